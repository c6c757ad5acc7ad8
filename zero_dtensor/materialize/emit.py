"""The end of a ``full_tensors`` call: per flat group one parameter-order buffer (converted once where the output
dtype or the loss scale asks for it), cut into every parameter's view with one ``split_with_sizes``, and the result
dict filled in request order. Local: no communication.
"""

from __future__ import annotations

import operator
from itertools import chain
from collections.abc import MutableMapping
from typing import Any

import torch

from ..layout.flat import ParamLayout
from .placements import assembly_of
from ..layout.plan import GroupPlan
from ..core.state import FlatState
from .results import GatheredGrads
from .transfers import Buffers, view_cache

__all__ = ["NAME", "converted", "cut_views", "emit", "request_names", "target_dtype"]

NAME = operator.attrgetter("name")


def request_names(state: FlatState, params: list[ParamLayout]) -> tuple[str, ...]:
    """The requested names in request order (the layout's own tuple for every parameter in model order)."""
    return state.layout.names if state.plan.is_everything(params) else tuple(map(NAME, params))


def target_dtype(state: FlatState, p: ParamLayout, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if state.loss_scale != 1.0 else state.storage.partitions[p.group].dtype


def converted(state: FlatState, g: int, order: torch.Tensor, want: torch.dtype, buffers: Buffers,
               copy: bool, kept: bool = True) -> torch.Tensor:
    """``order`` in true units and dtype ``want``: itself when nothing changes and no copy is needed, else one
    converted buffer (bit-identical to unscaling each parameter on its own)."""
    scale = state.loss_scale
    if scale == 1.0 and want == order.dtype and not copy:
        return order
    out = buffers.get(("converted", g, want), order.numel(), want, order.device, kept=kept)
    if scale == 1.0:
        out.copy_(order)
    elif want == torch.float32:
        out.copy_(order)
        out.div_(scale)
    else:
        out.copy_(order.to(torch.float32).div_(scale))
    return out


def cut_views(plan: GroupPlan, values: torch.Tensor, result: Any = None) -> tuple[torch.Tensor, ...]:
    """Every parameter of the group (buffer order) as a view of a parameter-order buffer: one ``split_with_sizes``,
    made once per recycled buffer (:meth:`~zero_dtensor.materialize.buffers.BufferPool.view_cache`) or per buffer
    of a :class:`GatheredGrads` ``result`` (reused when it comes back as ``out=``)."""
    cache = view_cache(result, values)
    if cache is None:
        return _make_cut(plan, values)
    key = ("cut", plan, values.storage_offset(), values.numel(), values.dtype)
    return cache.get(key, lambda _: _make_cut(plan, values))


def _make_cut(plan: GroupPlan, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    pieces = values.split_with_sizes(list(plan.param_order.sizes))
    out = []
    for k, p in enumerate(plan.params):
        piece = pieces[plan.param_order.piece[k]]
        if piece.numel() != p.numel:  # ZeRO-3: the (N, chunk) block is padded past the parameter
            piece = piece.narrow(0, 0, p.numel)
        out.append(piece if len(p.shape) == 1 else piece.view(p.shape))
    return tuple(out)


def emit(state: FlatState, params: list[ParamLayout], regions: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
          result: MutableMapping[str, torch.Tensor], dtype: torch.dtype | None, buffers: Buffers,
          reuse: bool) -> dict[str, torch.Tensor]:
    """Fill ``result`` in request order: per group one parameter-order buffer (converted once if needed), cut into
    views; entries of a user-made ``out=`` dict are filled with one ``_foreach_copy_`` per group."""
    user_dict = reuse and not isinstance(result, GatheredGrads)
    everything = state.plan.is_everything(params) and len(params) > 1 and not user_dict
    views: dict[str, torch.Tensor] = {}
    cuts: list[tuple[torch.Tensor, ...]] = []  # every parameter's view, per group (the fast path below)
    for g, members in state.plan.by_group(params).items():
        group, plan = state.group(g), state.plan.groups[g]
        want = target_dtype(state, members[0], dtype)
        if group.placement.is_sharded:
            region, area = regions[g]
            order = region if area is None else assembly_of(group).to_param_order(
                region, group, plan, area, view_cache(result, area))
            live = False
        else:
            order, live = state.storage.partitions[g], True  # a snapshot needs one local copy
        if user_dict:
            existing = [p for p in members if result.get(p.name) is not None]
            if existing:
                cut = dict(zip(plan.names, cut_views(plan, converted(state, g, order, want, buffers, copy=False))))
                torch._foreach_copy_([result[p.name] for p in existing], [cut[p.name] for p in existing])
            missing = [p for p in members if result.get(p.name) is None] if existing else members
            if not missing:
                continue
            values = converted(state, g, order, want, buffers, copy=True, kept=False)
            cut = dict(zip(plan.names, cut_views(plan, values)))
            views.update((p.name, cut[p.name]) for p in missing)
        else:
            values = converted(state, g, order, want, buffers, copy=live)
            if everything:
                cuts.append(cut_views(plan, values, result))
            else:
                views.update(zip(plan.names, cut_views(plan, values, result)))
    if everything:  # every parameter in model order into our own dict: one cached pick, no per-name lookups
        assert isinstance(result, GatheredGrads)
        flat = cuts[0] if len(cuts) == 1 else tuple(chain.from_iterable(cuts))
        take = state.plan.model_order_take
        names = state.layout.names
        if reuse and not result.in_order(names):  # a dict of other names: start over, in request order
            dict.clear(result)
        result.fill_cut(names, flat, take, dtype)
        return result  # type: ignore[return-value]
    names = list(map(NAME, params))
    if user_dict:
        result.update((n, views[n]) for n in names if n in views)
    else:
        result.update(zip(names, map(views.__getitem__, names)))
    if reuse and list(result) != names:  # keep the caller's key order: request order
        ordered = {n: result.pop(n) for n in names}
        result.update(ordered)
    if isinstance(result, GatheredGrads):
        result.record_issued(names, dtype)
    return result  # type: ignore[return-value]

