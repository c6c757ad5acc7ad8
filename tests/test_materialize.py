"""Issue 5: bulk and streaming materialization (full_tensors options, iter_full) against the default path."""

from __future__ import annotations

import pytest

from workers import materialize
from workers.common import EngineCase
from workers.rows import RowResults, assert_row, slug

CASES = [EngineCase(stage, dtype, world=ws) for ws in (2, 3) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]
# a data-parallel group of one rank: every strategy still returns the gradients (all_to_all: a local copy)
SINGLE_RANK_CASES = [EngineCase(stage, world=1) for stage in (1, 3)]
# weights / biases in two optimizer param groups, nothing frozen, 4 ranks
TWO_GROUP_CASES = [EngineCase(stage, world=4, groups=2, frozen=False) for stage in (1, 2, 3)]
_RESULTS = RowResults()


def _row_tests(cases: list[EngineCase]) -> list:
    """One test per (case, option); one worker call per case runs every row (tests/workers/rows.py)."""
    return [pytest.param(case, row, id=f"{case.id}-{slug(row)}") for case in cases for row in materialize.OPTION_ROWS]


def _check_counts(results: list[dict], row: str) -> None:
    """The data collectives of one call: one per transfer (send_recv: one batch of point-to-point ops); all_to_all
    (no coalesced form) one per sharded group."""
    for strategy in materialize.GATHER_STRATEGIES:
        if row == f"{strategy} strategy=":
            want = results[0]["sharded_groups"] if strategy == "all_to_all" else 1
            assert results[0][f"count_{strategy}"] == want


@pytest.mark.parametrize("case,row", _row_tests(CASES))
def test_full_tensors_options_match_default(ranks, case: EngineCase, row: str) -> None:
    results = _RESULTS.get(ranks, case.world, materialize.check_options, case)
    assert_row(results, row)
    _check_counts(results, row)


@pytest.mark.parametrize("case,row", _row_tests(SINGLE_RANK_CASES))
def test_full_tensors_options_on_one_rank(ranks, case: EngineCase, row: str) -> None:
    results = _RESULTS.get(ranks, case.world, materialize.check_options, case)
    assert_row(results, row)


@pytest.mark.parametrize("case,row", _row_tests(TWO_GROUP_CASES))
def test_two_param_groups_travel_in_one_collective(ranks, case: EngineCase, row: str) -> None:
    results = _RESULTS.get(ranks, case.world, materialize.check_options, case)
    assert results[0]["groups"] == 2
    assert_row(results, row)
    _check_counts(results, row)


PIPELINED_CASES = [EngineCase(3), EngineCase(3, "bf16", world=3), EngineCase(3, world=4, groups=2, frozen=False)]


@pytest.mark.parametrize("case,row", [pytest.param(case, row, id=f"{case.id}-{slug(row)}")
                                      for case in PIPELINED_CASES for row in materialize.PIPELINED_ROWS])
def test_pipelined_zero3_gather_matches_one_collective(ranks, case: EngineCase, row: str) -> None:
    """ZeRO-3 all_gathers of PIPELINE_MIN_BYTES or more travel as two collectives, the first part reordered while
    the second travels (forced here for small models): every option, bit for bit, two data collectives."""
    results = _RESULTS.get(ranks, case.world, materialize.check_pipelined, case)
    assert_row(results, row)
    if row == "pipelined matches DeepSpeed":
        assert results[0]["count_pipelined"] == 2


@pytest.mark.parametrize("case", [EngineCase(1), EngineCase(2, "bf16", world=3), EngineCase(3, world=4),
                                  EngineCase(3, "bf16", world=3), EngineCase(2, world=4)], ids=lambda c: c.id)
def test_iter_full_streams_within_budget(ranks, case: EngineCase) -> None:
    report = ranks(case.world).run(materialize.check_streaming, case)[0]
    for strategy in materialize.GATHER_STRATEGIES:
        r = report[strategy]
        assert r["buckets"] > 3  # the 512-element bucket really splits the model
        assert r["peak"] <= r["budget"]
        if not r["oversized"]:
            assert r["budget"] == r["bucket_bytes"]
    assert report["all_reduce"]["budget"] < report["all_reduce"]["full"]


