"""Issue 10: nothing silently wrong — lost writes, aliasing results, autograd history, bad arguments, hangs, hooks."""

from __future__ import annotations

import pytest

import zero_dtensor as zd
from workers import safety
from workers.common import EngineCase

BF16OPT = EngineCase(1, "bf16", bf16_optimizer=True)


@pytest.mark.parametrize("path", safety.RAW_WRITES)
@pytest.mark.parametrize("case", [EngineCase(1, optimizer="sgd"), EngineCase(2, optimizer="sgd")],
                         ids=lambda c: c.id)
def test_keep_full_grads_raw_writes_reach_step(ranks, case: EngineCase, path: str) -> None:
    ranks(case.world).run(safety.check_keep_full_raw_writes, case, path)


@pytest.mark.parametrize("case", [EngineCase(2, world=3, offload=True, optimizer="sgd")], ids=lambda c: c.id)
def test_keep_full_grads_raw_writes_offload(ranks, case: EngineCase) -> None:
    ranks(case.world).run(safety.check_keep_full_raw_writes, case, "param_to_local")


@pytest.mark.parametrize("case,keep_full", [
    (EngineCase(1), True), (EngineCase(2), True), (BF16OPT, False), (EngineCase(2), False), (EngineCase(3), False),
], ids=["z1-keep", "z2-keep", "bf16opt", "z2", "z3"])
def test_results_are_snapshots(ranks, case: EngineCase, keep_full: bool) -> None:
    ranks(case.world).run(safety.check_results_are_snapshots, case, keep_full)


@pytest.mark.parametrize("case", [EngineCase(1), EngineCase(2), EngineCase(3), BF16OPT],
                         ids=["z1", "z2", "z3", "bf16opt"])
def test_writes_record_no_history(ranks, case: EngineCase) -> None:
    ranks(case.world).run(safety.check_writes_record_no_history, case)


@pytest.mark.parametrize("case", [EngineCase(2, model="wide"), EngineCase(3, model="wide"), BF16OPT],
                         ids=["z2-wide", "z3-wide", "bf16opt"])
def test_tensor_subclass_values_are_written(ranks, case: EngineCase) -> None:
    staged = [r["staged"] for r in ranks(case.world).run(safety.check_tensor_subclass_values, case)]
    assert any(staged) == (case.model == "wide"), staged  # the wide model's small parameters are staged


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bad_arguments_clear_errors(ranks, stage: int) -> None:
    messages = ranks(2).run(safety.check_bad_arguments, stage)[0]
    assert "single string" in messages[0] and "int8" not in messages[0]


def test_stage0_refused_at_registration(ranks) -> None:
    assert "stage 0" in ranks(2).run(safety.check_stage0_refused)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_debug_skip_then_step_raises_on_every_rank(ranks, stage: int) -> None:
    messages = ranks(2).run(safety.check_skip_then_step_raises, stage)
    assert all("rank 0" in m and "rank 1" in m for m in messages)


@pytest.mark.parametrize("stage", [2, 3])
def test_different_flat_groups_raise_without_debug(ranks, stage: int) -> None:
    ranks(2).run(safety.check_different_groups_raise, stage)


def test_debug_skipped_call_raises_within_timeout() -> None:
    # fresh processes: a timed-out check leaves its process group unusable, so not the shared pool
    with zd.RankPool(2, start_method="fork") as pool:
        answers = pool.run(safety.skipped_call_times_out, 2.0, timeout=120)
    assert answers[1] == "skipped"
    assert "within 0:00:02" in answers[0]


@pytest.mark.parametrize("case", [EngineCase(1), EngineCase(2), EngineCase(3), BF16OPT],
                         ids=["z1", "z2", "z3", "bf16opt"])
def test_failed_hook_discards_gradients(ranks, case: EngineCase) -> None:
    ranks(case.world).run(safety.check_failed_hook_discards, case)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unmanaged_failed_hook_discards_gradients(ranks, stage: int) -> None:
    ranks(2).run(safety.check_unmanaged_failed_hook_discards, stage)


@pytest.mark.parametrize("case", [EngineCase(2), EngineCase(3), BF16OPT], ids=["z2", "z3", "bf16opt"])
def test_fuzz_set_full_and_full_tensors_arguments(ranks, case: EngineCase) -> None:
    outcomes = ranks(case.world).run(safety.fuzz_arguments, case, 40)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0]["errors"] > 10 and outcomes[0]["writes"] > 5 and outcomes[0]["reads"] > 5, outcomes[0]
