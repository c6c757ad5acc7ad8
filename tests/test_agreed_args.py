"""Issue 51, items 1 and 5: the clip bounds are agreed (one rank's ``max_norm`` one ulp apart, or
``error_if_nonfinite`` on one rank, raises on every rank and writes nothing), and ``set_full_`` writes a value that
is a view of the family's own partition on every rank (no rank raising alone). 2 ranks, ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import pytest

from workers import agreed_args
from workers.common import EngineCase
from workers.rows import RowResults, assert_row, slug

CASES = [EngineCase(2), EngineCase(3)]
_RESULTS = RowResults()


@pytest.mark.parametrize("case,row", [pytest.param(c, r, id=f"{c.id}-{slug(r)}")
                                      for c in CASES for r in agreed_args.ROWS])
def test_agreed_arguments(ranks, case: EngineCase, row: str) -> None:
    # a regression would leave one rank raising alone: the rows exchange outcomes instead of hanging; 2 minutes
    assert_row(_RESULTS.get(ranks, case.world, agreed_args.agreed_args, case, timeout=120.0), row)
