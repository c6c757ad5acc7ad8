"""Redistribute ZeRO gradients in bulk: per-parameter ``Shard(0)`` DTensors, whole parameters on owner ranks.

DeepSpeed keeps a gradient in its own layout (ZeRO-1/2: ragged pieces of a flat buffer; ZeRO-3: ``torch.chunk``
pieces of the *flattened* parameter; ``BF16_Optimizer``: the whole buffer on every rank). Two other layouts are
what sharded training code needs, and each moves about ``S/N`` bytes per rank instead of the ``(N-1)/N·S`` of
``full_tensors`` (``S`` the selected gradient bytes in the stored dtype, ``N`` ranks):

=============  ===============================================  ==============================================
target         rank ``r`` holds                                 communication (per process group and dtype)
=============  ===============================================  ==============================================
``rows``       rows ``[r·c, min((r+1)·c, R))`` of every          read: one ``all_to_all_single`` with uneven
               parameter, ``c = ceil(R/N)`` (``torch.chunk``,    splits, none for replicated groups (each rank
               FSDP2's ``Shard(0)``); a 0-d parameter whole      slices its own rows); write: one, the reverse
               on every rank (``Replicate``)                     (replicated groups too: every rank needs all)
``owners``     the whole gradient of the parameters assigned    the same
               to ``r`` (:func:`balanced_owners` or the user's)
=============  ===============================================  ==============================================

Bytes per rank of one exchange: this rank sends the part of its stored fragments that other ranks' targets cover and
receives the part of its targets that other ranks store: about ``(N-1)/N · S/N`` each way when the targets are
balanced (:func:`traffic` gives the exact figures of a call).

**Plan.** :func:`plan_for` computes, once per (layout, selection, target) and cached (the :data:`PLAN_CACHE_SIZE`
most recently used), every piece this rank sends
and receives: for each parameter and peer, the intersection of the source's fragment (``ParamLayout.rank_range``,
ragged ZeRO-1/2 pieces and ``torch.chunk`` ZeRO-3 pieces alike) with the destination's target range, as ``(slot,
offset, length)`` triples in peer order. Executing a plan takes a fixed number of tensor operations whatever the
number of parameters: one ``torch.cat`` of narrow views into a send buffer, one ``all_to_all_single``, one
``torch.split_with_sizes_copy`` of the receive buffer into narrow views of the destination (the output buffer, or
DeepSpeed's partitions; none when the received pieces already are the output in order), and at most two casts (fp16
unscaling, ``dtype=``). Per-parameter results are views into the output buffer.

**Validation.** Writes check every entry on every rank before anything is sent or written; a bad entry on one rank
raises on every rank (one ``all_reduce`` of ``N`` int64 error codes per process group): the failing rank raises
its own error, the others the same exception class (``ValueError``, ``TypeError``, ``KeyError``; a failure of a
user function: :class:`~zero_dtensor.errors.RankFailedError`) naming the failing ranks.

Nothing here prints; every collective goes through :mod:`zero_dtensor.collectives`.
"""

from __future__ import annotations

import functools
import heapq
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import collectives
from .agreement import Refusal, agree, error_code, local_only, raise_outcome
from .layout import GradLayout, ParamLayout
from .state import state_of
from .storage import GradStorage

__all__ = [
    "BucketPlan",
    "Plan",
    "TargetSlot",
    "Transfer",
    "agreement_groups",
    "balanced_owners",
    "checked_dtensors",
    "dtensor_signature",
    "map_full_",
    "mapping_names",
    "newton_schulz",
    "owned",
    "owners",
    "plan_for",
    "set_dtensors_",
    "set_owned_",
    "to_dtensors",
    "traffic",
]

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


@dataclass(frozen=True)
class BucketPlan:
    """The selected parameters of the flat groups sharing one process group and one stored dtype.

    ``read`` moves stored fragments to targets (send slots: positions in ``groups``; receive slot 0: the output
    buffer of ``out_numel`` elements); ``write`` moves targets back (send slots: positions in ``params``, offsets
    within each flattened target; receive slots: positions in ``groups``, offsets in the partitions).
    """

    groups: tuple[int, ...]
    dtype: torch.dtype
    world_size: int
    rank: int
    params: tuple[TargetSlot, ...]
    out_numel: int
    read: Transfer
    write: Transfer


@dataclass(frozen=True)
class Plan:
    """Every bucket of one (layout, selection, target); identical structure on every rank."""

    kind: str
    names: tuple[str, ...]
    buckets: tuple[BucketPlan, ...]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's contiguous strides (zero-size dims count as 1), computed without creating a tensor."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


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


