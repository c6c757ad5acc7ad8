"""Helpers shared by the per-optimizer adapters (still DeepSpeed-facing)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import GradientsNotReadyError
from ..layout.flat import FlatLayout, GroupLayout, ParamLayout
from ..layout.views import ViewCache

WINDOW = (
    "gradients are available after engine.backward() at a gradient-accumulation boundary "
    "(engine.is_gradient_accumulation_boundary() is True) and before engine.step()"
)


def param_names(engine: Any) -> dict[int, str]:
    """``id(param) -> name`` in model order; a tied parameter keeps its first name."""
    return {id(p): name for name, p in engine.module.named_parameters()}


def model_layout(engine: Any, groups: list[GroupLayout], params: list[ParamLayout]) -> FlatLayout:
    """The layout with ``params`` in model (``named_parameters()``) order, whatever order the optimizer keeps."""
    order = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    return FlatLayout(groups=tuple(groups), params=tuple(sorted(params, key=lambda p: order[p.name])))


def name_of(names: dict[int, str], param: torch.Tensor) -> str:
    try:
        return names[id(param)]
    except KeyError:
        raise GradientsNotReadyError(
            "a parameter managed by the ZeRO optimizer is not in engine.module.named_parameters(); "
            "zero_dtensor needs every optimized parameter to belong to the engine's module"
        ) from None


def wait_for_stream(stream: Any) -> None:
    """Make the current stream wait for DeepSpeed's reduction side stream (no-op where there is none)."""
    if stream is None:
        return
    from deepspeed.accelerator import get_accelerator

    current = get_accelerator().current_stream()
    if current is not None and hasattr(current, "wait_stream"):
        current.wait_stream(stream)


def micro_steps(engine: Any) -> int:
    return int(engine.micro_steps)


T = TypeVar("T")
_LAYOUTS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


def cached_layout(opt: Any, key: tuple[Any, ...], build: Callable[[], T]) -> T:
    """``build()`` once per optimizer and structural ``key`` (partition sizes, dtypes, parameter counts, rank):
    later steps reuse the layout, so that its plan is reused too and the first ``sharded_grads`` of a step costs
    no pass over the parameters."""
    per_opt = _LAYOUTS.setdefault(opt, {})
    value = per_opt.get(key)
    if value is None:
        value = per_opt[key] = build()
    return value


def param_offsets(opt: Any, group: int) -> list[int]:
    """ZeRO-1/2: where each parameter of flat group ``group`` starts in the global flat buffer (DeepSpeed order)."""
    offsets = getattr(opt, "round_robin_bit16_offsets", None)
    if offsets is not None:
        return [int(o) for o in offsets[group]]
    params = opt.round_robin_bit16_groups[group]
    paddings = getattr(opt, "round_robin_bit16_padding", None)
    pads = paddings[group] if paddings is not None else [0] * len(params)
    sizes = [p.numel() + int(pad) for p, pad in zip(params, pads)]
    return [0, *itertools.accumulate(sizes)][: len(params)]


_KEPT: weakref.WeakKeyDictionary[Any, dict[object, ViewCache]] = weakref.WeakKeyDictionary()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same 1-D elements of the same memory."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def kept_partition(opt: Any, key: object, partition: torch.Tensor) -> ViewCache:
    """The :class:`~zero_dtensor.layout.views.ViewCache` of a partition that DeepSpeed keeps in the same memory across
    steps (ZeRO-3's flat gradient buffer, an offload buffer, ``BF16_Optimizer``'s flat gradients): the same tensor
    object comes back every step, so the views cut from it are made once. The cache holds the memory alive only as
    long as DeepSpeed does (a new buffer replaces the entry)."""
    per_opt = _KEPT.setdefault(opt, {})
    cache = per_opt.get(key)
    if cache is None or not same_memory(cache.buffer, partition):
        cache = per_opt[key] = ViewCache(partition)
    return cache
