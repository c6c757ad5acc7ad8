"""Queries of the process groups zero_dtensor runs on: backends, world sizes, ranks, members, timeouts.

None of them communicates, so any rank may call them alone, except :func:`cpu_group_for`: its first call for a
group makes a new process group (``dist.new_group``), which every rank of the world must call, in the same order.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import settings

__all__ = [
    "CommSupport",
    "backend_of",
    "collective_path",
    "communicates",
    "comm_support",
    "comm_support_of",
    "cpu_group_for",
    "default_backend",
    "device_type_of",
    "global_rank",
    "global_world_size",
    "group_rank_of",
    "group_ranks",
    "is_distributed",
    "rank_in",
    "world_size_of",
    "world_timeout",
]


@dataclass(frozen=True)
class CommSupport:
    """What a backend can do with tensors of one device type, beyond the plain collectives (``all_reduce``,
    ``all_gather_into_tensor``, ``broadcast``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``gather``,
    ``reduce``), which every backend zero_dtensor runs on supports on the devices it communicates on."""

    point_to_point: bool  #: ``isend`` / ``irecv`` / ``batch_isend_irecv``
    coalescing: bool  #: ``dist._coalescing_manager`` around several collectives


def comm_support(backend: str, device_type: str) -> CommSupport:
    """The one place that decides which exchanges zero_dtensor may issue on ``backend`` for tensors on
    ``device_type``. Gloo over CUDA (or any accelerator) tensors: no point-to-point ops (gloo's ``isend`` /
    ``irecv`` abort the process, ``gloo::IoException ... writev: Bad address``) and no coalescing manager (its
    ``wait()`` segfaults): torch 2.11, gloo, H200, 2026-12-04. Everything else: both. No communication."""
    gloo_off_cpu = backend == "gloo" and device_type != "cpu"
    return CommSupport(point_to_point=not gloo_off_cpu, coalescing=not gloo_off_cpu)


def device_type_of(device: torch.device | str) -> str:
    """The device type a tensor on ``device`` communicates from (``"cpu"``, ``"cuda"``, ...): the seam the tests
    replace to make CPU tensors answer as CUDA ones. No communication."""
    return torch.device(device).type


def comm_support_of(group: dist.ProcessGroup, device: torch.device | str) -> CommSupport:
    """:func:`comm_support` of ``group``'s backend for tensors on ``device``. No communication."""
    return comm_support(backend_of(group), device_type_of(device))


def backend_of(group: dist.ProcessGroup) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    return dist.get_backend(group)


def world_size_of(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def collective_path(world_size: int) -> bool:
    """Whether a group of ``world_size`` ranks takes the collective path: more than one rank, or one rank under
    ``ZERO_DTENSOR_FORCE_COLLECTIVES=1`` (:func:`~zero_dtensor.settings.force_collectives`: the N-rank path with
    every collective issued over the one rank, values those of the one-rank path). The one switch: every place of
    the library that would skip communication for a one-rank group asks this. No communication."""
    return world_size > 1 or settings.force_collectives()


def communicates(group: dist.ProcessGroup) -> bool:
    """:func:`collective_path` of ``group``'s size. No communication."""
    return collective_path(dist.get_world_size(group))


def rank_in(group: dist.ProcessGroup) -> int:
    """This process's rank in ``group``. No communication."""
    return dist.get_rank(group)


def is_distributed() -> bool:
    """Whether a default process group is up (``torch.distributed`` available and initialized)."""
    return dist.is_available() and dist.is_initialized()


def default_backend() -> str:
    """The default process group's backend name (``"gloo"``, ``"nccl"``, ...). No communication."""
    return dist.get_backend()


def world_timeout() -> datetime.timedelta:
    """The world process group's own timeout, or torch's default where its backend does not expose one."""
    try:
        world = dist.group.WORLD
        backend = world._get_backend(torch.device("cpu" if dist.get_backend() == "gloo" else "cuda"))
        return backend.options._timeout
    except Exception:  # noqa: BLE001 - a backend that does not expose its options: torch's default
        from torch.distributed.distributed_c10d import default_pg_timeout

        return default_pg_timeout


def global_world_size() -> int:
    return dist.get_world_size()


def global_rank() -> int:
    return dist.get_rank()


def group_rank_of(group: dist.ProcessGroup, global_rank_: int) -> int:
    """``global_rank_``'s rank in ``group``; ``ValueError`` when it is not a member."""
    try:
        return dist.get_group_rank(group, global_rank_)
    except (ValueError, RuntimeError):
        raise ValueError(f"rank {global_rank_} is not a member of the process group") from None


_GROUP_RANKS: dict[dist.ProcessGroup, tuple[int, ...]] = {}


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """Global ranks of ``group``'s members, in group-rank order. No communication; cached per group."""
    ranks = _GROUP_RANKS.get(group)
    if ranks is None:
        ranks = _GROUP_RANKS[group] = tuple(dist.get_process_group_ranks(group))
    return ranks


_CPU_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def cpu_group_for(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A dedicated gloo group over ``group``'s ranks, made once (``dist.new_group`` is collective: every rank of
    the world must reach the first call; later calls are cached). For torch's ``async_save``, whose background
    collectives need a CPU backend and must not interleave with the training's own collectives on ``group``."""
    ranks = group_ranks(group)
    found = _CPU_GROUPS.get(ranks)
    if found is None:
        found = _CPU_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo")
    return found
