"""One check case on one rank (two twin engines, every check in order) and the record that merges every rank's
answer: passed, failed, not run (the stack cannot run it) or skipped (the time budget)."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Callable
from typing import Any

from . import family_checks, grad_checks
from .cases import CHECKS, STEPS, Case, build_engine, deepspeed_set_loop, fill_values, train
from .grad_checks import attempt
from .runtime import error_text, setup_runtime

STACK_LIMITS = ("not supported", "unsupported", "not implemented", "no backend type associated", "does not support")


def run_case(case: Case, device_type: str, workdir: str,
             announce: Callable[[str], None] = lambda _check: None) -> dict[str, Any]:
    """One case on this rank: ``{"checks": {name: {...}}, "optimizer": str, "error": str | None, "seconds": float}``.
    ``announce(check)`` is called before each check (the parent then knows where a rank that dies was);
    ``workdir``: a directory every rank of the case sees (the checkpoint goes to ``workdir/<case>``)."""
    t0 = time.perf_counter()
    checks: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] = {"checks": checks, "optimizer": None, "error": None}

    def check(name: str, fn: Callable[[], dict[str, Any] | None]) -> None:
        announce(name)
        attempt(checks, name, fn)

    try:
        announce("engines")
        setup_runtime(device_type)
        import torch

        import zero_dtensor as zd

        ours = build_engine(case, device_type)
        info["optimizer"] = type(ours.optimizer).__name__
        written: dict[int, dict[str, torch.Tensor]] = {}
        current: dict[str, Any] = {}
        fired: list[tuple[int, bool]] = []

        def edit(engine: Any, boundary: int) -> None:
            grads = zd.sharded_grads(engine)
            if boundary == 0:
                check("reads", lambda: grad_checks.check_reads(engine, grads))
                check("transforms", lambda: grad_checks.check_transforms(grads))
                check("redistribute", lambda: grad_checks.check_redistribute(grads))
            announce("set_full_ and training")
            written[boundary] = fill_values({n: tuple(grads[n].shape) for n in grads.names}, boundary, engine.device)
            grads.set_full_(written[boundary])
            current["grads"] = grads

        def hook(grads: Any) -> None:
            fired.append((ours.micro_steps, grads is current.get("grads")))

        with zd.on_grads(ours, hook):
            mine = train(ours, case, edit)

        twin = build_engine(case, device_type)
        theirs = train(twin, case, lambda engine, boundary: deepspeed_set_loop(engine, written[boundary], case))

        def same_params() -> dict[str, Any]:
            for k, (a, b) in enumerate(zip(mine, theirs)):
                for name in a:
                    if not torch.equal(a[name], b[name]):
                        diff = float((a[name] - b[name]).abs().max())
                        raise AssertionError(f"after step {k + 1}: {name} differs from DeepSpeed's set loop + step "
                                             f"(max abs diff {diff:g})")
            assert len(mine) == len(theirs) == STEPS, (len(mine), len(theirs))
            moved = any(not torch.equal(mine[0][n], mine[1][n]) for n in mine[0])
            assert moved, "the parameters did not change between the steps"
            return {"steps": STEPS, "tolerance": "exact"}

        def hook_fired() -> dict[str, Any]:
            expected = [((k + 1) * case.gas - 1, True) for k in range(STEPS)]
            assert fired == expected, f"hook calls (micro step, same grads object) {fired}, expected {expected}"
            return {"fired": len(fired), "boundaries": STEPS}

        check("set+step", same_params)
        check("hook", hook_fired)
        memo: dict[str, Any] = {}
        check("masters", lambda: family_checks.check_masters(ours, memo))
        check("save/load", lambda: family_checks.check_save_load(ours, twin, case, os.path.join(workdir, case.name),
                                                                 memo))
        check("master writes", lambda: family_checks.check_master_writes(ours, case))
        check("ema", lambda: family_checks.check_ema(ours))
        announce("done")
    except Exception as exc:  # noqa: BLE001 - recorded; the next case still runs
        info["error"] = error_text(exc)
    finally:
        gc.collect()
    info["seconds"] = time.perf_counter() - t0
    return info


def base_record(case: Case, status: str, reason: str | None) -> dict[str, Any]:
    return {"case": case.name, **dataclasses.asdict(case), "overlap_comm": case.overlap_comm,
            "offload": case.offload, "gas": case.gas, "status": status, "reason": reason, "optimizer": None,
            "checks": {}, "seconds": 0.0}


def merge_ranks(case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for a case from every rank's answer: passed only if every check passed on every rank."""
    checks: dict[str, dict[str, Any]] = {}
    errors = [f"rank {r}: {a['error']}" for r, a in enumerate(per_rank) if a.get("error")]
    for name in CHECKS:
        answers = [a["checks"].get(name) for a in per_rank]
        if any(x is None for x in answers):
            checks[name] = {"passed": False, "error": "not reached"}
            continue
        failed = [f"rank {r}: {x.get('error')}" for r, x in enumerate(answers) if not x["passed"]]
        checks[name] = dict(answers[0], passed=not failed, **({"error": "; ".join(failed)} if failed else {}))
    passed = not errors and all(c["passed"] for c in checks.values())
    record = base_record(case, "passed" if passed else "failed", "; ".join(errors) or None)
    record.update(optimizer=per_rank[0].get("optimizer"), checks=checks,
                  seconds=max(a.get("seconds", 0.0) for a in per_rank))
    return record


def not_run(case: Case, reason: str) -> dict[str, Any]:
    return base_record(case, "not run", reason)


def skipped(case: Case, reason: str = "budget") -> dict[str, Any]:
    """A case the ``--budget-s`` left out (``status`` ``skipped``, ``reason`` ``budget``)."""
    return base_record(case, "skipped", reason)


def is_stack_limitation(message: str) -> bool:
    """An error that says the backend cannot do something on this device (not a wrong result)."""
    low = message.lower()
    return any(s in low for s in STACK_LIMITS) and ("gloo" in low or "backend" in low or "cuda" in low)


def classify(case: Case, record: dict[str, Any]) -> dict[str, Any]:
    """A failed multi-rank case whose errors say the backend cannot do it becomes ``not run``, keeping the checks."""
    if record["status"] != "failed":
        return record
    reasons = " ".join([record["reason"] or ""] + [c.get("error", "") for c in record["checks"].values()]).strip()
    if not is_stack_limitation(reasons):
        return record
    return dict(not_run(case, f"the stack cannot run it: {reasons[:500]}"), checks=record["checks"])
