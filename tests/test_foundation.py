"""Issue 2: the gradient map equals DeepSpeed's own get/set, at world sizes 1-4, stages 1-3, fp32 and bf16."""

from __future__ import annotations

import pytest

from workers import foundation
from workers.common import EngineCase

CASES = [EngineCase(stage, dtype, world=ws)
         for ws in (1, 2, 3, 4) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reads_match_deepspeed(ranks, case: EngineCase) -> None:
    results = ranks(case.world).run(foundation.check_reads, case)
    assert results[0] == {"groups": 1, "params": 8}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_set_then_step_matches_deepspeed(ranks, case: EngineCase) -> None:
    skipped = ranks(case.world).run(foundation.check_writes, case)[0]
    if skipped:
        pytest.skip(skipped)
