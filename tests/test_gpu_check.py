"""Smoke test of benchmarks/gpu_check.py (issues 13, 42) on the CPU at its tiny size, so that the GPU script cannot
rot.

The script is meant for a CUDA device; here it runs the same code on CPU ranks over gloo: the full world-1 check
matrix, the 2-rank covering subset (``--quick``), the timing rows of a ~1M-parameter model with their floors, the
checkpoint rows and ``--profile``. A rank that dies is reported with its signal and stderr (a spawned pair that
kills itself). Issue 52: the script under ``torchrun --nproc_per_node=2`` (2 gloo ranks, one process each) checks
at 2 ranks, times against the bare collectives of the same bytes, and records the world size and the backend.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import background

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # the script's package by role, benchmarks/gpucheck (imports nothing heavy)

from gpucheck import case_run as gc_run  # noqa: E402
from gpucheck import cases as gc  # noqa: E402
from gpucheck import floors, ranks  # noqa: E402
from gpucheck.rank_deaths import redirect_stderr  # noqa: E402
from gpucheck.spawned import Spawned, announce  # noqa: E402

TIMING_ROWS = {
    "first sharded_grads() of a step", "ds safe_get_full_grad loop", "full_tensors()", "ds safe_set_full_grad loop",
    "set_full_()", "clip_grad_norm_()", "stats()",
    "mul_(1.0)", "norms()", "global_norm()", "dots()", "ds safe_get_full_fp32_param loop", "masters full_tensors()",
    "exp_avg full_tensors()", "masters set_full_()", "to_dtensors()",
}
CHECKPOINT_ROWS = {"zd.save (no fsync)", "zd.load", "ds save_checkpoint", "ds load_checkpoint"}


def test_matrix_covers_every_axis() -> None:
    full = gc.case_matrix()
    assert len(full) == len({c.name for c in full}) == 2 * 3 * 3 * 4
    quick = gc.case_matrix(quick=True)
    assert [c for c in quick if c.world == 1] == [c for c in full if c.world == 1]  # world 1 is never cut
    multi = [c for c in quick if c.world == 2]
    assert {(c.stage, c.dtype) for c in multi} == {(s, d) for s in gc.STAGES for d in gc.DTYPES}
    assert {c.variant for c in multi} == set(gc.VARIANTS)
    case = gc.Case(1, 3, "fp16", "offload")
    assert (case.offload, case.gas, case.overlap_comm) == (True, 1, None)
    assert gc.ds_config(case, "cuda")["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    assert gc.ds_config(case, "cpu")["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    assert gc.ds_config(gc.Case(1, 1, "bf16", "gas 2"), "cpu")["gradient_accumulation_steps"] == 2


def test_stack_limitations_are_told_apart_from_failures() -> None:
    assert gc_run.is_stack_limitation("RuntimeError: ProcessGroupGloo::reduce_scatter: unsupported device type cuda")
    assert gc_run.is_stack_limitation("RuntimeError: No backend type associated with device type cuda")
    assert not gc_run.is_stack_limitation("AssertionError: full_tensors: fc1.weight differs from safe_get_full_grad")
    case = gc.Case(2, 2, "fp32", "overlap off")
    failed = {"status": "failed", "reason": "rank 0: RuntimeError: gloo does not support reduce_scatter on cuda",
              "checks": {}}
    assert gc_run.classify(case, failed)["status"] == "not run"
    wrong = {"status": "failed", "reason": None, "checks": {"reads": {"passed": False, "error": "differs"}}}
    assert gc_run.classify(case, wrong)["status"] == "failed"


def _tiny_run(params: dict[str, Any], tmp_path: Path) -> background.Run:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return background.Run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--quick", "--repeat", "2", "--ds-repeat", "2",
         "--quiet", "--json", str(tmp_path / "gpu.json"), "--profile", str(tmp_path / "profile")],
        timeout=280, env=env, cwd=str(SCRIPT.parent.parent),
    )


@pytest.mark.timeout(300)
@background.job(_tiny_run)
def test_cpu_tiny_run_passes_and_writes_complete_json(background_run: Callable[[], background.Done]) -> None:
    """The run starts at collection and runs in the background (tests/background.py)."""
    done = background_run()
    proc, tmp_path = done.proc, done.workdir
    path = tmp_path / "gpu.json"
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ZeRO-3" in proc.stdout and "checks:" in proc.stdout
    data = json.loads(path.read_text())

    env_info = data["environment"]
    assert env_info["device_type"] == "cpu" and env_info["backend_world_1"] == "gloo"
    for key in ("torch", "deepspeed", "zero_dtensor", "device_name", "python"):
        assert env_info[key], key

    # every case of the matrix ran and passed: on the CPU nothing is "not run"
    expected = [c.name for c in gc.case_matrix(quick=True)]
    assert [c["case"] for c in data["checks"]] == expected
    for case in data["checks"]:
        assert case["status"] == "passed", case
        assert set(case["checks"]) == set(gc.CHECKS), case
        assert all(check["passed"] for check in case["checks"].values()), case
        assert case["checks"]["hook"]["fired"] == gc.STEPS
        assert case["checks"]["set+step"]["tolerance"] == "exact"
    assert data["summary"]["passed"] == len(expected) and data["summary"]["ok"] is True and not data["partial"]
    assert all(v == "ok" for v in data["multi_rank"]["collectives"].values()), data["multi_rank"]

    # timing rows for every stage, on the ~1M-parameter / 198-tensor model; no CUDA memory on the CPU
    model = data["timing_model"]
    assert model["tensors"] == 198 and 0.9e6 < model["params"] < 1.1e6
    for stage in (1, 2, 3):
        rows = {r["row"]: r for r in data["timings"] if r["stage"] == stage}
        assert set(rows) == TIMING_ROWS, (stage, sorted(rows))
        for r in rows.values():
            assert "error" not in r, r
            assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["repeat"] >= 2, r
            assert r["peak_bytes"] is None and r["peak_first_bytes"] is None
        assert rows["ds safe_get_full_grad loop"]["collectives"] == 198  # one per parameter
        assert rows["full_tensors()"]["speedup_vs_deepspeed"] > 0
        assert rows["set_full_()"]["collectives"] == 0
        assert model[f"zero{stage}"]["params"] == model["params"]
        assert model[f"zero{stage}"]["fused"]["status"].startswith("skipped: the fused path runs on accelerators")

    # issue 42: every row with a floor has it, timed in the same run, and its ratio
    for r in data["timings"]:
        if r["row"] in floors.FLOOR_OF:
            assert r["floor"] == floors.FLOOR_OF[r["row"]] and r["floor_ms"] > 0, r
            assert r["ratio"] == pytest.approx(r["median_ms"] / r["floor_ms"]), r
    assert set(model["zero1"]["floors"]) == set(floors.FLOOR_OF.values())
    # checkpoints timed against DeepSpeed's on the default stage (2); both wrote something
    ckpt = {r["row"]: r for r in data["checkpoint_timings"]}
    assert set(ckpt) == CHECKPOINT_ROWS and {r["stage"] for r in ckpt.values()} == {2}, sorted(ckpt)
    assert all(r["bytes_on_disk"] > 0 and r["median_ms"] > 0 for r in ckpt.values()), ckpt
    assert ckpt["zd.load"]["speedup_vs_deepspeed"] > 0
    # --profile: one profile per timed row, in both files
    profiled = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert {(p["stage"], p["row"]) for p in profiled} == {(r["stage"], r["row"]) for r in data["timings"]
                                                        if r["row"] != "first sharded_grads() of a step"}
    assert all(isinstance(p["host_syncs"], dict) and p["top_ops"] for p in profiled), profiled[:2]
    assert "== ZeRO-3 stats()" in (tmp_path / "profile" / "profile.txt").read_text()
    # the probe ran in throwaway processes, and nothing died
    assert data["multi_rank"]["deaths"] == [] and data["multi_rank"]["rank_deaths"] == []
    assert set(data["multi_rank"]["collectives"]) >= {"isend/irecv", "coalesced all_gather_into_tensor"}


def _die(rank: int, world: int, port: int, answers: Any, stderr_path: str) -> None:
    """A spawned pair: rank 0 writes gloo's point-to-point error and aborts, rank 1 segfaults."""
    redirect_stderr(stderr_path)
    announce(answers, rank, "ws2-z1-bf16-offload: reads")
    if rank == 0:
        print("terminate called after throwing an instance of 'gloo::IoException'\n"
              "  what():  [pair.cc:339] writev [127.0.0.1]:1234: Bad address", file=sys.stderr, flush=True)
        os.abort()
    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_dead_rank_is_named_by_its_signal_and_stderr() -> None:
    """Not 'did not start within N s' (what the script said when its ranks segfaulted on CUDA)."""
    group = Spawned(2, _die, ())
    try:
        got = group.collect("case", 120, key="ws2-z1-bf16-offload")
        why, reports = ranks._failure_reason(group, got, "case", 120)
    finally:
        group.close(finished=False)
    assert got == {}, got
    assert [r["ended"] for r in reports] == ["SIGABRT (exit code -6)", "SIGSEGV (exit code -11)"], reports
    assert "rank 0 died with SIGABRT (exit code -6) during ws2-z1-bf16-offload: reads" in why, why
    assert "gloo point-to-point" in why and "Bad address" in why, why
    assert "rank 1 died with SIGSEGV (exit code -11) during ws2-z1-bf16-offload: reads" in why, why
    assert reports[1]["fault"][0] == "Fatal Python error: Segmentation fault", reports[1]
    assert "did not start" not in why and "no answer" not in why, why