def _crosses(src: Sequence[Range], src_full: bool, dst: Sequence[Range]) -> bool:
    """Whether any element moves between ranks (rank-independent: computed from every rank's ranges)."""
    return not src_full and any(b > a and not (s[0] <= a and b <= s[1]) for s, (a, b) in zip(src, dst))


def _transfer(per_peer_send: list[list[Piece]], per_peer_recv: list[list[Piece]], communicates: bool,
              rank: int) -> Transfer:
    recv_pieces = tuple(p for ps in per_peer_recv for p in ps)
    return Transfer(
        communicates=communicates,
        send_counts=tuple(sum(n for _, _, n in ps) for ps in per_peer_send),
        recv_counts=tuple(sum(n for _, _, n in ps) for ps in per_peer_recv),
        send_pieces=tuple(p for ps in per_peer_send for p in ps),
        recv_pieces=recv_pieces,
        rank=rank,
        recv_in_order=_in_order(recv_pieces),
    )


def _in_order(pieces: Sequence[Piece]) -> bool:
    """Whether ``pieces`` fill slot 0 back to back from offset 0 (e.g. ZeRO-3 chunks that already are whole rows)."""
    offset = 0
    for slot, start, length in pieces:
        if slot != 0 or start != offset:
            return False
        offset += length
    return True


def _bucket(layout: GradLayout, groups: tuple[int, ...], params: list[ParamLayout], kind: str,
            owner_of: Mapping[str, int]) -> BucketPlan:
    first = layout.groups[groups[0]]
    world, me = first.world_size, first.rank
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
                                target_full, shape, _contiguous_stride(shape)))
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
        read_cross = read_cross or _crosses(stored, stored_full, target)
        write_cross = write_cross or _crosses(target, target_full, stored)
        out += tb - ta
    multi = world > 1
    return BucketPlan(groups, first.dtype, world, me, tuple(slots), out,
                      _transfer(read_send, read_recv, multi and read_cross, me),
                      _transfer(write_send, write_recv, multi and write_cross, me))


def _row_count(rows: int, world: int, rank: int) -> int:
    chunk = _ceil_div(rows, world)
    return max(0, min((rank + 1) * chunk, rows) - min(rank * chunk, rows))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _plan(layout: GradLayout, names: tuple[str, ...], pg_keys: tuple[int, ...], kind: str,
          owners: tuple[int, ...]) -> Plan:
    owner_of = dict(zip(names, owners)) if kind == OWNERS else {}
    buckets: dict[tuple[int, torch.dtype], tuple[list[int], list[ParamLayout]]] = {}
    for g in layout.groups:  # bucket order: first flat group of each (process group, dtype)
        groups, _ = buckets.setdefault((pg_keys[g.index], g.dtype), ([], []))
        groups.append(g.index)
    bucket_of = {g.index: buckets[(pg_keys[g.index], g.dtype)] for g in layout.groups}
    for name in names:
        p = layout.by_name[name]
        bucket_of[p.group][1].append(p)
    built = tuple(_bucket(layout, tuple(groups), params, kind, owner_of)
                  for groups, params in buckets.values() if params)
    return Plan(kind, names, built)


def _pg_keys(storage: GradStorage) -> tuple[int, ...]:
    """Per flat group, the index of the first flat group with the same process group object."""
    pgs = storage.process_groups
    return tuple(next(j for j in range(i + 1) if pgs[j] is pgs[i]) for i in range(len(pgs)))


def _group_ranks_of(storage: GradStorage, param: ParamLayout) -> tuple[int, ...]:
    return collectives.group_ranks(storage.process_groups[param.group])


def plan_for(storage: GradStorage, selected: Sequence[ParamLayout], kind: str = ROWS,
             assignment: Mapping[str, int] | None = None) -> Plan:
    """The cached plan for ``selected`` (in order) and a target: ``"rows"``, or ``"owners"`` with ``assignment``
    (name -> global rank, e.g. from :func:`owners`). No communication."""
    names = tuple(p.name for p in selected)
    if kind == OWNERS:
        if assignment is None:
            raise ValueError("an owners plan needs the assignment (name -> global rank)")
        ranks = tuple(_group_ranks_of(storage, p).index(assignment[p.name]) for p in selected)
    elif kind == ROWS:
        ranks = ()
    else:
        raise ValueError(f"unknown target {kind!r}; use 'rows' or 'owners'")
    return _plan(storage.layout, names, _pg_keys(storage), kind, ranks)


