"""Elastic DCP checkpoints of DeepSpeed engines (``zero_dtensor.checkpoint``): save at (N ranks, ZeRO stage s), load
at (M, t); FSDP2 interop both ways; training continued after save + load equals an uninterrupted run; refusals
change nothing. Engine builds dominate the cost: each worker call builds several engines and runs several checks.

The saves run once per module (``saved``); the loads compare with the values the saves recorded, bit for bit.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from workers import checkpoint as ck
from workers.common import EngineCase
from zero_dtensor.comm.collectives import GLOO_REDUCE_FROM

SAVES_2 = [
    ("z2-fp32", EngineCase(stage=2), 2),
    ("z1-bf16", EngineCase(stage=1, dtype="bf16"), 2),
    ("z2-offload-async", EngineCase(stage=2, offload=True), 2),
    ("z3-bf16-2g", EngineCase(stage=3, dtype="bf16", groups=2), 2),
    ("z2-fresh", EngineCase(stage=2), 0),
    ("tied-z2-nosync", EngineCase(stage=2, model="tied"), 2),  # mid2.weight is mid.weight
]
SAVES_1 = [("w1-z2-fp16", EngineCase(stage=2, dtype="fp16", world=1), 2)]
SAVES_4 = [
    ("w4-z3-tied-bf16", EngineCase(stage=3, dtype="bf16", model="tied", world=4), 2),
    ("w4-z1-fp16-2g", EngineCase(stage=1, dtype="fp16", groups=2, world=4), 2),
]
LOADS_4 = [
    ("z2-fp32", EngineCase(stage=3, world=4)),  # 2 -> 4
    ("w3-z3-2g", EngineCase(stage=2, groups=2, offload=True, world=4)),  # 3 -> 4
    ("tied-z2-nosync", EngineCase(stage=3, model="tied", world=4)),
    ("w1-z2-fp16", EngineCase(stage=3, dtype="fp16", world=4)),  # 1 -> 4
]
SAVES_3 = [
    ("w3-z3-bf16", EngineCase(stage=3, dtype="bf16", world=3), 2),
    ("w3-z3-2g", EngineCase(stage=3, groups=2, world=3), 2),
]
LOADS_3 = [
    ("z2-fp32", EngineCase(stage=3, world=3)),
    ("z1-bf16", EngineCase(stage=1, dtype="bf16", bf16_optimizer=True, world=3)),
    ("z2-offload-async", EngineCase(stage=3, offload=True, world=3)),
    ("z3-bf16-2g", EngineCase(stage=1, dtype="bf16", groups=2, world=3)),
    ("z2-fresh", EngineCase(stage=2, world=3)),
    ("w4-z1-fp16-2g", EngineCase(stage=3, dtype="fp16", groups=2, world=3)),  # 4 -> 3
]
LOADS_2 = [
    ("z2-fp32", EngineCase(stage=2)),  # same world size and stage
    ("w3-z3-bf16", EngineCase(stage=2, dtype="bf16")),
    ("w3-z3-2g", EngineCase(stage=3, groups=2)),
    ("z1-bf16", EngineCase(stage=3, dtype="bf16", zero={"sub_group_size": 600})),  # 5 sub-groups, 5 steps
    ("w4-z3-tied-bf16", EngineCase(stage=2, dtype="bf16", model="tied")),  # 4 -> 2
]


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("ckpt"))
    ranks(2).run(ck.save_cases, root, SAVES_2)
    ranks(1).run(ck.save_cases, root, SAVES_1)
    ranks(4).run(ck.save_cases, root, SAVES_4)
    ranks(3).run(ck.save_cases, root, SAVES_3)
    ranks(3).run(ck.fsdp_saves, root, "fsdp2")
    ranks(3).run(ck.fsdp_saves, root, "fsdp2-tied", "tied")
    return root


def test_load_at_four_ranks(ranks, saved) -> None:
    ranks(4).run(ck.load_cases, saved, LOADS_4)


def test_tied_parameters(ranks, saved) -> None:
    """A tied weight is saved under both its names, as torch's FSDP2 state dict has it (the optimizer state once,
    under the first name); checkpoints move between DeepSpeed and FSDP2 both ways (cross world size above)."""
    found = ranks(2).run(ck.tied_names, saved, "tied-z2-nosync")[0]
    assert found["checkpoint"] == [
        "model.mid.bias", "model.mid.weight", "model.mid2.bias", "model.mid2.weight",
        "optim.state.mid.bias.exp_avg", "optim.state.mid.bias.exp_avg_sq", "optim.state.mid.bias.step",
        "optim.state.mid.weight.exp_avg", "optim.state.mid.weight.exp_avg_sq", "optim.state.mid.weight.step",
        "optim.state.mid2.bias.exp_avg", "optim.state.mid2.bias.exp_avg_sq", "optim.state.mid2.bias.step"]
    assert found["same value"]  # get_state_dict: both names, one value
    assert not any(k.startswith("state.mid2.weight") for k in found["optim"])
    ranks(3).run(ck.fsdp_loads, saved, "tied-z2-nosync", "tied")  # ZeRO-2 at 2 -> FSDP2 at 3
    ranks(2).run(ck.load_fsdp_checkpoint, saved, "fsdp2-tied", EngineCase(stage=3, dtype="bf16", model="tied"))


def test_load_at_three_ranks_other_stage_and_fsdp2(ranks, saved) -> None:
    ranks(3).run(ck.load_cases, saved, LOADS_3)
    ranks(3).run(ck.fsdp_loads, saved, "z2-fp32")


def test_load_at_two_ranks(ranks, saved) -> None:
    ranks(2).run(ck.load_cases, saved, LOADS_2)
    ranks(2).run(ck.load_fsdp_checkpoint, saved, "fsdp2", EngineCase(stage=2, dtype="bf16"))
    ranks(2).run(ck.fsdp_loads, saved, "w3-z3-bf16")  # ZeRO-3 at 3 ranks -> FSDP2 at 2


@pytest.mark.parametrize("steps", [0, 1], ids=["fresh", "stepped"])
def test_torch_style_get_load_set(ranks, saved, steps) -> None:
    ranks(2).run(ck.load_in_place, saved, "w3-z3-bf16", EngineCase(stage=3, dtype="bf16"), steps)


@pytest.mark.parametrize("case", [
    EngineCase(stage=2, extra={"scheduler": ck.WARMUP["scheduler"]}),
    EngineCase(stage=3, dtype="fp16"),
    EngineCase(stage=1, dtype="bf16", model="tied"),
    EngineCase(stage=3, offload=True, groups=2),
    EngineCase(stage=1, dtype="bf16", bf16_optimizer=True, groups=2),  # read in place into BF16_Optimizer's state
], ids=lambda c: c.id)
def test_training_continues_bit_for_bit(ranks, tmp_path, case) -> None:
    ranks(2).run(ck.continue_equals_uninterrupted, str(tmp_path), case)


def test_refusals_change_nothing(ranks, tmp_path) -> None:
    messages = ranks(2).run(ck.refusals, str(tmp_path))
    for per_rank in messages:  # every rank raised, naming what differs
        assert "fc3.weight" in per_rank["other-model"] and "shape (96, 33)" in per_rank["other-model"]
        assert re.search(r"\.\.\. and \d+ more", per_rank["other-model"])  # long listings are cut
        assert "optimizer state of fc1.weight: [] in the checkpoint" in per_rank["other-optimizer"]  # SGD: none
        assert ".metadata" in per_rank["killed"] and ".metadata" in per_rank["overwrite killed"]
        assert "hyperparameters ['lr'] of fc2.weight differ" in per_rank["mixed-lr"]


def test_state_dict_format(ranks) -> None:
    found = ranks(2).run(ck.state_dict_format, EngineCase(stage=2, groups=2))[0]
    assert "fc1.bias" in found["model"] and "state.fc1.bias.exp_avg" not in found["optim"]  # frozen: weights only
    assert {"state.fc1.weight.exp_avg", "state.fc1.weight.exp_avg_sq", "state.fc1.weight.step",
            "param_groups.fc1.weight.lr", "param_groups.fc1.weight.betas"} <= set(found["optim"])
    assert {"DTensor", "Tensor", "float", "tuple"} <= set(found["kinds"])  # frozen fc1.bias and step: plain tensors


def test_collectives_counted(ranks, tmp_path) -> None:
    """What the docstrings promise, counted with CommDebugMode at 2 ranks on an 8-tensor ZeRO-2 and a 34-tensor
    ZeRO-3 engine: ``get_state_dict`` none; ``set_state_dict`` one agreement + the working weights' refresh;
    ``save`` one agreement (issue 45: its path and ``async_``, before its first collective) and DCP's object
    collectives (no tensor data), as many for either model, and no copy of a piece; ``load`` of a stepped engine
    two agreements (after every rank read and checked what it read, before its engine memory is written; and after
    that) and the refresh, nothing else (each rank plans its own reads: no DCP collective), with no staging buffer;
    of a never-stepped engine one agreement, its staging buffers freed before the refresh."""
    small, deep = ranks(2).run(ck.collective_counts, str(tmp_path), [EngineCase(stage=2),
                                                                     EngineCase(stage=3, model="deep")])[0]
    # at 2 gloo ranks an agreement is one small all_gather (zero_dtensor.comm.collectives.prefers_all_reduce)
    agreement_op = "c10d.allreduce_" if 2 >= GLOO_REDUCE_FROM else "c10d._allgather_base_"
    # the refresh: ZeRO-3 gathers the persistent parameters together; ZeRO-1/2 on gloo gathers each param group by
    # one batch of 2(N-1) point-to-point ops (counted by counting_p2p, which CommDebugMode does not see)
    assert deep["refresh"] == {"c10d._allgather_base_": 1}, deep
    assert small["refresh"] == {"p2p batches": 1, "p2p ops": 2}, small
    for found in (small, deep):
        assert found["get_state_dict"] == 0, found
        assert found["sync"] == 1 and found["set_state_dict"] == 1 + found["sync"], found
        dcp_save = Counter(found["save"]) - Counter({agreement_op: 1})  # the agreement, then DCP's objects only
        assert sum(dcp_save.values()) == sum(found["save"].values()) - 1, found
        assert not set(found["refresh"]) & set(dcp_save) and agreement_op not in dcp_save, found
        assert found["clones in save"] == [], found  # every piece handed to DCP over exactly its bytes: no copy
        # a stepped engine is read in place: no staging; one agreement before the engine is written, one after
        assert Counter(found["load"]) == Counter({agreement_op: 2}) + Counter(found["refresh"]), found
        assert found["staging"] == {"made": 0, "alive at the refresh": [0]}, found
        # a never-stepped engine reads into staging (freed before the refresh); one agreement
        assert Counter(found["load, never stepped"]) == Counter({agreement_op: 1}) + Counter(found["refresh"]), found
        assert found["staging, never stepped"]["made"] > 0, found
        assert found["staging, never stepped"]["alive at the refresh"] == [0], found
    assert small["save"] == deep["save"] and sum(small["save"].values()) == 1 + 9  # "about 9 at 2 ranks" + 1


def test_load_at_one_rank(ranks, saved) -> None:
    ranks(1).run(ck.load_cases, saved, [("w3-z3-2g", EngineCase(stage=2, groups=2, world=1)),
                                        ("z1-bf16", EngineCase(stage=3, dtype="bf16", world=1))])


def test_caching_planners_write_what_torch_save_writes() -> None:
    """The save planner's bytes entries are ``torch.save``'s bytes (so torch's own readers read them), serialized once
    per distinct value; the load planner shares only immutable results between entries with the same bytes."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType

    from zero_dtensor.checkpoint.planners import CachingLoadPlanner, CachingSavePlanner

    def torch_bytes(value: object) -> bytes:
        out = io.BytesIO()
        torch.save(value, out)
        return out.getvalue()

    saver = CachingSavePlanner()
    values = [0.001, (0.9, 0.999), True, 1, None, "x", -0.0, [1, 2], {"a": 1}]
    for value in values:
        item = WriteItem(index=MetadataIndex("k"), type=WriteItemType.BYTE_IO)
        assert saver.transform_object(item, value).getvalue() == torch_bytes(value), value
    assert len(saver._bytes) == 7  # the list and the dict are not cached
    assert saver.transform_object(item, 1).getvalue() != saver.transform_object(item, True).getvalue()

    state = {"a": None, "b": None, "c": None, "d": None}
    loader = CachingLoadPlanner()
    loader.set_up_planner(state, None, True)
    for key, value in (("a", (0.9, 0.999)), ("b", (0.9, 0.999)), ("c", [1, 2]), ("d", [1, 2])):
        item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key), dest_offsets=torch.Size([0]),
                        storage_index=MetadataIndex(key), storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
        loader.load_bytes(item, io.BytesIO(torch_bytes(value)))
    assert state == {"a": (0.9, 0.999), "b": (0.9, 0.999), "c": [1, 2], "d": [1, 2]}
    assert state["a"] is state["b"] and state["c"] is not state["d"]  # lists are never shared


