"""DTensors built from a local tensor without ``DTensor.from_local``'s per-call overhead. No communication.

``DTensor.from_local(local, mesh, [placement], run_check=False, shape=..., stride=...)`` costs tens of microseconds
per call (a new ``DTensorSpec``, an autograd node, a ``view_as`` of the local tensor): thousands of parameters make
it milliseconds. :func:`new_dtensor` builds the same DTensor from a cached spec with the no-autograd constructor
FSDP2 uses (``_from_local_no_grad``): ``DTensor.__new__`` alone (its ``__init__`` does nothing in eager mode, but
its tracing decorators cost about as much as the construction). The result holds ``local`` itself as its local
tensor and does not require grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["dtensor_specs", "from_specs", "new_dtensor"]

_SPECS: dict[tuple, tuple[Any, Any]] = {}
_NEW = DTensor.__new__
_MAX_SPECS = 8192  #: the spec cache starts over beyond this many entries


def _spec(mesh: Any, placement: Any, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> Any:
    """A cached ``DTensorSpec``, keyed on the mesh *object* (meshes over the same ranks compare equal even when their
    process groups differ, e.g. a second engine's)."""
    key = (id(mesh), placement, shape, stride, dtype)
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if len(_SPECS) > _MAX_SPECS:
        _SPECS.clear()
    spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
    _SPECS[key] = (mesh, spec)
    return spec


def new_dtensor(local: torch.Tensor, mesh: Any, placement: Any, shape: tuple[int, ...],
                stride: tuple[int, ...]) -> DTensor:
    """What ``DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride)`` builds
    (without the autograd link to ``local``); ``from_local`` itself on a torch without these internals."""
    try:
        return _NEW(DTensor, local, _spec(mesh, placement, tuple(shape), tuple(stride), local.dtype),
                    requires_grad=False)
    except (ImportError, TypeError, AttributeError):  # a torch without these internals: the public constructor
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape),
                                  stride=tuple(stride))


def dtensor_specs(mesh: Any, placements: Sequence[Any], shapes: Sequence[tuple[int, ...]],
                  strides: Sequence[tuple[int, ...]], dtype: torch.dtype) -> tuple[Any, ...] | None:
    """The specs :func:`new_dtensor` would use for local tensors of ``dtype`` with these placements, global shapes
    and strides (one per tensor, to keep beside a fixed layout and pass to :func:`from_specs`); ``None`` on a torch
    without these internals."""
    try:
        return tuple(_spec(mesh, placement, tuple(shape), tuple(stride), dtype)
                     for placement, shape, stride in zip(placements, shapes, strides))
    except (ImportError, TypeError, AttributeError):
        return None


def from_specs(locals_: Sequence[torch.Tensor], specs: Sequence[Any]) -> list[DTensor]:
    """A DTensor of each local tensor with its spec (from :func:`dtensor_specs`, of the locals' dtype): what
    :func:`new_dtensor` builds, with no per-tensor spec lookup."""
    return [_NEW(DTensor, local, spec, requires_grad=False) for local, spec in zip(locals_, specs)]