# --- owners -----------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _balanced(layout: GradLayout, names: tuple[str, ...], pg_keys: tuple[int, ...]) -> tuple[int, ...]:
    """Group rank per name: largest parameter first onto the least-loaded rank of its process group (ties: the
    earlier name in the selection, then the lower rank)."""
    params = [layout.by_name[n] for n in names]
    loads: dict[int, list[tuple[int, int]]] = {}
    owner = [0] * len(params)
    for j in sorted(range(len(params)), key=lambda j: (-params[j].numel, j)):
        key = pg_keys[params[j].group]
        heap = loads.get(key)
        if heap is None:
            heap = loads[key] = [(0, r) for r in range(layout.groups[params[j].group].world_size)]
        load, rank = heapq.heappop(heap)
        owner[j] = rank
        heapq.heappush(heap, (load + params[j].numel, rank))
    return tuple(owner)


def balanced_owners(storage: GradStorage, selected: Sequence[ParamLayout]) -> dict[str, int]:
    """The default assignment: ``{name: global rank}``, deterministic from the layout and the selection, identical
    on every rank. No communication."""
    ranks = _balanced(storage.layout, tuple(p.name for p in selected), _pg_keys(storage))
    return {p.name: _group_ranks_of(storage, p)[r] for p, r in zip(selected, ranks)}


def _as_rank(name: str, rank: Any) -> int:
    """A global rank given as any integer: ``int``, a NumPy integer, a 0-d integer tensor (``operator.index``
    accepts the first two; a tensor is read once). ``TypeError`` for bools, floats and anything else."""
    if isinstance(rank, torch.Tensor) and rank.ndim == 0 and not rank.is_floating_point() \
            and not rank.is_complex() and rank.dtype != torch.bool:
        return int(rank.item())
    if not isinstance(rank, bool):
        try:
            return operator.index(rank)
        except TypeError:
            pass
    raise TypeError(f"owners=: the owner of {name!r} must be a global rank (an integer: int, a NumPy integer or a "
                    f"0-d integer tensor), got {type(rank).__name__}")


def _check_owner_entry(storage: GradStorage, name: str, rank: Any) -> int:
    param = storage.layout.by_name.get(name) if isinstance(name, str) else None
    if param is None:
        raise KeyError(f"owners=: {name!r} is not a trainable parameter of this engine")
    rank = _as_rank(name, rank)
    members = _group_ranks_of(storage, param)
    if rank not in members:
        raise ValueError(f"owners=: the owner of {name!r} is rank {rank}, which is not in its data-parallel process "
                         f"group (global ranks {list(members)})")
    return int(rank)


def owners(storage: GradStorage, selected: Sequence[ParamLayout], given: Mapping[str, int] | None = None
           ) -> dict[str, int]:
    """``{name: global owner rank}`` for ``selected``: ``given`` (validated: every selected name present, each a
    member rank of the parameter's process group, no unknown names) or :func:`balanced_owners`. No communication."""
    if given is None:
        return balanced_owners(storage, selected)
    if not isinstance(given, Mapping):
        raise TypeError(f"owners= must be a mapping name -> global rank (e.g. grads.owners()), got "
                        f"{type(given).__name__}")
    checked = {name: _check_owner_entry(storage, name, rank) for name, rank in given.items()}
    missing = [p.name for p in selected if p.name not in checked]
    if missing:
        raise KeyError(f"owners= gives no rank for {missing[:8]}{' …' if len(missing) > 8 else ''}: give one for "
                       "every selected parameter (grads.owners(names) is a complete starting point)")
    return {p.name: checked[p.name] for p in selected}


