"""``set_full_``: validate full tensors, then write each rank's fragments into DeepSpeed's storage. **No
communication.**

Validation runs over all values with C-level passes (types, shapes, dtypes, devices); only when one fails does a
per-entry pass run, to name the first bad entry. Nothing is written before everything is checked.

Writing, per flat group, one ``_foreach_copy_``: where this rank holds most parameters whole (ZeRO-1/2, replicated
groups), each value is copied as it is into a view of its fragment in the parameter's shape, views made once per
kept partition; the few parameters held in part contribute a view of their part. Where most fragments are parts
(ZeRO-3 chunks) and the parameters are small (where one Python-level view per parameter would cost more than the
copy), the values are flattened into one buffer by one C++ call (``flatten_dense_tensors``), cut by a cached tiling
into (before, fragment, after) pieces with one ``split_with_sizes``, and the fragments copied. Under fp16 loss scaling
the sources are scaled in float32 first (one ``_foreach_mul``). Writes never record autograd history.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from itertools import repeat
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from .layout import ParamLayout
from .plan import GroupPlan, Tiling, tiling
from .state import GradState, short_names

__all__ = ["set_full_", "validate_full"]

_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_NAME = operator.attrgetter("name")

#: below this many elements per parameter on average, a group is written through one flattened buffer
FLATTEN_BELOW = 1 << 16


def validate_full(state: GradState, mapping: Mapping[str, torch.Tensor]) -> list[tuple[ParamLayout, torch.Tensor]]:
    """``(param, value)`` pairs of ``mapping`` in its order, every entry checked (see ``ShardedGrads.set_full_``)."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"set_full_ takes a mapping name -> full gradient tensor, got {type(mapping).__name__}")
    storage = state.storage
    devices = {storage.device, *(p.device for p in storage.partitions)}
    by_name = state.layout.by_name
    names, values = list(mapping.keys()), list(mapping.values())
    params = [by_name.get(n) if isinstance(n, str) else None for n in names]
    if (all(map(operator.is_not, params, repeat(None))) and all(type(v) is torch.Tensor for v in values)
            and list(map(_SHAPE, values)) == list(map(_SHAPE, params))
            and all(map(torch.Tensor.is_floating_point, values)) and set(map(_DEVICE, values)) <= devices):
        return list(zip(params, values))
    for name, value in zip(names, values):  # something is wrong: find the first bad entry, in order
        _check_entry(state, name, value, devices)
    return list(zip(params, values))  # not reached: _check_entry raised


