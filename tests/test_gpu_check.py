"""Smoke test of benchmarks/gpu_check.py (issue 13) on the CPU at its tiny size, so that the GPU script cannot rot.

The script is meant for a CUDA device; here it runs the same code on CPU ranks over gloo: the full world-1 check
matrix, the 2-rank covering subset (``--quick``) and the timing rows of a ~1M-parameter model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
TIMING_ROWS = {
    "first sharded_grads() of a step", "ds safe_get_full_grad loop", "full_tensors()", "ds safe_set_full_grad loop",
    "set_full_()", "clip_grad_norm_()", "stats()",
}


def load_script() -> ModuleType:
    """The script as a module (its top level imports nothing heavy)."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_matrix_covers_every_axis() -> None:
    gc = load_script()
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
    gc = load_script()
    assert gc.is_stack_limitation("RuntimeError: ProcessGroupGloo::reduce_scatter: unsupported device type cuda")
    assert gc.is_stack_limitation("RuntimeError: No backend type associated with device type cuda")
    assert not gc.is_stack_limitation("AssertionError: full_tensors: fc1.weight differs from safe_get_full_grad")
    case = gc.Case(2, 2, "fp32", "overlap off")
    failed = {"status": "failed", "reason": "rank 0: RuntimeError: gloo does not support reduce_scatter on cuda",
              "checks": {}}
    assert gc.classify(case, failed)["status"] == "not run"
    wrong = {"status": "failed", "reason": None, "checks": {"reads": {"passed": False, "error": "differs"}}}
    assert gc.classify(case, wrong)["status"] == "failed"


@pytest.mark.timeout(300)
def test_cpu_tiny_run_passes_and_writes_complete_json(tmp_path: Path) -> None:
    gc = load_script()
    path = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--quick", "--repeat", "2", "--ds-repeat", "2",
         "--quiet", "--json", str(path)],
        capture_output=True, text=True, timeout=280, env=env, cwd=SCRIPT.parent.parent,
    )
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
