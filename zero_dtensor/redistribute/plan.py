"""The exchange plan of a redistribution: per (layout, selection, target), every piece this rank sends and receives
(cached: :data:`PLAN_CACHE_SIZE`). No communication."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..comm import process_groups
from ..layout.flat import FlatLayout, ParamLayout, contiguous_stride
from ..core.storage import FlatStorage


ROWS = "rows"
OWNERS = "owners"
#: plans (and balanced owner assignments) kept, the most recently used: a plan of ``k`` selected parameters holds
#: about ``0.7 KiB · k`` (1.3 MiB at 2,000), and a selection not seen before costs one plan build (``to_dtensors`` of
#: 2,000 tensors: 179 ms the first time, 78 ms after), so keep selections stable across steps
PLAN_CACHE_SIZE = 16

Range = tuple[int, int]
Piece = tuple[int, int, int]  # (slot, offset, length)




# --- the plan -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    """One direction of one bucket's exchange, seen from this rank.

    ``send_pieces`` (grouped by destination rank, in rank order) say where each sent piece is read from,
    ``recv_pieces`` (grouped by source rank) where each received piece is written to; a piece is ``(slot, offset,
    length)`` in a 1-D source/destination tensor. ``communicates`` is the same on every rank: False when no element
    crosses ranks (then nothing is sent and the send buffer is the receive buffer).
    """

    communicates: bool
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    send_pieces: tuple[Piece, ...]
    recv_pieces: tuple[Piece, ...]
    rank: int
    recv_in_order: bool = False  # the receive buffer already is the destination slot 0, in order (no unpack)
    send_piece_counts: tuple[int, ...] = ()  # per destination rank, how many of ``send_pieces`` go there
    recv_piece_counts: tuple[int, ...] = ()  # per source rank, how many of ``recv_pieces`` come from there
    send_run: Piece | None = None  # ``send_pieces`` are this one run of one slot, back to back (no packing)
    recv_run: Piece | None = None  # ``recv_pieces`` fill this one run of one slot, back to back (received in place)

    def own_pieces(self) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        """``(sent, received)``: the pieces this rank sends itself, where they are read and where they land (the
        same elements, in the same order)."""
        me = self.rank
        s0, r0 = sum(self.send_piece_counts[:me]), sum(self.recv_piece_counts[:me])
        return (self.send_pieces[s0:s0 + self.send_piece_counts[me]],
                self.recv_pieces[r0:r0 + self.recv_piece_counts[me]])

    @functools.cached_property
    def own_runs(self) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        """:meth:`own_pieces` with the pieces that continue each other on both sides merged (:func:`coalesced`):
        a ZeRO-1/2 rank's own share under the balanced owners is one run. Computed once per (cached) plan."""
        sent, received = self.own_pieces()
        return coalesced(sent, received)

    @functools.cached_property
    def own_source_run(self) -> Piece | None:
        """The source pieces of :attr:`own_runs` as the one run they form (:func:`one_run`), else ``None``: a
        ZeRO-3 owner's own share is one run of its partition spread over one piece per parameter. Computed once per
        (cached) plan."""
        return one_run(self.own_runs[0])

    @functools.cached_property
    def peer_recv_runs(self) -> tuple[Piece, ...]:
        """The pieces received from the other ranks (:meth:`peer_pieces`) with those that continue each other in
        their destination merged: they lie back to back in a receive buffer of the peers' pieces, so each merged
        piece is one run there too (a ZeRO-3 write: what one owner sends a rank is one run of its partition).
        Computed once per (cached) plan."""
        return self._received_runs(code_elements=0)[1]

    @functools.cached_property
    def framed_recv_runs(self) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        """``(in the framed receive buffer, destination)``: the pieces received from the other ranks, where they lie
        in a receive buffer framed with one element after each peer's block (an error code; this rank's own block
        is that element alone) and where they go, merged as :attr:`own_runs`. Computed once per (cached) plan."""
        return self._received_runs(code_elements=1)

    def _received_runs(self, code_elements: int) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        """``(in the receive buffer, destination)`` of the pieces received from the other ranks, merged as
        :attr:`own_runs`, in a receive buffer of the peers' blocks in rank order, each followed by
        ``code_elements`` elements (this rank's block: those alone)."""
        received = self.peer_pieces()[1]
        in_buffer, base, at = [], 0, 0
        for r, (count, pieces) in enumerate(zip(self.recv_counts, self.recv_piece_counts)):
            count, pieces = (0, 0) if r == self.rank else (count, pieces)
            offset = base
            for _, _, n in received[at:at + pieces]:
                in_buffer.append((0, offset, n))
                offset += n
            base, at = base + count + code_elements, at + pieces
        return coalesced(in_buffer, received)

    @functools.cached_property
    def runs(self) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        """``(send_pieces, recv_pieces)`` merged as :attr:`own_runs` (for a transfer that does not communicate,
        whose pieces all stay on this rank). Computed once per (cached) plan."""
        return coalesced(self.send_pieces, self.recv_pieces)

    def peer_pieces(self) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
        """``(sent, received)``: the pieces exchanged with the other ranks (this rank's own left out)."""
        me = self.rank
        s0, r0 = sum(self.send_piece_counts[:me]), sum(self.recv_piece_counts[:me])
        s1, r1 = s0 + self.send_piece_counts[me], r0 + self.recv_piece_counts[me]
        return (self.send_pieces[:s0] + self.send_pieces[s1:], self.recv_pieces[:r0] + self.recv_pieces[r1:])

    def peer_counts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(send counts, receive counts)`` with this rank's own share set to 0."""
        me = self.rank
        return (tuple(0 if r == me else n for r, n in enumerate(self.send_counts)),
                tuple(0 if r == me else n for r, n in enumerate(self.recv_counts)))

    @functools.cached_property
    def peer_send_run(self) -> Piece | None:
        """The pieces sent to the other ranks as one run of one slot (this rank's own share at an end of
        ``send_run`` or empty): then sent as they lie, a view. Computed once per (cached) plan."""
        return one_run(self.peer_pieces()[0])

    @property
    def sent_elements(self) -> int:
        """Elements this rank sends to other ranks (its own share excluded)."""
        return sum(self.send_counts) - self.send_counts[self.rank] if self.communicates else 0

    @property
    def received_elements(self) -> int:
        """Elements this rank receives from other ranks."""
        return sum(self.recv_counts) - self.recv_counts[self.rank] if self.communicates else 0


