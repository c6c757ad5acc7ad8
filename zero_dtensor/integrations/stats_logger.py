"""``GradStatsLogger``: per-parameter gradient statistics at every (or every n-th) optimizer step, as plain floats.

Built on :func:`zero_dtensor.on_grads` and :meth:`ShardedGrads.stats` (per process group per logged step, the rank
agreement and at most two small all_reduces: a ``(k, 4)`` float64 sum and a ``(k,)`` float32 max for ``k``
parameters; no gradient is gathered).
The values are those the optimizer is about to use: true (unscaled under fp16), reduced, unclipped (DeepSpeed clips
inside ``step()``), and after any hook registered earlier on the same engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


from .hooks import GradHookHandle, on_grads
from ..comm.process_groups import global_rank, is_distributed
from ..families.sharded import ShardedGrads

__all__ = ["GradStatsLogger"]

METRICS = ("norm", "max_abs", "mean", "nan_count", "inf_count")


class GradStatsLogger:
    """Log per-parameter gradient statistics at accumulation boundaries, before the optimizer step, for any tracker.

    ``logger.latest`` is ``{"grad/<name>/<metric>": float, ..., "grad/global_norm": float, "grad/nan_count": float,
    "grad/inf_count": float}`` from the last logged step, identical on every rank. ``callback(metrics, step)`` gets a
    copy with ``step = engine.global_steps + 1``, e.g. ``lambda m, s: wandb.log(m, step=s)``. Create (and remove) it on
    every rank; use it as a context manager or call ``remove()``.

    Args:
        engine: a DeepSpeed engine (as for ``zd.on_grads``).
        every: log at every ``every``-th boundary (the first one included); the others cost nothing.
        callback: called on rank 0 only (on every rank with ``all_ranks=True``).
        params: which parameters (names, or a predicate ``name -> bool``); default all trainable ones.
        metrics: which of ``norm``, ``max_abs``, ``mean``, ``nan_count``, ``inf_count`` to report.
        prefix: key prefix.
        all_ranks: call ``callback`` on every rank.

    Returns:
        GradStatsLogger: the logger (registered through ``zd.on_grads``).

    Raises:
        TypeError: not a DeepSpeed engine, or a callback that is not callable.
        ValueError: an unknown metric or a bad ``every``.
        GradHookError: at ``engine.step()``, when the callback or the statistics failed on another rank (the step
            is skipped on every rank).

    Communication:
        Per logged boundary: ``stats()`` (the agreement and at most two ``all_reduce`` per process group) and the
        hook's small error agreement.

    Device and memory:
        As ``stats()``: a few per-row vectors; one host sync for the Python floats.

    Example:
        ```python
        with zd.GradStatsLogger(engine, every=10, callback=lambda m, s: wandb.log(m, step=s)):
            train()
        ```
    """

    def __init__(
        self,
        engine: Any,
        *,
        every: int = 1,
        callback: Callable[[dict[str, float], int], Any] | None = None,
        params: Any = None,
        metrics: Sequence[str] = METRICS,
        prefix: str = "grad/",
        all_ranks: bool = False,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        unknown = [m for m in metrics if m not in METRICS]
        if unknown or isinstance(metrics, str):
            raise ValueError(f"metrics must be a sequence drawn from {METRICS}, got {metrics!r}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self.engine = engine
        self.every = every
        self.callback = callback
        self.params = params
        self.metrics = tuple(metrics)
        self.prefix = prefix
        self.all_ranks = all_ranks
        self.latest: dict[str, float] = {}
        self.latest_step: int | None = None
        self.handle: GradHookHandle = on_grads(engine, self._on_grads, every=every)

    @property
    def boundaries(self) -> int:
        """Accumulation boundaries seen while attached (logged or not)."""
        return self.handle.boundaries

    def _on_grads(self, grads: ShardedGrads) -> None:
        stats = grads.stats(params=self.params)
        p = self.prefix
        out: dict[str, float] = {}
        sumsq = nans = infs = 0.0
        for name, s in stats.items():
            for metric in self.metrics:
                out[f"{p}{name}/{metric}"] = float(getattr(s, metric))
            sumsq += s.norm * s.norm
            nans += s.nan_count
            infs += s.inf_count
        out[f"{p}global_norm"] = math.sqrt(sumsq)
        out[f"{p}nan_count"] = float(nans)
        out[f"{p}inf_count"] = float(infs)
        self.latest = out
        self.latest_step = int(self.engine.global_steps) + 1
        if self.callback is not None and (self.all_ranks or _rank() == 0):
            self.callback(dict(out), self.latest_step)

    @property
    def active(self) -> bool:
        return self.handle.active

    def remove(self) -> None:
        """Stop logging (removes the hook; idempotent). ``latest`` keeps the last values.

        Returns:
            None.

        Raises nothing.

        Communication:
            None.

        Device and memory:
            Nothing allocated.

        Example:
            ```python
            logger = zd.GradStatsLogger(engine)
            logger.remove()
            ```
        """
        self.handle.remove()

    def __enter__(self) -> GradStatsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"GradStatsLogger(every={self.every}, boundaries={self.boundaries}, active={self.active})"


def _rank() -> int:
    return global_rank() if is_distributed() else 0
