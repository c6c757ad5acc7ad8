"""Smoke test of the benchmark CLI (python -m zero_dtensor.bench) at a tiny size: it runs, and its JSON is complete."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import background

ROWS = {
    "ds get loop", "ds set loop", "full_tensors out=prev", "full_tensors all_gather", "full_tensors all_to_all",
    "full_tensors all_reduce", "set_full_", "floor: bare all_gather", "ref: bare all_reduce",
    "ref: bare all_to_all gather",
}


def test_help_documents_flags(capsys) -> None:
    """``--help`` lists every flag. In process: the ``python -m zero_dtensor.bench`` entry point runs in the tests
    below, and a process of its own costs seconds of start-up and interpreter shutdown here."""
    from zero_dtensor.bench.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--nproc", "--stages", "--tiny", "--hidden", "--layers", "--params", "--repeat", "--json"):
        assert flag in out, flag


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def _tiny_run(params: dict[str, Any], tmp_path: Path) -> background.Run:
    return background.Run(
        [sys.executable, "-m", "zero_dtensor.bench", "--tiny", "--nproc", "2", "--stages", "1,3", "--repeat", "2",
         "--no-progress", "--json", str(tmp_path / "bench.json")],
        timeout=240, env=_env(),
    )


@background.job(_tiny_run)
def test_cli_tiny_run_writes_complete_json(background_run: Callable[[], background.Done]) -> None:
    """The bench runs of this file start at collection and run in the background (tests/background.py)."""
    done = background_run()
    proc, path = done.proc, done.workdir / "bench.json"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO-1" in proc.stdout and "ZeRO-3" in proc.stdout
    data = json.loads(path.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    assert sorted(int(s) for s in data["stages"]) == [1, 3]
    for stage in (1, 3):
        rows = {r["row"]: r for r in data["rows"] if r["stage"] == stage}
        names = set(rows)
        assert ROWS <= names, ROWS - names
        assert any(n.startswith("full_tensors [auto=") for n in names)
        assert any(n.startswith("iter_full") for n in names)
        n_tensors = data["stages"][str(stage)]["tensors"]
        assert n_tensors == 30
        for r in rows.values():
            assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"], r
            assert r["repeat"] >= 2
        # DeepSpeed reads each parameter with its own collective; zero_dtensor with one
        assert rows["ds get loop"]["collectives"] == n_tensors
        for name in ("full_tensors out=prev", "full_tensors all_gather", "full_tensors all_reduce"):
            assert rows[name]["collectives"] == 2, name  # one for the data, one the rank-agreement check
        assert rows["floor: bare all_gather"]["collectives"] == 1
        assert rows["set_full_"]["collectives"] == 0 and rows["ds set loop"]["collectives"] == 0
        assert rows["full_tensors out=prev"]["memory_bytes"] == 0
        assert rows["full_tensors all_gather"]["speedup_vs_deepspeed"] > 0
        assert rows["floor: bare all_gather"]["ratio_to_floor"] == 1.0
        if "clip_grad_norm_" in rows:
            assert rows["clip_grad_norm_"]["collectives"] == 2  # the all_reduce + the rank agreement
        # issue 12: redistribution rows (one all_to_all per exchange + the rank agreement)
        from zero_dtensor.bench.redistribute import DS_NS, FULL_NS, NS, ROWS as REDISTRIBUTION_ROWS

        assert set(REDISTRIBUTION_ROWS) <= names, set(REDISTRIBUTION_ROWS) - names
        a2a = {n: rows[n]["collective_ops"].get("alltoall_base", 0) for n in REDISTRIBUTION_ROWS}
        # owners hold contiguous runs of parameters: where none is cut by a partition boundary (this tiny model under
        # ZeRO-1/2), nothing crosses ranks and owned / set_owned_ issue no all_to_all; map_full_'s write always
        # exchanges its error codes
        crosses = {n: int(rows[n]["bytes_per_rank"] > 0) for n in ("owned", NS)}
        assert a2a["owned"] == a2a["set_owned_"] == crosses["owned"] and a2a[NS] == 1 + crosses[NS], (a2a, crosses)
        # ZeRO-3 on 2 ranks (even row counts): every chunk already is whole rows, nothing crosses ranks
        assert a2a["to_dtensors"] == a2a["set_dtensors_"] == (1 if stage == 1 else 0), a2a
        assert rows["to_dtensors"]["collectives"] == 1 + a2a["to_dtensors"]
        assert rows["owned"]["collectives"] == 1 + a2a["owned"]
        assert rows["set_dtensors_"]["collectives"] == 1 + a2a["set_dtensors_"]
        assert rows["set_owned_"]["collectives"] == 1 + a2a["set_owned_"]
        assert rows[NS]["collectives"] == 1 + a2a[NS] and rows[FULL_NS]["collectives"] == 2
        n_matrices = rows[DS_NS]["collectives"]
        assert 0 < n_matrices < n_tensors
        assert rows["owned"]["bytes_per_rank"] < rows["full_tensors all_gather"]["bytes_per_rank"]
        for name in ("to_dtensors", "owned", NS):
            relative = rows[name]["relative"]
            assert relative["ratio"] > 0 and relative["to"] in names, relative
        assert rows[NS]["relative"]["to"] == FULL_NS and rows[NS]["relative_ds"]["to"] == DS_NS


def _sweep(params: dict[str, Any], tmp_path: Path) -> background.Run:
    return background.Run(
        [sys.executable, "-m", "zero_dtensor.bench", "--tensors", "20,40", "--tiny", "--nproc", "2", "--stages",
         "1,3", "--repeat", "2", "--no-progress", "--json", str(tmp_path / "sweep.json")],
        timeout=240, env=_env(),
    )


@background.job(_sweep)
def test_tensor_sweep_writes_every_row_per_k(background_run: Callable[[], background.Done]) -> None:
    """Issue 11: ``--tensors`` sweeps the tensor count; every row for every K and stage, with sane figures."""
    from zero_dtensor.bench.sweep import FLOOR, ROWS as SWEEP_ROWS

    done = background_run()
    proc, path = done.proc, done.workdir / "sweep.json"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO-1" in proc.stdout and "ZeRO-3" in proc.stdout and "K=40" in proc.stdout
    data = json.loads(path.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    assert data["config"]["tensors"] == [20, 40]
    assert sorted((m["stage"], m["tensors"]) for m in data["runs"]) == [(1, 20), (1, 40), (3, 20), (3, 40)]
    for m in data["runs"]:
        assert m["model_tensors"] == m["tensors"] and m["layers"] == m["tensors"] // 2
        assert m["params"] == m["layers"] * (8 * 8 + 8)  # --tiny: Linear(8, 8)
        assert m["stored_bytes"] >= 4 * m["params"]
    for stage in (1, 3):
        for k in (20, 40):
            rows = {r["row"]: r for r in data["rows"] if r["stage"] == stage and r["tensors"] == k}
            assert set(rows) == set(SWEEP_ROWS), set(SWEEP_ROWS) ^ set(rows)
            floor = rows[FLOOR]
            assert floor["ratio_to_floor"] == 1.0 and floor["us_per_tensor_above_floor"] == 0.0
            assert floor["collectives"] == 1
            assert floor["repeat"] == 2 * (len(SWEEP_ROWS) - 1)  # the floor repetitions interleaved with every row
            for r in rows.values():
                assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"], r
                assert r["repeat"] == 2 or r is floor
                assert floor["min_s"] <= r["floor_median_s"] <= floor["max_s"], r  # its own floor, from the same run
                assert r["ratio_to_floor"] == pytest.approx(r["median_s"] / r["floor_median_s"])
                expected = 1e6 * (r["median_s"] - r["floor_median_s"]) / k
                assert abs(r["us_per_tensor_above_floor"] - expected) <= 1e-6 * max(1.0, abs(expected)), r
            assert rows["set_full_"]["collectives"] == 0
            assert rows["first sharded_grads"]["collectives"] == 0
            for name in ("full_tensors()", "full_tensors(out=prev)"):
                assert rows[name]["collectives"] >= 1, name
            for name in ("clip_grad_norm_", "norms", "global_norm"):
                assert rows[name]["collectives"] == 2, name  # the all_reduce + the rank agreement
            assert 2 <= rows["stats()"]["collectives"] <= 3


def _families(params: dict[str, Any], tmp_path: Path) -> background.Run:
    return background.Run(
        [sys.executable, "-m", "zero_dtensor.bench", "--tiny", "--nproc", "2", "--stages", "3", "--rows", "families",
         "--repeat", "2", "--no-progress", "--json", str(tmp_path / "families.json")],
        timeout=240, env=_env(),
    )


@background.job(_families)
def test_families_rows_run_and_count(background_run: Callable[[], background.Done]) -> None:
    """Issue 27: ``--rows families`` measures the masters' and the optimizer state's rows, each with its reference:
    bulk reads one collective plus the agreement where DeepSpeed's loops take one per parameter, the EMA none."""
    from zero_dtensor.bench.families import ROWS as FAMILY_ROWS

    done = background_run()
    proc, path = done.proc, done.workdir / "families.json"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(FAMILY_ROWS) <= set(rows), set(FAMILY_ROWS) - set(rows)
    tensors = rows["ds get loop"]["collectives"]
    assert rows["ds fp32 get loop"]["collectives"] == rows["ds exp_avg get loop"]["collectives"] == tensors
    assert rows["masters full_tensors"]["collectives"] == rows["exp_avg full_tensors"]["collectives"] == 2
    assert rows["ema.lerp_(masters)"]["collectives"] == 0
    for name in ("masters full_tensors", "exp_avg full_tensors", "ema.lerp_(masters)", "masters to_dtensors",
                 "masters owned"):
        assert rows[name]["relative_to_reference"]["ratio"] > 0, name


