"""Issue 2: the gradient map equals DeepSpeed's own get/set, at world sizes 1-4, stages 1-3, fp32 and bf16."""

from __future__ import annotations

import pytest

from workers import foundation

CASES = [(ws, stage, dtype) for ws in (1, 2, 3, 4) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]


@pytest.mark.parametrize("world_size,stage,dtype", CASES)
def test_reads_match_deepspeed(ranks, world_size: int, stage: int, dtype: str) -> None:
    results = ranks(world_size).run(foundation.check_reads, stage, dtype)
    assert results[0] == {"groups": 1, "params": 8}


@pytest.mark.parametrize("world_size,stage,dtype", CASES)
def test_set_then_step_matches_deepspeed(ranks, world_size: int, stage: int, dtype: str) -> None:
    skipped = ranks(world_size).run(foundation.check_writes, stage, dtype)[0]
    if skipped:
        pytest.skip(skipped)
