"""The multi-rank harness reports failures with each rank's traceback and turns hangs into failures."""

from __future__ import annotations

import pytest

from workers import harness
from zero_dtensor.launch import RankFailure, RankPool


def test_results_in_rank_order(ranks) -> None:
    assert ranks(3).run(harness.rank_and_sum) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_failure_and_hang_are_reported_and_pool_recovers(ranks) -> None:
    """On the session's 2-rank pool: each failure restarts it, and the last restart is the pool the next tests use
    (a pool of its own would cost one more start). Rank 0 waits in its collective without limit, so a 2 s timeout
    tells the hang as surely as a longer one."""
    pool = ranks(2)
    before = pool.run(harness.pid)
    with pytest.raises(RankFailure) as failure:
        pool.run(harness.fail_on_last_rank)
    assert "deliberate failure on the last rank" in failure.value.tracebacks[1]
    assert 0 not in failure.value.tracebacks  # rank 0 finished normally
    with pytest.raises(RankFailure) as hang:
        pool.run(harness.hang_on_rank_zero, timeout=2.0)
    assert "no answer in time" in hang.value.tracebacks[0]
    assert pool.run(harness.rank_and_sum) == [(0, 1.0), (1, 1.0)]  # restarted
    with pytest.raises(RankFailure) as unpicklable:  # reported at once, not after a timeout
        pool.run(harness.unpicklable_result, timeout=60.0)
    assert "pickle" in unpicklable.value.tracebacks[0]
    assert pool.run(harness.pid) != before


def test_a_start_stuck_on_a_stale_build_lock_is_reported(tmp_path, monkeypatch) -> None:
    """A rank stuck at start (here: DeepSpeed's comm op build waiting on the lock file a killed build left behind,
    as torch waits, without limit) fails the start after ``start_timeout``, naming the lock and what to do, instead
    of a pool that looks started whose next calls wait out their own timeout (or, once the late ranks answer, fail
    with a ``TypeError``)."""
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the spawned rank inherits it
    with pytest.raises(RankFailure, match="1 of 1 ranks failed to start") as failure:
        RankPool(1, start_timeout=6.0)
    message = failure.value.tracebacks[0]
    assert "no answer at start within 6 s" in message and str(lock) in message and "Delete it" in message
    assert lock.exists()  # reported, not removed: a build may be running
