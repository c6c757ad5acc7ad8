"""How each strategy's transfer is issued (:mod:`.strategy`): the zero-padded all_reduce's fill, the pipelined ZeRO-3
all_gather, the gather from every peer by ``all_to_all`` or by point-to-point ops (``send_recv``), and the sends of
a non-destination rank of ``dst=``. Each returns the pending works and the step that follows them (a reordering
into parameter order), run by :func:`~.results.run_steps` or ``PendingFullTensors.wait()``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from ..comm.collectives import (all_gather_by_all_to_all, all_gather_into, all_gather_single, gather_to,
                                peer_partitions_by_all_to_all)
from .placements import assembly_of
from ..layout.plan import ColumnPiece
from ..comm.point_to_point import (Exchange, all_gather_by_send_recv, gather_exchanges, peer_partitions_by_send_recv,
                                   send_recv)
from ..comm.process_groups import group_rank_of, rank_in, world_size_of
from ..core.state import FlatState
from ..layout.views import ViewCache
from .buffers import BUFFERS
from . import strategy as _strategy
from .transfers import Transfer, pipeline_pieces, view_cache, window_cut

__all__ = ["copy_whole", "fill_for_reduce", "gather_by_peers", "pipelined_gather", "send_only", "windowed_gather"]

Regions = dict[int, tuple[torch.Tensor, torch.Tensor | None]]  # group -> (assembled, reorder area)
Step = tuple[list[Any], Callable[[], None] | None]  # pending works, and what runs once they are done


def fill_for_reduce(state: FlatState, t: Transfer, buf: torch.Tensor) -> None:
    """Every group's all_reduce input: this rank's values in parameter order, zeros elsewhere (the placement's)."""
    for g, part in zip(t.groups, t.partitions):
        group, plan = state.group(g), state.plan.groups[g]
        pieces = state.pieces[g] if part is state.storage.partitions[g] else None  # moved: cut on use
        region = buf.narrow(0, t.offsets[g], group.flat_numel)
        assembly_of(group).fill_for_reduce(region, group, plan, part, pieces, BUFFERS.view_cache(region))


def copy_whole(state: FlatState, g: int, part: torch.Tensor, region: torch.Tensor, cache: ViewCache | None) -> None:
    """Group ``g`` of a process group of one rank: its partition is the whole group, copied into ``region`` in
    parameter order by one copy (:meth:`~zero_dtensor.materialize.assembly.GroupAssembly.to_param_order` where the
    placement reorders, ZeRO-3; else ``copy_``). No communication, no staging: ``S`` read, ``S`` written."""
    group = state.group(g)
    if assembly_of(group).reorder_area(group):
        assembly_of(group).to_param_order(part, group, state.plan.groups[g], region, cache)
    else:
        region.copy_(part)


def pipelined_gather(state: FlatState, t: Transfer, regions: Regions, narrow: Callable[[int, int], torch.Tensor],
                     result: MutableMapping[str, torch.Tensor]) -> list[tuple[list[Any], Callable[[], None]]]:
    """Issue a pipelined transfer's two all_gathers at once (each coalesced over its groups: every group's
    columns of that step, gathered as ``(N, width)`` rows into its part of the group's region), and return the
    steps that reorder each part into the group's area once it has arrived. The regions then hold the areas: in
    parameter order once the steps have run."""
    per_step: list[list[tuple[int, torch.Tensor, torch.Tensor, ColumnPiece]]] = [[], []]
    for g, part in zip(t.groups, t.partitions):
        area = regions[g][1]
        assert area is not None
        N = state.group(g).world_size
        for k, piece in enumerate(pipeline_pieces(state, g)):
            rows = narrow(t.offsets[g] + N * piece.lo, N * piece.width)
            per_step[k].append((g, rows, part.narrow(0, piece.lo, piece.width), piece))
        regions[g] = (area, None)
    steps: list[tuple[list[Any], Callable[[], None]]] = []
    for members in per_step:
        if not members:
            continue
        works = all_gather_into([rows for _, rows, _, _ in members], [inp for _, _, inp, _ in members], t.pg,
                                async_op=True)
        steps.append((works, reorder_step(state, members, regions, result)))
    return steps


def _gather_rows(strategy: str) -> Callable[..., list[Any]]:
    """How one window's ``(N, width)`` rows are gathered rank after rank by ``strategy`` (all_gather by
    ``all_gather_into_tensor``, all_to_all and send_recv as their whole-transfer forms gather one flat group)."""
    if strategy == "all_to_all":
        def by_all_to_all(out: torch.Tensor, inp: torch.Tensor, pg: Any, *, async_op: bool = False,
                          pollable: bool = False) -> list[Any]:
            return all_gather_by_all_to_all(out, inp, pg, async_op=async_op)
        return by_all_to_all
    if strategy == "send_recv":
        return all_gather_by_send_recv

    def by_all_gather(out: torch.Tensor, inp: torch.Tensor, pg: Any, *, async_op: bool = False,
                      pollable: bool = False) -> list[Any]:
        work = all_gather_single(out, inp, pg, async_op=async_op)
        return [work] if work is not None else []
    return by_all_gather


#: the strategies whose windows receive only the other ranks' rows (back to back in rank order)
_PEER_GATHERS: dict[str, Callable[..., list[Any]]] = {"send_recv": peer_partitions_by_send_recv,
                                                      "all_to_all": peer_partitions_by_all_to_all}


class WindowedGather:
    """A ZeRO-3 transfer gathered in bounded column windows (:func:`~.strategy.windowed`).

    The staging buffer holds :func:`~.strategy.window_bytes` (``C``: ``max(WINDOW_BYTES, S/WINDOW_SHARE)``, or the
    widest parameter's ``(N, chunk)`` block where one is wider) and is kept between calls
    (:meth:`~.buffers.BufferPool.lend`: a fresh one would cost a page fault per 4 KiB on the CPU, every call).
    The windows (:func:`~.transfers.window_cut`) hold at most ``C/2`` each, so that two fit in it at once, where
    that keeps the collective count within its bound; else ``C`` each, one at a time.

    Synchronous (``async_op=False``): two windows in flight, one at each end of the staging buffer; once one has
    arrived it is reordered by one row copy into its part of the group's parameter-order result while the other
    travels, then the next window is issued into the end it freed (where two consecutive windows do not fit side by
    side, the next waits for both). The memory beyond the result stays ``C``. By ``send_recv`` and ``all_to_all``
    only the other ranks' ``(N-1, width)`` rows travel into the staging buffer, and this rank's own columns go
    straight from its partition into their rows of the result while they travel: the result's bytes are written
    once (an all_gather's window holds this rank's row too, copied there first). Where ``send_recv`` gets one work
    per op (gloo), each peer's columns are put in place as soon as they have arrived, while the others travel.

    Asynchronous: every window is issued at the call (so that :meth:`~.results.PendingFullTensors.is_completed`
    completes without ``wait()``, and no collective is issued later): the first into the staging buffer, every
    later one into its own part of the result (its gathered rows are exactly as large), from where ``wait()`` copies
    it into the staging buffer and reorders it back: one more copy of those windows, the same memory bound.

    :attr:`pending` counts the windows not yet issued."""

    def __init__(self, state: FlatState, t: Transfer, regions: Regions, result: MutableMapping[str, torch.Tensor],
                 steps: list[Step], async_op: bool) -> None:
        self.state, self.t, self.regions, self.result = state, t, regions, result
        self.steps: list[Step] | None = steps
        limit = _strategy.window_bytes(t.nbytes)
        # synchronous send_recv / all_to_all: only the peers' rows travel into the staging buffer, this rank's own
        # columns go straight from its partition into their place (no copy of them into the rows first)
        self.peers_only = (not async_op and t.strategy in _PEER_GATHERS
                           and all(state.group(g).world_size > 1 for g in t.groups))
        cut, self.in_flight_max = window_cut(state, t.groups, limit)
        self.windows = [(g, part, piece) for g, part, pieces in zip(t.groups, t.partitions, cut) for piece in pieces]
        own = 1 if self.peers_only else 0
        self.sizes = [(state.group(g).world_size - own) * piece.width for g, _, piece in self.windows]
        esize = t.partitions[0].element_size()
        self.capacity = max(limit // esize, max(self.sizes))
        staged = max(self.sizes) if async_op else self.capacity
        self.key = ("window staging", t.device, t.dtype)
        self.staging: torch.Tensor | None = BUFFERS.lend(self.key, staged, t.dtype, t.device)
        self.gather = _gather_rows(t.strategy)
        self.async_op = async_op
        self.issued = 0
        self.in_flight: list[tuple[int, int]] = []  # (window, offset in the staging buffer), issue order

    @property
    def pending(self) -> int:
        return len(self.windows) - self.issued

    def start(self) -> None:
        """Issue the first windows (asynchronously: the steps await them); every window where ``async_op``."""
        if self.async_op:
            while self.issued < len(self.windows):
                self._issue_async()
            self._done()
        else:
            self._pump()

    def _rows_input(self, k: int) -> tuple[int, torch.Tensor]:
        g, part, piece = self.windows[k]
        return g, part.narrow(0, piece.lo, piece.width)

    def _target(self, k: int) -> torch.Tensor:
        """Window ``k``'s part of its group's parameter-order result (as many elements as its gathered rows)."""
        g, _, piece = self.windows[k]
        n = self.state.group(g).world_size
        return self.regions[g][0].narrow(0, n * piece.lo, n * piece.width)

    def _place(self, k: int) -> int | None:
        """Where window ``k`` goes in the staging buffer beside the windows in flight (None: not now)."""
        size = self.sizes[k]
        if not self.in_flight:
            return 0
        if len(self.in_flight) >= self.in_flight_max:
            return None
        j, at = self.in_flight[0]
        if at >= size:
            return 0
        end = self.capacity - size
        return end if end >= at + self.sizes[j] else None

    def _pump(self) -> None:
        """Issue the next windows while they fit beside those in flight."""
        while self.issued < len(self.windows):
            at = self._place(self.issued)
            if at is None:
                return
            k = self.issued
            assert self.staging is not None and self.steps is not None
            rows = self.staging.narrow(0, at, self.sizes[k])
            _, inp = self._rows_input(k)
            if self.peers_only:
                works = _PEER_GATHERS[self.t.strategy](rows, inp, self.t.pg, async_op=True)
                self._place_own(k, inp)  # while the peers' rows travel
            else:
                works = self.gather(rows, inp, self.t.pg, async_op=True)
            self.issued += 1
            self.in_flight.append((k, at))
            peers = self.state.group(self.windows[k][0]).world_size - 1
            if self.peers_only and len(works) == 2 * peers:  # one work per op (gloo): each peer placed on arrival
                for i in range(peers):
                    self.steps.append(([works[i]], lambda k=k, rows=rows, i=i: self._place_peer(k, rows, i)))
                self.steps.append((works[peers:], lambda k=k: self._window_done(k)))  # the sends
            else:
                self.steps.append((works, lambda k=k, rows=rows: self._arrived(k, rows)))

    def _issue_async(self) -> None:
        k = self.issued
        assert self.staging is not None and self.steps is not None
        rows = self.staging.narrow(0, 0, self.sizes[k]) if k == 0 else self._target(k)
        _, inp = self._rows_input(k)
        works = self.gather(rows, inp, self.t.pg, async_op=True, pollable=True)
        self.issued += 1
        staging = self.staging

        last = self.issued == len(self.windows)

        def arrived(k: int = k, rows: torch.Tensor = rows) -> None:
            if k:  # gathered into its own part of the result: staged out, then reordered back
                rows = staging.narrow(0, 0, self.sizes[k]).copy_(rows)
            self._reorder(k, rows)
            if last:  # the steps run in issue order: every window is in place
                BUFFERS.give_back(self.key)
        self.steps.append((works, arrived))

    def _reorder(self, k: int, rows: torch.Tensor) -> None:
        g, _, piece = self.windows[k]
        group, area = self.state.group(g), self.regions[g][0]
        plan, cache = self.state.plan.groups[g], view_cache(self.result, area)
        if self.peers_only:
            assembly_of(group).peers_to_param_order(rows, group, plan, self._target(k), cache, piece)
        else:
            assembly_of(group).to_param_order(rows, group, plan, self._target(k), cache, piece)

    def _place_own(self, k: int, columns: torch.Tensor) -> None:
        """This rank's columns of window ``k`` straight into their rows of its part of the result."""
        self._place_rank(k, columns, self.state.group(self.windows[k][0]).rank)

    def _place_peer(self, k: int, rows: torch.Tensor, i: int) -> None:
        """The ``i``-th other rank's columns of window ``k`` (``rows``: the peers' back to back) into place."""
        width = self.windows[k][2].width
        self._place_rank(k, rows.narrow(0, i * width, width), i + (i >= self.state.group(self.windows[k][0]).rank))

    def _place_rank(self, k: int, columns: torch.Tensor, rank: int) -> None:
        g, _, piece = self.windows[k]
        group, area = self.state.group(g), self.regions[g][0]
        assembly_of(group).rank_to_param_order(columns, rank, group, self.state.plan.groups[g], self._target(k),
                                               view_cache(self.result, area), piece)

    def _arrived(self, k: int, rows: torch.Tensor) -> None:
        self._reorder(k, rows)
        self._window_done(k)

    def _window_done(self, k: int) -> None:
        """Window ``k`` is in place: its end of the staging buffer is free for the next."""
        self.in_flight = [(j, at) for j, at in self.in_flight if j != k]
        self._pump()
        if self.issued == len(self.windows) and not self.in_flight:
            self._done()

    def _done(self) -> None:
        """Every window issued (and, synchronously, in place): let go of the steps (their closures refer to this
        object: a cycle that would keep the result's buffer from being recycled until the garbage collector runs)
        and of the staging buffer (kept by the pool)."""
        self.steps = None
        if not self.async_op:
            self.staging = None
            BUFFERS.give_back(self.key)


def windowed_gather(state: FlatState, t: Transfer, regions: Regions, result: MutableMapping[str, torch.Tensor],
                    steps: list[Step], async_op: bool = False) -> WindowedGather:
    """Start a :class:`WindowedGather` of ``t`` into ``regions`` (each group's region is its parameter-order
    result), its steps appended to ``steps`` as its windows are issued."""
    gather = WindowedGather(state, t, regions, result, steps, async_op)
    gather.start()
    return gather


def gather_by_peers(state: FlatState, t: Transfer, regions: Regions, result: MutableMapping[str, torch.Tensor],
                    async_op: bool, by_send_recv: bool = False) -> list[Step]:
    """Every group of the transfer gathered from its peers, and the steps that follow: by point-to-point ops
    (``by_send_recv``: :func:`_gather_by_send_recv`), or by one ``all_to_all_single`` per flat group (it has no
    coalesced form). Where the placement reorders through rows
    (:meth:`~zero_dtensor.materialize.assembly.GroupAssembly.peer_rows`: ZeRO-3), the all_to_all receives the other ranks'
    partitions back to back into the group's region (issued asynchronously even for a synchronous call: the step
    awaits them) while this rank's partition is copied into its rows of parameter order, and copies them into
    theirs once they have arrived: ``S`` copied in all, not ``S/N`` into the gathered rows and then ``S``.
    Elsewhere the group is gathered rank after rank and reordered as an all_gather is. The regions of the first
    kind then hold their areas."""
    if by_send_recv:
        return _gather_by_send_recv(state, t, regions, result, async_op)
    works: list[Any] = []
    local: list[Callable[[], Any]] = []  # this rank's own partitions into place, once the peers' are under way
    after: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (peer row copy, received, area)
    for g, part in zip(t.groups, t.partitions):
        group = state.group(g)
        region, area = regions[g]
        rows = assembly_of(group).peer_rows(state.plan.groups[g], part.element_size()) if area is not None else None
        if rows is None or area is None:
            works += all_gather_by_all_to_all(region, part, t.pg, async_op=async_op)
            continue
        own, peers = rows
        received = region.narrow(0, 0, (group.world_size - 1) * group.partition_numel)
        works += peer_partitions_by_all_to_all(received, part, t.pg, async_op=True)  # awaited by the step
        # while it travels (both only read the partition)
        local.append(lambda own=own, part=part, area=area: own.copy(part, area))
        after.append((peers, received, area))
        regions[g] = (area, None)
    for copy in local:
        copy()
    if not after:
        return [(works, None)]

    def reorder() -> None:
        for peers, received, area in after:
            peers.copy(received, area)
    return [(works, reorder)]


def _gather_by_send_recv(state: FlatState, t: Transfer, regions: Regions,
                         result: MutableMapping[str, torch.Tensor], async_op: bool = False) -> list[Step]:
    """The whole transfer by **one** batch of point-to-point ops (:func:`~zero_dtensor.comm.point_to_point.send_recv`:
    ``2(N-1)`` per flat group): each partition sent as it is, every peer's received straight into its row of the
    group's region, no copy of ``S``, no scratch; issued asynchronously even for a synchronous call (the steps
    await them). Where no reorder is needed (ZeRO-1/2), this rank's row is copied locally while the peers' travel.
    Where the placement reorders (ZeRO-3), this rank's partition goes straight into its place in parameter order
    while the peers' travel, and each peer's into its place as soon as it has arrived, while the later ones still
    travel (where the backend returns one work per op, gloo; else once all have): ``S`` copied in all, ``(N-1)/N``
    of it overlapping the transfer; the regions of that kind then hold their areas."""
    me = rank_in(t.pg)
    sends: list[Exchange] = []
    recvs: list[Exchange] = []
    local: list[Callable[[], Any]] = []  # this rank's own partitions into place, once the peers' are under way
    placing: list[tuple[int, torch.Tensor, torch.Tensor, ViewCache | None]] = []  # (group, its rows, area, cache)
    for g, part in zip(t.groups, t.partitions):
        region, area = regions[g]
        _add(gather_exchanges(region, part, t.pg), sends, recvs)
        if area is None:
            own_row = region.narrow(0, me * part.numel(), part.numel())
            local.append(lambda own_row=own_row, part=part: own_row.copy_(part))
            continue
        cache = view_cache(result, area)
        group, plan = state.group(g), state.plan.groups[g]
        local.append(lambda part=part, group=group, plan=plan, area=area, cache=cache:
                     assembly_of(group).rank_to_param_order(part, me, group, plan, area, cache))
        placing.append((g, region, area, cache))
        regions[g] = (area, None)
    works = send_recv(sends, recvs, t.pg, async_op=True, pollable=async_op)  # polled by the caller's handle
    for copy in local:
        copy()
    peers = [r for r in range(world_size_of(t.pg)) if r != me]

    def place(peer: int) -> None:
        for g, rows, area, cache in placing:
            group = state.group(g)
            n = group.partition_numel
            assembly_of(group).rank_to_param_order(rows.narrow(0, peer * n, n), peer, group, state.plan.groups[g],
                                                area, cache)

    if not placing:
        return [(works, None)]
    if len(works) != len(sends) + len(recvs):  # one work for the batch (NCCL coalesces): place after it
        def place_all() -> None:
            for peer in peers:
                place(peer)
        return [(works, place_all)]
    # one work per op, receives first in the order listed: per group, the peers in rank order
    per_peer = [[works[k * len(peers) + i] for k in range(len(t.groups))] for i in range(len(peers))]
    steps: list[Step] = [(arrived, lambda peer=peer: place(peer)) for peer, arrived in zip(peers, per_peer)]
    steps.append((works[len(recvs):], None))  # the sends
    return steps


def _add(exchanges: tuple[list[Exchange], list[Exchange]], sends: list[Exchange], recvs: list[Exchange]) -> None:
    sends += exchanges[0]
    recvs += exchanges[1]


def reorder_step(state: FlatState, members: list[tuple[int, torch.Tensor, torch.Tensor, ColumnPiece]],
                 regions: Regions, result: MutableMapping[str, torch.Tensor]) -> Callable[[], None]:
    def reorder() -> None:
        for g, rows, _, piece in members:
            group, area = state.group(g), regions[g][0]
            target = area.narrow(0, group.world_size * piece.lo, group.world_size * piece.width)
            assembly_of(group).to_param_order(rows, group, state.plan.groups[g], target, view_cache(result, area),
                                           piece)
    return reorder


def send_only(t: Transfer, dst: int | None, async_op: bool) -> list[Any]:
    """A non-destination rank of ``dst=`` with all_gather: send this rank's partitions (one gather per group)."""
    works: list[Any] = []
    for part in t.partitions:
        works += gather_to(part, None, group_rank_of(t.pg, dst), t.pg, async_op=async_op)
    return works

