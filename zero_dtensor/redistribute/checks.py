"""Validation of redistribution entries (DTensors, whole tensors) and the DTensors the reads build. No
communication."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..comm import collectives, process_groups
from ..comm.dtensor_new import dtensor_specs, new_dtensor
from ..layout.flat import ParamLayout
from ..core.storage import FlatStorage
from .plan import PLAN_CACHE_SIZE, BucketPlan, TargetSlot


def mapping_names(mapping: Any, what: str) -> list[Any]:
    """The keys of a write's ``mapping`` (``TypeError`` unless it is a mapping). No communication."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{what} takes a mapping name -> tensor, got {type(mapping).__name__}")
    return list(mapping)


def agreement_groups(storage: FlatStorage, selected: Sequence[ParamLayout] | None) -> tuple[Any, ...]:
    """The process groups a write over ``selected`` (``None``: any parameter) may communicate on: multi-rank groups,
    replicated ones included (every rank needs the whole new value)."""
    indices = sorted({p.group for p in selected}) if selected is not None else range(len(storage.process_groups))
    return tuple(storage.process_groups[i] for i in indices
                 if process_groups.collective_path(storage.layout.groups[i].world_size))


def _allowed_devices(storage: FlatStorage) -> set[torch.device]:
    return {torch.device(storage.device), *(p.device for p in storage.partitions)}


def _same_ranks(mesh: Any, pg: Any, device_type: str) -> bool:
    """Whether ``mesh`` is 1-D over ``pg``'s ranks in group order (the library's own mesh: no tensor access)."""
    if mesh is collectives.mesh_for(pg, device_type):
        return True
    return mesh.ndim == 1 and mesh.mesh.flatten().tolist() == list(process_groups.group_ranks(pg))


def check_dtensor(storage: FlatStorage, slot: TargetSlot, value: Any, pg: Any) -> torch.Tensor:
    """This rank's flattened local shard of a valid ``set_dtensors_`` entry; raises on anything else."""
    name = slot.name
    if not isinstance(value, DTensor):
        raise TypeError(f"set_dtensors_: value for {name!r} must be a DTensor (e.g. from grads.to_dtensors()), got "
                        f"{type(value).__name__}; for full tensors use set_full_")
    mesh = value.device_mesh
    if not _same_ranks(mesh, pg, value.device.type):
        raise ValueError(f"set_dtensors_: {name!r} lives on a mesh over ranks {mesh.mesh.tolist()}; expected a 1-D "
                         f"mesh over its data-parallel process group, ranks {list(process_groups.group_ranks(pg))} "
                         "(as to_dtensors builds)")
    expected = (Replicate(),) if slot.replicate else (Shard(0),)
    if tuple(value.placements) != expected:
        raise ValueError(f"set_dtensors_: {name!r} has placements {tuple(value.placements)}, expected {expected} "
                         "(redistribute it first)")
    if tuple(value.shape) != slot.global_shape:
        raise ValueError(f"set_dtensors_: {name!r} has shape {tuple(value.shape)}, expected {slot.global_shape}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"set_dtensors_: {name!r} has dtype {value.dtype}, expected a floating dtype")
    local = value.to_local()
    if tuple(local.shape) != slot.shape:
        raise ValueError(f"set_dtensors_: the local shard of {name!r} has shape {tuple(local.shape)} on this rank, "
                         f"expected {slot.shape} (torch.chunk rows of dim 0)")
    if local.device not in _allowed_devices(storage):
        raise ValueError(f"set_dtensors_: the local shard of {name!r} is on {local.device}, expected one of "
                         f"{sorted(str(d) for d in _allowed_devices(storage))}")
    return local


def check_full(storage: FlatStorage, what: str, param: ParamLayout, value: Any) -> torch.Tensor:
    """A whole-gradient value for ``param`` (``set_owned_``, ``map_full_``'s results); raises otherwise."""
    if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: value for {param.name!r} must be a torch.Tensor of shape {tuple(param.shape)}, got "
                        f"{type(value).__name__}")
    if value.shape != param.shape:
        raise ValueError(f"{what}: value for {param.name!r} has shape {tuple(value.shape)}, expected "
                         f"{tuple(param.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{what}: value for {param.name!r} has dtype {value.dtype}, expected a floating dtype")
    if value.device not in _allowed_devices(storage):
        raise ValueError(f"{what}: value for {param.name!r} is on {value.device}, expected one of "
                         f"{sorted(str(d) for d in _allowed_devices(storage))}")
    return value


#: per (bucket, mesh, dtype), by identity: the DTensor specs of the bucket's slots (:func:`slot_specs`)
_SLOT_SPECS: dict[tuple[int, int, torch.dtype], tuple[BucketPlan, Any, tuple[Any, ...] | None]] = {}


def slot_specs(bucket: BucketPlan, mesh: Any, dtype: torch.dtype) -> tuple[Any, ...] | None:
    """The DTensor spec of each of ``bucket``'s slots (``Shard(0)``, ``Replicate()`` for a replicated slot) on
    ``mesh`` for results of ``dtype``, made once per (cached) bucket plan, mesh object and dtype
    (:func:`~zero_dtensor.comm.dtensor_new.dtensor_specs`; ``None`` on a torch without its internals)."""
    key = (id(bucket), id(mesh), dtype)
    hit = _SLOT_SPECS.get(key)
    if hit is not None and hit[0] is bucket and hit[1] is mesh:
        return hit[2]
    shard, replicate = Shard(0), Replicate()
    slots = bucket.params
    specs = dtensor_specs(mesh, [replicate if s.replicate else shard for s in slots],
                          [s.global_shape for s in slots], [s.global_stride for s in slots], dtype)
    if len(_SLOT_SPECS) >= 2 * PLAN_CACHE_SIZE:
        _SLOT_SPECS.clear()
    _SLOT_SPECS[key] = (bucket, mesh, specs)
    return specs


def build_dtensor(local: torch.Tensor, mesh: Any, placement: Any, slot: TargetSlot) -> DTensor:
    """``local`` as the DTensor of ``slot``'s global shape and stride (:func:`~zero_dtensor.comm.dtensor_new.new_dtensor`:
    a cached spec, no autograd node)."""
    return new_dtensor(local, mesh, placement, slot.global_shape, slot.global_stride)
