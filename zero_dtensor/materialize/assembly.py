"""What assembling a flat group's buffer from its ranks means for every placement kind (:class:`GroupAssembly`, the
kinds are in :mod:`zero_dtensor.materialize.placements`, with tables of what each moves), its defaults, and the
:class:`Allocator` that :meth:`GroupAssembly.assemble_window` takes its buffers from.

Nothing here communicates; a kind's methods marked **Collective** must be called on every rank of the group, in the
same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from ..layout.flat import GroupPlacement
from ..layout.tiling import Tiling, tiling

if TYPE_CHECKING:
    from ..layout.flat import GroupLayout, ParamLayout
    from ..layout.plan import ColumnPiece, GroupPlan
    from ..layout.rows import RowMap
    from ..layout.views import ViewCache

__all__ = ["Allocator", "GroupAssembly"]


class Allocator(Protocol):
    """Where :meth:`GroupAssembly.assemble_window` takes its buffers from (``BUFFERS.alloc`` of
    :mod:`zero_dtensor.materialize.buffers`, which the tests observe)."""

    def __call__(self, numel: int, dtype: torch.dtype, device: torch.device, *,
                 zero: bool = False) -> torch.Tensor: ...


@dataclass(frozen=True)
class GroupAssembly(GroupPlacement):
    """One kind of flat group: its placement (:class:`~zero_dtensor.layout.flat.GroupPlacement`: which rank holds what)
    and how its buffer is assembled (see :mod:`zero_dtensor.materialize.placements`)."""

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """One parameter's full flat values (stored dtype, still scaled), in memory the caller owns. **Collective**
        for sharded placements (see each kind)."""
        raise NotImplementedError

    def fill_for_reduce(self, region: torch.Tensor, group: GroupLayout, plan: GroupPlan, partition: torch.Tensor,
                        pieces: tuple[torch.Tensor, ...] | None, cache: ViewCache | None = None) -> None:
        """Write this rank's values into ``region`` (``flat_numel`` elements) in parameter order, zeros elsewhere:
        the input of the zero-padded sum all_reduce. ``partition`` is this rank's (1-D), ``pieces`` the same cut by
        ``plan.local`` when already made (else ``None``); ``cache``
        (the region's buffer's, if it is kept) keeps per-parameter target views across calls."""
        raise NotImplementedError

    def to_param_order(self, gathered: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                       area: torch.Tensor | None, cache: ViewCache | None = None,
                       piece: ColumnPiece | None = None) -> torch.Tensor:
        """An all_gather's result in parameter order: ``gathered`` itself, or reordered into ``area`` (``cache``:
        as for :meth:`fill_for_reduce`); with ``piece`` (one of :meth:`pipeline_pieces`), only that piece's
        gathered rows into its part of ``area``."""
        return gathered

    def reorder_area(self, group: GroupLayout) -> int:
        """Elements of the extra buffer :meth:`to_param_order` needs after an all_gather (0: none)."""
        return 0

    def rank_to_param_order(self, row: torch.Tensor, rank: int, group: GroupLayout, plan: GroupPlan,
                            area: torch.Tensor, cache: ViewCache | None = None,
                            piece: ColumnPiece | None = None) -> None:
        """What :meth:`to_param_order` does for one rank's row of the gathered rows: its partition (``row``) into
        its place in ``area``, so that a peer's partition is put in order as soon as it has arrived; with
        ``piece`` (one of :meth:`window_pieces`), ``row`` is the rank's columns of that piece and ``area`` the
        piece's part of the parameter-order buffer. Only placements that reorder (:meth:`reorder_area` non-zero)
        implement it."""
        raise NotImplementedError(f"{type(self).__name__} gathers in parameter order: nothing to reorder")

    def peers_to_param_order(self, received: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                             area: torch.Tensor, cache: ViewCache | None = None,
                             piece: ColumnPiece | None = None) -> None:
        """The other ranks' rows (``received``: back to back in rank order, as
        :func:`~zero_dtensor.comm.point_to_point.peer_partitions_by_send_recv` leaves them; with ``piece``, their
        columns of it) into their places in ``area``, this rank's rows untouched. Only placements that reorder
        implement it."""
        raise NotImplementedError(f"{type(self).__name__} gathers in parameter order: nothing to reorder")

    def peer_rows(self, plan: GroupPlan, element_size: int) -> tuple[RowMap, RowMap] | None:
        """Where an all_gather of ``element_size``-byte elements needs a reorder: the row copies that put this
        rank's partition, and the other ranks' received back to back
        (:func:`~zero_dtensor.comm.collectives.peer_partitions_by_all_to_all`), each straight into its rows of parameter
        order (``area`` of :meth:`to_param_order`), so that this rank's own partition is never copied into the
        gathered rows first; ``None`` where no reorder is needed or rows do not pay."""
        return None

    def pipeline_pieces(self, plan: GroupPlan, element_size: int) -> tuple[ColumnPiece, ...]:
        """The column ranges (``element_size``-byte elements) of the partitions that a pipelined all_gather
        gathers as collectives of their own, each reordered by :meth:`to_param_order` once it has arrived (while
        the next travels, where the process group runs collectives in issue order); empty where an all_gather needs
        no reorder (then nothing is worth pipelining)."""
        return ()

    def window_pieces(self, plan: GroupPlan, element_size: int, max_width: int) -> tuple[ColumnPiece, ...]:
        """The column windows (at most ``max_width`` columns of ``element_size``-byte elements each, cut at
        parameter boundaries; a wider parameter alone) that a gather in bounded windows gathers one by one, each
        reordered by :meth:`to_param_order` into its part of the result once it has arrived; empty where a gather
        needs no reorder (it lands in the result itself)."""
        return ()

    # --- streaming windows (``iter_full``): the parameters covering [start, stop) of the :meth:`span` axis -------
    @property
    def window_collectives(self) -> int:
        """Collectives :meth:`assemble_window` issues for one window."""
        return 1

    def window_strategy(self, choose: Callable[[bool], str]) -> str:
        """The strategy of this group's windows: ``choose(param_order_gather)`` (the caller's selection, told
        whether an all_gather lands in parameter order), or ``"none"`` where no collective is needed."""
        return choose(self.param_order_gather)

    def window_order_tiling(self, group: GroupLayout, params: tuple[ParamLayout, ...], start: int,
                            width: int) -> Tiling:
        """The layout of :meth:`assemble_window`'s result: each of ``params`` (consecutive, buffer order, spanning
        ``[start, start + width)``) at its place in the window, in parameter order."""
        return tiling([(self.span(p)[0] - start, p.numel) for p in params], width)

    def window_elements(self, group: GroupLayout, strategy: str, start: int, stop: int) -> int:
        """Elements :meth:`assemble_window` allocates (through ``alloc``) for the window ``[start, stop)``."""
        raise NotImplementedError

    def assemble_window(self, group: GroupLayout, plan: GroupPlan, partition: torch.Tensor, pg: dist.ProcessGroup,
                        device: torch.device, params: tuple[ParamLayout, ...], start: int, stop: int, strategy: str,
                        alloc: Allocator) -> torch.Tensor:
        """The window's values (stored dtype, still scaled) laid out by :meth:`window_order_tiling`, in buffers
        from ``alloc``. ``partition`` is this rank's stored partition (moved to a device ``pg`` communicates on,
        else ``device``, where a collective needs it). **Collective** (:attr:`window_collectives`) for sharded
        placements (see each kind)."""
        raise NotImplementedError
