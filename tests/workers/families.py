"""Worker side of ``tests/test_families.py``: the public fronts of the fp32 masters and the optimizer state
(``zd.sharded_master_params``, ``zd.sharded_optimizer_state``, ``zd.sync_model_params``, the drop-ins), one table of
rows per engine pair (``ours`` is driven through zero_dtensor, ``theirs`` through DeepSpeed's own per-parameter API).

Rows run in order and later rows build on earlier ones: reads and the DeepSpeed comparison first (both engines must
still be identical), then the rows that only use ``ours`` (writes, the guard, cross-family operations, the EMA).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zero_dtensor as zd
from workers.common import EngineCase, batch, build_engine, count_comms, rank_checks
from workers.families_ds import (
    assert_same,
    ds_full_masters,
    ds_full_state,
    ds_refresh,
    ds_relink,
    ds_set,
    named_trainable,
    step,
    sync_collectives,
    targets,
    working_weights,
)
from workers.rows import Rows

STRATEGIES = ("all_gather", "all_to_all", "all_reduce")
EMA_STEPS = 20
DECAY = 0.9

ROWS = [
    "state not ready before the first step",
    "masters before the first step",
    "bulk reads equal DeepSpeed",
    "every read path",
    "collectives counted",
    "set_full_ + sync equals DeepSpeed's setters",
    "working weights are the cast masters",
    "forward without sync raises",
    "bad input raises before writing",
    "reductions",
    "transforms",
    "redistribution",
    "cross-family",
    "ema",
]


def sharded_multi(front: Any) -> bool:
    return dist.get_world_size() > 1 and any(not g.replicated for g in front.layout.groups)


def data_collectives(front: Any, strategy: str) -> int:
    """The data collectives of one ``full_tensors(strategy=...)`` of every parameter (no calibration: pinned), as
    the gradient tests count them (one rank: none, whatever the strategy: the partition is copied)."""
    sharded = [i for i, g in enumerate(front.layout.groups) if not g.replicated]
    if dist.get_world_size() == 1:
        return 0
    if strategy == "all_to_all":
        return len(sharded)
    return len({(id(front._storage.process_groups[i]), front.local_partitions[i].dtype) for i in sharded})


def full_reference(front: Any) -> dict[str, torch.Tensor]:
    return front.full_tensors(strategy="all_reduce")


def fused_like_eager(master: zd.ShardedMasterParams, state: zd.ShardedOptimizerState) -> None:
    """Issue 42: ``dots()`` and ``stats()`` (nan/inf written into a clone, counted exactly) with
    ``zd.set_fused_reductions(True)``, forced onto CPU tensors, equal the eager calls; the fused path ran."""
    from zero_dtensor.layout import fused_rows

    bad = state.clone()
    first = bad.full_tensors(strategy="all_reduce")
    name = max(first, key=lambda n: first[n].numel())  # the longest: full rows of the plan
    value = first[name].reshape(-1).clone()
    value[[0, 5, value.numel() - 1]] = float("nan")
    value[[7, 200]] = torch.tensor([float("inf"), -float("inf")])
    bad.set_full_({name: value.view(first[name].shape)})
    calls = {"dots": lambda: master.dots(state), "stats": bad.stats, "master stats": master.stats}
    eager = {k: call() for k, call in calls.items()}
    used: list[str] = []
    wrapped = {k: getattr(fused_rows, k) for k in ("row_moments", "row_dots")}
    try:
        fused_rows._FORCE_CPU = True
        zd.set_fused_reductions(True)
        for k, fn in wrapped.items():
            setattr(fused_rows, k, lambda *a, _k=k, _fn=fn, **kw: used.append(_k) or _fn(*a, **kw))
        fused = {k: call() for k, call in calls.items()}
    finally:
        zd.set_fused_reductions(False)
        fused_rows._FORCE_CPU = False
        for k, fn in wrapped.items():
            setattr(fused_rows, k, fn)
    assert sorted(set(used)) == ["row_dots", "row_moments"], used
    for n in eager["dots"]:
        torch.testing.assert_close(fused["dots"][n], eager["dots"][n], rtol=1e-6, atol=1e-9)
    for k in ("stats", "master stats"):
        for n, e in eager[k].items():
            f = fused[k][n]
            assert (f.nan_count, f.inf_count, f.numel) == (e.nan_count, e.inf_count, e.numel), (k, n, f, e)
            assert f.max_abs == e.max_abs or math.isnan(f.max_abs) and math.isnan(e.max_abs), (k, n, f, e)
            for a, b in ((f.norm, e.norm), (f.mean, e.mean)):
                assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or math.isnan(a) and math.isnan(b), (k, n)
    assert (fused["stats"][name].nan_count, fused["stats"][name].inf_count) == (3, 2)


def check_front(case: EngineCase) -> dict[str, Any]:
    rows = Rows(ROWS)
    ours, theirs = build_engine(case), build_engine(case)
    names = named_trainable(ours)
    shapes = {n: p.ds_shape if hasattr(p, "ds_shape") else p.shape for n, p in names.items()}
    keys = ("exp_avg", "exp_avg_sq")

    def not_ready() -> None:
        with pytest.raises(zd.OptimizerStateNotReadyError, match="first engine.step"):
            zd.sharded_optimizer_state(ours, "exp_avg")
        with pytest.raises(zd.OptimizerStateNotReadyError):
            zd.optimizer_state_keys(ours)
        with pytest.raises(zd.OptimizerStateNotReadyError):
            zd.get_full_optimizer_state(ours, "exp_avg")

    rows.run("state not ready before the first step", not_ready)

    def masters_initial() -> None:
        with count_comms() as mode:
            master = zd.sharded_master_params(ours)
        assert mode.get_total_counts() == 0
        assert isinstance(master, zd.ShardedMasterParams) and isinstance(master, zd.ShardedTensors)
        assert not isinstance(master, zd.ShardedGrads)
        assert master.names == tuple(names)
        assert_same(zd.get_full_fp32_params(ours), ds_full_masters(ours), "initial masters")

    rows.run("masters before the first step", masters_initial)
    step(ours, 0)
    step(theirs, 0)
    master = zd.sharded_master_params(ours)
    assert zd.sharded_master_params(ours) is master  # one front per engine while DeepSpeed holds the tensors

    def bulk_reads() -> None:
        assert zd.optimizer_state_keys(ours) == keys
        assert_same(zd.get_full_fp32_params(ours), ds_full_masters(ours), "masters")
        for k in keys:
            assert_same(zd.get_full_optimizer_state(ours, k), ds_full_state(ours, k), f"state {k}")
        subset = list(names)[1::2]
        got = zd.get_full_fp32_params(ours, subset)
        assert list(got) == subset
        assert_same(got, {n: v for n, v in ds_full_masters(ours).items() if n in subset}, "subset")
        state = zd.sharded_optimizer_state(ours, "exp_avg")
        assert isinstance(state, zd.ShardedOptimizerState) and zd.sharded_optimizer_state(ours, "exp_avg") is state
        if case.stage == 3:  # DeepSpeed's local variants (ZeRO-3 only): this rank's chunk (padding not compared)
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            for n, p in names.items():
                start, stop = master[n].local_range
                mine = safe_get_local_fp32_param(p).flatten()
                assert torch.equal(master[n].to_local(), mine[:stop - start]), n
                theirs_state = safe_get_local_optimizer_state(p, "exp_avg").flatten()
                assert torch.equal(state[n].to_local(), theirs_state[:stop - start]), n
        with pytest.raises(KeyError, match="exp_avg"):
            zd.sharded_optimizer_state(ours, "step")

    rows.run("bulk reads equal DeepSpeed", bulk_reads)

    def read_paths() -> None:
        for front in (master, zd.sharded_optimizer_state(ours, "exp_avg_sq")):
            ref = full_reference(front)
            for s in STRATEGIES:
                assert_same(front.full_tensors(strategy=s), ref, s)
                out = front.full_tensors(strategy=s)
                again = front.full_tensors(out=out, strategy=s)
                assert_same(again, ref, f"{s} out=")
                got = front.full_tensors(dst=0, strategy=s)
                assert (got.keys() == ref.keys()) if dist.get_rank() == 0 else got == {}
                pending = front.full_tensors(async_op=True, strategy=s)
                assert_same(pending.wait(), ref, f"{s} async")
            assert_same(dict(front.iter_full(bucket_bytes=256)), ref, "iter_full")
            for n in front.names:
                view = front[n]
                assert torch.equal(view.full_tensor(), ref[n]), n
                start, stop = view.local_range
                assert torch.equal(view.to_local(), ref[n].flatten()[start:stop]), n
            dts = front.to_dtensors()
            assert_same({n: d.full_tensor() for n, d in dts.items()}, ref, "to_dtensors")
            owned = front.owned()
            owners = front.owners()
            assert sorted(owned) == sorted(n for n, r in owners.items() if r == dist.get_rank())
            for n, v in owned.items():
                assert torch.equal(v, ref[n]), n
            parts = front.local_partitions
            assert len(parts) == len(front.groups)

    rows.run("every read path", read_paths)

    def counted() -> None:
        multi = sharded_multi(master)
        for s in STRATEGIES:
            with count_comms() as mode:
                master.full_tensors(strategy=s)
            expected = data_collectives(master, s) + (1 if multi else 0)
            assert mode.get_total_counts() == expected, (s, mode.get_comm_counts(), expected)
            assert rank_checks(master) == (1 if multi else 0)
        ema = master.clone()
        with count_comms() as mode:
            ema.lerp_(master, 1 - DECAY)
            ema.mul_(1.0)
        assert mode.get_total_counts() == 0, mode.get_comm_counts()
        with count_comms() as mode:
            master.norms()
        assert mode.get_total_counts() == (2 if multi else 0), mode.get_comm_counts()

    rows.run("collectives counted", counted)

    def same_edit() -> None:
        new_master = targets(names, shapes, "front", 0.05)
        new_state = targets(names, shapes, "front-state", 1e-3)
        with count_comms() as mode:
            zd.set_full_fp32_params(ours, new_master)
        sync_comms = mode.get_total_counts()
        zd.set_full_optimizer_state(ours, "exp_avg", new_state)
        ds_relink(theirs)
        for n, p in named_trainable(theirs).items():
            ds_set(theirs, p, new_master[n])
            ds_set(theirs, p, new_state[n], "exp_avg")
        ds_refresh(theirs)
        assert sync_comms >= (1 if dist.get_world_size() > 1 else 0)
        assert_same(zd.get_full_fp32_params(ours), new_master, "written masters")
        assert_same(ds_full_masters(theirs), new_master, "DeepSpeed's written masters")
        assert_same(working_weights(ours), working_weights(theirs), "working weights")
        for i in (1, 2):
            assert torch.equal(step(ours, i), step(theirs, i)), i
        assert_same(zd.get_full_fp32_params(ours), ds_full_masters(theirs), "masters after two steps")
        for k in keys:
            assert_same(zd.get_full_optimizer_state(ours, k), ds_full_state(theirs, k), f"state {k} after steps")
        assert_same(working_weights(ours), working_weights(theirs), "working weights after two steps")

    rows.run("set_full_ + sync equals DeepSpeed's setters", same_edit)

    def cast_masters() -> None:
        master.mul_(0.5)
        zd.sync_model_params(ours)
        weights, full = working_weights(ours), zd.get_full_fp32_params(ours)
        for n in names:
            assert torch.equal(weights[n], full[n].to(weights[n].dtype)), n

    rows.run("working weights are the cast masters", cast_masters)

    def guard() -> None:
        x = batch(ours, 5)
        dts = master.to_dtensors()
        owned = master.owned()
        full = master.full_tensors(strategy="all_reduce")
        clone = master.clone()
        writes = {
            "set_full_": lambda: master.set_full_(full),
            "mul_": lambda: master.mul_(1.0),
            "copy_": lambda: master.copy_(clone),
            "set_dtensors_": lambda: master.set_dtensors_(dts),
            "set_owned_": lambda: master.set_owned_(owned),
            "map_full_": lambda: master.map_full_(lambda n, t: t),
            "mark_written": master.mark_written,
        }
        for what, write in writes.items():
            write()
            with pytest.raises(zd.ModelParamsNotSyncedError, match=r"zero_dtensor\.sync_model_params\(engine\)"):
                ours(x)
            zd.sync_model_params(ours)
            ours(x)  # passes after the sync
        clone.mul_(2.0)  # a clone is not the masters
        ours(x)
        # a write between backward and an applied engine.step(): the step copies every master itself
        ours.backward(ours(x).float().pow(2).mean())
        master.mul_(1.0)
        ours.step()
        ours(x)
        master.mul_(1.0)
        with pytest.raises(zd.ModelParamsNotSyncedError):
            ours(x)
        with count_comms() as mode:
            zd.sync_model_params(ours)
        multi = dist.get_world_size() > 1
        assert mode.get_total_counts() == sync_collectives(ours) + int(multi), mode.get_comm_counts()
        assert not zd.families.master.needs_sync(ours)

    rows.run("forward without sync raises", guard)

    def bad_input() -> None:
        before = zd.get_full_fp32_params(ours)
        first = master.names[0]
        for mapping, error in (({"nope": before[first]}, KeyError),
                               ({first: before[first].flatten()[:1]}, ValueError),
                               ({first: before[first].to(torch.int32)}, TypeError)):
            with pytest.raises(error):
                zd.set_full_fp32_params(ours, mapping)
            with pytest.raises(error):
                master.set_full_(mapping)
        ours(batch(ours, 5))  # nothing was written: no sync needed
        me, last = dist.get_rank(), dist.get_world_size() - 1
        # a collective call refused by one rank raises on every rank (the agreement), before any data moves
        if sharded_multi(master):
            with pytest.raises(KeyError):
                master.full_tensors(["nope"] if me == last else None, strategy="all_gather")
            dts = master.to_dtensors()
            bad = dict(dts)
            if me == last:
                dt = dts[first]
                bad[first] = DTensor.from_local(dt.to_local().to(torch.int32), dt.device_mesh, dt.placements,
                                                run_check=False, shape=dt.shape, stride=dt.stride())
            with pytest.raises(TypeError):
                master.set_dtensors_(bad)
        with pytest.raises(KeyError):
            zd.set_full_optimizer_state(ours, "exp_avg", {"nope": before[first]})
        assert_same(zd.get_full_fp32_params(ours), before, "nothing written")
        ours(batch(ours, 5))

    rows.run("bad input raises before writing", bad_input)

    def reductions() -> None:
        state = zd.sharded_optimizer_state(ours, "exp_avg")
        fm, fs = master.full_tensors(strategy="all_reduce"), state.full_tensors(strategy="all_reduce")
        norms = master.norms()
        for n in names:
            torch.testing.assert_close(norms[n], fm[n].float().norm(), rtol=1e-5, atol=1e-6)
        total = torch.stack([fm[n].float().norm() for n in names]).norm()
        torch.testing.assert_close(master.global_norm(), total, rtol=1e-5, atol=1e-6)
        dots = master.dots(state)
        for n in names:
            torch.testing.assert_close(dots[n], (fm[n].double() * fs[n].double()).sum().float(), rtol=1e-4,
                                       atol=1e-6)
        stats = state.stats()
        for n in names:
            assert stats[n].numel == fm[n].numel() and stats[n].nan_count == 0
            assert abs(stats[n].max_abs - fs[n].abs().max().item()) <= 1e-7, n
        if dist.get_world_size() == 1:  # one rank: the fused row pass, forced onto these CPU tensors (compiles)
            fused_like_eager(master, state)

    rows.run("reductions", reductions)

    def transforms() -> None:
        copy = master.clone()  # the masters' geometry, its own memory (no sync involved)
        assert isinstance(copy, zd.ShardedMasterParams) and copy.layout is master.layout
        full = copy.full_tensors(strategy="all_reduce")
        first = copy.names[0]
        copy.clamp_(-0.05, 0.05).mul_(2.0).add_(0.25, params=[first]).zero_(params=lambda n: n.endswith("bias"))
        copy.apply_(lambda x: x.mul_(3.0).sub_(1.0))
        expected = {n: v.clamp(-0.05, 0.05) * 2.0 for n, v in full.items()}
        expected[first] = expected[first] + 0.25
        expected = {n: (torch.zeros_like(v) if n.endswith("bias") else v) * 3.0 - 1.0 for n, v in expected.items()}
        torch.testing.assert_close(copy.full_tensors(strategy="all_reduce"), expected, rtol=1e-6, atol=1e-7)
        noisy = master.clone().zero_().add_noise_(1.0, seed=7)
        for n, v in noisy.full_tensors(strategy="all_reduce").items():
            assert torch.equal(v.flatten(), zd.counter_normal(7, n, v.numel())), n
        assert not zd.families.master.needs_sync(ours)

    rows.run("transforms", transforms)

    def redistribution() -> None:
        state = zd.sharded_optimizer_state(ours, "exp_avg_sq")
        before = state.full_tensors(strategy="all_reduce")
        state.map_full_(lambda n, t: t * 2)
        after = state.full_tensors(strategy="all_reduce")
        assert_same(after, {n: v * 2 for n, v in before.items()}, "map_full_")
        state.set_dtensors_({n: d / 2 for n, d in state.to_dtensors().items()})
        assert_same(state.full_tensors(strategy="all_reduce"), before, "set_dtensors_")
        state.set_owned_({n: v * 3 for n, v in state.owned().items()})
        assert_same(state.full_tensors(strategy="all_reduce"), {n: v * 3 for n, v in before.items()}, "set_owned_")
        state.copy_(state.clone().div_(3))
        torch.testing.assert_close(state.full_tensors(strategy="all_reduce"), before, rtol=1e-6, atol=0)
        state.set_full_(before)
        ours(batch(ours, 5))  # optimizer-state writes need no sync

    rows.run("redistribution", redistribution)

    def cross_family() -> None:
        loss = ours(batch(ours, 8)).float().pow(2).mean()
        ours.backward(loss)
        grads = zd.sharded_grads(ours)
        state = zd.sharded_optimizer_state(ours, "exp_avg")
        if case.bf16_optimizer:  # the gradient replicated, the masters sharded
            for call in (lambda: master.add_(grads, alpha=-0.1), lambda: grads.dots(state),
                         lambda: master.lerp_(grads, 0.5), lambda: master.copy_(grads)):
                with pytest.raises(ValueError, match="replicated"):
                    call()
        else:
            fm, fg = master.full_tensors(strategy="all_reduce"), grads.full_tensors(dtype=torch.float32,
                                                                                  strategy="all_reduce")
            fs = state.full_tensors(strategy="all_reduce")
            dots = grads.dots(state)
            for n in names:
                torch.testing.assert_close(dots[n], (fg[n].double() * fs[n].double()).sum().float(), rtol=1e-4,
                                           atol=1e-7)
            master.add_(grads, alpha=-0.1)
            expected = {n: fm[n] + (-0.1 * fg[n]) for n in names}
            torch.testing.assert_close(master.full_tensors(strategy="all_reduce"), expected, rtol=1e-6, atol=1e-7)
            zd.sync_model_params(ours)
        ours.step()

    rows.run("cross-family", cross_family)

    def ema() -> dict[str, Any]:
        avg = master.clone()
        reference = {n: v.clone() for n, v in master.full_tensors(strategy="all_reduce").items()}
        comms = 0
        for i in range(EMA_STEPS):
            step(ours, 10 + i)
            with count_comms() as mode:
                avg.lerp_(master, 1 - DECAY)
            comms += mode.get_total_counts()
            current = master.full_tensors(strategy="all_reduce")
            for n in names:
                reference[n].lerp_(current[n], 1 - DECAY)
        assert comms == 0
        got = avg.full_tensors(strategy="all_reduce")
        torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-7)
        return {n: v.clone() for n, v in got.items()}

    rows.run("ema", ema)
    return rows.report(describe=master._storage.describe)


def check_load_checkpoint(directory: str) -> None:
    """Fronts between steps and across ``engine.load_checkpoint``: the masters' front stays current (DeepSpeed copies
    masters in place), the optimizer-state front turns stale (new tensors) with an error saying what to do, and a new
    front holds the loaded values."""
    engine = build_engine(EngineCase(1))
    step(engine, 0)
    master = zd.sharded_master_params(engine)
    state = zd.sharded_optimizer_state(engine, "exp_avg")
    saved_master, saved_state = zd.get_full_fp32_params(engine), state.full_tensors()
    engine.save_checkpoint(directory, tag="t")
    step(engine, 1)
    assert master.is_current() and state.is_current()  # valid between steps
    engine.load_checkpoint(directory, tag="t")
    assert master.is_current() and zd.sharded_master_params(engine) is master
    assert_same(master.full_tensors(), saved_master, "loaded masters")
    assert not state.is_current()
    with pytest.raises(zd.StaleTensorsError, match=r"sharded_optimizer_state\(engine, key\) again"):
        state.full_tensors()
    with pytest.raises(zd.StaleTensorsError):
        state["fc1.weight"]
    fresh = zd.sharded_optimizer_state(engine, "exp_avg")
    assert fresh is not state and fresh.is_current()
    assert_same(fresh.full_tensors(), saved_state, "loaded state")
    assert_same(zd.get_full_optimizer_state(engine, "exp_avg"), ds_full_state(engine, "exp_avg"), "vs DeepSpeed")
