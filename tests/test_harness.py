"""The multi-rank harness reports failures with each rank's traceback and turns hangs into failures."""

from __future__ import annotations

import pytest

from workers import harness
from zero_dtensor.launch import RankFailure, RankPool


def test_results_in_rank_order(ranks) -> None:
    assert ranks(3).run(harness.rank_and_sum) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_failure_and_hang_are_reported_and_pool_recovers() -> None:
    with RankPool(2, grace_s=2.0) as pool:
        before = pool.run(harness.pid)
        with pytest.raises(RankFailure) as failure:
            pool.run(harness.fail_on_last_rank)
        assert "deliberate failure on the last rank" in failure.value.tracebacks[1]
        assert 0 not in failure.value.tracebacks  # rank 0 finished normally
        with pytest.raises(RankFailure) as hang:
            pool.run(harness.hang_on_rank_zero, timeout=5.0)
        assert "no answer in time" in hang.value.tracebacks[0]
        assert pool.run(harness.rank_and_sum) == [(0, 1.0), (1, 1.0)]  # restarted
        with pytest.raises(RankFailure) as unpicklable:  # reported at once, not after a timeout
            pool.run(harness.unpicklable_result, timeout=60.0)
        assert "pickle" in unpicklable.value.tracebacks[0]
        assert pool.run(harness.pid) != before
