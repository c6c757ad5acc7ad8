"""Helpers shared by the per-optimizer adapters (still DeepSpeed-facing)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import GradientsNotReadyError
from ..layout import GradLayout, GroupLayout, ParamLayout

WINDOW = (
    "gradients are available after engine.backward() at a gradient-accumulation boundary "
    "(engine.is_gradient_accumulation_boundary() is True) and before engine.step()"
)


def param_names(engine: Any) -> dict[int, str]:
    """``id(param) -> name`` in model order; a tied parameter keeps its first name."""
    return {id(p): name for name, p in engine.module.named_parameters()}


def model_layout(engine: Any, groups: list[GroupLayout], params: list[ParamLayout]) -> GradLayout:
    """The layout with ``params`` in model (``named_parameters()``) order, whatever order the optimizer keeps."""
    order = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    return GradLayout(groups=tuple(groups), params=tuple(sorted(params, key=lambda p: order[p.name])))


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