def test_load_planner_builds_dcps_plan(ranks, tmp_path) -> None:
    """``zd.load``'s planner builds the local load plan itself (without DCP's runtime-protocol check per tensor): the
    same read items as DCP's ``DefaultLoadPlanner`` and the same tensors looked up for them, on ZeRO-2 with a frozen
    parameter group and on ZeRO-3, 2 ranks; a key the checkpoint lacks goes to DCP's plan and its error."""
    found = ranks(2).run(ck.load_plans, str(tmp_path), [EngineCase(stage=2, groups=2), EngineCase(stage=3)])
    for per_rank in found:
        for case in per_rank:
            assert case["same"] and case["items"] > 0, case
            assert case["asked DCP's plan"] == ["DefaultLoadPlanner"], case  # only the reference asked DCP's plan
            message, asked = case["missing key"]
            assert "Missing key in checkpoint state_dict: model.extra" in message and asked == ["CachingLoadPlanner"]


def test_repeated_saves_reuse_plans(ranks, tmp_path) -> None:
    """A save whose plans have not changed sends empty plans (DCP's plan cache); a coordinator without its cache
    (restarted) refuses once and every rank plans again; every checkpoint loads back what it saved."""
    rank0, rank1 = ranks(2).run(ck.cached_plans, str(tmp_path), EngineCase(stage=3, dtype="bf16"))
    for found in (rank0, rank1):
        assert found["first"] == {"usable": [True], "refused": 0}, found
        assert found["cached"] == {"usable": [False], "refused": 0, "kept": [True]}, found
        assert len(found["keys"]) == 1 and found["keys"][0].startswith("zero_dtensor:"), found
    # the coordinator dropped its cache: rank 1 sent an empty plan, the coordinator refused, both planned again
    assert rank0["coordinator-restarted"] == {"usable": [True, True], "refused": 1}, rank0
    assert rank1["coordinator-restarted"] == {"usable": [False, True], "refused": 0}, rank1


