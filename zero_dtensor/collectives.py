"""The few collectives zero_dtensor issues, each over one DeepSpeed data-parallel process group.

Every function here must be called on every rank of the group, in the same order, with the same arguments (apart
from the local data): that is what a collective is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["all_gather_flat", "all_gather_partitions", "all_reduce_sum", "mesh_for"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_MESHES: dict[tuple[dist.ProcessGroup, str], DeviceMesh] = {}


def mesh_for(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over an existing process group (creates no communicator). Cached per group."""
    key = (group, device_type)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return mesh


def all_gather_flat(local: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor | None = None) -> torch.Tensor:
    """One ``all_gather`` of equal-size 1-D ``local`` tensors: ``(N-1)/N·S`` bytes received per rank."""
    world = dist.get_world_size(group)
    if out is None:
        out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    _all_gather_single(out, local, group=group)
    return out


def all_gather_partitions(
    partitions: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """Gather several equal-per-rank 1-D partitions of one process group in **one** coalesced collective.

    All partitions must share dtype and device. Bytes received per rank: ``(N-1)/N`` of the summed full sizes.
    """
    if len(partitions) == 1:
        return [all_gather_flat(partitions[0], group)]
    world = dist.get_world_size(group)
    outs = [torch.empty(world * p.numel(), dtype=p.dtype, device=p.device) for p in partitions]
    with dist._coalescing_manager(group=group, device=partitions[0].device):
        for out, part in zip(outs, partitions):
            _all_gather_single(out, part, group=group)
    return outs


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One in-place sum ``all_reduce``."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
