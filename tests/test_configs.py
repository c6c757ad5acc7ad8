"""Issue 3: every DeepSpeed configuration gives the true gradient (single-process fp32 reference) or a clear error.

The matrix is a covering subset of stages {1,2,3} x {fp32,bf16,fp16} x accumulation {1,2} x offload {none,cpu} x
world {2,3,4} x {one group, two groups with frozen parameters}: every stage appears with every dtype, and every other
axis value appears with every stage. Each case also checks the mid-accumulation answer (ZeRO-3 without offload:
the reduced partial sums; otherwise GradientsNotReadyError), DeepSpeed's own safe_get_full_grad where it is right,
and StaleGradientsError / GradientsNotReadyError after engine.step().
"""

from __future__ import annotations

import pytest

from workers import configs

# (world, stage, dtype, gas, offload, groups)
MATRIX = [
    (2, 1, "fp32", 1, False, 1),
    (3, 1, "bf16", 2, True, 2),
    (4, 1, "fp16", 2, False, 2),
    (2, 1, "fp16", 1, True, 1),
    (2, 2, "fp32", 2, True, 2),
    (4, 2, "bf16", 1, False, 2),
    (3, 2, "fp16", 1, True, 1),
    (2, 2, "bf16", 2, False, 1),
    (3, 3, "fp32", 2, False, 2),
    (2, 3, "bf16", 1, True, 1),
    (4, 3, "fp16", 2, True, 2),
    (2, 3, "fp16", 2, False, 1),
    (4, 3, "fp32", 1, True, 1),
]


def _id(case: tuple) -> str:
    world, stage, dtype, gas, offload, groups = case
    return f"ws{world}-z{stage}-{dtype}-gas{gas}-{'offload' if offload else 'dev'}-{groups}g"


@pytest.mark.parametrize("case", MATRIX, ids=[_id(c) for c in MATRIX])
def test_matrix_matches_reference(ranks, case: tuple) -> None:
    world, stage, dtype, gas, offload, groups = case
    result = ranks(world).run(configs.run_case, stage, dtype, gas=gas, offload=offload, groups=groups)
    assert result[0]["groups"] == groups
    assert result[0]["params"] == (8 if groups == 1 else 6)


# ZeRO options that change DeepSpeed's flat layout or reduction path (world 2)
OPTIONS = [
    (1, "fp32", {"round_robin_gradients": True}),
    (2, "fp32", {"round_robin_gradients": True}),
    (2, "bf16", {"round_robin_gradients": True, "parameter_alignment": True}),
    (1, "fp32", {"parameter_alignment": True}),
    (2, "fp16", {"reduce_bucket_size": 100}),
    (1, "bf16", {"reduce_bucket_size": 100, "overlap_comm": True}),
    (2, "fp32", {"overlap_comm": True}),
    (1, "fp32", {"contiguous_gradients": False}),
    (2, "fp32", {"contiguous_gradients": False, "reduce_scatter": False}),
    (3, "fp32", {"reduce_bucket_size": 100, "reduce_scatter": False}),
]


@pytest.mark.parametrize("stage,dtype,zero", OPTIONS, ids=[f"z{s}-{d}-{'-'.join(z)}" for s, d, z in OPTIONS])
def test_zero_options_match_reference(ranks, stage: int, dtype: str, zero: dict) -> None:
    ranks(2).run(configs.run_case, stage, dtype, gas=2, **zero)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tied_parameter_appears_once(ranks, stage: int) -> None:
    result = ranks(2).run(configs.run_case, stage, "fp32", model="tied")
    assert result[0]["params"] == 7  # fc1 (2), mid (2, weight shared with mid2), mid2.bias, fc3 (2)


@pytest.mark.parametrize("gas", [1, 2])
def test_bf16_optimizer_is_replicated_and_writable(ranks, gas: int) -> None:
    ranks(2).run(configs.check_bf16_optimizer, gas)


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_is_reported(ranks, stage: int) -> None:
    ranks(2).run(configs.check_fp16_overflow, stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_writes_are_rescaled(ranks, stage: int) -> None:
    ranks(2).run(configs.check_fp16_writes_rescaled, stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_clip_norm_sees_written_values(ranks, stage: int) -> None:
    result = ranks(2).run(configs.check_offload_norm_after_write, stage)[0]
    assert abs(result[True] - result[False]) <= 1e-5 * result[False]


@pytest.mark.parametrize("stage,dtype,gas", [(1, "fp32", 1), (2, "bf16", 2), (3, "fp32", 2)])
def test_data_parallel_group_smaller_than_world(ranks, stage: int, dtype: str, gas: int) -> None:
    """4 ranks as 2 (DP, via deepspeed.initialize(mpu=...)) x 2: meshes and averages follow DeepSpeed's DP group."""
    results = ranks(4).run(configs.check_sub_world_dp, stage, dtype, gas)
    assert [r["dp_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_zero3_hpz_reads_true_gradient(ranks) -> None:
    """hpZ (zero_hpz_partition_size 2 of 4) only adds a secondary parameter copy; gradients stay DP-partitioned."""
    ranks(4).run(configs.check_hpz)
