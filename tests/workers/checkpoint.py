"""Worker side of ``tests/test_checkpoint.py``: elastic DCP checkpoints of DeepSpeed engines
(``zero_dtensor.checkpoint``).

Saved values are assembled here into full tensors with the test's own geometry (``workers.families_ds.assemble``,
one all_gather per flat group) and written next to the checkpoint as ``<name>.expected.pt``; loads at another world
size / stage are compared with them bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import weakref
from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from workers.common import DTYPES, EngineCase, build_engine, forward_backward, raises_everywhere
from workers.families_ds import assemble
from zero_dtensor._deepspeed import checkpointing as dsck
from zero_dtensor._deepspeed import families
from zero_dtensor.checkpoint import (
    CheckpointMismatchError,
    CheckpointReadError,
    IncompleteCheckpointError,
    get_state_dict,
    load,
    save,
    set_state_dict,
)

WARMUP = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                       "warmup_num_steps": 10}}}


def train(engine: Any, steps: range) -> None:
    for step in steps:
        forward_backward(engine, step)
        engine.step()


def working(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's full working weights (ZeRO-3: gathered)."""
    params = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.data.clone() for n, p in params.items()}
    return {n: p.data.clone() for n, p in params.items()}


def snapshot(engine: Any) -> dict[str, Any]:
    """Full masters, optimizer state, steps, hyperparameters, working weights and counters (collective)."""
    out: dict[str, Any] = {"master": assemble(families.master_storage(engine)), "working": working(engine),
                           "counters": dsck.engine_counters(engine), "hps": dsck.group_hyperparameters(engine),
                           "scaler": dsck.loss_scaler_state(engine), "scheduler": dsck.lr_scheduler_state(engine)}
    if families.optimizer_state_ready(engine):
        # sorted: the state dict's key order may differ between ranks (DeepSpeed's universal load builds it from a
        # set of key names, in each process's own string-hash order) and ``assemble`` is a collective per key
        out["state"] = {k: assemble(families.optimizer_state_storage(engine, k))
                        for k in sorted(families.optimizer_state_keys(engine))}
        out["steps"] = [float(s) for s in families.optimizer_steps(engine)]
    else:
        out["state"], out["steps"] = None, None
    return out


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested snapshots."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def diff(a: dict, b: dict) -> list[str]:
    return [k for k in a if not same(a[k], b.get(k))]


# ---- save side -----------------------------------------------------------------------------------------------------

def save_cases(root: str, cases: list[tuple[str, EngineCase, int]]) -> None:
    """Per ``(name, case, steps)``: build, train ``steps`` steps, save into ``root/name`` (async for names ending in
    ``-async``, without fsync for names ending in ``-nosync``) with a client state, check the save changed nothing,
    write the expected values."""
    for name, case, steps in cases:
        engine = build_engine(case, seed=1)
        train(engine, range(steps))
        before = snapshot(engine)
        future = save(engine, os.path.join(root, name), async_=name.endswith("-async"),
                      sync_files=not name.endswith("-nosync"), client_state={"name": name, "epoch": 3})
        if future is not None:
            future.result()
        after = snapshot(engine)
        assert same(before, after), f"{name}: save changed {diff(before, after)}"
        if dist.get_rank() == 0:
            torch.save(before, os.path.join(root, f"{name}.expected.pt"))
        dist.barrier()


# ---- load side -----------------------------------------------------------------------------------------------------

def check_resident(engine: Any, expected: dict[str, Any], name: str) -> int:
    """ZeRO-3: parameters that stay gathered (persistent, frozen ones too) already hold the loaded values, without a
    new gather (what the next forward uses). Returns how many were checked."""
    if engine.zero_optimization_stage() != 3:
        return 0
    dtype = next(iter(engine.module.parameters())).dtype
    checked = 0
    for n, p in engine.module.named_parameters():
        if p.data.numel() == p.ds_numel and p.ds_numel > 0:
            want = expected["master"].get(n, expected["working"][n]).to(dtype)
            assert same(p.data.view(want.shape), want), f"{name}: resident weights of {n} are stale"
            checked += 1
    return checked


def check_loaded(engine: Any, expected: dict[str, Any], name: str, *, counters: bool = True) -> None:
    resident = check_resident(engine, expected, name)
    assert engine.zero_optimization_stage() != 3 or resident > 0, f"{name}: no persistent parameter checked"
    got = snapshot(engine)
    for n, value in expected["master"].items():
        assert same(got["master"][n], value), f"{name}: master {n}"
    dtype = next(iter(engine.module.parameters())).dtype
    for n, value in expected["working"].items():
        want = expected["master"][n].to(dtype) if n in expected["master"] else value.to(dtype)
        assert same(got["working"][n], want), f"{name}: working weights of {n} are not the cast master"
    if expected["state"] is None:  # saved before the first step: zero state, step 0
        assert all(bool((t == 0).all()) for k in got["state"].values() for t in k.values()), name
        assert got["steps"] == [0.0] * len(got["steps"]), name
    else:
        for key, values in expected["state"].items():
            for n, value in values.items():
                assert same(got["state"][key][n], value), f"{name}: {key} of {n}"
        assert set(got["steps"]) == set(expected["steps"]), f"{name}: steps {got['steps']} {expected['steps']}"
    assert not counters or got["counters"] == expected["counters"], f"{name}: {got['counters']} {expected['counters']}"
    for g, h in zip(got["hps"], expected["hps"]):
        assert g == h, f"{name}: hyperparameters {g} {h}"


