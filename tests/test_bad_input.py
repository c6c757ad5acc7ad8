"""Issue 3: bad input is refused with a clear error before anything is written; disagreeing ranks raise, not hang."""

from __future__ import annotations

import pytest

from workers import bad_input
from workers.common import EngineCase
from workers.rows import RowResults, assert_row, slug

WRITE_CASES = [
    EngineCase(1, "fp32"),
    EngineCase(2, "fp16"),
    EngineCase(3, "fp32"),
    EngineCase(2, "fp32", offload=True),
    EngineCase(3, "bf16", offload=True),
    EngineCase(1, "bf16", bf16_optimizer=True),
    # parameters small enough to be staged: the values of parameters a rank holds nothing of are checked, not read
    EngineCase(1, "fp32", model="wide"),
    EngineCase(2, "bf16", model="wide", world=3),
    # ZeRO-3, small parameters: every value is staged (every rank holds a chunk of each), so a repeated request keeps
    # no per-value record and is checked by the ordinary passes and the staging itself
    EngineCase(3, "fp32", model="wide"),
]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_bad_writes_change_nothing(ranks, case: EngineCase) -> None:
    assert ranks(case.world).run(bad_input.bad_writes, case)[0] == 8 + 8


@pytest.mark.parametrize("stage,debug_mode", [(2, False), (3, True)])
def test_disagreeing_ranks_raise(ranks, stage: int, debug_mode: bool) -> None:
    messages = ranks(2).run(bad_input.disagreeing_collectives, stage, debug_mode)
    assert "rank 0" in messages[0][0] and "rank 1" in messages[0][0]


REFUSAL_CASES = [EngineCase(1, world=3), EngineCase(2), EngineCase(3), EngineCase(3, "bf16", world=3),
                 EngineCase(1, "bf16", bf16_optimizer=True)]
REFUSAL_TESTS = [pytest.param(case, row, id=f"{case.id}-{slug(row)}")
                 for case in REFUSAL_CASES for row in bad_input.REFUSAL_ROWS]
_REFUSAL_RESULTS = RowResults()


@pytest.mark.parametrize("case,row", REFUSAL_TESTS)
def test_one_rank_refusing_raises_on_every_rank(ranks, case: EngineCase, row: str) -> None:
    """A bad argument on one rank (the last) makes every rank raise at the rank-agreement check, before any rank
    communicates or writes: no hang, no half-applied call, and the next call lines up (replicated engines: the calls
    that communicate nothing raise on that rank alone)."""
    # a rank left waiting would hang: the check takes seconds, so a regression fails after two minutes, not ten
    assert_row(_REFUSAL_RESULTS.get(ranks, case.world, bad_input.one_rank_refusals, case, timeout=120.0), row)
