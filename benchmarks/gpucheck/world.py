"""The ranks of a run (issue 52). One process (``python benchmarks/gpu_check.py``): a world-1 group, NCCL on CUDA
with ``ZERO_DTENSOR_FORCE_COLLECTIVES=1`` (every NCCL call the library makes, over the one rank), gloo on the CPU.
Under ``torchrun --nproc_per_node=N``: N ranks, one device each (``cuda:LOCAL_RANK``, NCCL; gloo on the CPU).

Every rank runs the same parts in the same order; rank 0 writes the JSON and the table. Whatever decides what a rank
runs next (the ``--budget-s`` clock) is rank 0's decision, sent to every rank (:class:`AgreedBudget`), so that the
ranks never part ways inside a collective."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import tempfile
from typing import Any

from .budget import Budget
from .runtime import free_port

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_S = 300.0  # a collective one rank never joins raises after this instead of hanging the run


def under_torchrun() -> bool:
    """Whether a launcher (torchrun, or anything that sets its variables) started this process as one of N ranks."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def init_world(device_type: str) -> tuple[int, int, str]:
    """Initialize the run's process group unless one exists: ``(rank, world size, backend)``. Under torchrun one
    device per rank (``cuda:LOCAL_RANK``) and NCCL on CUDA, gloo on the CPU; else a world-1 group."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if not under_torchrun():
        from .runtime import init_world_one

        backend = init_world_one(device_type)
        return 0, 1, backend
    local = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        if local >= torch.cuda.device_count():
            raise SystemExit(f"LOCAL_RANK {local}: this machine has {torch.cuda.device_count()} GPUs; run "
                             f"torchrun --nproc_per_node at most that")
        torch.cuda.set_device(local)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {"device_id": torch.device("cuda", local)} if device_type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S), **kwargs)
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def agreed(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (one ``broadcast_object_list``; nothing at world 1)."""
    import torch.distributed as dist

    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (one ``all_gather_object``; ``[value]`` at world 1)."""
    import torch.distributed as dist

    if world_size() == 1:
        return [value]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    """Every rank here before any goes on (nothing at world 1): the start of a timed call."""
    import torch.distributed as dist

    if world_size() > 1:
        dist.barrier()


def shared_dir(prefix: str, root: str | None = None) -> str:
    """A fresh directory rank 0 makes and every rank is told (the ranks of one machine see it)."""
    return agreed(tempfile.mkdtemp(prefix=prefix, dir=root) if rank() == 0 else None)


class AgreedBudget(Budget):
    """The ``--budget-s`` clock with rank 0's admissions: each :meth:`admit` is rank 0's answer on every rank."""

    def admit(self, what: str, seconds: float) -> bool:
        decision = bool(agreed(self.fits(seconds)))
        if not decision:
            self.skipped.append(what)
        return decision


__all__ = ["AgreedBudget", "agreed", "barrier", "free_port", "gathered", "init_world", "rank", "shared_dir",
           "under_torchrun", "world_size"]