def load_cases(root: str, cases: list[tuple[str, EngineCase]]) -> None:
    """Per ``(saved name, case)``: build a fresh engine (every second one stepped once first, so that it is read in
    place; the others read into staging buffers), load, compare with the expected values, take one step."""
    for i, (name, case) in enumerate(cases):
        engine = build_engine(case, seed=2)
        if i % 2:
            train(engine, range(9, 10))
        client = load(engine, os.path.join(root, name))
        assert client == {"name": name, "epoch": 3}, client
        expected = torch.load(os.path.join(root, f"{name}.expected.pt"), weights_only=False)
        check_loaded(engine, expected, f"{name} -> {case.id}")
        train(engine, range(5, 6))  # trains on
        dist.barrier()


def load_in_place(root: str, name: str, case: EngineCase, steps: int) -> None:
    """torch's flow: ``get_state_dict`` → ``dcp.load`` into it → ``set_state_dict`` (``steps`` steps first: 0, the
    state dict holds zero-filled state that ``set_state_dict`` copies into the state it creates; else views of the
    engine's memory, loaded in place)."""
    import torch.distributed.checkpoint as dcp

    engine = build_engine(case, seed=2)
    train(engine, range(7, 7 + steps))
    model, optim = get_state_dict(engine)
    dcp.load({"model": model, "optim": optim}, checkpoint_id=os.path.join(root, name))
    set_state_dict(engine, model, optim)
    expected = torch.load(os.path.join(root, f"{name}.expected.pt"), weights_only=False)
    check_loaded(engine, expected, f"{name} -> {case.id} in place", counters=False)
    train(engine, range(5, 6))


def continue_equals_uninterrupted(root: str, case: EngineCase) -> None:
    """Save after 2 steps and train 2 more; a fresh engine that loads trains the same 2 steps: equal bit for bit
    (masters, state, steps, working weights, counters, lr scheduler, loss scaler)."""
    path = os.path.join(root, f"continue-{case.id}")
    a = build_engine(case, seed=1)
    train(a, range(2))
    save(a, path)
    train(a, range(2, 4))
    b = build_engine(case, seed=2)
    train(b, range(7, 8))  # a stepped engine with other values: the load replaces everything
    load(b, path)
    train(b, range(2, 4))
    sa, sb = snapshot(a), snapshot(b)
    assert same(sa, sb), f"{case.id}: {diff(sa, sb)}"


# ---- refusals --------------------------------------------------------------------------------------------------------

def _refused(engine: Any, path: str, error: type[BaseException]) -> str:
    before = snapshot(engine)
    try:
        load(engine, path)
    except error as exc:
        message = str(exc)
    else:
        raise AssertionError(f"loading {path} did not raise {error.__name__}")
    after = snapshot(engine)
    assert same(before, after), f"a refused load changed {diff(before, after)}"
    return message


def _overwrite_killed(engine: Any, root: str) -> str:
    """A save over an existing checkpoint that dies after it started leaves no ``.metadata``: refused, not loaded
    half old, half new."""
    from unittest import mock

    from zero_dtensor.checkpoint import io as ckio

    path = os.path.join(root, "overwritten")
    save(engine, path)
    with mock.patch.object(ckio.dcp, "save", side_effect=RuntimeError("killed while writing")):
        try:
            save(engine, path)
        except RuntimeError as exc:
            assert "killed" in str(exc)
    dist.barrier()
    return _refused(engine, path, IncompleteCheckpointError)


