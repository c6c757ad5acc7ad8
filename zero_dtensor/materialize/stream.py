"""Streaming materialization (``iter_full``): consecutive parameters of a flat group in windows of bounded size.

Each window is one collective and a fixed number of tensor operations (its buffer cut into parameters with one
``split_with_sizes``, converted once when a dtype or the loss scale asks for it), whatever the number of parameters
in it. See ``ShardedGrads.iter_full`` for the contract.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..collectives import all_gather_into, all_reduce_sum_work
from ..layout import GroupLayout, ParamLayout
from ..plan import Tiling, tiling
from ..state import GradState
from .buffers import BUFFERS
from .strategy import check_strategy, stream_strategy

__all__ = ["DEFAULT_BUCKET_BYTES", "iter_full", "plan_windows"]

DEFAULT_BUCKET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class _Window:
    """Consecutive parameters (buffer order) of one group, materialized by one collective."""

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

    def order_tiling(self) -> Tiling:
        """The window's parameter-order buffer: each parameter's span (``N·chunk`` for ZeRO-3) back to back."""
        n = 1 if self.group.placement.param_order_gather else self.group.world_size
        spans = [((self.group.placement.span(p)[0] - self.start) * n, p.numel) for p in self.params]
        return tiling(spans, self.width * n)


def _overlaps(group: GroupLayout, start: int, stop: int) -> list[tuple[int, int]]:
    """Per rank, the part ``[lo, hi)`` of global window ``[start, stop)`` that it holds (ZeRO-1/2)."""
    P = group.partition_numel
    return [(max(start, r * P), max(min(stop, (r + 1) * P), max(start, r * P))) for r in range(group.world_size)]


def _window_cost(group: GroupLayout, strategy: str, params: list[ParamLayout]) -> int:
    """Elements this module allocates to materialize ``params`` (consecutive in the buffer) in one window."""
    w = _Window(group, tuple(params), strategy)
    if not group.placement.is_sharded:
        return w.width  # one local copy
    if not group.placement.param_order_gather:  # ZeRO-3: the (N, width) rows, plus their reordered copy
        return group.world_size * w.width * (1 if strategy == "all_reduce" else 2)
    if strategy == "all_reduce":
        return w.width
    m = max(hi - lo for lo, hi in _overlaps(group, w.start, w.stop))
    return (group.world_size + 1) * m  # receive buffer N·m, plus a padded send buffer or a stitching temporary


def _windows(state: GradState, params: list[ParamLayout], bucket_bytes: int, strategy: str) -> list[_Window]:
    windows: list[_Window] = []
    chosen = {p.name for p in params}
    for plan in state.plan.groups:
        ordered = [p for p in plan.params if p.name in chosen]
        if not ordered:
            continue
        group = plan.group
        how = "none" if not group.placement.is_sharded else stream_strategy(
            strategy, state.storage.process_groups[group.index], group.placement.param_order_gather)
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


def _assemble(state: GradState, w: _Window) -> torch.Tensor:
    """One collective: the window's values (stored dtype, still scaled) in the window's parameter order."""
    group = w.group
    g, pg, rank, world = group.index, state.storage.process_groups[group.index], group.rank, group.world_size
    if not group.placement.is_sharded:
        stored = state.storage.partitions[g]
        return BUFFERS.alloc(w.width, stored.dtype, stored.device).copy_(stored.narrow(0, w.start, w.width))
    part = state.comm_partition(g)
    plan = state.plan.groups[g]
    if not group.placement.param_order_gather:  # ZeRO-3: each parameter's (N, chunk) block back to back
        columns = tiling([(p.offset - w.start, p.chunk_numel) for p in w.params], w.width)
        if w.strategy == "all_reduce":
            order = BUFFERS.alloc(world * w.width, part.dtype, part.device, zero=True)
            names = {p.name for p in w.params}
            keep = [k for k, p in enumerate(plan.params) if p.name in names and plan.frag_len[k]]
            if keep:
                blocks = order.split_with_sizes([world * s for s in columns.sizes])
                index = {p.name: i for i, p in enumerate(w.params)}
                targets = [blocks[columns.piece[index[plan.params[k].name]]].view(world, -1)[rank]
                           .narrow(0, 0, plan.frag_len[k]) for k in keep]
                pieces = part.split_with_sizes(list(plan.local.sizes))
                torch._foreach_copy_(targets, [pieces[plan.local.piece[k]] for k in keep])
            all_reduce_sum_work(order, pg)
            return order
        gathered = BUFFERS.alloc(world * w.width, part.dtype, part.device)
        all_gather_into([gathered], [part.narrow(0, w.start, w.width)], pg)
        order = BUFFERS.alloc(world * w.width, part.dtype, part.device)
        blocks = order.split_with_sizes([world * s for s in columns.sizes])
        torch.split_with_sizes_copy(gathered.view(world, w.width), list(columns.sizes), dim=1,
                                    out=[b.view(world, -1) for b in blocks])
        del gathered
        return order
    # ZeRO-1/2: the global window [start, stop)
    start, stop, P = w.start, w.stop, group.partition_numel
    overlaps = _overlaps(group, start, stop)
    lo, hi = overlaps[rank]
    if w.strategy == "all_reduce":
        buf = BUFFERS.alloc(stop - start, part.dtype, part.device, zero=True)
        if hi > lo:
            buf.narrow(0, lo - start, hi - lo).copy_(part.narrow(0, lo - rank * P, hi - lo))
        all_reduce_sum_work(buf, pg)
        return buf
    m = max(b - a for a, b in overlaps)
    if hi - lo == m:
        send = part.narrow(0, lo - rank * P, m)
    else:
        send = BUFFERS.alloc(m, part.dtype, part.device, zero=True)
        if hi > lo:
            send.narrow(0, 0, hi - lo).copy_(part.narrow(0, lo - rank * P, hi - lo))
    recv = BUFFERS.alloc(world * m, part.dtype, part.device)
    all_gather_into([recv], [send], pg)
    del send
    # stitch in place: piece r moves left from r*m to lo_r - start (a temporary only where the two overlap);
    # one copy per rank, not per parameter
    for r, (a, b) in enumerate(overlaps):
        n, at = b - a, a - start
        if n and at != r * m:
            piece = recv.narrow(0, r * m, n)
            if at + n > r * m:
                piece = BUFFERS.alloc(n, part.dtype, part.device).copy_(piece)
            recv.narrow(0, at, n).copy_(piece)
            del piece
    return recv.narrow(0, 0, stop - start)


def _true(state: GradState, values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The window in true units and ``dtype``: one conversion of the whole window (or none)."""
    return state.finish(values, dtype)


def iter_full(state: GradState, params: list[ParamLayout], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              dtype: torch.dtype | None = None, strategy: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """See ``ShardedGrads.iter_full`` (the documented entry point); ``params`` are already validated."""
    state.check_current()
    check_strategy(strategy)
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    return _stream(state, _windows(state, params, bucket_bytes, strategy), dtype)


def _stream(state: GradState, windows: list[_Window], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
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


def plan_windows(state: GradState, params: list[ParamLayout], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 strategy: str = "auto") -> list[dict[str, Any]]:
    """The windows :func:`iter_full` would use: per window its flat group, strategy, parameter names, the
    elements this module allocates for it, and its collectives. No communication."""
    out = []
    for w in _windows(state, params, bucket_bytes, strategy):
        out.append({"group": w.group.index, "strategy": w.strategy, "names": [p.name for p in w.params],
                    "elements": _window_cost(w.group, w.strategy, list(w.params)),
                    "collectives": 1 if w.group.placement.is_sharded else 0})
    return out