def _check_entry(state: GradState, name: object, value: object, devices: set[torch.device]) -> None:
    param = state.layout.by_name.get(name) if isinstance(name, str) else None
    if param is None:
        raise KeyError(f"set_full_: {name!r} is not a trainable parameter of this engine; known: "
                       f"{short_names(state.layout.names)}")
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        raise TypeError(
            f"set_full_: value for {name!r} must be a full torch.Tensor of shape {tuple(param.shape)}, "
            f"got {type(value).__name__} (for a DTensor pass value.full_tensor())"
        )
    if value.shape != param.shape:
        raise ValueError(f"set_full_: value for {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"set_full_: value for {name!r} has dtype {value.dtype}, expected a floating dtype")
    if value.device not in devices:
        raise ValueError(
            f"set_full_: value for {name!r} is on {value.device}, expected one of "
            f"{sorted(str(d) for d in devices)} (the engine's device or where the gradient is stored)"
        )


def set_full_(state: GradState, checked: list[tuple[ParamLayout, torch.Tensor]]) -> None:
    """Write validated ``(param, value)`` pairs (true units) into this rank's fragments, group by group."""
    grouped: dict[int, list[tuple[ParamLayout, torch.Tensor]]] = {}
    for pair in checked:
        grouped.setdefault(pair[0].group, []).append(pair)
    with torch.no_grad():  # a value that requires grad must not give DeepSpeed's memory an autograd history
        for g, pairs in grouped.items():
            _write_group(state, g, pairs)
    state.storage.after_write([p.name for p, _ in checked])


def _write_group(state: GradState, g: int, pairs: list[tuple[ParamLayout, torch.Tensor]]) -> None:
    plan = state.plan.groups[g]
    params = [p for p, _ in pairs]
    values = [v for _, v in pairs]
    mostly_partial = 2 * len(plan.whole_local) < len(plan.has_local)  # ZeRO-3: every fragment is a chunk
    small = sum(p.numel for p in params) < FLATTEN_BELOW * len(params)
    if mostly_partial and small and len(values) > 1 and len({v.device for v in values}) == 1:
        _write_flattened(state, plan, params, values)
    else:
        _write_direct(state, plan, params, values)


def _write_flattened(state: GradState, plan: GroupPlan, params: list[ParamLayout], values: list[torch.Tensor]) -> None:
    cut = _source_tiling(plan, tuple(map(_NAME, params)))
    flat = torch._C._nn.flatten_dense_tensors(values)
    if state.loss_scale != 1.0:
        flat = flat.to(torch.float32).mul_(state.loss_scale)
    pieces = flat.split_with_sizes(list(cut.tiling.sizes))
    if not cut.sources:
        return
    sources = [pieces[i] for i in cut.sources]
    dests = state.fragments_of(plan.index, cut.dests)
    torch._foreach_copy_(dests, sources)


def _write_direct(state: GradState, plan: GroupPlan, params: list[ParamLayout], values: list[torch.Tensor]) -> None:
    """Whole local parameters: the value itself into a cached view of its fragment in the parameter's shape (no
    view per call); parameters this rank holds only part of: a view of the value's part."""
    shaped = state.view_caches[plan.index].get(("shaped", plan), lambda _: _shaped_fragments(state, plan))
    whole, positions = plan.whole_position, plan.positions
    dests: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    partial: list[tuple[int, torch.Tensor]] = []
    for k, value in zip(map(positions.__getitem__, map(_NAME, params)), values):
        i = whole.get(k)
        if i is not None:
            dests.append(shaped[i])
            sources.append(value)
        elif plan.frag_len[k]:
            partial.append((k, value))
    if partial:
        dests += state.fragments_of(plan.index, [k for k, _ in partial])
        sources += [v.reshape(-1).narrow(0, plan.frag_start[k], plan.frag_len[k]) for k, v in partial]
    if not dests:
        return
    scale = state.loss_scale
    if scale != 1.0:  # value × scale in float32 (bit-identical to scaling each value alone), cast on copy
        if all(s.dtype == torch.float32 for s in sources):
            sources = torch._foreach_mul(sources, scale)
        else:  # other dtypes: one cat (promoting), one cast, one multiply; then flat pieces into flat fragments
            flat = torch.cat([s.reshape(-1) for s in sources]).to(torch.float32).mul_(scale)
            sources = list(flat.split_with_sizes([d.numel() for d in dests]))
            dests = [d.view(-1) for d in dests]
    torch._foreach_copy_(dests, sources)


def _shaped_fragments(state: GradState, plan: GroupPlan) -> list[torch.Tensor]:
    """Views, in each parameter's shape, of the fragments of the parameters this rank holds whole."""
    pieces = state.pieces[plan.index]
    return [pieces[plan.local.piece[k]].view(plan.params[k].shape) for k in plan.whole_local]


class _SourceTiling:
    """Values of some parameters flattened back to back (request order), cut into (before, fragment, after) pieces:
    ``sources`` are the fragment pieces with a local fragment, ``dests`` their indices in the group's plan."""

    __slots__ = ("tiling", "sources", "dests")

    def __init__(self, cut: Tiling, sources: tuple[int, ...], dests: tuple[int, ...]) -> None:
        self.tiling, self.sources, self.dests = cut, sources, dests


_TILINGS: OrderedDict[tuple[GroupPlan, tuple[str, ...]], _SourceTiling] = OrderedDict()
_TILINGS_KEPT = 16


def _source_tiling(plan: GroupPlan, names: tuple[str, ...]) -> _SourceTiling:
    key = (plan, names)
    found = _TILINGS.get(key)
    if found is not None:
        _TILINGS.move_to_end(key)
        return found
    positions = plan.positions
    spans: list[tuple[int, int]] = []
    sources: list[int] = []
    dests: list[int] = []
    at = 0
    for name in names:
        k = positions[name]
        spans.append((at + plan.frag_start[k], plan.frag_len[k]))
        if plan.frag_len[k]:
            sources.append(len(spans) - 1)
            dests.append(k)
        at += plan.params[k].numel
    cut = tiling(spans, at)
    found = _SourceTiling(cut, tuple(cut.piece[i] for i in sources), tuple(dests))
    _TILINGS[key] = found
    if len(_TILINGS) > _TILINGS_KEPT:
        _TILINGS.popitem(last=False)
    return found