def refusals(root: str) -> dict[str, str]:
    """Loads that must raise on every rank and change nothing."""
    odd = EngineCase(stage=2, world=dist.get_world_size())
    for name, case in (("other-model", EngineCase(stage=2, model="wide", world=odd.world)),
                       ("other-optimizer", EngineCase(stage=2, optimizer="sgd", world=odd.world)),
                       ("good", odd)):
        engine = build_engine(case)
        train(engine, range(1))
        save(engine, os.path.join(root, name))
        if name == "good":  # the same state, one parameter's lr changed: its group's hyperparameters disagree
            import torch.distributed.checkpoint as dcp

            model, optim = get_state_dict(engine)
            optim["param_groups.fc2.weight.lr"] = 0.5
            dcp.save({"model": model, "optim": optim}, checkpoint_id=os.path.join(root, "mixed-lr"))
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(root, "good"), os.path.join(root, "killed"))
        os.remove(os.path.join(root, "killed", ".metadata"))
        shutil.copytree(os.path.join(root, "good"), os.path.join(root, "damaged"))
        with open(os.path.join(root, "damaged", "__1_0.distcp"), "r+b") as f:
            f.truncate(100)
    dist.barrier()
    target = build_engine(odd, seed=3)
    train(target, range(1))
    messages = {
        "other-model": _refused(target, os.path.join(root, "other-model"), CheckpointMismatchError),
        "other-optimizer": _refused(target, os.path.join(root, "other-optimizer"), CheckpointMismatchError),
        "killed": _refused(target, os.path.join(root, "killed"), IncompleteCheckpointError),
        "missing": _refused(target, os.path.join(root, "nowhere"), IncompleteCheckpointError),
        "damaged": _refused(target, os.path.join(root, "damaged"), CheckpointReadError),
        "mixed-lr": _refused(target, os.path.join(root, "mixed-lr"), CheckpointMismatchError),
    }
    messages["overwrite killed"] = _overwrite_killed(target, root)
    fresh = build_engine(odd, seed=4)  # never stepped: a refusal creates no optimizer state either
    _refused(fresh, os.path.join(root, "other-model"), CheckpointMismatchError)
    assert not families.optimizer_state_ready(fresh)
    load(target, os.path.join(root, "good"))  # the engine still loads a good checkpoint afterwards
    return messages


def state_dict_format(case: EngineCase) -> dict[str, Any]:
    """The keys and value kinds of ``get_state_dict`` (rank 0 reports)."""
    engine = build_engine(case)
    train(engine, range(1))
    model, optim = get_state_dict(engine)
    return {"model": sorted(model), "optim": sorted(optim),
            "kinds": sorted({type(v).__name__ for v in [*model.values(), *optim.values()]})}


__all__ = ["DTYPES", "continue_equals_uninterrupted", "load_cases", "refusals", "save_cases", "state_dict_format"]


# ---- FSDP2 interop ---------------------------------------------------------------------------------------------------

def _fsdp(seed: int, kind: str = "odd") -> tuple[Any, Any]:
    """FSDP2 + torch AdamW: ``odd`` with ``fully_shard`` per Linear and on the root; ``tied`` (a weight shared by
    two Linears) on the root only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from workers.common import MODELS

    torch.manual_seed(seed)
    model = MODELS[kind]()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "odd":
        for layer in (model.fc1, model.fc2, model.tiny, model.fc3):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def _fsdp_state(model: Any, optim: Any) -> tuple[dict, dict, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, optim, options=options)
    return msd, osd, options


def fsdp_loads(root: str, name: str, kind: str = "odd") -> None:
    """A checkpoint from ``save`` loads into FSDP2 + torch AdamW with torch's own functions: equal bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, optim = _fsdp(seed=9, kind=kind)
    msd, osd, options = _fsdp_state(model, optim)
    if kind == "tied":  # torch's model state dict names a tied weight under both names
        assert {"mid.weight", "mid2.weight"} <= set(msd), sorted(msd)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, name))
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=options)
    expected = torch.load(os.path.join(root, f"{name}.expected.pt"), weights_only=False)
    for n, p in model.named_parameters():
        assert same(p.full_tensor(), expected["master"][n]), n
        state = optim.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert same(state[key].full_tensor(), expected["state"][key][n]), (n, key)
        assert float(state["step"]) == expected["steps"][0], n
    assert optim.param_groups[0]["lr"] == expected["hps"][0]["lr"]
    if kind == "tied":
        assert model.mid2.weight is model.mid.weight  # still tied after set_state_dict
    loss = model(torch.randn(4, 33)).pow(2).mean()  # trains on
    loss.backward()
    optim.step()


