"""The command line of ``benchmarks/gpu_check.py``: options, the order of the parts (world-1 checks, timings,
the multi-rank checks) under the ``--budget-s`` clock, the JSON written after every part, the exit code."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
from typing import Any

from .budget import Budget
from .case_run import classify, merge_ranks, run_case, skipped
from .cases import MULTI_RANK, SIZES, STAGES, STEPS, case_matrix
from .profiling import Profiles
from .ranks import run_multi_rank
from .report import render
from .runtime import environment, error_text, pick_device, setup_runtime
from .world import AgreedBudget, agreed, barrier, gathered, init_world, shared_dir

DEFAULT_BUDGET_S = 290.0


def _stages(p: argparse.ArgumentParser, text: str, option: str) -> list[int]:
    stages = [int(s) for s in str(text).split(",") if s.strip()]
    if any(s not in STAGES for s in stages):
        p.error(f"{option} takes 1, 2 and/or 3 (comma-separated)")
    return stages


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py",
        description="Check zero_dtensor against DeepSpeed on one device (world 1, then 2 ranks sharing it) and time "
                    "it against bare-op floors on a ~1B-parameter bf16 model. Exit code 1 if a check fails.")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--tiny", action="store_true", help="a ~1M-parameter timing model (same 198 tensors): CI smoke")
    p.add_argument("--quick", action="store_true", help="the 2-rank part as a 9-case covering subset (CI)")
    p.add_argument("--json", metavar="PATH", help="write checks, timings and environment as JSON")
    p.add_argument("--skip-timing", action="store_true", help="checks only")
    p.add_argument("--skip-checks", action="store_true", help="timings only")
    p.add_argument("--skip-world-one", action="store_true",
                   help="no check cases at world 1 (the --ranks part still runs): the multi-rank matrix alone")
    p.add_argument("--ranks", type=int, default=MULTI_RANK,
                   help=f"ranks sharing the device for the multi-rank checks (0: none). Default {MULTI_RANK}")
    p.add_argument("--timing-stages", default="1,2,3", help="ZeRO stages to time. Default 1,2,3")
    p.add_argument("--checkpoint-stages", default="2",
                   help="ZeRO stages whose zd.save/zd.load and DeepSpeed save/load_checkpoint are timed (each "
                        "writes the whole fp32 state: ~12 GiB on the 1B model). Default 2; '' for none")
    p.add_argument("--checkpoint-dir", help="where the timed checkpoints go (removed after). Default: the temp dir")
    p.add_argument("--hidden", type=int, help="timing model hidden size (default 2304; --tiny 72)")
    p.add_argument("--layers", type=int, help="timing model blocks, 12 tensors each (default 16)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per row after a warm-up. Default 5")
    p.add_argument("--ds-repeat", type=int, default=3, help="repetitions of DeepSpeed's loops. Default 3")
    p.add_argument("--case-timeout", type=float, default=120.0,
                   help="seconds a multi-rank case may take before its ranks are killed. Default 120")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="skip whatever would end past this many seconds from the start, estimated from the time the "
                        f"same kind of work took so far (reported 'skipped: budget'). 0: no limit. Default "
                        f"{DEFAULT_BUDGET_S:g}")
    p.add_argument("--profile", metavar="DIR",
                   help="profile one call of each timing row (torch.profiler): DIR/profile.json and profile.txt")
    p.add_argument("--fused-cpu", action="store_true",
                   help="on --device cpu, also time the fused reductions' rows, forced onto CPU tensors (they run on "
                        "accelerators only; Inductor's C++ backend compiles them: a smoke test of the wiring)")
    p.add_argument("--force-collectives", choices=("auto", "on", "off"), default="auto",
                   help="at world 1, ZERO_DTENSOR_FORCE_COLLECTIVES=1: the one rank takes the collective path of N "
                        "ranks (every NCCL call of the library, over itself). auto: on for CUDA, off on the CPU")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    hidden, layers = SIZES["tiny" if args.tiny else "full"]
    args.hidden, args.layers = args.hidden or hidden, args.layers or layers
    args.timing_stages = _stages(p, args.timing_stages, "--timing-stages")
    args.checkpoint_stages = _stages(p, args.checkpoint_stages, "--checkpoint-stages")
    if args.repeat < 1 or args.ds_repeat < 1:
        p.error("--repeat and --ds-repeat take a number >= 1")
    return args


def in_process_checks(results: dict[str, Any], cases: list[Any], device_type: str, workdir: str, budget: Budget,
                      progress: Any) -> None:
    """The cases of this process group's world size, run by every rank of it (world 1, or torchrun's N ranks):
    every rank's answer merged into one record per case."""
    for case in cases:
        if not budget.admit(case.name, budget.estimate("case", 3.0)):
            results["checks"].append(skipped(case))
            continue
        progress(case.name)
        with budget.timed("case"):
            answers = gathered(run_case(case, device_type, workdir))
            record = merge_ranks(case, answers)
            results["checks"].append(classify(case, record) if case.world > 1 else record)


def forced_collectives(choice: str, device_type: str, world: int) -> bool:
    """Whether this run sets ``ZERO_DTENSOR_FORCE_COLLECTIVES=1``: only at world 1; ``auto`` on CUDA."""
    return world == 1 and (choice == "on" or (choice == "auto" and device_type == "cuda"))


