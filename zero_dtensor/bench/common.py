"""What the benchmark's entry points share: the engine config, starting the ranks, syncing a device, byte units.

:mod:`zero_dtensor.bench.cli` (the per-call benchmark) and :mod:`zero_dtensor.bench.sweep` (the tensor-count sweep)
both import from here; neither imports the other's helpers. :func:`timed_call` is how both time one call.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

__all__ = ["engine_config", "fmt_bytes", "run_ranks", "sync", "timed_call"]


def sync(device: Any) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing to wait for on the CPU) before reading a clock."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], Any], device: Any) -> float:
    """Seconds of one call of ``fn`` on this rank, started at a barrier with ``device`` idle, its queued work waited
    for; the result is dropped before returning."""
    import time

    import torch.distributed as dist

    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    elapsed = time.perf_counter() - t0
    del result
    return elapsed


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes in B / KiB / MiB / GiB for a table (``"-"`` for ``None``)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def engine_config(stage: int, dtype: str, *, lr: float) -> dict[str, Any]:
    """The DeepSpeed config of the benchmark's engines (torch Adam: no op to build; micro-batch 2)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": lr, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def run_ranks(rank_main: Callable[[argparse.Namespace], dict[str, Any]], args: argparse.Namespace
              ) -> dict[str, Any] | None:
    """``rank_main(args)`` on every rank: in place under torchrun (``RANK``/``WORLD_SIZE`` set; NCCL on GPUs), else
    on ``args.nproc`` local gloo ranks. Rank 0's results, ``None`` on the other ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import deepspeed
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        results = rank_main(args)
        return results if dist.get_rank() == 0 else None
    from ..launch import launch

    return launch(rank_main, args, nprocs=args.nproc, timeout=args.timeout)
