"""The operands of the elementwise transforms (:mod:`zero_dtensor.ops.transforms`): checked (a real number, a 0-d tensor
or a mapping ``name -> operand``), moved once to the storage device, and cut per flat group for one ``_foreach_*``
call. No communication.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Union

import torch

from ..layout.devices import Devices, to_device, to_storage
from ..core.state import FlatState, Selection

__all__ = ["PerParam", "Scalar", "foreach_operands", "group_operands", "per_param", "scalar", "to_storage_operand",
           "values_to_storage"]

Scalar = Union[numbers.Real, torch.Tensor]


class PerParam:
    """Operands for the selected parameters, one per parameter (``values[i]`` for ``Selection.params[i]``)."""

    __slots__ = ("values",)

    def __init__(self, values: list[Any]) -> None:
        self.values = values


def scalar(value: Any, what: str) -> float | torch.Tensor:
    """A real number (as float) or a 0-d real tensor (detached); anything else raises naming ``what``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a real number or a 0-d tensor, got bool")
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{what} must be a number or a 0-d tensor, got a tensor of shape {tuple(value.shape)} "
                "(for per-element operands pass another ShardedGrads or a clone)"
            )
        if value.is_complex():
            raise TypeError(f"{what} must be real, got {value.dtype}")
        from torch.distributed.tensor import DTensor

        return (value.full_tensor() if isinstance(value, DTensor) else value).detach()
    raise TypeError(f"{what} must be a real number or a 0-d tensor, got {type(value).__name__}")


def per_param(state: FlatState, value: Any, sel: Selection, what: str) -> float | torch.Tensor | PerParam:
    """A uniform operand, or a mapping ``name -> operand`` covering every selected parameter as :class:`PerParam`."""
    if not isinstance(value, Mapping):
        return scalar(value, what)
    unknown = sorted(str(n) for n in value if n not in state.layout.by_name)
    if unknown:
        raise KeyError(f"{what}: not trainable parameters of this engine: {unknown}")
    missing = [p.name for p in sel.params if p.name not in value]
    if missing:
        raise KeyError(f"{what}: no value for selected parameters {missing}")
    return PerParam([scalar(value[p.name], f"{what}[{p.name!r}]") for p in sel.params])


def to_storage_operand(state: FlatState, value: Any) -> Any:
    """``value`` where the data is: a tensor (or a :class:`PerParam`'s tensors, stacked and moved once) on the
    storage device; numbers and ``None`` unchanged."""
    devices = state.storage.devices
    if isinstance(value, torch.Tensor):
        return to_storage(value, devices)
    if isinstance(value, PerParam):
        return PerParam(values_to_storage(value.values, devices))
    return value


def values_to_storage(values: list[Any], devices: Devices) -> list[Any]:
    """Per-parameter operands with their tensors on the storage device: one ``stack`` (per dtype) and one move,
    not a move per parameter (tensors already there stay as they are)."""
    at = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.device != devices.storage]
    if not at:
        return values
    out = list(values)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in at:
        by_dtype.setdefault(values[i].dtype, []).append(i)
    for indices in by_dtype.values():
        moved = to_storage(torch.stack([values[i] for i in indices]), devices).unbind(0)
        for i, t in zip(indices, moved):
            out[i] = t
    return out


def group_operands(sel: Selection, per: PerParam, state: FlatState) -> dict[int, list[Any]]:
    """Per group, the per-parameter operands in the group's buffer order (as :meth:`Selection.by_group` lists)."""
    order = {p.name: i for i, p in enumerate(sel.params)}
    out: dict[int, list[Any]] = {}
    for g, indices in sel.by_group.items():
        params = state.plan.groups[g].params
        out[g] = [per.values[order[params[k].name]] for k in indices]
    return out


def foreach_operands(values: list[Any], device: torch.device) -> list[float] | list[torch.Tensor]:
    """Operands for one ``_foreach_*`` call: all numbers (a ScalarList) or all 0-d tensors on ``device`` (one
    conversion for the numbers; tensors are on ``device`` already after :func:`to_storage_operand`, else moved)."""
    if all(not isinstance(v, torch.Tensor) for v in values):
        return values
    numbers_at = [i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    out = [to_device(v, device) if isinstance(v, torch.Tensor) else None for v in values]
    if numbers_at:
        converted = torch.tensor([values[i] for i in numbers_at], dtype=torch.float32, device=device).unbind(0)
        for i, t in zip(numbers_at, converted):
            out[i] = t
    return out  # type: ignore[return-value]