def test_plan_key_tells_apart_what_dcp_does_not_compare() -> None:
    import torch

    from zero_dtensor.checkpoint.planners import plan_key

    def key(dtype=torch.float32, shape=(4, 2), ranks=(0, 1), value=0.1):
        return plan_key({"model": {"w": torch.zeros(shape, dtype=dtype)}, "optim": {"lr": value}}, ranks)

    assert key() == key() == key(value=0.2)  # values do not change a plan
    assert len({key(), key(dtype=torch.bfloat16), key(shape=(2, 4)), key(ranks=(0, 2)), key(value=1)}) == 5


def test_failure_while_reading_into_the_engine_is_reported_on_every_rank(ranks, tmp_path) -> None:
    rank0, rank1 = ranks(2).run(ck.second_pass_failure, str(tmp_path))
    assert "the disk went away" in rank1 and "partly overwritten" in rank1, rank1
    assert "another rank failed" in rank0 and "partly overwritten" in rank0, rank0


def test_optimizer_entries_the_engine_does_not_have_are_named() -> None:
    """``_check_optim`` (what ``set_state_dict`` and ``zd.load`` check an optimizer state dict by): the engine's own
    entries and unknown hyperparameters of its parameters pass; state entries of other keys or parameters, and
    entries of any other form, are named (dotted names parsed as torch writes them)."""
    from types import SimpleNamespace

    import torch

    from zero_dtensor.checkpoint.state_dict import _check_optim

    pieces = tuple(SimpleNamespace(name=n, start=0, stop=4, group=0) for n in ("a.w", "a.b.w"))
    target = SimpleNamespace(names=("a.w", "a.b.w"), entry_keys=lambda: ("exp_avg", "step"), pieces=pieces,
                             state_keys=("exp_avg",), has_step=True, param_group=(0,),
                             masters=SimpleNamespace(partitions=(torch.zeros(8),)))
    hparams = {"a.w": {"lr": 0.1}, "a.b.w": {"lr": 0.1}}
    optim = {f"state.{n}.{k}": v for n in target.names for k, v in (("exp_avg", torch.zeros(4)),
                                                                        ("step", torch.tensor(3.0)))}
    optim |= {f"param_groups.{n}.lr": 0.1 for n in target.names}
    optim["param_groups.a.b.w.foreach"] = None  # a hyperparameter the engine's group lacks: accepted
    problems, steps, chosen = _check_optim(target, optim, hparams)
    assert problems == [] and steps == [3.0] and chosen == {0: {"lr": 0.1}}
    strays = ["state.a.b.w.exp_avg_sq", "state.a.c.exp_avg", "state.a", "param_groups.a.c.lr", "param_groups.a",
              "other"]
    problems, _, _ = _check_optim(target, {**optim, **dict.fromkeys(strays, 0.0)}, hparams)
    assert problems == ["optimizer entries the engine does not have (another model or optimizer?): "
                        + ", ".join(sorted(strays))], problems


