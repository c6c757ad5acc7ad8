"""The multi-rank part: ``world`` spawned gloo ranks sharing the one device run the cases in order; a case whose
rank dies or hangs fails alone (the ranks are restarted for the rest) and is reported with the signal and stderr."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from . import probe as probe_mod
from .budget import Budget
from .case_run import classify, merge_ranks, not_run, run_case, skipped
from .cases import STAGES, Case
from .rank_deaths import describe_death, redirect_stderr
from .runtime import setup_runtime
from .spawned import Spawned, announce


def rank_main(rank: int, world: int, port: int, answers: Any, stderr_path: str, device_type: str,
              cases: list[Case], workdir: str) -> None:
    """A spawned rank: stderr to its file, a gloo process group on the shared device, then every case in order."""
    redirect_stderr(stderr_path)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      LOCAL_RANK="0")  # every rank on device 0: DeepSpeed picks its device from LOCAL_RANK
    try:
        announce(answers, rank, "start-up")
        setup_runtime(device_type)
        import deepspeed
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if device_type == "cuda":
            torch.cuda.set_device(0)
        # gloo, initialized here rather than by DeepSpeed, which would bind the group to cuda:LOCAL_RANK
        # a collective one rank never joins raises after a minute instead of hanging the run
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        answers.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        answers.put((rank, "start failed", traceback.format_exc()[-1500:]))
        return
    for case in cases:
        def at(check: str, name: str = case.name) -> None:
            announce(answers, rank, f"{name}: {check}")

        answers.put((rank, "case", (case.name, run_case(case, device_type, workdir, at))))
    dist.destroy_process_group()


def _failure_reason(group: Spawned, got: dict[int, tuple[str, Any]], kind: str, timeout: float
                    ) -> tuple[str, list[dict[str, Any]]]:
    """Why ``got`` lacks a ``kind`` answer from some rank: deaths with signal and stderr, silence, or another
    answer."""
    missing = sorted(set(range(group.world)) - set(got))
    reports = group.reports(missing)
    words = [describe_death(r) if r["exitcode"] is not None
             else f"rank {r['rank']} gave no answer within {timeout:g} s, still running"
                  + (f" during {r['doing']}" if r.get("doing") else "") for r in reports]
    words += [f"rank {r}: {str(p).strip().splitlines()[-1] if p else what}"
              for r, (what, p) in sorted(got.items()) if what != kind]
    return "; ".join(words), reports


def run_multi_rank(cases: list[Case], world: int, device_type: str, case_timeout: float, start_timeout: float,
                   workdir: str, budget: Budget, progress: Callable[[str], None]
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``cases`` on ``world`` spawned ranks sharing the device, after a probe of the bare collectives in
    throwaway processes. Returns the case records and what the probe found."""
    records: dict[str, dict[str, Any]] = {}
    remaining = list(cases)
    if not budget.admit(f"{world}-rank checks", budget.estimate("rank start", 20.0) + budget.estimate("rank case", 10)):
        return [skipped(c) for c in cases], {"world": world, "skipped": "budget"}
    progress(f"starting {world} gloo ranks on the {device_type} device, and probing the collectives in "
             f"{world} throwaway processes meanwhile")
    first = Spawned(world, rank_main, (device_type, remaining, workdir))  # starts while the probe runs
    try:
        found = probe_mod.probe_collectives(world, device_type, start_timeout)
    except BaseException:
        first.close(finished=False)
        raise
    info: dict[str, Any] = {"world": world, "backend": "gloo", "tensors": device_type, **found,
                            "kill_the_process": probe_mod.killers(found["collectives"]), "rank_deaths": []}
    missing = probe_mod.missing_required(found["collectives"])
    if missing:  # the stack lacks collectives the engines need: one case per stage, the rest not run
        first.close(finished=False)
        first = None
        degraded = "; ".join(f"{op}: {err}" for op, err in missing.items())
        info["degraded"] = degraded
        sample = [next(c for c in remaining if c.stage == s) for s in STAGES if any(c.stage == s for c in remaining)]
        for case in remaining:
            if case not in sample:
                records[case.name] = not_run(case, f"gloo on {device_type} tensors lacks a collective: {degraded}")
        remaining = sample
        case_timeout = min(case_timeout, 60.0)
    while remaining:
        estimate = budget.estimate("rank start", 20.0) + budget.estimate("rank case", 10.0)
        if first is None and not budget.admit(f"{world}-rank checks after a restart", estimate):
            for case in remaining:
                records[case.name] = skipped(case)
            break
        if first is None:
            progress(f"starting {world} gloo ranks on the {device_type} device")
        group, first = first or Spawned(world, rank_main, (device_type, remaining, workdir)), None
        try:
            with budget.timed("rank start"):
                ready = group.collect("ready", start_timeout)
            if len(ready) < world or any(w != "ready" for w, _ in ready.values()):
                why, reports = _failure_reason(group, ready, "ready", start_timeout)
                info["start_error"] = why
                info["rank_deaths"] += reports
                for case in remaining:
                    records[case.name] = not_run(case, f"{world} gloo ranks on one {device_type} device did not "
                                                       f"start: {why}")
                remaining = []
                break
            while remaining:
                if not budget.admit(f"{world}-rank cases from {remaining[0].name}", budget.estimate("rank case", 10.0)):
                    for case in remaining:
                        records[case.name] = skipped(case)
                    remaining = []
                    break
                case = remaining.pop(0)
                progress(case.name)
                with budget.timed("rank case"):
                    got = group.collect("case", case_timeout, key=case.name)
                if len(got) == world and all(w == "case" for w, _ in got.values()):
                    record = classify(case, merge_ranks(case, [got[r][1][1] for r in range(world)]))
                    if missing and record["status"] == "failed":
                        record = dict(not_run(case, f"{record['reason'] or 'a check failed'}; the probe had found "
                                                    f"gloo on {device_type} tensors lacking: {info['degraded']}"),
                                      checks=record["checks"])
                    records[case.name] = record
                    continue
                why, reports = _failure_reason(group, got, "case", case_timeout)
                info["rank_deaths"] += reports
                record = dict(not_run(case, ""), status="failed", reason=why + "; ranks restarted for the rest",
                              rank_deaths=reports)
                records[case.name] = record
                break  # restart the ranks for the rest
        finally:
            group.close(finished=not remaining)
    return [records[c.name] for c in cases], info
