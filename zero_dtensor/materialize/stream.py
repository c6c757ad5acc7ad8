"""Streaming materialization (``iter_full``): consecutive parameters of a flat group in windows of bounded size.

Each window is one collective (a local copy for a replicated group) and a fixed number of tensor operations (its
buffer cut into parameters with one ``split_with_sizes``, converted once when a dtype or the loss scale asks for
it), whatever the number of parameters in it. See ``ShardedGrads.iter_full`` for the contract.

What a window costs and how it is assembled depend on how its group is stored: this module asks the group's
placement (:mod:`zero_dtensor.materialize.placements`: ``window_strategy``, ``window_elements``, ``assemble_window``,
``window_order_tiling``, ``window_collectives``) and hands it ``BUFFERS.alloc`` (:mod:`.buffers`) for every
buffer, so that the tests and the benchmark see each allocation. It never branches on the kind of a group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..layout.flat import GroupLayout, ParamLayout
from .placements import assembly_of
from ..layout.tiling import Tiling
from ..core.state import FlatState
from .buffers import BUFFERS
from ..comm.collectives import comm_device
from .strategy import check_possible, check_strategy, explicit, stream_strategy

__all__ = ["DEFAULT_BUCKET_BYTES", "check_request", "iter_full", "plan_windows"]

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _Window:
    """Consecutive parameters (buffer order) of one group, materialized by one collective (or a local copy)."""

    group: GroupLayout
    params: tuple[ParamLayout, ...]
    strategy: str

    @property
    def start(self) -> int:
        return self.group.placement.span(self.params[0])[0]

    @property
    def stop(self) -> int:
        return self.group.placement.span(self.params[-1])[1]

    @property
    def width(self) -> int:
        return self.stop - self.start

    @property
    def elements(self) -> int:
        """Elements this module allocates to materialize the window."""
        return assembly_of(self.group).window_elements(self.group, self.strategy, self.start, self.stop)

    def order_tiling(self) -> Tiling:
        """The window's parameter-order buffer (the layout :meth:`~zero_dtensor.materialize.assembly.GroupAssembly.assemble_window` returns)."""
        return assembly_of(self.group).window_order_tiling(self.group, self.params, self.start, self.width)


def _window_cost(group: GroupLayout, strategy: str, params: list[ParamLayout]) -> int:
    """Elements this module allocates to materialize ``params`` (consecutive in the buffer) in one window."""
    return _Window(group, tuple(params), strategy).elements


def _windows(state: FlatState, params: list[ParamLayout], bucket_bytes: int, strategy: str) -> list[_Window]:
    windows: list[_Window] = []
    chosen = {p.name for p in params}
    for plan in state.plan.groups:
        ordered = [p for p in plan.params if p.name in chosen]
        if not ordered:
            continue
        group = plan.group
        pg = state.storage.process_groups[group.index]
        device = _comm_device(state, group.index)
        how = assembly_of(group).window_strategy(lambda in_order: stream_strategy(strategy, pg, in_order, device))
        limit = max(1, bucket_bytes // state.storage.partitions[group.index].element_size())
        current: list[ParamLayout] = []
        for p in ordered:
            if current and _window_cost(group, how, current + [p]) > limit:
                windows.append(_Window(group, tuple(current), how))
                current = []
            current.append(p)
        if current:
            windows.append(_Window(group, tuple(current), how))
    return windows


def _assemble(state: FlatState, w: _Window) -> torch.Tensor:
    """The window's values (stored dtype, still scaled) in the window's parameter order: one collective (or a local
    copy), buffers from :data:`BUFFERS`."""
    g = w.group.index
    storage = state.storage
    return assembly_of(w.group).assemble_window(w.group, state.plan.groups[g], storage.partitions[g],
                                             storage.process_groups[g], storage.device, w.params, w.start, w.stop,
                                             w.strategy, BUFFERS.alloc)


def _true(state: FlatState, values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The window in true units and ``dtype``: one conversion of the whole window (or none)."""
    return state.finish(values, dtype)


def iter_full(state: FlatState, params: list[ParamLayout], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              dtype: torch.dtype | None = None, strategy: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """See ``ShardedGrads.iter_full`` (the documented entry point); ``params`` and the arguments are already
    validated (:func:`check_request`, before the rank-agreement check)."""
    state.check_current()
    return _stream(state, _windows(state, params, bucket_bytes, strategy), dtype)


def _comm_device(state: FlatState, g: int) -> torch.device:
    """The device group ``g``'s windows communicate on (no copy made)."""
    storage = state.storage
    return comm_device(storage.partitions[g], storage.process_groups[g], storage.device)


def check_request(bucket_bytes: Any, strategy: str, state: FlatState | None = None,
                  params: list[ParamLayout] | None = None) -> None:
    """Refuse an ``iter_full`` request this rank cannot make, before any communication: ``ValueError`` (with
    ``state`` and ``params``, also a ``send_recv`` asked for or pinned where the sharded groups' backend cannot run
    it on their device, :func:`~.strategy.check_possible`). No communication."""
    check_strategy(strategy)
    if state is not None and params is not None:
        chosen = explicit(strategy)
        for g in state.plan.by_group(params):
            if state.group(g).placement.is_sharded:
                check_possible(chosen, state.storage.process_groups[g], _comm_device(state, g))
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")


def _stream(state: FlatState, windows: list[_Window], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    for w in windows:
        state.check_current()
        values = _true(state, _assemble(state, w), dtype)
        tile = w.order_tiling()
        pieces = values.split_with_sizes(list(tile.sizes))
        del values
        for i, p in enumerate(w.params):
            tensor = pieces[tile.piece[i]].view(p.shape)
            yield p.name, tensor
            del tensor
        del pieces


def plan_windows(state: FlatState, params: list[ParamLayout], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 strategy: str = "auto") -> list[dict[str, Any]]:
    """The windows :func:`iter_full` would use: per window its flat group, strategy, parameter names, the
    elements this module allocates for it, and its collectives. No communication."""
    out = []
    for w in _windows(state, params, bucket_bytes, strategy):
        out.append({"group": w.group.index, "strategy": w.strategy, "names": [p.name for p in w.params],
                    "elements": w.elements, "collectives": assembly_of(w.group).window_collectives})
    return out