def fsdp_saves(root: str, name: str, kind: str = "odd") -> None:
    """FSDP2 + torch AdamW trains 2 steps and saves through DCP (torch's flattened format); expected values are
    written in the snapshot format."""
    import torch.distributed.checkpoint as dcp

    model, optim = _fsdp(seed=11, kind=kind)
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        model(torch.randn(4, 33, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    msd, osd, _ = _fsdp_state(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, name))
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

    nested = torch_get_state_dict(model, optim)  # torch's default: param_groups by position
    dcp.save({"model": nested[0], "optim": nested[1]}, checkpoint_id=os.path.join(root, f"{name}-nested"))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    state = {k: {n: optim.state[p][k].full_tensor() for n, p in model.named_parameters()}
             for k in ("exp_avg", "exp_avg_sq")}
    expected = {"master": full, "working": full, "state": state, "steps": [2.0],
                "counters": {"global_steps": 0, "global_samples": 0, "skipped_steps": 0},
                "hps": [{k: v for k, v in optim.param_groups[0].items() if k != "params"}]}
    if dist.get_rank() == 0:
        torch.save(expected, os.path.join(root, f"{name}.expected.pt"))
    dist.barrier()


def tied_names(root: str, name: str) -> dict[str, Any]:
    """The tied weight's entries in a checkpoint (names and sizes) and in ``get_state_dict`` of a tied engine."""
    from torch.distributed.checkpoint import FileSystemReader

    case = EngineCase(stage=3, model="tied", world=dist.get_world_size())
    model, optim = get_state_dict(build_engine(case))
    meta = FileSystemReader(os.path.join(root, name)).read_metadata().state_dict_metadata
    return {"checkpoint": sorted(k for k in meta if ".mid" in k and "param_groups" not in k),
            "same value": model["mid2.weight"] is model["mid.weight"], "optim": sorted(k for k in optim if "mid2" in k)}


def load_fsdp_checkpoint(root: str, name: str, case: EngineCase) -> None:
    """A DCP checkpoint written by FSDP2 + torch AdamW loads into a DeepSpeed engine with ``load``; one in torch's
    nested optimizer form loads too, its hyperparameters (``param_groups.0.lr``) left alone."""
    engine = build_engine(case, seed=2)
    own = dsck.group_hyperparameters(engine)
    assert load(engine, os.path.join(root, f"{name}-nested")) is None
    expected = torch.load(os.path.join(root, f"{name}.expected.pt"), weights_only=False)
    check_loaded(engine, {**expected, "hps": list(own)}, f"{name}-nested -> {case.id}")
    engine = build_engine(case, seed=2)
    assert load(engine, os.path.join(root, name)) is None
    check_loaded(engine, expected, f"{name} -> {case.id}")
    train(engine, range(5, 6))


def collective_counts(root: str, cases: list[EngineCase]) -> list[dict[str, Any]]:
    return [_collective_counts(root, case) for case in cases]


def _collective_counts(root: str, case: EngineCase) -> dict[str, Any]:
    """Collectives (``CommDebugMode``) of ``get_state_dict``, ``set_state_dict``, ``save`` and ``load`` on a stepped
    engine, and what the refresh of the working weights is documented to issue."""
    from workers.common import count_comms
    from workers.families_ds import sync_collectives
    from zero_dtensor._deepspeed.sync import sync_model_params

    engine = build_engine(case)
    train(engine, range(1))
    path = os.path.join(root, f"counts-{case.id}")
    out: dict[str, Any] = {"sync": sync_collectives(engine)}
    with count_comms() as mode:
        model, optim = get_state_dict(engine)
    out["get_state_dict"] = mode.get_total_counts()
    with count_comms() as mode:
        set_state_dict(engine, model, optim)
    out["set_state_dict"] = mode.get_total_counts()
    with count_comms() as mode:
        sync_model_params(engine)
    out["refresh"] = {str(k): v for k, v in mode.get_comm_counts().items()}
    clones: list[torch.Size] = []
    original_clone = torch.Tensor.clone

    def counted_clone(self, *args, **kwargs):
        clones.append(self.shape)
        return original_clone(self, *args, **kwargs)

    torch.Tensor.clone = counted_clone  # DCP clones a CPU view whose storage holds more than it before writing it
    try:
        with count_comms() as mode:
            save(engine, path)
    finally:
        torch.Tensor.clone = original_clone
    out["save"] = {str(k): v for k, v in mode.get_comm_counts().items()}
    out["clones in save"] = clones
    with count_comms() as mode, _staging_watched() as watched:
        load(engine, path)
    out["load"] = {str(k): v for k, v in mode.get_comm_counts().items()}
    out["staging"] = watched
    fresh = build_engine(case)  # never stepped: no optimizer state to read into, staging buffers instead
    with count_comms() as mode, _staging_watched() as watched:
        load(fresh, path)
    out["load, never stepped"] = {str(k): v for k, v in mode.get_comm_counts().items()}
    out["staging, never stepped"] = watched
    return out


@contextlib.contextmanager
def _staging_watched() -> Iterator[dict[str, Any]]:
    """During ``load``: how many staging buffers ``_destination`` makes (none where the optimizer state exists: the
    engine's memory is read in place) and how many are still alive when the working-weight refresh starts
    (documented: none, they are freed before it; the collector is paused during ``load``, so only what nothing
    refers to any more is freed)."""
    import zero_dtensor.checkpoint.io as ckio

    buffers: list[weakref.ref] = []
    found: dict[str, Any] = {"alive at the refresh": []}
    destination, refresh = ckio._destination, ckio.sync_model_params

    def watched_destination(*args: Any) -> tuple[dict[str, Any], set[int]]:
        empty_like = torch.empty_like

        def recorded(*a: Any, **k: Any) -> torch.Tensor:  # every buffer _destination makes
            made = empty_like(*a, **k)
            buffers.append(weakref.ref(made))
            return made

        torch.empty_like = recorded
        try:
            return destination(*args)
        finally:
            torch.empty_like = empty_like
            found["made"] = len(buffers)

    def watched_refresh(engine: Any) -> None:
        found["alive at the refresh"].append(sum(ref() is not None for ref in buffers))
        refresh(engine)

    ckio._destination, ckio.sync_model_params = watched_destination, watched_refresh
    try:
        yield found
    finally:
        ckio._destination, ckio.sync_model_params = destination, refresh


def cached_plans(root: str, case: EngineCase) -> dict[str, Any]:
    """Three saves of one engine, a step apart: the first plans in full, the second reuses every rank's cached plans
    (DCP's plan cache), the third runs after the coordinator alone dropped its cache (as a restarted coordinator
    would): refused once, then planned in full. Every checkpoint loads back the values it saved."""
    from torch.distributed.checkpoint.planner import SavePlanner

    from zero_dtensor.checkpoint import io as zio
    from zero_dtensor.checkpoint import planners

    usable: list[bool] = []
    refused: list[str] = []
    keys: set[str] = set()
    local_plan = planners.CachingSavePlanner.create_local_plan
    global_plan = planners.CachingSavePlanner.create_global_plan

    def recorded_local(self):
        plan = local_plan(self)
        usable.append(plan.usable)
        keys.add(self._cached_plans_key)
        return plan

    def recorded_global(self, all_plans):
        try:
            return global_plan(self, all_plans)
        except planners.PlansNotCachedError as exc:
            refused.append(str(exc))
            raise

    for key in [k for k in SavePlanner._cached_save_plan if k.startswith("zero_dtensor:")]:
        planners.forget_plans(key)  # as in a new process: earlier tests saved engines of the same shapes
    engine = build_engine(case, seed=1)
    found: dict[str, Any] = {}
    planners.CachingSavePlanner.create_local_plan = recorded_local
    planners.CachingSavePlanner.create_global_plan = recorded_global
    try:
        for name in ("first", "cached", "coordinator-restarted"):
            train(engine, range(1))
            if name == "coordinator-restarted" and dist.get_rank() == 0:
                for key in [k for k in SavePlanner._cached_all_plans if k.startswith("zero_dtensor:")]:
                    planners.forget_plans(key)
            usable.clear(), refused.clear()
            expected = snapshot(engine)
            save(engine, os.path.join(root, name))
            found[name] = {"usable": list(usable), "refused": len(refused)}
            train(engine, range(1))
            load(engine, os.path.join(root, name))
            check_loaded(engine, expected, name)
    finally:
        planners.CachingSavePlanner.create_local_plan = local_plan
        planners.CachingSavePlanner.create_global_plan = global_plan
    found["keys"] = sorted(keys)
    found["cached"]["kept"] = [k in SavePlanner._cached_save_plan for k in keys]
    assert zio.plan_key is planners.plan_key
    return found


def second_pass_failure(root: str) -> str:
    """An I/O error on rank 1 while its checked entries are read into the engine (the second pass): every rank
    raises (no hang in the refresh that would follow), saying the engine is partly overwritten; a new load
    restores it."""
    from zero_dtensor.checkpoint import reader

    engine = build_engine(EngineCase(stage=2, world=dist.get_world_size()))
    train(engine, range(1))
    path = os.path.join(root, "second-pass")
    save(engine, path)
    expected = snapshot(engine)
    train(engine, range(1, 2))
    second_pass = reader.DirectReader._read_deferred

    def failing(self, planner):
        if dist.get_rank() != 1:
            return second_pass(self, planner)
        read_to, copy_to = reader._read_to, reader._copy_to  # the second pass reads, or copies from a checked map

        def broken(*args):
            raise OSError("the disk went away")

        reader._read_to = reader._copy_to = broken
        try:
            return second_pass(self, planner)
        finally:
            reader._read_to, reader._copy_to = read_to, copy_to

    reader.DirectReader._read_deferred = failing
    try:
        load(engine, path)
    except CheckpointReadError as exc:
        message = f"{exc} {' '.join(getattr(exc, '__notes__', []))}"
    else:
        raise AssertionError("the failed second pass was not reported")
    finally:
        reader.DirectReader._read_deferred = second_pass
    load(engine, path)
    check_loaded(engine, expected, "after the failed load")
    return message


def load_plans(root: str, cases: list[EngineCase]) -> list[dict[str, Any]]:
    """Per case (a stepped engine, saved): the local load plan of ``zd.load``'s state dict by ``CachingLoadPlanner``
    (its own plan, DCP's default planner never asked) and by DCP's ``DefaultLoadPlanner``, each lookup of the read
    items, and the same for a state dict of another shape (DCP's own plan)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from zero_dtensor.checkpoint.io import _destination, read_metadata
    from zero_dtensor.checkpoint.planners import CachingLoadPlanner
    from zero_dtensor.checkpoint.target import describe

    out = []
    for case in cases:
        engine = build_engine(case)
        train(engine, range(1))
        path = os.path.join(root, f"plans-{case.id}")
        save(engine, path)
        metadata = read_metadata(path)
        state, _ = _destination(engine, describe(engine), metadata)
        found: dict[str, Any] = {}
        asked = []
        original = DefaultLoadPlanner.create_local_plan

        def recorded(self):
            asked.append(type(self).__name__)
            return original(self)

        DefaultLoadPlanner.create_local_plan = recorded
        try:
            for name, planner in (("ours", CachingLoadPlanner(allow_partial_load=False)),
                                  ("dcp", DefaultLoadPlanner(allow_partial_load=False))):
                planner.set_up_planner(state, metadata, dist.get_rank() == 0)
                plan = planner.create_local_plan()
                looked_up = [planner.lookup_tensor(item.dest_index) for item in plan.items
                             if item.type.name != "BYTE_IO"]
                found[name] = (plan.items, [(t.data_ptr(), tuple(t.shape)) for t in looked_up])
            found["asked DCP's plan"] = asked[:]
            asked.clear()
            other = {"model": {"extra": torch.zeros(3)}}  # a key the checkpoint lacks: DCP's own plan and error
            planner = CachingLoadPlanner(allow_partial_load=False)
            planner.set_up_planner(other, metadata, dist.get_rank() == 0)
            try:
                planner.create_local_plan()
            except RuntimeError as exc:
                found["missing key"] = (str(exc), asked[:])
        finally:
            DefaultLoadPlanner.create_local_plan = original
        found["items"] = len(found["ours"][0])
        found["same"] = found["ours"] == found["dcp"]
        del found["ours"], found["dcp"]
        out.append(found)
    return out


# ---- issue 45: save and load calls that differ between ranks -------------------------------------------------------

def disagreeing_saves(root: str, case: EngineCase) -> dict[str, str]:
    """Issue 45, items 4 and 5: ``save`` agrees on its normalized path and ``async_`` before its first collective.
    A path per rank (each rank's own directory; or rank 0 over an existing checkpoint) and ``async_=True`` on some
    ranks only (its first collective, a process group's creation, ran on those ranks only: a hang) raise
    :class:`RankDisagreementError` on every rank; nothing is written (no directory made, an existing checkpoint
    keeps its ``.metadata`` and still loads). Saves that agree work afterwards, async ones too."""
    from zero_dtensor.errors import RankDisagreementError

    rank, last = dist.get_rank(), dist.get_rank() == dist.get_world_size() - 1
    engine = build_engine(case, seed=1)
    train(engine, range(1))
    existing = os.path.join(root, "existing")
    save(engine, existing)
    before = snapshot(engine)
    messages = {
        "path per rank": raises_everywhere(
            "path per rank", lambda: save(engine, os.path.join(root, f"per-rank-{rank}")), RankDisagreementError),
        "over a checkpoint on rank 0": raises_everywhere(
            "over a checkpoint", lambda: save(engine, existing if rank == 0 else os.path.join(root, "elsewhere")),
            RankDisagreementError),
        "async on some ranks": raises_everywhere(
            "async on some ranks", lambda: save(engine, os.path.join(root, "async-some"), async_=not last),
            RankDisagreementError),
    }
    dist.barrier()
    made = sorted(set(os.listdir(root)) - {"existing"})
    assert made == [], f"refused saves wrote {made}"
    assert os.path.isfile(os.path.join(existing, ".metadata"))
    after = snapshot(engine)
    assert same(before, after), f"a refused save changed {diff(before, after)}"
    # the group is in step: an async save on every rank, then a load of each checkpoint
    future = save(engine, os.path.join(root, "async-all"), async_=True)
    future.result()
    dist.barrier()
    for path in (existing, os.path.join(root, "async-all")):
        target = build_engine(case, seed=3)
        train(target, range(1))
        load(target, path)
        assert same(snapshot(target)["master"], before["master"]), path
    return messages


def disagreeing_loads(root: str, case: EngineCase) -> dict[str, str]:
    """Issue 45, item 2: ``load`` with another checkpoint on some rank (each rank picking "the latest" itself)
    loaded a mixture (some parameters from one checkpoint, some from the other, one half and half; ``global_steps``
    differing between ranks). Its first agreement now hashes the normalized path and the checkpoint's identity
    (DCP's ``save_id``): every rank raises :class:`RankDisagreementError` and no engine changes, stepped or never
    stepped. The same path naming different checkpoints (node-local storage; simulated on the last rank by
    patching the path normalization) is caught by the identity. Afterwards an agreeing load works."""
    from unittest import mock

    from zero_dtensor.checkpoint import io as ckio
    from zero_dtensor.errors import RankDisagreementError

    last = dist.get_rank() == dist.get_world_size() - 1
    engine = build_engine(case, seed=1)
    train(engine, range(1))
    old, new = os.path.join(root, "old"), os.path.join(root, "new")
    save(engine, old)
    train(engine, range(1, 3))
    save(engine, new)
    target = build_engine(case, seed=3)
    train(target, range(1))
    fresh = build_engine(case, seed=4)  # never stepped: read into staging, one agreement
    messages: dict[str, str] = {}
    for name, engine_ in (("stepped", target), ("never stepped", fresh)):
        before = snapshot(engine_)
        messages[f"{name}: another path"] = raises_everywhere(
            f"{name}: another path", lambda: load(engine_, new if last else old), RankDisagreementError)
        same_name = mock.patch.object(ckio, "normalized", lambda path: os.path.abspath(old)) if last \
            else contextlib.nullcontext()
        with same_name:  # the last rank reads `new` under the name `old`
            messages[f"{name}: another checkpoint"] = raises_everywhere(
                f"{name}: another checkpoint", lambda: load(engine_, new if last else old), RankDisagreementError)
        after = snapshot(engine_)
        assert same(before, after), f"{name}: a refused load changed {diff(before, after)}"
    assert not families.optimizer_state_ready(fresh)
    load(target, new)
    counters = [None] * dist.get_world_size()
    dist.all_gather_object(counters, dsck.engine_counters(target))
    assert all(c == counters[0] for c in counters), counters
    assert same(snapshot(target)["master"], snapshot(engine)["master"])
    return messages
# ---- integrity: damaged data, the write mark (issue 45) --------------------------------------------------------------

def _flip_in_rank_file(path: str, prefix: str, rank: int) -> tuple[str, str]:
    """A copy of checkpoint ``path`` with one bit flipped in the tensor data of the largest entry whose name starts
    with ``prefix`` in rank ``rank``'s ``.distcp`` file (this rank does it: call on one rank); its path and the
    entry's name."""
    import io as _io

    from torch.distributed.checkpoint import FileSystemReader

    damaged = f"{path}-{prefix.replace('.', '-')}-flipped"
    shutil.copytree(path, damaged)
    file = f"__{rank}_0.distcp"
    entries = [(info.length, index.fqn, info) for index, info in FileSystemReader(path).read_metadata()
               .storage_data.items() if index.fqn.startswith(prefix) and info.relative_path == file]
    _, fqn, info = max(entries, key=lambda e: e[0])
    with open(os.path.join(damaged, file), "r+b") as f:
        f.seek(info.offset)
        archive = torch._C.PyTorchFileReader(_io.BytesIO(f.read(info.length)))
        where = info.offset + archive.get_record_offset("data/0") + len(archive.get_record("data/0")) // 2
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x01]))
    return damaged, fqn


def _cast_masters_equal_working(engine: Any) -> bool:
    """Whether every trainable parameter's working weights are its fp32 master cast to their dtype (collective)."""
    masters, weights = assemble(families.master_storage(engine)), working(engine)
    return all(torch.equal(weights[n], m.to(weights[n].dtype).view_as(weights[n])) for n, m in masters.items())


def integrity(root: str, stage: int) -> dict[str, str]:
    """Damaged checkpoints refused on every rank with a documented class naming the checkpoint (and, on the rank
    that read it, the file and entry), the engine unchanged: one flipped bit in a master piece and in an
    ``exp_avg_sq`` piece of rank 1's file, a truncated ``.metadata``. Then the write mark: ``zd.load`` and
    ``zd.set_state_dict`` after an unsynced master write clear it (a forward runs), and ``engine.save_checkpoint``
    while marked syncs first (the original engine's working weights are the cast masters afterwards, and so are those
    of an engine resumed by ``load_checkpoint``). Returns this rank's messages."""
    from unittest import mock

    import zero_dtensor as zd
    from zero_dtensor.families import master as master_module
    from zero_dtensor.families.master import needs_sync

    case = EngineCase(stage=stage, dtype="bf16", world=dist.get_world_size())
    source = build_engine(case)
    train(source, range(1))
    good = os.path.join(root, f"good-{stage}")
    save(source, good)
    damaged: dict[str, tuple[str, str]] = {}
    if dist.get_rank() == 0:
        damaged["master"] = _flip_in_rank_file(good, "model.", 1)
        damaged["exp_avg_sq"] = _flip_in_rank_file(good, "optim.state.", 1)
        while not damaged["exp_avg_sq"][1].endswith("exp_avg_sq"):  # the largest state entry may be exp_avg
            shutil.rmtree(damaged["exp_avg_sq"][0])
            damaged["exp_avg_sq"] = _flip_in_rank_file(good, "optim.state." + damaged["exp_avg_sq"][1]
                                                       [len("optim.state."):].rpartition(".")[0] + ".exp_avg_sq", 1)
        truncated = os.path.join(root, f"truncated-{stage}")
        shutil.copytree(good, truncated)
        with open(os.path.join(truncated, ".metadata"), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(truncated, ".metadata")) // 2)
    shared = [damaged]
    dist.broadcast_object_list(shared, src=0)
    damaged = shared[0]
    target = source  # refused loads must leave it as it is (``_refused`` compares)
    messages = {}
    for kind, (path, fqn) in damaged.items():
        message = _refused(target, path, CheckpointReadError)
        assert repr(path) in message, message
        if dist.get_rank() == 1:  # the rank that read the damaged entry names the file and the entry
            assert "CRC-32" in message and "'__1_0.distcp'" in message and repr(fqn) in message, message
        messages[kind] = message
    truncated = os.path.join(root, f"truncated-{stage}")
    messages["truncated .metadata"] = _refused(target, truncated, CheckpointReadError)
    assert repr(truncated) in messages["truncated .metadata"], messages["truncated .metadata"]

    master = zd.sharded_master_params(target)
    master.mul_(1.5)  # an unsynced write; the load overwrites every master and refreshes the working weights
    load(target, good)
    assert not needs_sync(target) and _cast_masters_equal_working(target)
    forward_backward(target, 1)  # no ModelParamsNotSyncedError
    target.step()
    model, optim = get_state_dict(target)
    model, optim = ({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
                    for d in (model, optim))
    master.mul_(1.5)
    set_state_dict(target, model, optim)
    assert not needs_sync(target) and _cast_masters_equal_working(target)
    forward_backward(target, 2)
    target.step()

    master.mul_(1.5)  # unsynced: DeepSpeed's save_checkpoint must not save the stale working weights
    ds_dir = os.path.join(root, f"ds-{stage}")
    with mock.patch.object(master_module, "sync_model_params", side_effect=master_module.sync_model_params) as sync:
        target.save_checkpoint(ds_dir, tag="t")
        if stage < 3:  # ZeRO-3's load_checkpoint makes the working weights from the masters itself
            resumed = build_engine(case, seed=4)
            resumed.load_checkpoint(ds_dir, tag="t")
            assert _cast_masters_equal_working(resumed), "the resumed engine's working weights are not its masters"
        assert sync.call_count == 1 and not needs_sync(target) and _cast_masters_equal_working(target)
        target.save_checkpoint(ds_dir, tag="u")  # unmarked: the agreement only, no sync
        assert sync.call_count == 1, sync.call_count
        if dist.get_rank() == 0:  # marked on one rank only (a write through live views): every rank syncs, none hangs
            master.mark_written()
        target.save_checkpoint(ds_dir, tag="v")
        assert sync.call_count == 2 and not needs_sync(target), sync.call_count
    return messages



def save_after_state_order_differs(root: str, case: EngineCase) -> None:
    """The inner optimizer's state dicts list their keys in another order on rank 1 (as after DeepSpeed's universal
    load, which builds them from a set of key names, in each process's own string-hash order): ``zd.save`` and
    ``zd.load`` still pair each key with itself across ranks, and a fresh engine loads the saving engine's values
    bit for bit."""
    path = os.path.join(root, f"order-{case.id}")
    a = build_engine(case, seed=1)
    train(a, range(2))
    if dist.get_rank() == 1:
        inner = a.optimizer.optimizer
        for p in list(inner.state):
            inner.state[p] = dict(reversed(list(inner.state[p].items())))
    inner = a.optimizer.optimizer
    orders: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(orders, [list(inner.state[p]) for p in inner.state])
    assert orders[0] != orders[1], orders  # the case this is about: the state dicts' orders differ ...
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, families.optimizer_state_keys(a))
    assert keys[0] == keys[1], keys  # ... the families' order does not (a loop over them pairs each key with itself)
    expected = snapshot(a)
    save(a, path)
    b = build_engine(case, seed=2)
    train(b, range(7, 8))
    if dist.get_rank() == 0:
        inner = b.optimizer.optimizer
        for p in list(inner.state):
            inner.state[p] = dict(reversed(list(inner.state[p].items())))
    load(b, path)
    got = snapshot(b)
    assert same(expected["master"], got["master"]) and same(expected["state"], got["state"]), \
        f"{case.id}: {diff(expected, got)}"


def mid_accumulation_load(root: str, case: EngineCase) -> dict[str, str]:
    """``zd.load`` into an engine one micro-step into a gradient accumulation cycle (``case.gas`` = 2) is refused
    on every rank with the engine unchanged (its accumulated gradients would meet the loaded state at a shifted
    boundary: the next step trained differently, silently); at the boundary, after the cycle's second micro-step,
    the same checkpoint loads."""
    engine = build_engine(case)
    train(engine, range(2))  # one full cycle: the optimizer stepped once
    path = os.path.join(root, "mid-accumulation")
    save(engine, path)
    train(engine, range(2, 3))  # one micro-step into the next cycle
    message = _refused(engine, path, CheckpointMismatchError)
    train(engine, range(3, 4))  # the cycle's boundary
    load(engine, path)
    return {"message": message}