def _torchrun_run(params: dict[str, Any], tmp_path: Path) -> background.Run:
    """``torchrun --nproc_per_node=2 benchmarks/gpu_check.py --device cpu --tiny --json PATH``, kept to CI size: the
    2-rank covering subset of the matrix (``--quick``), one timed stage (ZeRO-3), no checkpoint rows."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return background.Run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
         "--device", "cpu", "--tiny", "--json", str(tmp_path / "gpu.json"), "--quick", "--repeat", "2",
         "--ds-repeat", "2", "--timing-stages", "3", "--checkpoint-stages", "", "--quiet"],
        timeout=280, env=env, cwd=str(SCRIPT.parent.parent),
    )


@pytest.mark.timeout(300)
@background.job(_torchrun_run)
def test_torchrun_two_ranks_check_and_time_against_the_collectives(
        background_run: Callable[[], background.Done]) -> None:
    done = background_run()
    proc = done.proc
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "2 ranks, gloo" in proc.stdout and "checks: 9 passed" in proc.stdout, proc.stdout[-3000:]
    data = json.loads((done.workdir / "gpu.json").read_text())
    assert (data["world_size"], data["backend"], data["launcher"]) == (2, "gloo", "torchrun")
    assert data["forced_collectives"] is False and data["multi_rank"] is None  # the ranks are torchrun's
    # the 2-rank matrix, each case checked on both ranks against DeepSpeed's safe_* functions
    expected = [c.name for c in gc.case_matrix((2,), quick=True)]
    assert [c["case"] for c in data["checks"]] == expected
    for case in data["checks"]:
        assert case["status"] == "passed" and set(case["checks"]) == set(gc.CHECKS), case
    assert data["summary"]["ok"] is True and data["summary"]["passed"] == len(expected) and not data["partial"]
    # timings at 2 ranks beside the bare collectives of the same bytes, each with its bus bandwidth
    model = data["timing_model"]
    assert (model["world"], model["backend"]) == (2, "gloo")
    rows = {r["row"]: r for r in data["timings"]}
    assert set(rows) == TIMING_ROWS and {r["stage"] for r in rows.values()} == {3}
    comm = model["zero3"]["comm_floors"]
    assert set(comm) >= {"all_gather_into_tensor", "all_reduce", "all_to_all_single", "all_to_all_single (partition)",
                         "all_gather_into_tensor (fp32)"}, sorted(comm)
    for name, f in comm.items():
        assert f["world"] == 2 and f["bytes"] > 0 and f["busbw_GBps"] > 0, (name, f)
        factor = 2 * (2 - 1) / 2 if f["collective"] == "all_reduce" else (2 - 1) / 2
        assert f["busbw_GBps"] == pytest.approx(f["algbw_GBps"] * factor), (name, f)
    for row, floor in floors.COMM_FLOOR_OF.items():
        assert rows[row]["comm_floor"] == floor and rows[row]["comm_ratio"] > 0, rows[row]
    # the seed's row: DeepSpeed's per-parameter loop (one collective per tensor) against one full_tensors()
    assert rows["ds safe_get_full_grad loop"]["collectives"] == 198
    assert rows["full_tensors()"]["speedup_vs_deepspeed"] > 0
