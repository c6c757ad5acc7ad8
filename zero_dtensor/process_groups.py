"""Queries of the process groups zero_dtensor runs on: backends, world sizes, ranks, members, timeouts.

None of them communicates, so any rank may call them alone, except :func:`cpu_group_for`: its first call for a
group makes a new process group (``dist.new_group``), which every rank of the world must call, in the same order.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = [
    "backend_of",
    "cpu_group_for",
    "default_backend",
    "global_rank",
    "global_world_size",
    "group_rank_of",
    "group_ranks",
    "is_distributed",
    "rank_in",
    "world_size_of",
    "world_timeout",
]


def backend_of(group: dist.ProcessGroup) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    return dist.get_backend(group)


def world_size_of(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


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