# --- execution --------------------------------------------------------------------------------------------------------
def _pack(sources: Sequence[torch.Tensor], pieces: Sequence[Piece], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """One ``torch.cat`` of narrow views (type promotion across sources); an empty tensor when nothing is sent."""
    if not pieces:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([sources[s].narrow(0, o, n) for s, o, n in pieces])


def _unpack(buffer: torch.Tensor, pieces: Sequence[Piece], dests: Sequence[torch.Tensor]) -> None:
    """One ``torch.split_with_sizes_copy`` of ``buffer`` into narrow views of ``dests``."""
    if pieces:
        torch.split_with_sizes_copy(buffer, [n for _, _, n in pieces],
                                    out=[dests[s].narrow(0, o, n) for s, o, n in pieces])


def _exchange(send: torch.Tensor, transfer: Transfer, storage: GradStorage, bucket: BucketPlan) -> torch.Tensor:
    """The bucket's one ``all_to_all_single`` (or the send buffer itself when nothing crosses ranks)."""
    if not transfer.communicates:
        return send
    recv = torch.empty(sum(transfer.recv_counts), dtype=send.dtype, device=send.device)
    pg = storage.process_groups[bucket.groups[0]]
    collectives.all_to_all_into(recv, send, transfer.recv_counts, transfer.send_counts, pg)
    return recv


def _comm_device(storage: GradStorage, bucket: BucketPlan) -> torch.device:
    return collectives.comm_device(storage.partitions[bucket.groups[0]], storage.process_groups[bucket.groups[0]],
                                   storage.device)


def _read(storage: GradStorage, plan: Plan, dtype: torch.dtype | None) -> list[tuple[BucketPlan, torch.Tensor]]:
    """Per bucket, the output buffer (true units, ``dtype``): every target of this rank back to back."""
    results = []
    for bucket in plan.buckets:
        parts = [storage.partitions[g] for g in bucket.groups]
        send = _pack(parts, bucket.read.send_pieces, bucket.dtype, parts[0].device).to(_comm_device(storage, bucket))
        recv = _exchange(send, bucket.read, storage, bucket)  # a new tensor either way: never DeepSpeed's memory
        if bucket.read.recv_in_order and recv.numel() == bucket.out_numel:
            out = recv
        else:
            out = torch.empty(bucket.out_numel, dtype=recv.dtype, device=recv.device)
            _unpack(recv, bucket.read.recv_pieces, [out])
        out = storage.to_true(out)
        results.append((bucket, out if dtype is None or out.dtype == dtype else out.to(dtype)))
    return results


def _write(storage: GradStorage, plan: Plan, values: Mapping[str, torch.Tensor], *,
           code: int | None = None) -> list[tuple[int, int]]:
    """Send every bucket's targets back into the partitions. ``values[name]``: this rank's flattened target (true
    units, any floating dtype); names absent on this rank must have an empty target here.

    ``code`` (a user function ran before this write; :func:`~zero_dtensor.agreement.error_code` of its failure on
    this rank): every multi-rank bucket's exchange then carries one error code per peer after its data, every
    exchange completes before anything is written, and where any rank failed nothing is written: returns
    ``(global rank, code)`` of the failed ranks (this one included), in rank order. A failed rank sends zeros."""
    failed: dict[int, int] = {}
    received = []
    with torch.no_grad():
        for bucket in plan.buckets:
            device = _comm_device(storage, bucket)
            if code:
                send = torch.zeros(sum(bucket.write.send_counts), dtype=bucket.dtype, device=device)
            else:
                none = _empty(bucket.dtype, device)  # for targets this rank does not hold
                sources = [_flat_on(values.get(slot.name), none, device) for slot in bucket.params]
                send = _pack(sources, bucket.write.send_pieces, bucket.dtype, device)
                send = storage.to_stored(send)
                send = send if send.dtype == bucket.dtype else send.to(bucket.dtype)
            if code is None or bucket.world_size == 1:
                recv = _exchange(send, bucket.write, storage, bucket)
            else:
                recv, codes = _exchange_with_codes(send, bucket.write, storage, bucket, code)
                members = collectives.group_ranks(storage.process_groups[bucket.groups[0]])
                failed.update({members[r]: c for r, c in enumerate(codes) if c})
            received.append((bucket, recv))
        if code:
            failed[_my_rank(storage)] = code
        if failed:
            return sorted(failed.items())
        for bucket, recv in received:
            parts = [storage.partitions[g] for g in bucket.groups]
            _unpack(recv.to(parts[0].device), bucket.write.recv_pieces, parts)
    return []


_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared empty tensor (made once per dtype and device; nothing can be written into it)."""
    key = (dtype, device)
    t = _EMPTY.get(key)
    if t is None:
        t = _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return t


def _exchange_with_codes(send: torch.Tensor, transfer: Transfer, storage: GradStorage, bucket: BucketPlan,
                         code: int) -> tuple[torch.Tensor, list[int]]:
    """The bucket's ``all_to_all_single`` with this rank's error ``code`` appended to what it sends each peer (also
    where no data crosses ranks): returns the received data, as :func:`_exchange` would, and every peer's code in
    group-rank order. One element more each way per peer; one copy of the data on each side."""
    send_counts = [n + 1 for n in transfer.send_counts]
    recv_counts = [n + 1 for n in transfer.recv_counts]
    framed = torch.full((sum(send_counts),), float(code), dtype=send.dtype, device=send.device)
    torch.split_with_sizes_copy(send, list(transfer.send_counts),
                                out=[c.narrow(0, 0, n) for c, n in zip(framed.split(send_counts),
                                                                        transfer.send_counts)])
    recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
    collectives.all_to_all_into(recv, framed, recv_counts, send_counts, storage.process_groups[bucket.groups[0]])
    chunks = recv.split(recv_counts)
    codes = [int(c) for c in torch.cat([c.narrow(0, n, 1) for c, n in zip(chunks, transfer.recv_counts)]).tolist()]
    return torch.cat([c.narrow(0, 0, n) for c, n in zip(chunks, transfer.recv_counts)]), codes


def _flat_on(value: torch.Tensor | None, none: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` flattened without autograd history (a view when contiguous), on ``device`` (a copy only there)."""
    if value is None:
        return none
    flat = value.detach().reshape(-1)
    return flat if flat.device == device else flat.to(device)


def _my_rank(storage: GradStorage) -> int:
    """This process's global rank (from the first group's process group and group rank). No communication."""
    return collectives.group_ranks(storage.process_groups[0])[storage.layout.groups[0].rank]


# --- validation -------------------------------------------------------------------------------------------------------
def mapping_names(mapping: Any, what: str) -> list[Any]:
    """The keys of a write's ``mapping`` (``TypeError`` unless it is a mapping). No communication."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{what} takes a mapping name -> tensor, got {type(mapping).__name__}")
    return list(mapping)


def dtensor_signature(mapping: Mapping[str, Any]) -> tuple:
    """Rank-independent metadata of ``set_dtensors_``'s entries, for the rank-agreement check."""
    def meta(value: Any) -> tuple:
        if isinstance(value, DTensor):
            return (tuple(value.shape), str(value.dtype), tuple(str(p) for p in value.placements))
        return (type(value).__name__,)
    return tuple((name, meta(value)) for name, value in mapping.items())


def agreement_groups(storage: GradStorage, selected: Sequence[ParamLayout] | None) -> tuple[Any, ...]:
    """The process groups a write over ``selected`` (``None``: any parameter) may communicate on: multi-rank groups,
    replicated ones included (every rank needs the whole new value)."""
    indices = sorted({p.group for p in selected}) if selected is not None else range(len(storage.process_groups))
    return tuple(storage.process_groups[i] for i in indices if storage.layout.groups[i].world_size > 1)


def _allowed_devices(storage: GradStorage) -> set[torch.device]:
    return {torch.device(storage.device), *(p.device for p in storage.partitions)}


def _same_ranks(mesh: Any, pg: Any, device_type: str) -> bool:
    """Whether ``mesh`` is 1-D over ``pg``'s ranks in group order (the library's own mesh: no tensor access)."""
    if mesh is collectives.mesh_for(pg, device_type):
        return True
    return mesh.ndim == 1 and mesh.mesh.flatten().tolist() == list(collectives.group_ranks(pg))


def _check_dtensor(storage: GradStorage, slot: TargetSlot, value: Any, pg: Any) -> torch.Tensor:
    """This rank's flattened local shard of a valid ``set_dtensors_`` entry; raises on anything else."""
    name = slot.name
    if not isinstance(value, DTensor):
        raise TypeError(f"set_dtensors_: value for {name!r} must be a DTensor (e.g. from grads.to_dtensors()), got "
                        f"{type(value).__name__}; for full tensors use set_full_")
    mesh = value.device_mesh
    if not _same_ranks(mesh, pg, value.device.type):
        raise ValueError(f"set_dtensors_: {name!r} lives on a mesh over ranks {mesh.mesh.tolist()}; expected a 1-D "
                         f"mesh over its data-parallel process group, ranks {list(collectives.group_ranks(pg))} "
                         "(as to_dtensors builds)")
    expected = (Replicate(),) if slot.replicate else (Shard(0),)
    if tuple(value.placements) != expected:
        raise ValueError(f"set_dtensors_: {name!r} has placements {tuple(value.placements)}, expected {expected} "
                         "(redistribute it first)")
    if tuple(value.shape) != slot.global_shape:
        raise ValueError(f"set_dtensors_: {name!r} has shape {tuple(value.shape)}, expected {slot.global_shape}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"set_dtensors_: {name!r} has dtype {value.dtype}, expected a floating dtype")
    local = value.to_local()
    if tuple(local.shape) != slot.shape:
        raise ValueError(f"set_dtensors_: the local shard of {name!r} has shape {tuple(local.shape)} on this rank, "
                         f"expected {slot.shape} (torch.chunk rows of dim 0)")
    if local.device not in _allowed_devices(storage):
        raise ValueError(f"set_dtensors_: the local shard of {name!r} is on {local.device}, expected one of "
                         f"{sorted(str(d) for d in _allowed_devices(storage))}")
    return local


def _check_full(storage: GradStorage, what: str, param: ParamLayout, value: Any) -> torch.Tensor:
    """A whole-gradient value for ``param`` (``set_owned_``, ``map_full_``'s results); raises otherwise."""
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: value for {param.name!r} must be a torch.Tensor of shape {tuple(param.shape)}, got "
                        f"{type(value).__name__}")
    if value.shape != param.shape:
        raise ValueError(f"{what}: value for {param.name!r} has shape {tuple(value.shape)}, expected "
                         f"{tuple(param.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{what}: value for {param.name!r} has dtype {value.dtype}, expected a floating dtype")
    if value.device not in _allowed_devices(storage):
        raise ValueError(f"{what}: value for {param.name!r} is on {value.device}, expected one of "
                         f"{sorted(str(d) for d in _allowed_devices(storage))}")
    return value


_SPECS: dict[tuple, tuple[Any, Any]] = {}


def _spec(mesh: Any, placement: Any, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> Any:
    """A cached ``DTensorSpec``, keyed on the mesh *object* (meshes over the same ranks compare equal even when their
    process groups differ, e.g. a second engine's)."""
    key = (id(mesh), placement, shape, stride, dtype)
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if len(_SPECS) > 8192:
        _SPECS.clear()
    spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
    _SPECS[key] = (mesh, spec)
    return spec


def _dtensor(local: torch.Tensor, mesh: Any, placement: Any, slot: TargetSlot) -> DTensor:
    """What ``DTensor.from_local(local, mesh, [placement], run_check=False, shape=..., stride=...)`` builds, without
    its per-call overhead (about 60 µs: a new spec and an autograd node per parameter): a cached spec and the
    no-autograd constructor FSDP2 uses (``_from_local_no_grad``); ``from_local`` where that is unavailable."""
    try:
        spec = _spec(mesh, placement, slot.global_shape, slot.global_stride, local.dtype)
        return DTensor(local, spec, requires_grad=False)
    except (ImportError, TypeError, AttributeError):  # a torch without these internals: the public constructor
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(slot.global_shape),
                                  stride=slot.global_stride)


# --- the calls --------------------------------------------------------------------------------------------------------
def to_dtensors(storage: GradStorage, selected: Sequence[ParamLayout], *, dtype: torch.dtype | None = None
                ) -> dict[str, DTensor]:
    """Every selected parameter's gradient as a ``Shard(0)`` DTensor of its shape (0-d: ``Replicate``) on a 1-D mesh
    over its data-parallel process group; a snapshot (true units, ``dtype``). **Collective**: one
    ``all_to_all_single`` per (process group, dtype) of sharded groups (none for replicated groups or where the
    stored pieces already are the rows), about ``(N-1)/N · S/N`` bytes sent and received per rank."""
    plan = plan_for(storage, selected, ROWS)
    result: dict[str, DTensor] = {}
    for bucket, buffer in _read(storage, plan, dtype):
        mesh = collectives.mesh_for(storage.process_groups[bucket.groups[0]], buffer.device.type)
        for slot in bucket.params:
            local = buffer.narrow(0, slot.start, slot.numel).view(slot.shape)
            result[slot.name] = _dtensor(local, mesh, Replicate() if slot.replicate else Shard(0), slot)
    return {p.name: result[p.name] for p in selected}


def checked_dtensors(storage: GradStorage, selected: Sequence[ParamLayout], mapping: Mapping[str, Any]
                     ) -> dict[str, torch.Tensor]:
    """This rank's local shards of ``set_dtensors_``'s entries, each checked (DTensor type, mesh over the group's
    ranks, placement, global shape, dtype, this rank's local shard shape, device); raises at the first bad one.
    No communication."""
    plan = plan_for(storage, selected, ROWS)
    values: dict[str, torch.Tensor] = {}
    for bucket in plan.buckets:
        pg = storage.process_groups[bucket.groups[0]]
        for slot in bucket.params:
            values[slot.name] = _check_dtensor(storage, slot, mapping[slot.name], pg)
    return values


def set_dtensors_(storage: GradStorage, selected: Sequence[ParamLayout], values: Mapping[str, torch.Tensor]) -> None:
    """Write the local shards of ``Shard(0)`` DTensors (:func:`checked_dtensors`, agreed on every rank) back.
    **Collective**: one ``all_to_all_single`` per (process group, dtype), replicated groups included, about
    ``(N-1)/N · S/N`` bytes each way per rank (replicated: ``(N-1)/N · S`` received)."""
    _write(storage, plan_for(storage, selected, ROWS), values)
    storage.after_write([p.name for p in selected])


def owned(storage: GradStorage, selected: Sequence[ParamLayout], assignment: Mapping[str, int], *,
          dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole gradients of the selected parameters ``assignment`` gives this rank (true units, ``dtype``); a
    snapshot. **Collective**: one ``all_to_all_single`` per (process group, dtype) of sharded groups, about
    ``(N-1)/N · S/N`` bytes each way per rank when the assignment is balanced."""
    plan = plan_for(storage, selected, OWNERS, assignment)
    return _owned_views(storage, plan, dtype)


def _owned_views(storage: GradStorage, plan: Plan, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    result = {}
    for bucket, buffer in _read(storage, plan, dtype):
        for slot in bucket.params:
            if slot.present:
                result[slot.name] = buffer.narrow(0, slot.start, slot.numel).view(slot.shape)
    return {n: result[n] for n in plan.names if n in result}


def _provided(storage: GradStorage, mapping: Any, restrict: Mapping[str, int] | None) -> dict[str, torch.Tensor]:
    """This rank's ``set_owned_`` entries, each checked; raises at the first bad one. No communication."""
    values: dict[str, torch.Tensor] = {}
    names = mapping_names(mapping, "set_owned_")
    me = _my_rank(storage)
    for name in names:
        param = storage.layout.by_name.get(name) if isinstance(name, str) else None
        if param is None:
            raise KeyError(f"set_owned_: {name!r} is not a trainable parameter of this engine")
        if restrict is not None and restrict.get(name) != me:
            owner = f"rank {restrict[name]}" if name in restrict else "not given"
            raise ValueError(f"set_owned_: rank {me} passed {name!r}, whose owner under owners= is {owner}: "
                             "pass each parameter on its owner only")
        values[name] = _check_full(storage, "set_owned_", param, mapping[name])
    return values


def _restriction(storage: GradStorage, assignment: Any) -> dict[str, int] | None:
    """``set_owned_``'s ``owners=``, checked (``None`` when not given). No communication."""
    if assignment is None:
        return None
    if not isinstance(assignment, Mapping):
        raise TypeError(f"owners= must be a mapping name -> global rank, got {type(assignment).__name__}")
    return {name: _check_owner_entry(storage, name, rank) for name, rank in assignment.items()}


def set_owned_(storage: GradStorage, mapping: Mapping[str, torch.Tensor], *,
               assignment: Mapping[str, int] | None = None) -> None:
    """Write whole gradients from the ranks holding them (each parameter from at most one rank; ``assignment``
    given: from its owner there). **Collective**: the rank agreement, which also tells every rank which rank passed
    which parameter (per multi-rank process group one ``all_gather`` of ``2 + k`` int64 per rank, ``k`` the
    group's parameters), then one ``all_to_all_single`` per (process group, dtype), about ``(N-1)/N · S/N`` bytes
    each way per rank (replicated groups: the owner's values to every rank)."""
    values: dict[str, torch.Tensor] = {}
    restrict: dict[str, int] | None = None
    with Refusal() as refusal:
        restrict = _restriction(storage, assignment)
        values = _provided(storage, mapping, restrict)
    signature = () if refusal.error else (None if restrict is None else sorted(restrict.items()),)
    layout = storage.layout
    groups = agreement_groups(storage, None)
    by_pg = {id(storage.process_groups[g.index]): [p for p in layout.params
                                                   if storage.process_groups[p.group] is storage.process_groups[g.index]]
             for g in layout.groups}
    rows = agree("set_owned_", signature, groups, storage.device, refused=refusal.error,
                 payload=lambda pg: [int(p.name in values) for p in by_pg[id(pg)]])
    provider = _providers(storage, values, rows, by_pg)
    selection = [p.name for p in layout.params if p.name in provider]
    plan = plan_for(storage, [layout.by_name[n] for n in selection], OWNERS, provider)
    _write(storage, plan, values)
    storage.after_write(selection)


def _providers(storage: GradStorage, values: Mapping[str, torch.Tensor], rows: Mapping[int, list[list[int]]],
               by_pg: Mapping[int, list[ParamLayout]]) -> dict[str, int]:
    """``{name: global rank that passed it}`` from the agreement's rows (the same on every rank); a parameter passed
    by more than one rank raises ``ValueError`` on every rank. No communication."""
    provider: dict[str, int] = {}
    twice: list[str] = []
    for pg in {id(storage.process_groups[p.group]): storage.process_groups[p.group]
               for p in storage.layout.params}.values():
        params = by_pg[id(pg)]
        if id(pg) not in rows:  # a single-rank group: this rank alone
            provider.update({p.name: _my_rank(storage) for p in params if p.name in values})
            continue
        members = collectives.group_ranks(pg)
        for k, p in enumerate(params):
            passed = [members[r] for r, row in enumerate(rows[id(pg)]) if row[2 + k]]
            if len(passed) > 1:
                twice.append(p.name)
            elif passed:
                provider[p.name] = passed[0]
    if twice:
        raise ValueError(f"set_owned_: {twice[:8]} were passed by more than one rank; pass each parameter on one "
                         "rank only (its owner: see grads.owners()). Nothing was written on any rank.")
    return provider


def map_full_(storage: GradStorage, selected: Sequence[ParamLayout], assignment: Mapping[str, int],
              fn: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """``fn(name, whole gradient)`` on each parameter's owner, written back: each gradient computed once in the job.
    **Collective**: :func:`owned`'s ``all_to_all_single``, then the reverse ``all_to_all_single`` per (process
    group, dtype) carrying one error code per peer besides the data: about ``2 · (N-1)/N · S/N`` bytes each way per
    rank in all. ``fn`` runs on the owner only and must not communicate. An exception in ``fn`` (or a bad result)
    on any rank raises on every rank before anything is written: there the original one, elsewhere
    :class:`~zero_dtensor.errors.RankFailedError` (or the same validation error class)."""
    plan = plan_for(storage, selected, OWNERS, assignment)
    mine = _owned_views(storage, plan, None)
    results: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        with local_only("map_full_"):
            for name, full in mine.items():
                param = storage.layout.by_name[name]
                results[name] = _check_full(storage, "map_full_", param, fn(name, full))
    except Exception as exc:  # noqa: BLE001 - any failure of the user's function must reach every rank
        error = exc
    failed = _write(storage, plan, results, code=error_code(error))
    raise_outcome("map_full_", error, failed)
    storage.after_write([p.name for p in selected])


# --- tools ------------------------------------------------------------------------------------------------------------
def traffic(grads: Any, names: Sequence[str] | None = None, *, target: str = ROWS,
            assignment: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes this rank sends to / receives from other ranks for a read and a write of ``target`` (``"rows"`` or
    ``"owners"``, with ``assignment`` or the balanced one), from the plan (exact, stored dtype). ``grads``: a ``ShardedGrads`` or its storage. No
    communication."""
    storage: GradStorage = grads if isinstance(grads, GradStorage) else state_of(grads).storage
    layout = storage.layout
    selected = list(layout.params) if names is None else [layout.by_name[n] for n in names]
    plan = plan_for(storage, selected, target, owners(storage, selected, assignment) if target == OWNERS else None)
    out = {"read_sent": 0, "read_received": 0, "write_sent": 0, "write_received": 0}
    for bucket in plan.buckets:
        size = torch.empty(0, dtype=bucket.dtype).element_size()
        out["read_sent"] += size * bucket.read.sent_elements
        out["read_received"] += size * bucket.read.received_elements
        out["write_sent"] += size * bucket.write.sent_elements
        out["write_received"] += size * bucket.write.received_elements
    return out


def newton_schulz(grad: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration: an approximately orthogonal matrix with ``grad``'s row/column spaces
    (``U Vᵀ`` of its SVD, singular values pushed into about [0.7, 1.2]). 2-D input; computed in float32, returned
    in ``grad``'s dtype. Local (no communication)."""
    if grad.ndim != 2:
        raise ValueError(f"newton_schulz takes a matrix, got shape {tuple(grad.shape)}")
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad.to(torch.float32)
    x = x / (x.norm() + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(grad.dtype)
