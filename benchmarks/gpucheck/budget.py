"""The ``--budget-s`` clock: each part is estimated from what the same kind of work took so far in this run, and
skipped (reported ``skipped: budget``) when it would end past the budget."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

SKIPPED = "skipped: budget"


class Budget:
    """Wall-clock budget of one run; ``total_s`` None or <= 0: no limit (every ``fits`` is True)."""

    def __init__(self, total_s: float | None, started: float | None = None) -> None:
        self.total_s = total_s if total_s and total_s > 0 else None
        self.started = time.perf_counter() if started is None else started
        self.durations: dict[str, list[float]] = {}
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return float("inf") if self.total_s is None else self.total_s - self.elapsed()

    def estimate(self, kind: str, default: float) -> float:
        """The median duration of ``kind`` so far, else ``default`` (seconds)."""
        seen = self.durations.get(kind)
        return statistics.median(seen) if seen else default

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()

    def admit(self, what: str, seconds: float) -> bool:
        """``fits``, remembering ``what`` as skipped when it does not."""
        if self.fits(seconds):
            return True
        self.skipped.append(what)
        return False

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        """Record how long the block took, as one more sample of ``kind``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.durations.setdefault(kind, []).append(time.perf_counter() - t0)
