"""Issue 26: one agreement between ranks. A setting that differs between ranks raises on every rank before any data
moves (no wrong value, no hang, no abort); the redistribution calls' rough edges; one agreement per call."""

from __future__ import annotations

import pytest

from workers import agreement
from workers.common import EngineCase
from workers.rows import RowResults, assert_row, slug

# 4 ranks: the agreement is an all_reduce there (zero_dtensor.comm.collectives.prefers_all_reduce), a gather below
SETTING_CASES = [EngineCase(2), EngineCase(3), EngineCase(1, "bf16", world=3), EngineCase(3, "bf16", world=3),
                 EngineCase(2, world=4)]
_SETTING_RESULTS = RowResults()


@pytest.mark.parametrize("case,row", [pytest.param(c, r, id=f"{c.id}-{slug(r)}")
                                      for c in SETTING_CASES for r in agreement.SETTING_ROWS])
def test_setting_on_one_rank_raises_on_every_rank(ranks, case: EngineCase, row: str) -> None:
    # a regression would hang: the rows take seconds, so fail after two minutes rather than ten
    assert_row(_SETTING_RESULTS.get(ranks, case.world, agreement.mismatched_settings, case, timeout=120.0), row)


EDGE_CASES = [EngineCase(1), EngineCase(2, "bf16"), EngineCase(3, world=3), EngineCase(3, world=4)]
_EDGE_RESULTS = RowResults()


@pytest.mark.parametrize("case,row", [pytest.param(c, r, id=f"{c.id}-{slug(r)}")
                                      for c in EDGE_CASES for r in agreement.EDGE_ROWS])
def test_redistribution_rough_edges(ranks, case: EngineCase, row: str) -> None:
    assert_row(_EDGE_RESULTS.get(ranks, case.world, agreement.rough_edges, case, timeout=120.0), row)