DISAGREE_CASES = [EngineCase(stage=2), EngineCase(stage=3), EngineCase(stage=2, world=3),
                  EngineCase(stage=3, world=3)]


@pytest.mark.parametrize("case", DISAGREE_CASES, ids=lambda c: c.id)
def test_saves_that_differ_between_ranks_raise_on_every_rank(ranks, tmp_path, case) -> None:
    """Issue 45, items 4 and 5: a path per rank reported success (rank 0's directory looked complete and could not
    be loaded); ``async_=True`` on some ranks hung past the process group's timeout. Both raise on every rank now,
    before anything is written."""
    results = ranks(case.world).run(ck.disagreeing_saves, str(tmp_path), case, timeout=180.0)
    for rank, messages in enumerate(results):
        for what, message in messages.items():
            assert "checkpoint.save" in message, (what, message)
        assert f"per-rank-{case.world - 1}" in messages["path per rank"], messages
        assert "True" in messages["async on some ranks"] and "False" in messages["async on some ranks"], messages


@pytest.mark.parametrize("case", DISAGREE_CASES, ids=lambda c: c.id)
def test_loads_that_differ_between_ranks_raise_on_every_rank(ranks, tmp_path, case) -> None:
    """Issue 45, item 2: ranks loading different checkpoints (another path, or the same path holding another
    checkpoint) loaded a mixture with no error. They raise on every rank now, the engine unchanged."""
    results = ranks(case.world).run(ck.disagreeing_loads, str(tmp_path), case, timeout=180.0)
    for messages in results:
        for what, message in messages.items():
            assert "checkpoint.load" in message, (what, message)
        assert "new" in messages["stepped: another path"] and "old" in messages["stepped: another path"], messages
        ids = re.findall(r"save_id [0-9a-f-]+", messages["stepped: another checkpoint"])
        assert len(set(ids)) == 2, messages  # the same path, two checkpoints: told apart by their save_id
