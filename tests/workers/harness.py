"""Worker functions that exercise the harness itself."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def rank_and_sum() -> tuple[int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def fail_on_last_rank() -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("deliberate failure on the last rank")


def hang_on_rank_zero() -> None:
    """Rank 0 waits in a collective that the others never join."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))


def pid() -> int:
    return os.getpid()


def unpicklable_result() -> object:
    return lambda: None  # a lambda cannot be pickled


def world_device_types() -> list[str]:
    from zero_dtensor.comm.collectives import comm_device_types

    return sorted(comm_device_types(dist.group.WORLD))
