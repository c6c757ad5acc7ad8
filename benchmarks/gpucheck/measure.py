"""Timing one call: synchronized wall time and peak extra device memory per call, a warm-up, repetitions, the
collectives counted, the budget checked after the warm-up, and an optional profile."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .budget import SKIPPED, Budget
from .profiling import Profiles
from .runtime import synchronize
from .world import barrier


def sample(fn: Callable[[], Any], device: Any) -> tuple[float, int | None]:
    """``(seconds, peak extra bytes)`` of one synchronized call, started together on every rank (a barrier); the
    bytes are None off CUDA."""
    import torch

    cuda = device.type == "cuda"
    synchronize(device)
    barrier()
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    seconds = time.perf_counter() - t0
    peak = int(torch.cuda.max_memory_allocated(device) - base) if cuda else None
    del result
    return seconds, peak


def summarize(row: str, stage: int, first: tuple[float, int | None], rest: list[tuple[float, int | None]],
              collectives: int | None = None) -> dict[str, Any]:
    times = [t for t, _ in rest]
    peaks = [m for _, m in rest if m is not None]
    return {
        "stage": stage, "row": row, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times), "first_ms": 1e3 * first[0], "repeat": len(times),
        "peak_first_bytes": first[1], "peak_bytes": max(peaks) if peaks else None, "collectives": collectives,
    }


def skipped_row(row: str, stage: int, first: tuple[float, int | None] | None = None) -> dict[str, Any]:
    """A row the budget left out (with its warm-up time when it had one)."""
    out: dict[str, Any] = {"stage": stage, "row": row, "status": SKIPPED}
    if first is not None:
        out.update(first_ms=1e3 * first[0], peak_first_bytes=first[1])
    return out


class Timer:
    """Measures rows of one stage on one device, within a budget, profiling each row when asked."""

    def __init__(self, stage: int, device: Any, repeat: int, budget: Budget, profiles: Profiles) -> None:
        self.stage, self.device, self.repeat, self.budget, self.profiles = stage, device, repeat, budget, profiles

    def measure(self, row: str, fn: Callable[[], Any], repeat: int | None = None,
                count_collectives: bool = True) -> dict[str, Any]:
        """One warm-up call (reported as ``first``), then ``repeat`` timed calls; collectives counted in a separate
        call. Skipped (``status``: ``skipped: budget``) when the repetitions would overrun the budget."""
        from torch.distributed.tensor.debug import CommDebugMode

        repeat = self.repeat if repeat is None else repeat
        first = sample(fn, self.device)
        calls = repeat + int(count_collectives) + int(bool(self.profiles))
        if not self.budget.admit(f"ZeRO-{self.stage} {row}", calls * first[0]):
            return skipped_row(row, self.stage, first)
        collectives = None
        if count_collectives:
            with CommDebugMode() as mode:
                fn()
            collectives = int(mode.get_total_counts())
        rest = [sample(fn, self.device) for _ in range(repeat)]
        out = summarize(row, self.stage, first, rest, collectives)
        if self.profiles:
            self.profiles.add(out, fn, self.device)
        return out

    def once(self, row: str, fn: Callable[[], Any], estimate_s: float) -> dict[str, Any]:
        """One timed call, no warm-up (checkpoints: each call writes or reads the whole state); skipped when
        ``estimate_s`` does not fit the budget."""
        if not self.budget.admit(f"ZeRO-{self.stage} {row}", estimate_s):
            return skipped_row(row, self.stage)
        first = sample(fn, self.device)
        out = summarize(row, self.stage, first, [first])
        out["repeat"] = 1
        return out