@pytest.mark.parametrize("stage,pipelined", [(2, False), (3, False), (3, True)])
def test_fp16_results_are_unscaled_for_every_option(ranks, stage: int, pipelined: bool) -> None:
    ranks(2).run(materialize.check_fp16, stage, pipelined)


@pytest.mark.parametrize("stage,pipelined,groups", [(2, False, 1), (3, False, 1), (3, True, 1), (2, False, 2),
                                                   (3, False, 2)])
def test_auto_calibrates_once_and_agrees_across_ranks(ranks, stage: int, pipelined: bool, groups: int) -> None:
    """A transfer of one flat group may pick all_to_all; one of two never does (one collective per transfer);
    send_recv (one batch per transfer) is a candidate for both."""
    results = ranks(2).run(materialize.check_calibration, stage, pipelined, groups)
    decisions = [r["decisions"] for r in results]
    candidates = (("all_gather", "all_to_all", "all_reduce", "send_recv") if groups == 1
                  else ("all_gather", "all_reduce", "send_recv"))
    assert len(decisions[0]) == 1 and decisions[0][0] in candidates
    assert all(d == decisions[0] for d in decisions)
    assert all(r["reorders"] == [stage == 3] for r in results)
    assert all(r["pipelines"] == [pipelined] for r in results)


def test_bad_arguments_raise_before_any_collective(ranks) -> None:
    ranks(2).run(materialize.check_errors)


@pytest.mark.parametrize("case", [EngineCase(3, "bf16", world=3, groups=2, frozen=False, model="deep")],
                         ids=lambda c: c.id)
def test_zero3_gathers_in_bounded_windows(ranks, case: EngineCase) -> None:
    """Issue 44: a ZeRO-3 gather larger than WINDOW_BYTES (forced small here) travels in column windows, each
    reordered into the result as it arrives: the pool allocates the result plus at most one window (today's code
    allocates a staging twin of the result), no single allocation exceeds the result and the local writes are the
    one reorder (plus this rank's own row for send_recv), as cudaops' DispatchProbe counts them; one collective per
    window, values bit for bit, for every gather strategy, async, out= and dtype; the gradients (bf16, two param
    groups in one transfer) and the fp32 masters."""
    reports = ranks(case.world).run(materialize.check_windowed, case)
    assert all(r[family]["all_gather"]["collectives"] > 1 for r in reports for family in ("grads", "masters"))


@pytest.mark.parametrize("case", [EngineCase(2, "fp32", model="deep"), EngineCase(3, "fp32", model="deep")],
                         ids=lambda c: c.id)
def test_async_gather_completes_when_polled(ranks, case: EngineCase) -> None:
    """Issue 51 item 4: polling ``is_completed()`` of ``full_tensors(async_op=True)`` terminates without ``wait()``,
    over the window threshold (forced small) too, for every gather strategy, gradients and fp32 masters, with
    DeepSpeed's values; ``wait()`` then communicates nothing. (Before: only ``wait()`` issued the later windows, and
    the poll loop spun until its deadline.)"""
    reports = ranks(case.world).run(materialize.check_async_polled, case)
    if case.stage == 3:  # the windowed path ran: several windows per call
        assert all(r[k]["windows"] > 1 for r in reports for k in r), reports


def test_set_full_writes_each_byte_once(ranks) -> None:
    """Issue 42 item 2 / issue 44: set_full_ of gradients and fp32 masters on ZeRO-1/2/3 writes each byte of the
    partitions at most once; the per-parameter path writes nothing else and allocates nothing (DispatchProbe).
    Measured: 6600 B (ZeRO-1/2) / 6664 B (ZeRO-3) held per rank, written once, by one op, no allocation: one
    ``torch.cat(..., out=)`` into the run of the partition the fragments form (on CUDA one vectorized kernel instead
    of ``_foreach_copy_``'s launch per 320 chunks); a non-contiguous value, or a value that is a live view of the
    partition, falls back to one ``_foreach_copy_`` with the same result."""
    reports = ranks(2).run(materialize.check_set_full_copies)
    assert all(len(r) == 18 for r in reports), reports
