"""How a flat group's buffer (of any family) is assembled from the ranks of its process group, and what that costs.

One placement kind per way DeepSpeed stores a group: its geometry (which elements each rank holds) is
:mod:`zero_dtensor.layout`'s (:class:`~zero_dtensor.layout.flat.RaggedShard`, :class:`~zero_dtensor.layout.flat.ChunkShard`,
:class:`~zero_dtensor.layout.flat.Replicated`); each kind's assembly here (:func:`assembly_of` picks it) adds, for a
whole group at once, how the group's full buffer is assembled (which collective, how many bytes) and how an
assembled buffer is cut into parameters, implementing :class:`~zero_dtensor.materialize.assembly.GroupAssembly` (the
methods every kind has, their defaults). Nothing outside this module and :mod:`zero_dtensor.layout` branches on the
kind of a group.

``N`` ranks, ``P`` elements per rank's partition, ``S`` the bytes of the group's padded flat buffer (``N·P``
elements, stored dtype; ``P`` elements for a replicated group):

===============  ===========================  =======================================  ===================================
placement        DeepSpeed                    rank ``r`` holds                         gathered with (bytes per rank)
===============  ===========================  =======================================  ===================================
``RaggedShard``  ZeRO-1/2                     ``[r·P, (r+1)·P)`` of the flat buffer:   ``all_gather`` of the partitions
                 (``DeepSpeedZeroOptimizer``) a parameter straddles ranks at any       ``(N-1)/N·S``; zero-padded
                                              offset (ragged pieces)                   ``all_reduce`` ``2(N-1)/N·S``;
                                                                                       ``gather`` to one rank ``S/N`` sent
``ChunkShard``   ZeRO-3                       chunk ``r`` of every parameter           as ``RaggedShard``; the gathered
                 (``..._Stage3``)             (``torch.chunk`` of the flattened        ``(N, P)`` rows are reordered
                                              parameter), back to back                 into parameters by one row
                                                                                       copy (``index_select``)
``Replicated``   ``BF16_Optimizer``,          the whole buffer                         nothing (one local copy for a
                 ``keep_full_grads``                                                   snapshot)
===============  ===========================  =======================================  ===================================

Cutting into parameters: ``RaggedShard`` and ``Replicated`` buffers are in parameter order already (one
``split_with_sizes`` gives every parameter as a view); ``ChunkShard`` buffers are rank-major, and parameter ``p``
is the row-major flattening of its ``(N, chunk_p)`` column block, so the whole group is reordered into a
parameter-order buffer by one row copy (:mod:`zero_dtensor.layout.rows`: one ``index_select`` of rows as wide as the
chunks' common divisor), or, where rows do not pay (under 32 bytes wide, or chunks of 4,096 elements or more on
average), by one ``torch.split_with_sizes_copy`` along
dimension 1 (as FSDP2 copies out its all-gather; one kernel on CUDA, a copy per block on the CPU) — and, for the
zero-padded ``all_reduce``, each rank writes its chunks straight into parameter order (one row copy likewise). A
pipelined all_gather (:meth:`~zero_dtensor.materialize.assembly.GroupAssembly.pipeline_pieces`: ``ChunkShard`` only, large transfers) gathers the
columns in two pieces cut at a parameter boundary and reorders each piece by its own row copy into its part of the
parameter-order buffer.

Streaming windows (``iter_full``): a window is consecutive parameters of one group whose spans
(:meth:`~zero_dtensor.materialize.assembly.GroupAssembly.span`) cover ``[start, stop)``, ``W = stop - start`` elements. Its buffers come from the
caller's allocator, and :meth:`~zero_dtensor.materialize.assembly.GroupAssembly.assemble_window` issues :attr:`~zero_dtensor.materialize.assembly.GroupAssembly.window_collectives`
(one, or none) per window (elements per rank; times the element size for bytes):

===============  ====================================  ============================================
placement        ``all_reduce`` (zero-padded sum)      ``all_gather``
===============  ====================================  ============================================
``RaggedShard``  of ``W``: ``2(N-1)/N·W``              each rank's share of the window, padded to
                                                       the largest (``m``): ``m`` sent, ``(N-1)·m``
                                                       received, stitched in place
``ChunkShard``   of ``N·W``: ``2(N-1)·W``              of the ``W`` columns: ``W`` sent,
                                                       ``(N-1)·W`` received, reordered into a
                                                       second ``N·W`` buffer
``Replicated``   nothing: one local copy of ``W``      nothing: one local copy of ``W``
===============  ====================================  ============================================

``send_recv`` (one batch of point-to-point ops per window; the default on gloo): ``RaggedShard`` receives every
other rank's share of the window straight into its place (no padding, no stitching, no zero fill), ``ChunkShard``
receives the ``W`` columns of every other rank into its row, then reorders as ``all_gather`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_into, all_gather_single, all_reduce_sum_work, on_comm_device
from .assembly import Allocator, GroupAssembly
from ..layout.flat import ChunkShard, GroupPlacement, RaggedShard, Replicated
from ..comm.point_to_point import all_gather_by_send_recv, send_recv
from ..layout.tiling import Tiling, tiling
from ..layout.views import ViewCache

if TYPE_CHECKING:
    from ..layout.flat import GroupLayout, ParamLayout
    from ..layout.plan import ColumnPiece, GroupPlan
    from ..layout.rows import RowMap

__all__ = ["ChunkAssembly", "RaggedAssembly", "ReplicatedAssembly", "assembly_of"]


@dataclass(frozen=True)
class RaggedAssembly(RaggedShard, GroupAssembly):
    """ZeRO-1/2 (:class:`~zero_dtensor.layout.flat.RaggedShard`): gathered in parameter order."""

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """One sum ``all_reduce`` of a zero-padded ``numel`` buffer (exact: one non-zero contributor per element),
        ``2(N-1)/N·numel`` elements per rank."""
        start, stop = self.rank_range(group, param, group.rank)
        local = partition.narrow(0, self.local_offset(group, param, group.rank), stop - start)
        local = on_comm_device(local, pg, device)
        full = torch.zeros(param.numel, dtype=local.dtype, device=local.device)
        full.narrow(0, start, stop - start).copy_(local)
        all_reduce_sum_work(full, pg)
        return full

    def fill_for_reduce(self, region: torch.Tensor, group: GroupLayout, plan: GroupPlan, partition: torch.Tensor,
                        pieces: tuple[torch.Tensor, ...] | None, cache: ViewCache | None = None) -> None:
        """The partition into its own range, zeros around it: two fills, one copy."""
        P, r = group.partition_numel, group.rank
        region.narrow(0, 0, r * P).zero_()
        region.narrow(0, (r + 1) * P, group.flat_numel - (r + 1) * P).zero_()
        region.narrow(0, r * P, P).copy_(partition)

    @staticmethod
    def _overlaps(group: GroupLayout, start: int, stop: int) -> list[tuple[int, int]]:
        """Per rank, the part ``[lo, hi)`` of global window ``[start, stop)`` that it holds."""
        P = group.partition_numel
        return [(max(start, r * P), max(min(stop, (r + 1) * P), max(start, r * P))) for r in range(group.world_size)]

    def window_elements(self, group: GroupLayout, strategy: str, start: int, stop: int) -> int:
        """``all_reduce`` and ``send_recv``: the window; ``all_gather``: the receive buffer ``N·m`` plus a padded
        send buffer or a stitching temporary (``m``: the largest rank's share of the window)."""
        if strategy in ("all_reduce", "send_recv"):
            return stop - start
        m = max(hi - lo for lo, hi in self._overlaps(group, start, stop))
        return (group.world_size + 1) * m

    def assemble_window(self, group: GroupLayout, plan: GroupPlan, partition: torch.Tensor, pg: dist.ProcessGroup,
                        device: torch.device, params: tuple[ParamLayout, ...], start: int, stop: int, strategy: str,
                        alloc: Allocator) -> torch.Tensor:
        """The global window ``[start, stop)``. ``all_reduce``: one sum all_reduce of the zero-padded window
        (``2(N-1)/N·W`` elements per rank); ``all_gather``: one all_gather of each rank's share padded to the
        largest, ``m`` (``(N-1)·m`` received), stitched in place; ``send_recv``: one batch of point-to-point ops,
        every other rank's share received straight into its place of the window (about ``(N-1)/N·W`` received; this
        rank's share, sent as it is to every rank that does not hold the whole window, copied locally)."""
        part = on_comm_device(partition, pg, device)
        if strategy == "all_reduce":
            return self._window_by_all_reduce(group, part, pg, start, stop, alloc)
        if strategy == "send_recv":
            return self._window_by_send_recv(group, part, pg, start, stop, alloc)
        return self._window_by_all_gather(group, part, pg, start, stop, alloc)

    def _window_by_send_recv(self, group: GroupLayout, part: torch.Tensor, pg: dist.ProcessGroup, start: int,
                             stop: int, alloc: Allocator) -> torch.Tensor:
        rank, P = group.rank, group.partition_numel
        overlaps = self._overlaps(group, start, stop)
        buf = alloc(stop - start, part.dtype, part.device)
        lo, hi = overlaps[rank]
        peers = [r for r in range(group.world_size) if r != rank]
        mine = part.narrow(0, lo - rank * P, hi - lo) if hi > lo else None
        sends = [(mine, r) for r in peers] if mine is not None else []
        recvs = [(buf.narrow(0, a - start, b - a), r) for r, (a, b) in enumerate(overlaps) if r != rank and b > a]
        works = send_recv(sends, recvs, pg, async_op=True)
        if mine is not None:
            buf.narrow(0, lo - start, hi - lo).copy_(mine)
        for work in works:
            work.wait()
        return buf

    def _window_by_all_reduce(self, group: GroupLayout, part: torch.Tensor, pg: dist.ProcessGroup, start: int,
                              stop: int, alloc: Allocator) -> torch.Tensor:
        rank, P = group.rank, group.partition_numel
        lo, hi = self._overlaps(group, start, stop)[rank]
        buf = alloc(stop - start, part.dtype, part.device, zero=True)
        if hi > lo:
            buf.narrow(0, lo - start, hi - lo).copy_(part.narrow(0, lo - rank * P, hi - lo))
        all_reduce_sum_work(buf, pg)
        return buf

    def _window_by_all_gather(self, group: GroupLayout, part: torch.Tensor, pg: dist.ProcessGroup, start: int,
                              stop: int, alloc: Allocator) -> torch.Tensor:
        rank, P = group.rank, group.partition_numel
        overlaps = self._overlaps(group, start, stop)
        lo, hi = overlaps[rank]
        m = max(b - a for a, b in overlaps)
        if hi - lo == m:
            send = part.narrow(0, lo - rank * P, m)
        else:
            send = alloc(m, part.dtype, part.device, zero=True)
            if hi > lo:
                send.narrow(0, 0, hi - lo).copy_(part.narrow(0, lo - rank * P, hi - lo))
        recv = alloc(group.world_size * m, part.dtype, part.device)
        all_gather_into([recv], [send], pg)
        del send
        # stitch in place: piece r moves left from r*m to lo_r - start (a temporary only where the two overlap);
        # one copy per rank, not per parameter
        for r, (a, b) in enumerate(overlaps):
            n, at = b - a, a - start
            if n and at != r * m:
                piece = recv.narrow(0, r * m, n)
                if at + n > r * m:
                    piece = alloc(n, part.dtype, part.device).copy_(piece)
                recv.narrow(0, at, n).copy_(piece)
                del piece
        return recv.narrow(0, 0, stop - start)


@dataclass(frozen=True)
class ChunkAssembly(ChunkShard, GroupAssembly):
    """ZeRO-3 (:class:`~zero_dtensor.layout.flat.ChunkShard`): gathered rank-major, reordered into parameters."""

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """One ``all_gather`` of the ``chunk_numel``-long (padded) chunks, ``(N-1)/N·numel`` elements per rank."""
        chunk = on_comm_device(partition.narrow(0, param.offset, param.chunk_numel), pg, device)
        gathered = torch.empty(group.world_size * param.chunk_numel, dtype=chunk.dtype, device=chunk.device)
        all_gather_single(gathered, chunk, pg)
        return gathered.narrow(0, 0, param.numel)

    def fill_for_reduce(self, region: torch.Tensor, group: GroupLayout, plan: GroupPlan, partition: torch.Tensor,
                        pieces: tuple[torch.Tensor, ...] | None, cache: ViewCache | None = None) -> None:
        """Rank ``r``'s chunk of parameter ``p`` goes to row ``r`` of ``p``'s ``(N, chunk)`` block: one zero fill,
        then one row copy of the whole partition (:meth:`~zero_dtensor.layout.plan.GroupPlan.own_column_rows`; the
        chunks' padding lands in the blocks' padding, which no result shows), or, where rows do not pay
        (:func:`~zero_dtensor.layout.rows.row_map`), one ``_foreach_copy_`` of the fragments."""
        region.zero_()
        rows = plan.own_column_rows(partition.element_size())
        if rows is not None:
            rows.copy(partition, region)
            return
        keep = plan.has_local
        if keep:
            def build(_: torch.Tensor) -> list[torch.Tensor]:
                blocks = region.split_with_sizes(list(plan.param_order.sizes))
                return [blocks[plan.param_order.piece[k]].view(group.world_size, -1)[group.rank]
                        .narrow(0, 0, plan.frag_len[k]) for k in keep]

            targets = _views(cache, ("fill", plan, region.storage_offset()), region, build)
            if pieces is None:
                pieces = tuple(partition.split_with_sizes(list(plan.local.sizes)))
            torch._foreach_copy_(list(targets), [pieces[i] for i in plan.local_pieces_of(keep)])

    def to_param_order(self, gathered: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                       area: torch.Tensor | None, cache: ViewCache | None = None,
                       piece: ColumnPiece | None = None) -> torch.Tensor:
        """The ``(N, P)`` rows (or a ``piece``'s ``(N, hi - lo)`` rows) cut into column blocks in ``area`` (the
        piece's ``N·(hi - lo)`` elements): one row copy (:attr:`~zero_dtensor.layout.plan.ColumnPiece.rows`: one
        ``index_select``, or a strided copy per run family), or, where rows do not pay
        (:func:`~zero_dtensor.layout.rows.row_map`), one ``split_with_sizes_copy`` (FSDP2's copy-out; one kernel on CUDA, a
        copy per block elsewhere). One rank: the rows are parameter order already, one ``copy_``."""
        assert area is not None
        N = group.world_size
        if N == 1:
            return area.copy_(gathered)
        piece = plan.whole_columns(gathered.element_size()) if piece is None else piece
        if piece.rows is not None:
            piece.rows.copy(gathered, area)
            return area

        def build(_: torch.Tensor) -> list[torch.Tensor]:
            return [b.view(N, -1) for b in area.split_with_sizes([N * s for s in piece.sizes])]

        blocks = _views(cache, ("columns", plan, area.storage_offset(), piece.lo, piece.hi), area, build)
        torch.split_with_sizes_copy(gathered.view(N, piece.width), list(piece.sizes), dim=1, out=list(blocks))
        return area

    def rank_to_param_order(self, row: torch.Tensor, rank: int, group: GroupLayout, plan: GroupPlan,
                            area: torch.Tensor, cache: ViewCache | None = None,
                            piece: ColumnPiece | None = None) -> None:
        """Rank ``rank``'s partition (``P`` elements: its chunk of every parameter; with ``piece``, its
        ``width`` columns of it) into row ``rank`` of every parameter's ``(N, chunk)`` block in ``area`` (the
        piece's ``N·width`` elements): one row copy (:meth:`~zero_dtensor.layout.plan.GroupPlan.rank_column_rows`),
        or, where rows do not pay, one ``split_with_sizes_copy`` into the blocks' rows (contiguous pieces). The
        row's elements copied."""
        rows = plan.rank_column_rows(rank, row.element_size(), piece)
        if rows is not None:
            rows.copy(row, area)
            return
        N = group.world_size
        sizes = plan.gathered.sizes if piece is None else piece.sizes
        lo = 0 if piece is None else piece.lo

        def build(_: torch.Tensor) -> list[torch.Tensor]:
            return [b.view(N, -1)[rank] for b in area.split_with_sizes([N * s for s in sizes])]

        targets = _views(cache, ("rank rows", plan, area.storage_offset(), rank, lo, len(sizes)), area, build)
        torch.split_with_sizes_copy(row, list(sizes), out=list(targets))

    def peers_to_param_order(self, received: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                             area: torch.Tensor, cache: ViewCache | None = None,
                             piece: ColumnPiece | None = None) -> None:
        """The other ranks' partitions (or ``piece``'s columns of them), back to back in rank order, into their
        rows of every parameter's block in ``area``: one row copy
        (:meth:`~zero_dtensor.layout.plan.GroupPlan.peer_column_rows`), or, where rows do not pay, one
        :meth:`rank_to_param_order` per peer. ``received``'s elements copied."""
        rows = plan.peer_column_rows(received.element_size(), piece)
        if rows is not None:
            rows.copy(received, area)
            return
        width = received.numel() // (group.world_size - 1)
        peers = [r for r in range(group.world_size) if r != group.rank]
        for i, peer in enumerate(peers):
            self.rank_to_param_order(received.narrow(0, i * width, width), peer, group, plan, area, cache, piece)

    def reorder_area(self, group: GroupLayout) -> int:
        return group.flat_numel

    def peer_rows(self, plan: GroupPlan, element_size: int) -> tuple[RowMap, RowMap] | None:
        """:meth:`~zero_dtensor.layout.plan.GroupPlan.own_column_rows` and
        :meth:`~zero_dtensor.layout.plan.GroupPlan.peer_column_rows` (both or ``None``)."""
        own, peers = plan.own_column_rows(element_size), plan.peer_column_rows(element_size)
        return None if own is None or peers is None else (own, peers)

    def pipeline_pieces(self, plan: GroupPlan, element_size: int) -> tuple[ColumnPiece, ...]:
        """:meth:`~zero_dtensor.layout.plan.GroupPlan.column_pieces`: two, cut at a parameter boundary."""
        return plan.column_pieces(element_size)

    def window_pieces(self, plan: GroupPlan, element_size: int, max_width: int) -> tuple[ColumnPiece, ...]:
        """:meth:`~zero_dtensor.layout.plan.GroupPlan.column_windows`."""
        return plan.column_windows(element_size, max_width)

    def window_order_tiling(self, group: GroupLayout, params: tuple[ParamLayout, ...], start: int,
                            width: int) -> Tiling:
        """Each parameter's ``(N, chunk)`` block (``N·chunk_numel`` elements: the parameter, then its padding) back
        to back: ``N·width`` elements."""
        n = group.world_size
        return tiling([((p.offset - start) * n, p.numel) for p in params], width * n)

    def window_elements(self, group: GroupLayout, strategy: str, start: int, stop: int) -> int:
        """The ``(N, W)`` rows (``all_reduce``: written in parameter order), plus their reordered copy
        (``all_gather``, ``send_recv``)."""
        return group.world_size * (stop - start) * (1 if strategy == "all_reduce" else 2)

    def assemble_window(self, group: GroupLayout, plan: GroupPlan, partition: torch.Tensor, pg: dist.ProcessGroup,
                        device: torch.device, params: tuple[ParamLayout, ...], start: int, stop: int, strategy: str,
                        alloc: Allocator) -> torch.Tensor:
        """Columns ``[start, stop)`` of every rank's partition, as each parameter's ``(N, chunk)`` block back to
        back. ``all_reduce``: one sum all_reduce of ``N·W`` elements, each rank's chunks written straight into
        parameter order (``2(N-1)·W`` elements per rank); ``all_gather``: one all_gather of the ``W`` columns
        (``(N-1)·W`` received), reordered by one ``split_with_sizes_copy`` into a second ``N·W`` buffer;
        ``send_recv``: the same rows by one batch of point-to-point ops (the ``W`` columns sent as they are, every
        other rank's received into its row, this rank's copied locally), reordered the same way."""
        part = on_comm_device(partition, pg, device)
        width = stop - start
        columns = tiling([(p.offset - start, p.chunk_numel) for p in params], width)
        if strategy == "all_reduce":
            return self._window_by_all_reduce(group, plan, part, pg, params, columns, width, alloc)
        return self._window_by_all_gather(group, part, pg, columns, start, width, alloc, strategy == "send_recv")

    def _window_by_all_reduce(self, group: GroupLayout, plan: GroupPlan, part: torch.Tensor, pg: dist.ProcessGroup,
                              params: tuple[ParamLayout, ...], columns: Tiling, width: int,
                              alloc: Allocator) -> torch.Tensor:
        world = group.world_size
        order = alloc(world * width, part.dtype, part.device, zero=True)
        names = {p.name for p in params}
        keep = [k for k, p in enumerate(plan.params) if p.name in names and plan.frag_len[k]]
        if keep:
            blocks = order.split_with_sizes([world * s for s in columns.sizes])
            index = {p.name: i for i, p in enumerate(params)}
            targets = [blocks[columns.piece[index[plan.params[k].name]]].view(world, -1)[group.rank]
                       .narrow(0, 0, plan.frag_len[k]) for k in keep]
            pieces = part.split_with_sizes(list(plan.local.sizes))
            torch._foreach_copy_(targets, [pieces[plan.local.piece[k]] for k in keep])
        all_reduce_sum_work(order, pg)
        return order

    def _window_by_all_gather(self, group: GroupLayout, part: torch.Tensor, pg: dist.ProcessGroup, columns: Tiling,
                              start: int, width: int, alloc: Allocator, by_send_recv: bool = False) -> torch.Tensor:
        world = group.world_size
        gathered = alloc(world * width, part.dtype, part.device)
        columns_here = part.narrow(0, start, width)
        if by_send_recv:
            all_gather_by_send_recv(gathered, columns_here, pg)
        else:
            all_gather_into([gathered], [columns_here], pg)
        order = alloc(world * width, part.dtype, part.device)
        blocks = order.split_with_sizes([world * s for s in columns.sizes])
        torch.split_with_sizes_copy(gathered.view(world, width), list(columns.sizes), dim=1,
                                    out=[b.view(world, -1) for b in blocks])
        del gathered
        return order


@dataclass(frozen=True)
class ReplicatedAssembly(Replicated, GroupAssembly):
    """``BF16_Optimizer`` and ``keep_full_grads`` (:class:`~zero_dtensor.layout.flat.Replicated`): nothing to
    gather."""

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """No communication: one local copy (a snapshot, never a view of the live gradient)."""
        return partition.narrow(0, param.offset, param.numel).clone()

    @property
    def window_collectives(self) -> int:
        return 0

    def window_strategy(self, choose: Callable[[bool], str]) -> str:
        return "none"

    def window_elements(self, group: GroupLayout, strategy: str, start: int, stop: int) -> int:
        """One local copy of the window."""
        return stop - start

    def assemble_window(self, group: GroupLayout, plan: GroupPlan, partition: torch.Tensor, pg: dist.ProcessGroup,
                        device: torch.device, params: tuple[ParamLayout, ...], start: int, stop: int, strategy: str,
                        alloc: Allocator) -> torch.Tensor:
        """No communication: one local copy of ``[start, stop)`` of the stored buffer (a snapshot, on its device)."""
        return alloc(stop - start, partition.dtype, partition.device).copy_(partition.narrow(0, start, stop - start))


_ASSEMBLIES: dict[type[GroupPlacement], GroupAssembly] = {
    RaggedShard: RaggedAssembly(), ChunkShard: ChunkAssembly(), Replicated: ReplicatedAssembly()}


def assembly_of(group: GroupLayout) -> GroupAssembly:
    """How ``group``'s buffer is assembled: the assembly of its placement (:attr:`~zero_dtensor.layout.flat.GroupLayout.
    placement`, whose geometry it shares). No communication."""
    return _ASSEMBLIES[type(group.placement)]


def _views(cache: ViewCache | None, key: object, region: torch.Tensor,
           build: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
    """``build(region)``: made once and kept in ``cache`` when the region's buffer is kept, else made now."""
    return build(region) if cache is None else cache.get(key, build)
