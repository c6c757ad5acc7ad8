"""Issue 6: ``zd.on_grads`` fires once per accumulation boundary, after reduction and before the optimizer step, in a
plain DeepSpeed loop and under Accelerate's DeepSpeed plugin; removal restores DeepSpeed; errors raise on every rank."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

import background
from workers import hooks
from workers.common import EngineCase

pytest.importorskip("deepspeed")
DS_018 = Version(version("deepspeed").split("+")[0]) < Version("0.19")


def needs_step(stage: int) -> None:
    """These checks run ``engine.step()``. DeepSpeed 0.18.x with torch 2.13 fails inside its own ZeRO-1/2 step
    (``all_gather_into_tensor_dp_groups``: "Output 0 of Split is a view and is being modified inplace"), not ours."""
    if DS_018 and stage in (1, 2):
        pytest.skip("DeepSpeed 0.18.x ZeRO-1/2 engine.step() fails inside DeepSpeed with torch 2.13 (not zero_dtensor)")


def needs_unmanaged() -> None:
    if DS_018:
        pytest.skip("managed_gradient_accumulation is new in DeepSpeed 0.19")


@pytest.mark.parametrize("case", [EngineCase(stage, gas=gas) for stage in (1, 2, 3) for gas in (1, 2)],
                         ids=lambda c: c.id)
def test_fires_once_per_boundary_with_reduced_grads(ranks, case: EngineCase) -> None:
    needs_step(case.stage)
    assert ranks(case.world).run(hooks.check_fires_once_per_boundary, case)[0] == {"fired": hooks.STEPS}


@pytest.mark.parametrize("case", [EngineCase(1, gas=2), EngineCase(2), EngineCase(2, gas=2), EngineCase(3, gas=2)],
                         ids=lambda c: c.id)
def test_edit_reaches_optimizer_like_safe_set_full_grad(ranks, case: EngineCase) -> None:
    needs_step(case.stage)
    ranks(case.world).run(hooks.check_edit_reaches_optimizer, case)


def test_several_hooks_run_in_order(ranks) -> None:
    needs_step(2)
    ranks(2).run(hooks.check_several_hooks_in_order)


def test_rejects_non_engines(ranks) -> None:
    ranks(2).run(hooks.check_rejects_non_engines)


@pytest.mark.parametrize("stage", [1, 3])
def test_remove_restores_deepspeed(ranks, stage: int) -> None:
    needs_step(stage)
    ranks(2).run(hooks.check_remove_restores, stage)


def test_remove_respects_other_instance_wrappers(ranks) -> None:
    needs_step(1)
    ranks(2).run(hooks.check_instance_attribute_preserved)


@pytest.mark.parametrize("stage,failing_rank,after_collective", [(1, 0, False), (2, 1, False), (3, 1, False),
                                                                   (2, 0, True), (3, 1, True)])
def test_error_on_one_rank_raises_everywhere_without_stepping(ranks, stage: int, failing_rank: int,
                                                              after_collective: bool) -> None:
    needs_step(stage)
    ranks(2).run(hooks.check_error_on_one_rank, stage, failing_rank, after_collective)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_discard_step_after_error(ranks, stage: int) -> None:
    needs_step(stage)
    ranks(2).run(hooks.check_discard_after_error, stage)


def test_error_on_all_ranks(ranks) -> None:
    needs_step(2)
    ranks(2).run(hooks.check_error_on_all_ranks)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unmanaged_accumulation_hooks_after_finalize(ranks, stage: int) -> None:
    needs_unmanaged()
    ranks(2).run(hooks.check_unmanaged, stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unmanaged_discard_after_error(ranks, stage: int) -> None:
    needs_unmanaged()
    ranks(2).run(hooks.check_unmanaged_discard_after_error, stage)


@pytest.mark.parametrize("case", [EngineCase(2), EngineCase(2, gas=2), EngineCase(3, gas=2)], ids=lambda c: c.id)
def test_accelerate_deepspeed_plugin(ranks, case: EngineCase) -> None:
    needs_step(case.stage)
    pytest.importorskip("accelerate")
    result = ranks(case.world).run(hooks.check_accelerate, case)[0]
    assert result["fired"] == hooks.STEPS
    assert result["sync"] == ([False] * (case.gas - 1) + [True]) * hooks.STEPS


@pytest.mark.parametrize("case,every", [(EngineCase(1, gas=2), 1), (EngineCase(2), 2), (EngineCase(3, gas=2), 1),
                                        (EngineCase(1, "bf16", bf16_optimizer=True), 1)],
                         ids=["z1-gas2-every1", "z2-every2", "z3-gas2-every1", "z1-bf16opt-every1"])
def test_stats_logger_matches_safe_get_full_grad(ranks, case: EngineCase, every: int) -> None:
    needs_step(case.stage)
    result = ranks(case.world).run(hooks.check_stats_logger, case, every)[0]
    assert result["steps"] == list(range(1, 4, every))
    if case.dtype == "bf16":
        assert result["optimizer"] == "BF16_Optimizer"


def test_stats_logger_counts_nonfinite_and_callback_errors_stop_the_step(ranks) -> None:
    needs_step(2)
    ranks(2).run(hooks.check_stats_logger_nan_and_callback_error)


def test_accelerate_error_on_one_rank(ranks) -> None:
    needs_step(2)
    pytest.importorskip("accelerate")
    ranks(2).run(hooks.check_accelerate_error)


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _example(params: dict[str, Any], workdir: Path) -> background.Run | None:
    if DS_018 or (params["needs"] and importlib.util.find_spec(params["needs"]) is None):
        return None  # the test skips
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return background.Run([sys.executable, os.path.join(EXAMPLES, params["script"])], timeout=300, env=env,
                          cwd=os.path.dirname(EXAMPLES))


@pytest.mark.parametrize("script,needs", [("plain_deepspeed.py", None), ("accelerate_loop.py", "accelerate"),
                                          ("hf_trainer.py", "transformers")])
@background.job(_example)
def test_example_runs_on_two_cpu_ranks(script: str, needs: str | None,
                                       background_run: Callable[[], background.Done]) -> None:
    """Each example forks 2 gloo ranks itself (``python examples/<script>``) and asserts its own results. The runs
    start at collection and run in the background (tests/background.py)."""
    needs_step(2)  # the examples use ZeRO-2
    if needs:
        pytest.importorskip(needs)
    proc = background_run().proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
