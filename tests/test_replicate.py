"""Issue 3: opt-in Replicate gradients for ZeRO-1/2 (keep_full_grads): true values, zero collectives, writes stick."""

from __future__ import annotations

import pytest

from workers import replicate
from workers.common import EngineCase

CASES = [
    EngineCase(1, "fp32", world=2, gas=1),
    EngineCase(2, "fp32", world=2, gas=2),
    EngineCase(2, "bf16", world=3, gas=1, offload=True, groups=2),
    EngineCase(1, "fp16", world=2, gas=2, zero={"reduce_bucket_size": 100}),
    EngineCase(2, "fp32", world=2, gas=1, groups=2, zero={"reduce_scatter": False}),
    EngineCase(1, "bf16", world=3, gas=2, offload=True, zero={"overlap_comm": True}),
    EngineCase(2, "fp16", world=2, gas=2, zero={"round_robin_gradients": True}),
    EngineCase(1, "fp32", world=4, gas=1, groups=2, zero={"parameter_alignment": True}),
    # stage-2 offload sums micro-steps in bf16: kept values must round the same
    EngineCase(2, "bf16", world=2, gas=2, offload=True),
    EngineCase(2, "fp16", world=2, gas=3, offload=True, zero={"reduce_scatter": False}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_keep_full_grads(ranks, case: EngineCase) -> None:
    result = ranks(case.world).run(replicate.check_keep, case)
    assert result[0]["nbytes"] > 0


def test_unsuitable_configs_are_refused_by_key(ranks) -> None:
    messages = ranks(2).run(replicate.check_refusals)[0]
    assert len(messages) == 3


@pytest.mark.parametrize("gas", [1, 2])
def test_enabled_after_backward_falls_back_to_shards(ranks, gas: int) -> None:
    ranks(2).run(replicate.check_late_enable, gas)


@pytest.mark.parametrize("case", [EngineCase(1, "fp32"), EngineCase(2, "bf16", zero={"reduce_scatter": False})],
                         ids=lambda c: c.id)
def test_keep_full_grads_reads(ranks, case: EngineCase) -> None:
    """Reads only: also part of the DeepSpeed 0.18.9 CI pass."""
    ranks(case.world).run(replicate.check_keep_reads, case)
