"""The fused reductions' rows (issue 42): ``stats() fused`` and ``dots() fused`` beside ``stats()`` / ``dots()``,
with the same floors, timed with ``zd.set_fused_reductions(True)``, and a check that their values equal the eager
ones (a gradient clone with nan and inf written in included: counts exact). A value that differs makes the row an
error (exit code 1). Where the fused path cannot run the rows say why (``skipped: ...``, e.g. on CUDA without
Triton); on the CPU, where it never runs by itself (offloaded buffers keep the eager recipe), they are left out
(the reason is in the stage's facts, ``timing_model.zeroN.fused``) unless ``--fused-cpu`` forces the path onto CPU
tensors (Inductor's C++ backend: a smoke test of the wiring, not a timing that means anything). The first fused
call compiles (seconds, once per process; reported as ``compile_s``) and is admitted by the ``--budget-s`` clock
like any part."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

from .budget import Budget
from .measure import Timer, skipped_row

ROWS = ("stats() fused", "dots() fused")
COMPILE_GUESS_S = 60.0  # the first compile's estimate before one was timed in this run
RTOL = 1e-5  # two float32 row sums (W elements, different orders) against each other, relative to a bound


def unavailable(device: Any, force_cpu: bool) -> str | None:
    """Why the fused rows cannot run here (``skipped: ...``), or None."""
    from zero_dtensor import settings

    if device.type == "cpu" and not force_cpu:
        return "skipped: the fused path runs on accelerators only (CPU buffers keep the eager recipe; --fused-cpu)"
    reason = settings.fused_unavailable() if device.type == "cuda" else None
    return None if reason is None else f"skipped: {reason}"


@contextlib.contextmanager
def fused_on(device: Any) -> Iterator[None]:
    """The fused reductions on (and let onto CPU tensors when ``device`` is the CPU), then off again."""
    import zero_dtensor as zd
    from zero_dtensor.layout import fused_rows

    forced = fused_rows._FORCE_CPU
    fused_rows._FORCE_CPU = device.type == "cpu"
    zd.set_fused_reductions(True)
    try:
        yield
    finally:
        zd.set_fused_reductions(False)
        fused_rows._FORCE_CPU = forced


def _nonfinite_clone(grads: Any) -> Any:
    """A clone of ``grads`` with 3 nan and 2 inf written into its largest parameter (one ``set_full_``)."""
    import torch

    bad = grads.clone()
    name = max(bad.names, key=lambda n: bad[n].numel)
    value = bad[name].full_tensor().reshape(-1).clone()
    at = torch.tensor([0, 5, 7, value.numel() // 2, value.numel() - 1], device=value.device)
    value[at] = torch.tensor([math.nan, math.nan, math.inf, -math.inf, math.nan], dtype=value.dtype,
                             device=value.device)
    bad.set_full_({name: value.view(bad[name].shape)})
    return bad


def _values(grads: Any, other: Any, bad: Any) -> dict[str, Any]:
    return {"stats": dict(grads.stats()), "bad stats": dict(bad.stats()),
            "dots": {n: float(v) for n, v in grads.dots(other).items()}}


def _same(a: float, b: float, bound: float) -> bool:
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= RTOL * bound


def compare(eager: dict[str, Any], fused: dict[str, Any]) -> list[str]:
    """What differs (empty: equal): counts and max exactly, norms relative to themselves, means and dots relative
    to their bound (``norm · sqrt(numel)`` over ``numel``; ``norm · norm'``, the clone's norm being the same)."""
    bad: list[str] = []
    for key in ("stats", "bad stats"):
        for n, e in eager[key].items():
            f = fused[key][n]
            exact = (f.nan_count, f.inf_count, f.numel) == (e.nan_count, e.inf_count, e.numel)
            same_max = f.max_abs == e.max_abs or (math.isnan(f.max_abs) and math.isnan(e.max_abs))
            mean_bound = e.norm / math.sqrt(max(e.numel, 1))
            if not (exact and same_max and _same(f.norm, e.norm, abs(e.norm)) and _same(f.mean, e.mean, mean_bound)):
                bad.append(f"{key} {n}: fused {f} eager {e}")
    for n, e in eager["dots"].items():
        norm = eager["stats"][n].norm
        if not _same(fused["dots"][n], e, norm * norm):
            bad.append(f"dots {n}: fused {fused['dots'][n]!r} eager {e!r}")
    if sum(s.nan_count for s in fused["bad stats"].values()) != 3:
        bad.append("the 3 nan written into the clone are not counted 3 times")
    return bad


def fused_rows(grads: Any, timer: Timer, budget: Budget, force_cpu: bool, facts: dict[str, Any]) -> list[dict]:
    """The two fused rows of one stage (timed with the fused path on; skipped with a reason where it cannot run or
    the budget is spent), the equality check attached to each (``equal_eager``; ``error`` when it fails). Facts:
    ``fused``: the compile time of this stage's first fused call and the check's outcome."""
    stage = timer.stage
    why = unavailable(timer.device, force_cpu)
    if why is None and not budget.admit(f"ZeRO-{stage} fused compile", budget.estimate("fused compile",
                                                                                       COMPILE_GUESS_S)):
        why = "skipped: budget"
    if why is not None:
        facts["fused"] = {"status": why}
        if timer.device.type == "cpu" and not force_cpu:
            return []  # rows of a path that never runs on the CPU are left out (the reason is in the facts)
        return [{**skipped_row(row, stage), "status": why} for row in ROWS]
    other, bad = grads.clone(), _nonfinite_clone(grads)
    eager = _values(grads, other, bad)
    with fused_on(timer.device):
        with budget.timed("fused compile"):
            t0 = time.perf_counter()
            fused = _values(grads, other, bad)  # the first fused calls: compiled here
            compile_s = time.perf_counter() - t0
        del bad
        differ = compare(eager, fused)
        rows = [timer.measure("stats() fused", grads.stats), timer.measure("dots() fused", lambda: grads.dots(other))]
    facts["fused"] = {"status": "ran", "compile_s": compile_s, "equal_eager": not differ, "differences": differ[:5]}
    for r in rows:
        r["equal_eager"] = not differ
        if differ:
            r["error"] = f"fused values differ from the eager ones ({len(differ)}): " + "; ".join(differ[:3])
    return rows