@dataclass(frozen=True)
class TargetSlot:
    """One selected parameter's target on this rank: ``numel`` elements at ``start`` of the bucket's output buffer,
    viewed as ``shape``. ``present`` is False where this rank holds no result (an ``owners`` target of another
    rank); ``replicate`` marks a 0-d ``rows`` target (every rank holds it)."""

    name: str
    start: int
    numel: int
    shape: tuple[int, ...]
    present: bool
    replicate: bool
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class BucketPlan:
    """The selected parameters of the flat groups sharing one process group and one stored dtype.

    ``read`` moves stored fragments to targets (send slots: positions in ``groups``; receive slot 0: the output
    buffer of ``out_numel`` elements); ``write`` moves targets back (send slots: positions in ``params``, offsets
    within each flattened target; receive slots: positions in ``groups``, offsets in the partitions). Compared
    (and hashed) by identity: a plan is cached, and its buckets key the views kept of output buffers.
    """

    groups: tuple[int, ...]
    dtype: torch.dtype
    world_size: int
    rank: int
    params: tuple[TargetSlot, ...]
    out_numel: int
    read: Transfer
    write: Transfer

    @functools.cached_property
    def present(self) -> tuple[tuple[str, ...], tuple[bool, ...]]:
        """``(names, mask)``: every slot's name, and whether this rank holds its result (:attr:`TargetSlot.present`).
        Computed once per (cached) plan."""
        return tuple(slot.name for slot in self.params), tuple(slot.present for slot in self.params)


@dataclass(frozen=True)
class Plan:
    """Every bucket of one (layout, selection, target); identical structure on every rank."""

    kind: str
    names: tuple[str, ...]
    buckets: tuple[BucketPlan, ...]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)



def _row_ranges(param: ParamLayout, world: int) -> tuple[tuple[Range, ...], bool]:
    """Per rank, the flattened range of its ``torch.chunk`` rows; 0-d parameters: the whole of it everywhere."""
    if len(param.shape) == 0:
        return ((0, param.numel),) * world, True
    rows = param.shape[0]
    row = param.numel // rows if rows else 0
    chunk = _ceil_div(rows, world)
    return tuple((min(r * chunk, rows) * row, min((r + 1) * chunk, rows) * row) for r in range(world)), False


def _owner_ranges(param: ParamLayout, world: int, owner: int) -> tuple[tuple[Range, ...], bool]:
    return tuple((0, param.numel) if r == owner else (0, 0) for r in range(world)), False


