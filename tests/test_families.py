"""Issue 27, the public front: ``zd.sharded_master_params``, ``zd.sharded_optimizer_state``, ``zd.sync_model_params``
and the drop-ins for DeepSpeed's ``safe_get/set_full_fp32_param`` / ``safe_get/set_full_optimizer_state``, against
DeepSpeed's own per-parameter API on an identical engine, on ZeRO-1/2/3, fp32/bf16/fp16, CPU offload,
``BF16_Optimizer``, two param groups with frozen parameters, a tied parameter, and world sizes 1 to 4. One worker call per case runs every
row (``tests/workers/rows.py``); the example ``examples/ema.py`` runs as its own test."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import background
from test_families_ds import needs_step
from workers import families
from workers.common import EngineCase
from workers.rows import RowResults, assert_row, slug

pytest.importorskip("deepspeed")

CASES = [
    EngineCase(1),
    EngineCase(2, "bf16", groups=2),  # two param groups, frozen parameters
    EngineCase(2, "fp16", offload=True),
    EngineCase(1, "bf16", bf16_optimizer=True),  # gradient replicated, masters sharded
    EngineCase(3),
    EngineCase(3, "fp16", offload=True, groups=2),
    EngineCase(3, "bf16", world=3),
    EngineCase(2, world=1),  # one rank: nothing communicates
    EngineCase(2, world=4),
    EngineCase(3, "bf16", model="tied"),  # a tied parameter, listed once
]
ROW_TESTS = [pytest.param(case, row, id=f"{case.id}-{slug(row)}") for case in CASES for row in families.ROWS]
_RESULTS = RowResults()


@pytest.mark.parametrize("case,row", ROW_TESTS)
def test_front(ranks, case: EngineCase, row: str) -> None:
    needs_step(case.stage)
    results = _RESULTS.get(ranks, case.world, families.check_front, case)
    assert_row(results, row)


def _ema_example(params: dict[str, Any], workdir: Path) -> background.Run:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return background.Run([sys.executable, os.path.join(root, "examples", "ema.py")], env=env, cwd=root, timeout=300)


@background.job(_ema_example)
def test_ema_example(background_run: Callable[[], background.Done]) -> None:
    """The example starts at collection and runs in the background (tests/background.py)."""
    done = background_run().proc
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "restored exactly" in done.stdout, done.stdout[-2000:]


def test_fronts_across_load_checkpoint(ranks, tmp_path) -> None:
    needs_step(1)
    ranks(2).run(families.check_load_checkpoint, str(tmp_path))
