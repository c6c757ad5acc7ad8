"""Issue 11: per-parameter views are made once per kept buffer and reused, never over memory still in use."""

from __future__ import annotations

import pytest

from workers import view_reuse
from workers.common import EngineCase

CASES = [EngineCase(1), EngineCase(2), EngineCase(3), EngineCase(2, "bf16"), EngineCase(2, offload=True),
         EngineCase(1, "bf16", bf16_optimizer=True), EngineCase(3, world=3)]


#: ZeRO-2 with separate gradient tensors (no grads_in_partition): the pieces are copied into a kept flat partition
#: every step (the other ZeRO-1/2 cases are used in place from the second step on)
SEPARATE_PIECES = EngineCase(2, zero={"contiguous_gradients": False})


@pytest.mark.parametrize("case", [*CASES, SEPARATE_PIECES], ids=lambda c: c.id)
def test_partition_memory_reused_only_when_free(ranks, case: EngineCase) -> None:
    results = ranks(case.world).run(view_reuse.check_partition_reuse, case)
    # a partition used in place is DeepSpeed's own memory (a new buffer every backward): nothing of ours to reuse
    assert all(r["reused"] or all(f["in_place"] for f in r["firsts"][1:]) for r in results)
    if case is SEPARATE_PIECES:
        # rank 1's partition spans several parameters (rank 0's is part of the first one, a view used in place)
        assert not any(f["in_place"] for f in results[1]["firsts"]) and results[1]["reused"], results[1]
    # issue 42: the first sharded_grads of a step allocates nothing once its flat partition exists (steps 1 and 3:
    # step 2 follows a step whose views the caller still holds, the one case for a second flat partition); a
    # partition used in place costs no operation, write or allocation at all
    for rank, r in enumerate(results):
        for step, first in enumerate(r["firsts"]):
            if step in (1, 3):
                assert first["allocated"] == 0, (rank, step, first)
            if first["in_place"]:
                assert first["ops"] == first["written"] == first["allocated"] == 0, (rank, step, first)
    # ZeRO-1 stores the partition's pieces in flat order in one buffer (grads_in_partition): a rank whose partition
    # has no zero padding of its own (rank 0 here) reads them in place, every step, not as a copy
    if case.stage == 1 and not case.offload and not case.bf16_optimizer:
        assert all(f["in_place"] for f in results[0]["firsts"]), results[0]["firsts"]
    # from the backward after the first sharded_grads on, ZeRO-1/2 lay that buffer in flat order with each group's
    # zero padding after its pieces (grad_order): every rank, ZeRO-2 (pieces that arrive out of order) and a last
    # rank's padding included, reads its partition in place
    if case.stage in (1, 2) and not case.offload and not case.bf16_optimizer and case is not SEPARATE_PIECES:
        for rank, r in enumerate(results):
            assert all(f["in_place"] for f in r["firsts"][1:]), (rank, r["firsts"])


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.id)
def test_result_views_reused_only_when_free(ranks, case: EngineCase) -> None:
    ranks(case.world).run(view_reuse.check_result_views_reused, case)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.id)
def test_late_freed_result_does_not_displace_the_dropped_one(ranks, case: EngineCase) -> None:
    ranks(case.world).run(view_reuse.check_late_freed_result_not_preferred, case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_storage_held_by_the_caller_is_never_reused(ranks, case: EngineCase) -> None:
    ranks(case.world).run(view_reuse.check_held_storage_not_reused, case)


@pytest.mark.parametrize("max_classes", [0, 16], ids=["per-param-views", "row-copy"])
@pytest.mark.parametrize("case", [EngineCase(1, model="wide"), EngineCase(2, model="wide"), EngineCase(3, model="wide"),
                                  EngineCase(2, "fp16", model="wide"), EngineCase(3, "fp16", world=3, model="wide"),
                                  EngineCase(2, "bf16", world=3, model="wide")], ids=lambda c: c.id)
def test_write_paths_agree(ranks, case: EngineCase, max_classes: int) -> None:
    staged = [r["staged"] for r in ranks(case.world).run(view_reuse.check_write_paths, case, max_classes)]
    # a rank whose fragments form one long run writes it directly (rows.LONG_RUN); the small wide model stages
    assert any(staged) if max_classes else not any(staged), staged


@pytest.mark.parametrize("case", [EngineCase(3, model="wide"), EngineCase(3, "bf16", world=3, model="wide")],
                         ids=lambda c: c.id)
def test_zero3_row_reorder_matches_deepspeed(ranks, case: EngineCase) -> None:
    results = ranks(case.world).run(view_reuse.check_row_reorder, case)
    assert all(r["rows"] for r in results), "the wide model must take the row paths"
    assert all(r["peer_rows"] for r in results), "the wide model must take the all_to_all and send_recv row paths"


@pytest.mark.parametrize("case", [EngineCase(1), EngineCase(1, "bf16"), EngineCase(2, world=3)], ids=lambda c: c.id)
def test_replaced_pieces_are_freed_by_the_step(ranks, case: EngineCase) -> None:
    ranks(case.world).run(view_reuse.check_replaced_pieces_freed_by_the_step, case)


@pytest.mark.parametrize("case", [EngineCase(2, gas=2, zero={"round_robin_gradients": True}),
                                  EngineCase(2, "fp16", world=3, zero={"overlap_comm": True})], ids=lambda c: c.id)
def test_flat_order_buffer_trains_like_deepspeed_alone(ranks, case: EngineCase) -> None:
    """Four steps read through zero_dtensor give bitwise the parameters of a twin that DeepSpeed trains alone,
    while every rank (a last rank's zero padding included) reads its partition in place from the second step."""
    for rank, in_place in enumerate(ranks(case.world).run(view_reuse.check_ordered_buffer_trains_alike, case)):
        assert in_place[1:] == [True, True, True], (rank, in_place)


@pytest.mark.parametrize("case", [EngineCase(2, "bf16"), EngineCase(3, "bf16")], ids=lambda c: c.id)
def test_an_empty_result_keeps_its_dtype(ranks, case: EngineCase) -> None:
    """A kept empty buffer of one dtype is never taken for another's (both have address 0): the last rank, which
    holds none of the two one-row parameters, reads its gradients' empty shards in their own dtype, after the fp32
    masters left an empty buffer in the pool; the values match ``full_tensors()``."""
    local = ranks(case.world).run(view_reuse.check_empty_results_keep_their_dtype, case)
    assert all(n == 0 for n in local[-1].values()), local  # the case the test is for: the last rank holds none
