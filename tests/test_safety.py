"""Issue 10: nothing silently wrong — lost writes, aliasing results, autograd history, bad arguments, hangs, hooks."""

from __future__ import annotations

import pytest

import zero_dtensor as zd
from workers import safety


@pytest.mark.parametrize("path", safety.RAW_WRITES)
@pytest.mark.parametrize("stage", [1, 2])
def test_keep_full_grads_raw_writes_reach_step(ranks, stage: int, path: str) -> None:
    ranks(2).run(safety.check_keep_full_raw_writes, stage, path)


@pytest.mark.parametrize("world", [3])
def test_keep_full_grads_raw_writes_offload(ranks, world: int) -> None:
    ranks(world).run(safety.check_keep_full_raw_writes, 2, "param_to_local", True)


@pytest.mark.parametrize("stage,keep_full,bf16_optimizer", [
    (1, True, False), (2, True, False), (1, False, True), (2, False, False), (3, False, False),
], ids=["z1-keep", "z2-keep", "bf16opt", "z2", "z3"])
def test_results_are_snapshots(ranks, stage: int, keep_full: bool, bf16_optimizer: bool) -> None:
    ranks(2).run(safety.check_results_are_snapshots, stage, keep_full, bf16_optimizer)


@pytest.mark.parametrize("stage,bf16_optimizer", [(1, False), (2, False), (3, False), (1, True)],
                         ids=["z1", "z2", "z3", "bf16opt"])
def test_writes_record_no_history(ranks, stage: int, bf16_optimizer: bool) -> None:
    ranks(2).run(safety.check_writes_record_no_history, stage, bf16_optimizer)


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


@pytest.mark.parametrize("stage,bf16_optimizer", [(1, False), (2, False), (3, False), (1, True)],
                         ids=["z1", "z2", "z3", "bf16opt"])
def test_failed_hook_discards_gradients(ranks, stage: int, bf16_optimizer: bool) -> None:
    ranks(2).run(safety.check_failed_hook_discards, stage, bf16_optimizer)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unmanaged_failed_hook_discards_gradients(ranks, stage: int) -> None:
    ranks(2).run(safety.check_unmanaged_failed_hook_discards, stage)


@pytest.mark.parametrize("stage,bf16_optimizer", [(2, False), (3, False), (1, True)], ids=["z2", "z3", "bf16opt"])
def test_fuzz_set_full_and_full_tensors_arguments(ranks, stage: int, bf16_optimizer: bool) -> None:
    outcomes = ranks(2).run(safety.fuzz_arguments, stage, bf16_optimizer, 40)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0]["errors"] > 10 and outcomes[0]["writes"] > 5 and outcomes[0]["reads"] > 5, outcomes[0]