def _ab(params: dict[str, Any], tmp_path: Path) -> background.Run:
    root = str(Path(__file__).resolve().parents[1])
    return background.Run(
        [sys.executable, os.path.join(root, "benchmarks", "ab.py"), "--a", root, "--b", root, "--world", "2",
         "--rounds", "1", "--reps", "1", "--stages", "3", "--hidden", "16", "--layers", "1", "--tensors", "0",
         "--rows", "z3 full_tensors,z3 norms", "--json", str(tmp_path / "ab.json")],
        timeout=600, env=_env(),
    )


@background.job(_ab)
def test_ab_compares_a_tree_with_itself(background_run: Callable[[], background.Done]) -> None:
    """Issue 55: ``benchmarks/ab.py`` runs two trees' pools interleaved (here this tree twice, tiny model, 2 ranks,
    1 round) and prints each row's ratio B/A; its JSON holds every round's times of both trees."""
    done = background_run()
    proc = done.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "B/A" in proc.stdout and "z3 full_tensors out=" in proc.stdout and "z3 norms" in proc.stdout
    data = json.loads((done.workdir / "ab.json").read_text())
    rows = {e["row"]: e for e in data["summary"]}
    assert set(rows) == {"z3 full_tensors", "z3 full_tensors out=", "z3 norms"}, set(rows)
    for e in rows.values():
        assert e["world"] == 2 and e["a_ms"] > 0 and e["b_ms"] > 0, e
        assert e["ratio"] == e["ratio_min"] == e["ratio_max"] == pytest.approx(e["b_ms"] / e["a_ms"]), e
    (result,) = data["results"]
    assert result["zero_dtensor"]["A"] == result["zero_dtensor"]["B"]  # both pools imported the tree given
    assert result["zero_dtensor"]["A"].startswith(str(Path(__file__).resolve().parents[1]))
