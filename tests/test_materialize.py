"""Issue 5: bulk and streaming materialization (full_tensors options, iter_full) against the default path."""

from __future__ import annotations

import pytest

from workers import materialize

CASES = [(ws, stage, dtype) for ws in (2, 3) for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]


@pytest.mark.parametrize("world_size,stage,dtype", CASES)
def test_full_tensors_options_match_default(ranks, world_size: int, stage: int, dtype: str) -> None:
    results = ranks(world_size).run(materialize.check_options, stage, dtype)
    assert results[0]["count_all_gather"] == results[0]["count_all_reduce"] == 1


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_two_param_groups_travel_in_one_collective(ranks, stage: int) -> None:
    results = ranks(4).run(materialize.check_options, stage, "fp32", True)
    assert results[0]["groups"] == 2
    assert results[0]["count_all_gather"] == results[0]["count_all_reduce"] == 1


@pytest.mark.parametrize("world_size,stage,dtype", [(2, 1, "fp32"), (3, 2, "bf16"), (4, 3, "fp32"), (3, 3, "bf16"),
                                                    (4, 2, "fp32")])
def test_iter_full_streams_within_budget(ranks, world_size: int, stage: int, dtype: str) -> None:
    report = ranks(world_size).run(materialize.check_streaming, stage, dtype)[0]
    for strategy in ("all_gather", "all_reduce"):
        r = report[strategy]
        assert r["buckets"] > 3  # the 512-element bucket really splits the model
        assert r["peak"] <= r["budget"]
        if not r["oversized"]:
            assert r["budget"] == r["bucket_bytes"]
    assert report["all_reduce"]["budget"] < report["all_reduce"]["full"]


@pytest.mark.parametrize("stage", (2, 3))
def test_fp16_results_are_unscaled_for_every_option(ranks, stage: int) -> None:
    ranks(2).run(materialize.check_fp16, stage)


def test_auto_calibrates_once_and_agrees_across_ranks(ranks) -> None:
    results = ranks(2).run(materialize.check_calibration)
    decisions = [r["decisions"] for r in results]
    assert len(decisions[0]) == 1 and decisions[0][0] in ("all_gather", "all_reduce")
    assert all(d == decisions[0] for d in decisions)


def test_bad_arguments_raise_before_any_collective(ranks) -> None:
    ranks(2).run(materialize.check_errors)
