"""Issue 3: opt-in Replicate gradients for ZeRO-1/2 (keep_full_grads): true values, zero collectives, writes stick."""

from __future__ import annotations

import pytest

from workers import replicate

CASES = [
    # (world, stage, dtype, gas, offload, groups, zero options)
    (2, 1, "fp32", 1, False, 1, {}),
    (2, 2, "fp32", 2, False, 1, {}),
    (3, 2, "bf16", 1, True, 2, {}),
    (2, 1, "fp16", 2, False, 1, {"reduce_bucket_size": 100}),
    (2, 2, "fp32", 1, False, 2, {"reduce_scatter": False}),
    (3, 1, "bf16", 2, True, 1, {"overlap_comm": True}),
    (2, 2, "fp16", 2, False, 1, {"round_robin_gradients": True}),
    (4, 1, "fp32", 1, False, 2, {"parameter_alignment": True}),
    (2, 2, "bf16", 2, True, 1, {}),  # stage-2 offload sums micro-steps in bf16: kept values must round the same
    (2, 2, "fp16", 3, True, 1, {"reduce_scatter": False}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ws{c[0]}-z{c[1]}-{c[2]}-gas{c[3]}"
                         f"{'-offload' if c[4] else ''}-{c[5]}g{''.join('-' + k for k in c[6])}")
def test_keep_full_grads(ranks, case: tuple) -> None:
    world, stage, dtype, gas, offload, groups, zero = case
    result = ranks(world).run(replicate.check_keep, stage, dtype, gas=gas, offload=offload, groups=groups, **zero)
    assert result[0]["nbytes"] > 0


def test_unsuitable_configs_are_refused_by_key(ranks) -> None:
    messages = ranks(2).run(replicate.check_refusals)[0]
    assert len(messages) == 3


@pytest.mark.parametrize("gas", [1, 2])
def test_enabled_after_backward_falls_back_to_shards(ranks, gas: int) -> None:
    ranks(2).run(replicate.check_late_enable, gas)


@pytest.mark.parametrize("stage,dtype,zero", [(1, "fp32", {}), (2, "bf16", {"reduce_scatter": False})])
def test_keep_full_grads_reads(ranks, stage: int, dtype: str, zero: dict) -> None:
    """Reads only: also part of the DeepSpeed 0.18.9 CI pass."""
    ranks(2).run(replicate.check_keep_reads, stage, dtype, **zero)