@pytest.mark.parametrize("world,stage", [(2, 2), (3, 3)], ids=["2ranks-z2", "3ranks-z3"])
def test_damaged_checkpoints_and_the_write_mark(ranks, tmp_path, world, stage) -> None:
    """Issue 45: a flipped bit in a master piece and in an ``exp_avg_sq`` piece (rank 1's file), a truncated
    ``.metadata``: ``CheckpointReadError`` on every rank naming the checkpoint (rank 1 also the file and the entry),
    the engine unchanged; ``zd.load`` / ``zd.set_state_dict`` clear the write mark they make obsolete;
    ``engine.save_checkpoint`` while marked syncs first (checked inside the worker)."""
    messages = ranks(world).run(ck.integrity, str(tmp_path), stage)
    for rank, per_rank in enumerate(messages):
        assert set(per_rank) == {"master", "exp_avg_sq", "truncated .metadata"}
        assert ".metadata cannot be read" in per_rank["truncated .metadata"], per_rank
        if rank != 1:
            assert "failed on another rank" in per_rank["master"], per_rank


@pytest.mark.parametrize("case", [EngineCase(stage=2), EngineCase(stage=3, groups=2)], ids=lambda c: c.id)
def test_state_key_order_may_differ_between_ranks(ranks, tmp_path, case) -> None:
    """After DeepSpeed's universal load the inner optimizer's state keys come in a per-process order: a save and a
    load still pair each key with itself on every rank (values bit for bit)."""
    ranks(2).run(ck.save_after_state_order_differs, str(tmp_path), case)


@pytest.mark.parametrize("stage", [2, 3])
def test_load_inside_an_accumulation_cycle_is_refused(ranks, tmp_path, stage: int) -> None:
    """Loading between the micro-steps of a gradient accumulation cycle trained on differently, silently (the held
    gradients met the loaded state at a shifted boundary): refused on every rank, engine unchanged; at the boundary
    the same checkpoint loads."""
    for per_rank in ranks(2).run(ck.mid_accumulation_load, str(tmp_path), EngineCase(stage, gas=2)):
        assert "1 of 2 micro-steps into a gradient accumulation cycle" in per_rank["message"], per_rank