def timings(results: dict[str, Any], args: argparse.Namespace, device_type: str, backend: str, budget: Budget,
            profiles: Profiles, progress: Any) -> None:
    import torch

    from zero_dtensor.bench.model import count

    from .timings import time_stage

    params, tensors = count(args.hidden, args.layers)
    import torch.distributed as dist

    results["timing_model"] = {"hidden": args.hidden, "layers": args.layers, "params": params, "tensors": tensors,
                               "dtype": "bf16", "world": dist.get_world_size(), "backend": backend}
    for stage in args.timing_stages:
        first_guess = 5.0 + 40.0 * params / 1e9  # before a stage was timed: the engine's build grows with the model
        if not budget.admit(f"timing ZeRO-{stage}", budget.estimate("stage", first_guess)):
            results["timings"].append({"stage": stage, "row": "(stage)", "status": "skipped: budget"})
            continue
        try:
            with budget.timed("stage"):
                rows, checkpoints, facts = time_stage(stage, args, device_type, budget, profiles, progress)
            results["timings"] += rows
            results["checkpoint_timings"] += checkpoints
            results["timing_model"][f"zero{stage}"] = facts
        except Exception as exc:  # noqa: BLE001 - recorded; the other stages still run
            results["timings"].append({"stage": stage, "row": "(stage failed)", "error": error_text(exc)})
        gc.collect()  # the stage's engine and buffers, before the next stage builds its own
        if device_type == "cuda":
            torch.cuda.empty_cache()


def summary(results: dict[str, Any], budget: Budget) -> dict[str, Any]:
    statuses = [c["status"] for c in results["checks"]]
    timed = results["timings"] + results["checkpoint_timings"]
    out = {"passed": statuses.count("passed"), "failed": statuses.count("failed"),
           "not_run": statuses.count("not run"), "skipped": statuses.count("skipped"),
           "timing_errors": sum("error" in r for r in timed), "elapsed_s": budget.elapsed(),
           "budget_s": budget.total_s, "skipped_parts": budget.skipped}
    out["ok"] = not out["failed"] and not out["timing_errors"]
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    import os

    from zero_dtensor.settings import ENV_FORCE_COLLECTIVES

    args = parse_args(argv)
    device_type = pick_device(args.device)
    console = Console(width=None if sys.stdout.isatty() else 160)
    errors = Console(stderr=True)
    setup_runtime(device_type)
    rank, world, backend = init_world(device_type)
    forced = forced_collectives(args.force_collectives, device_type, world)
    if forced:  # before any call of the library: the one switch, read at every call
        os.environ[ENV_FORCE_COLLECTIVES] = "1"
    elif world == 1:
        os.environ.pop(ENV_FORCE_COLLECTIVES, None)
    budget = AgreedBudget(args.budget_s) if world > 1 else Budget(args.budget_s)
    profiles = Profiles(args.profile)  # every rank profiles the same calls (collectives inside); rank 0 writes

    def progress(what: str) -> None:
        if not args.quiet and rank == 0:
            errors.print(f"[dim]{budget.elapsed():7.1f}s  {escape(what)}[/dim]", highlight=False)

    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "environment": environment(device_type, backend),
        "world_size": world, "backend": backend, "forced_collectives": forced,
        "launcher": "torchrun" if world > 1 or "TORCHELASTIC_RUN_ID" in os.environ else "python",
        "config": {"tiny": args.tiny, "quick": args.quick, "ranks": args.ranks, "steps_per_case": STEPS,
                   "hidden": args.hidden, "layers": args.layers, "repeat": args.repeat, "ds_repeat": args.ds_repeat,
                   "timing_stages": args.timing_stages, "checkpoint_stages": args.checkpoint_stages,
                   "budget_s": budget.total_s, "profile": args.profile,
                   "fused_cpu": args.fused_cpu},
        "checks": [], "multi_rank": None, "timings": [], "checkpoint_timings": [], "timing_model": None,
        "summary": None, "partial": True,
    }

    def dump() -> None:
        """Write the JSON after every part, so that a run killed at its time limit still leaves what it did."""
        if args.json and rank == 0:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2, default=str)

    workdir = shared_dir("gpu_check_")  # the check cases' checkpoints (small), one directory for every rank
    try:
        # world 1: its cases here, then --ranks gloo ranks sharing the device (spawned); torchrun: its N ranks
        worlds = (1,) + ((args.ranks,) if args.ranks > 1 else ()) if world == 1 else (world,)
        cases = [] if args.skip_checks else case_matrix(worlds, quick=args.quick)
        here = [c for c in cases if c.world == world and not (world == 1 and args.skip_world_one)]
        in_process_checks(results, here, device_type, workdir, budget, progress)
        dump()
        if not args.skip_timing:
            timings(results, args, device_type, backend, budget, profiles, progress)
            results["profile_files"] = profiles.write() if rank == 0 else []
            dump()
        multi = [c for c in cases if c.world > 1] if world == 1 else []
        if multi:
            records, probe = run_multi_rank(multi, args.ranks, device_type, args.case_timeout, 180.0, workdir,
                                            budget, progress)
            results["checks"] += records
            results["multi_rank"] = probe
    finally:
        barrier()
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
    results["summary"] = summary(results, budget)
    results["partial"] = False
    if rank == 0:
        render(results, console)
    dump()
    ok = bool(agreed(results["summary"]["ok"]))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0 if ok else 1