def _pieces(src: Sequence[Range], src_full: bool, dst: Sequence[Range], me: int
            ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """This rank's ``(peer, start, stop)`` sends and receives for one parameter (flattened element ranges).

    ``src[r]`` is what rank ``r`` holds, ``dst[r]`` what it must end with; ``src_full``: every rank holds it all,
    so each rank serves itself. Otherwise the sources are disjoint and every overlap is one piece."""
    if src_full:
        a, b = dst[me]
        mine = [(me, a, b)] if b > a else []
        return mine, list(mine)
    sa, sb = src[me]
    sends = [(d, max(sa, da), min(sb, db)) for d, (da, db) in enumerate(dst) if min(sb, db) > max(sa, da)]
    ta, tb = dst[me]
    recvs = [(s, max(ta, a), min(tb, b)) for s, (a, b) in enumerate(src) if min(tb, b) > max(ta, a)]
    return sends, recvs


def _crosses(src: Sequence[Range], src_full: bool, dst: Sequence[Range], forced: bool = False) -> bool:
    """Whether any element moves between ranks (rank-independent: computed from every rank's ranges). ``forced``
    (one rank forced through the collective path): whether any element of a sharded source is to go anywhere, as
    it would cross ranks at N ranks."""
    return not src_full and any(b > a and (forced or not (s[0] <= a and b <= s[1])) for s, (a, b) in zip(src, dst))


def _transfer(per_peer_send: list[list[Piece]], per_peer_recv: list[list[Piece]], communicates: bool,
              rank: int) -> Transfer:
    recv_pieces = tuple(p for ps in per_peer_recv for p in ps)
    send_pieces = tuple(p for ps in per_peer_send for p in ps)
    return Transfer(
        communicates=communicates,
        send_counts=tuple(sum(n for _, _, n in ps) for ps in per_peer_send),
        recv_counts=tuple(sum(n for _, _, n in ps) for ps in per_peer_recv),
        send_pieces=send_pieces,
        recv_pieces=recv_pieces,
        rank=rank,
        recv_in_order=_in_order(recv_pieces),
        send_run=one_run(send_pieces),
        recv_run=one_run(recv_pieces),
        send_piece_counts=tuple(map(len, per_peer_send)),
        recv_piece_counts=tuple(map(len, per_peer_recv)),
    )


def coalesced(sources: Sequence[Piece], dests: Sequence[Piece]) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
    """Matching source and destination pieces (the same lengths, in order) with each pair that continues the
    previous one on both sides (same slot, next offset) merged into it: the same elements copied to the same
    places by fewer, longer copies."""
    merged_src: list[list[int]] = []
    merged_dst: list[list[int]] = []
    for (s, a, n), (d, b, _) in zip(sources, dests):
        if merged_src:
            ps, pd = merged_src[-1], merged_dst[-1]
            if ps[0] == s and ps[1] + ps[2] == a and pd[0] == d and pd[1] + pd[2] == b:
                ps[2] += n
                pd[2] += n
                continue
        merged_src.append([s, a, n])
        merged_dst.append([d, b, n])
    return tuple(map(tuple, merged_src)), tuple(map(tuple, merged_dst))  # type: ignore[return-value]


def one_run(pieces: Sequence[Piece]) -> Piece | None:
    """``(slot, start, length)`` where ``pieces`` follow each other in one slot with no gap (what is sent is then a
    view of it: owners that hold contiguous runs of a ZeRO partition), else ``None``."""
    if not pieces:
        return None
    slot, start, end = pieces[0][0], pieces[0][1], pieces[0][1]
    for s, a, n in pieces:
        if s != slot or a != end:
            return None
        end += n
    return slot, start, end - start


def _in_order(pieces: Sequence[Piece]) -> bool:
    """Whether ``pieces`` fill slot 0 back to back from offset 0 (e.g. ZeRO-3 chunks that already are whole rows)."""
    run = one_run(pieces)
    return not pieces or (run is not None and run[:2] == (0, 0))


def _bucket(layout: FlatLayout, groups: tuple[int, ...], params: list[ParamLayout], kind: str,
            owner_of: Mapping[str, int], dtype: torch.dtype, forced: bool = False) -> BucketPlan:
    first = layout.groups[groups[0]]
    world, me = first.world_size, first.rank
    forced = forced and world == 1  # one rank through the N-rank path: its sharded pieces travel (to itself)
    slot_of_group = {g: i for i, g in enumerate(groups)}
    read_send: list[list[Piece]] = [[] for _ in range(world)]
    read_recv: list[list[Piece]] = [[] for _ in range(world)]
    write_send: list[list[Piece]] = [[] for _ in range(world)]
    write_recv: list[list[Piece]] = [[] for _ in range(world)]
    slots: list[TargetSlot] = []
    read_cross = write_cross = False
    out = 0
    for j, p in enumerate(params):
        group = layout.groups[p.group]
        stored = tuple(p.rank_range(group, r) for r in range(world))
        stored_full = group.replicated
        if kind == ROWS:
            target, target_full = _row_ranges(p, world)
        else:
            target, target_full = _owner_ranges(p, world, owner_of[p.name])
        ta, tb = target[me]
        shape = tuple(p.shape)
        if kind == OWNERS:
            local_shape = shape if owner_of[p.name] == me else (0,)
        elif target_full:
            local_shape = shape
        else:
            local_shape = (_row_count(shape[0], world, me), *shape[1:])
        slots.append(TargetSlot(p.name, out, tb - ta, local_shape, kind == ROWS or owner_of[p.name] == me,
                                target_full, shape, contiguous_stride(shape)))
        gslot = slot_of_group[p.group]
        base = p.local_offset(group, me) - stored[me][0]  # partition offset of element e is base + e
        sends, recvs = _pieces(stored, stored_full, target, me)
        for d, a, b in sends:
            read_send[d].append((gslot, base + a, b - a))
        for s, a, b in recvs:
            read_recv[s].append((0, out + a - ta, b - a))
        sends, recvs = _pieces(target, target_full, stored, me)
        for d, a, b in sends:
            write_send[d].append((j, a - ta, b - a))
        for s, a, b in recvs:
            write_recv[s].append((gslot, base + a, b - a))
        read_cross = read_cross or _crosses(stored, stored_full, target, forced)
        write_cross = write_cross or _crosses(target, target_full, stored, forced)
        out += tb - ta
    multi = world > 1 or forced
    return BucketPlan(groups, dtype, world, me, tuple(slots), out,
                      _transfer(read_send, read_recv, multi and read_cross, me),
                      _transfer(write_send, write_recv, multi and write_cross, me))


def _row_count(rows: int, world: int, rank: int) -> int:
    chunk = _ceil_div(rows, world)
    return max(0, min((rank + 1) * chunk, rows) - min(rank * chunk, rows))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _plan(layout: FlatLayout, names: tuple[str, ...], pg_keys: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
          kind: str, owners: tuple[int, ...], forced: bool = False) -> Plan:
    owner_of = dict(zip(names, owners)) if kind == OWNERS else {}
    buckets: dict[tuple[int, torch.dtype], tuple[list[int], list[ParamLayout]]] = {}
    for g in layout.groups:  # bucket order: first flat group of each (process group, dtype)
        groups, _ = buckets.setdefault((pg_keys[g.index], dtypes[g.index]), ([], []))
        groups.append(g.index)
    bucket_of = {g.index: buckets[(pg_keys[g.index], dtypes[g.index])] for g in layout.groups}
    for name in names:
        p = layout.by_name[name]
        bucket_of[p.group][1].append(p)
    built = tuple(_bucket(layout, tuple(groups), params, kind, owner_of, dtype, forced)
                  for (_, dtype), (groups, params) in buckets.items() if params)
    return Plan(kind, names, built)


def process_group_keys(storage: FlatStorage) -> tuple[int, ...]:
    """Per flat group, the index of the first flat group with the same process group object."""
    pgs = storage.process_groups
    return tuple(next(j for j in range(i + 1) if pgs[j] is pgs[i]) for i in range(len(pgs)))


def group_ranks_of(storage: FlatStorage, param: ParamLayout) -> tuple[int, ...]:
    return process_groups.group_ranks(storage.process_groups[param.group])


def group_members(storage: FlatStorage) -> tuple[tuple[int, ...], ...]:
    """Per flat group, the global ranks of its process group's members, in group-rank order."""
    return tuple(process_groups.group_ranks(pg) for pg in storage.process_groups)


NAME = operator.attrgetter("name")  #: a parameter layout's name (``map(NAME, params)``: no Python loop)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _group_ranks_of_owners(layout: FlatLayout, names: tuple[str, ...], owners: tuple[int, ...],
                           members: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Per name, its owner's rank in the parameter's process group (``owners``: global ranks; ``members``: per
    flat group, its members' global ranks). Cached: an unchanged assignment is converted once."""
    tables = [{r: i for i, r in enumerate(m)} for m in members]
    return tuple([tables[layout.by_name[n].group][r] for n, r in zip(names, owners)])


def plan_for(storage: FlatStorage, selected: Sequence[ParamLayout], kind: str = ROWS,
             assignment: Mapping[str, int] | None = None) -> Plan:
    """The cached plan for ``selected`` (in order) and a target: ``"rows"``, or ``"owners"`` with ``assignment``
    (name -> global rank, e.g. from :func:`owners`). No communication."""
    names = tuple(map(NAME, selected))
    if kind == OWNERS:
        if assignment is None:
            raise ValueError("an owners plan needs the assignment (name -> global rank)")
        ranks = _group_ranks_of_owners(storage.layout, names, tuple(map(assignment.__getitem__, names)),
                                       group_members(storage))
    elif kind == ROWS:
        ranks = ()
    else:
        raise ValueError(f"unknown target {kind!r}; use 'rows' or 'owners'")
    dtypes = tuple(p.dtype for p in storage.partitions)  # the family's: the layout is geometry only
    return _plan(storage.layout, names, process_group_keys(storage), dtypes, kind, ranks,
                 process_groups.collective_path(1))
