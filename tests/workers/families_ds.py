"""Worker side of ``tests/test_families_ds.py``: DeepSpeed's fp32 masters and optimizer state as sharded storages
(``zero_dtensor._deepspeed.families``) and the working-weight refresh (``zero_dtensor._deepspeed.sync``).

Every check compares with DeepSpeed's own per-parameter API (``safe_get_full_fp32_param``,
``safe_get_full_optimizer_state``, ``safe_set_*``) on an identical engine. The full tensors are assembled here from
every rank's partitions with the test's own geometry (not the library's placement code).
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)

from workers.common import DTYPES, MODELS, EngineCase, batch, build_engine, count_comms, fill_value, raises_everywhere
from zero_dtensor._deepspeed import families, grad_storage, sync
from zero_dtensor.errors import OptimizerStateNotReadyError
from zero_dtensor.errors import UnsupportedDeepSpeedError
from zero_dtensor.layout.flat import GroupLayout, Packing, ParamLayout
from zero_dtensor.core.storage import FlatStorage


# ---- the test's own geometry -------------------------------------------------------------------------------------

def fragment(group: GroupLayout, param: ParamLayout, rank: int) -> tuple[int, int, int]:
    """``(start, stop, local offset)``: the elements of the flattened ``param`` that ``rank`` holds and where they
    start in its partition."""
    if group.replicated:
        return 0, param.numel, param.offset
    if group.packing is Packing.CHUNKED:
        start = min(rank * param.chunk_numel, param.numel)
        return start, min(start + param.chunk_numel, param.numel), param.offset
    lo, hi = rank * group.partition_numel, (rank + 1) * group.partition_numel
    first, last = max(param.offset, lo), min(param.offset + param.numel, hi)
    if first >= last:
        return 0, 0, 0
    return first - param.offset, last - param.offset, first - lo


def assemble(storage: FlatStorage) -> dict[str, torch.Tensor]:
    """Every parameter's full fp32 values, from every rank's partitions (one all_gather per group)."""
    layout = storage.layout
    gathered = []
    for g, part, pg in zip(layout.groups, storage.partitions, storage.process_groups):
        out = [torch.empty_like(part) for _ in range(g.world_size)]
        dist.all_gather(out, part.contiguous(), group=pg)
        gathered.append(out)
    full = {}
    for p in layout.params:
        g = layout.groups[p.group]
        flat = torch.empty(p.numel, dtype=torch.float32)
        covered = torch.zeros(p.numel, dtype=torch.bool)
        for r in range(g.world_size):
            start, stop, local = fragment(g, p, r)
            flat[start:stop] = gathered[p.group][r][local:local + stop - start].float()
            covered[start:stop] = True
        assert bool(covered.all()), p.name
        full[p.name] = flat.view(p.shape)
    return full


def write_full(storage: FlatStorage, values: dict[str, torch.Tensor]) -> None:
    """This rank's fragment of every value into ``storage``'s partitions (no communication)."""
    layout = storage.layout
    for p in layout.params:
        g = layout.groups[p.group]
        start, stop, local = fragment(g, p, g.rank)
        storage.partitions[p.group][local:local + stop - start].copy_(values[p.name].flatten()[start:stop])


# ---- DeepSpeed's side --------------------------------------------------------------------------------------------

def named_trainable(engine: Any) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by their first name (tied parameters once)."""
    out: dict[str, torch.nn.Parameter] = {}
    seen = set()
    for name, p in engine.module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


def ds_masters(engine: Any) -> tuple[torch.Tensor, ...]:
    opt = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        if hasattr(opt, attr):
            return tuple(getattr(opt, attr))
    raise AssertionError(type(opt))


def ds_set(engine: Any, p: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """DeepSpeed's own full write of a master (``key`` None) or a state tensor. ZeRO-3's full setters fail on the
    last rank when ``numel % world_size != 0`` (DeepSpeed narrows past the end); there DeepSpeed's local setter takes
    this rank's zero-padded chunk."""
    if engine.zero_optimization_stage() == 3 and p.ds_numel % dist.get_world_size() != 0:
        pn = p.partition_numel()
        chunk = torch.zeros(pn * dist.get_world_size(), dtype=torch.float32)
        chunk[: p.ds_numel] = value.flatten()
        mine = chunk[dist.get_rank() * pn:(dist.get_rank() + 1) * pn]
        if key is None:
            safe_set_local_fp32_param(p, mine)
        else:
            safe_set_local_optimizer_state(p, mine, key)
        return
    if key is None:
        safe_set_full_fp32_param(p, value)
    else:
        safe_set_full_optimizer_state(p, value, key)


def ds_refresh(engine: Any) -> None:
    """DeepSpeed's own refresh of the working weights after a master write (what its step does afterwards)."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() != 3:
        opt.update_lp_params()
        return
    for sg in range(len(opt.fp16_groups)):
        opt._reassign_or_swap_out_partitioned_parameters(sg)
    opt._partition_all_parameters()
    if opt.persistent_parameters:
        opt.persistent_parameters[0].all_gather(opt.persistent_parameters)


def working_weights(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's working (bf16/fp16/fp32) weight, full (gathered under ZeRO-3), frozen ones included."""
    params = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def step(engine: Any, index: int) -> torch.Tensor:
    loss = engine(batch(engine, index)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.detach()


def ds_relink(engine: Any) -> None:
    """Make DeepSpeed's per-parameter optimizer-state views cover every param group. DeepSpeed 0.19.8 ZeRO-1/2 links
    them once, right after the *first* group's inner step (stage_1_and_2.py:2987, 852-857), when the other groups
    have no state yet: with two param groups, ``safe_get/set_full_optimizer_state`` of every parameter outside
    group 0 raises ``ValueError: exp_avg not found in optimizer state fragment`` for ever. Relinking by hand is the
    workaround (BF16_Optimizer links after its whole step and is not affected)."""
    opt = engine.optimizer
    if hasattr(opt, "single_partition_of_fp32_groups"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def ds_full_state(engine: Any, key: str) -> dict[str, torch.Tensor]:
    ds_relink(engine)
    return {n: safe_get_full_optimizer_state(p, key).float() for n, p in named_trainable(engine).items()}


def ds_full_masters(engine: Any) -> dict[str, torch.Tensor]:
    return {n: safe_get_full_fp32_param(p).float() for n, p in named_trainable(engine).items()}


def assert_same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == theirs.keys(), (what, sorted(ours), sorted(theirs))
    for n in ours:
        assert ours[n].shape == theirs[n].shape, (what, n, ours[n].shape, theirs[n].shape)
        assert torch.equal(ours[n], theirs[n]), (what, n, (ours[n] - theirs[n]).abs().max().item())


def plain_output(case: EngineCase, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The forward output of a plain (non-DeepSpeed) copy of the model holding ``weights``."""
    model = MODELS[case.model]().to(DTYPES[case.dtype])
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
        return model(x)


def engine_output(engine: Any, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine(x)


# ---- checks -------------------------------------------------------------------------------------------------------

def expected_keys(case: EngineCase) -> tuple[str, ...]:
    return ("momentum_buffer",) if case.optimizer == "sgd" else ("exp_avg", "exp_avg_sq")


def targets(names: Any, shapes: dict[str, torch.Size], tag: str, scale: float) -> dict[str, torch.Tensor]:
    return {n: fill_value(n + tag, shapes[n]) * scale for n in names}


def sync_collectives(engine: Any) -> int:
    """What ``sync_model_params`` is documented to issue on this engine."""
    opt = engine.optimizer
    if dist.get_world_size() == 1:
        return 0
    if engine.zero_optimization_stage() == 3:  # the persistent parameters together, one gather per dtype
        return len({p.ds_tensor.dtype for p in opt.persistent_parameters})
    return len(ds_masters(engine))


def check_family(case: EngineCase) -> dict[str, Any]:
    ours, theirs = build_engine(case), build_engine(case)
    names = named_trainable(ours)

    # before the first step: masters exist (as initialized), the optimizer state does not
    with count_comms() as mode:
        master = families.master_storage(ours)
    assert mode.get_total_counts() == 0, mode.get_comm_counts()
    assert_same(assemble(master), ds_full_masters(ours), "initial masters")
    assert not families.optimizer_state_ready(ours)
    for call in (lambda: families.optimizer_state_keys(ours), lambda: families.optimizer_state_storage(ours, "exp_avg"),
                 lambda: families.optimizer_steps(ours)):
        try:
            call()
        except OptimizerStateNotReadyError as e:
            assert "first engine.step()" in str(e), e
        else:
            raise AssertionError("state before the first step")

    step(ours, 0)
    step(theirs, 0)

    # the families alias DeepSpeed's memory and equal DeepSpeed's per-parameter view
    assert master.is_current()
    for part, ds in zip(master.partitions, ds_masters(ours)):
        assert part.data_ptr() == ds.data_ptr() and part.numel() == ds.numel() and part.device == ds.device
    assert [p.name for p in master.layout.params] == list(names)
    assert_same(assemble(master), ds_full_masters(ours), "masters")
    assert families.optimizer_state_ready(ours)
    keys = families.optimizer_state_keys(ours)
    assert keys == expected_keys(case), keys
    with count_comms() as mode:
        states = {k: families.optimizer_state_storage(ours, k) for k in keys}
    assert mode.get_total_counts() == 0, mode.get_comm_counts()
    for k, s in states.items():
        assert s.is_current() and s.layout is master.layout  # fp32 state: the masters' layout object itself
        assert_same(assemble(s), ds_full_state(ours, k), f"state {k}")
    steps = families.optimizer_steps(ours)
    assert len(steps) == len(master.partitions)
    if case.optimizer == "sgd":
        assert steps == (None,) * len(steps), steps
    else:
        assert all(torch.is_tensor(s) and s.dim() == 0 and float(s) == 1.0 for s in steps), steps
    for bad in ("step", "nope"):
        try:
            families.optimizer_state_storage(ours, bad)
        except KeyError as e:
            assert str(keys) in str(e), e
        else:
            raise AssertionError(bad)

    # the same edit, through the storages here and through DeepSpeed's per-parameter setters there
    shapes = {n: p.ds_shape if hasattr(p, "ds_shape") else p.shape for n, p in names.items()}
    new_master = targets(names, shapes, "master", 0.05)
    state_key = keys[0]
    new_state = targets(names, shapes, state_key, 1e-3)
    write_full(master, new_master)
    write_full(states[state_key], new_state)
    if case.optimizer != "sgd":
        families.set_optimizer_steps(ours, 3)
        assert all(float(s) == 3.0 for s in families.optimizer_steps(ours))
        assert all(a is b for a, b in zip(steps, families.optimizer_steps(ours)))  # filled in place
    with count_comms() as mode:
        sync.sync_model_params(ours)
    assert mode.get_total_counts() == sync_collectives(ours), (mode.get_comm_counts(), sync_collectives(ours))
    if case.stage == 3:  # as after DeepSpeed's step: persistent parameters gathered (fresh), the others released
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        persistent = {id(p) for p in ours.optimizer.persistent_parameters}
        for p in ours.module.parameters():
            expected = ZeroParamStatus.AVAILABLE if id(p) in persistent else ZeroParamStatus.NOT_AVAILABLE
            assert p.ds_status == expected, (p.ds_summary(), expected)

    ds_relink(theirs)
    for n, p in named_trainable(theirs).items():
        ds_set(theirs, p, new_master[n])
        ds_set(theirs, p, new_state[n], state_key)
    if case.optimizer != "sgd":
        for m in ds_masters(theirs):
            theirs.optimizer.optimizer.state[m]["step"].fill_(3.0)
    ds_refresh(theirs)

    # the working weights are the cast masters, on both engines, and the forward uses them
    dtype = DTYPES[case.dtype]
    assert_same(assemble(master), new_master, "written masters")
    assert_same(ds_full_masters(ours), new_master, "written masters (DeepSpeed)")
    weights = working_weights(ours)
    for n in names:
        assert weights[n].dtype == dtype and torch.equal(weights[n], new_master[n].to(dtype)), n
    assert_same(working_weights(theirs), weights, "working weights (DeepSpeed's edit)")
    x = batch(ours, 7)
    out = engine_output(ours, x)
    assert torch.equal(out, plain_output(case, weights, x))
    assert torch.equal(engine_output(theirs, x), out)

    # one more step: identical on both engines; the gradient has the masters' geometry
    loss_ours = ours(batch(ours, 1)).float().pow(2).mean()
    ours.backward(loss_ours)
    grads = grad_storage(ours)
    assert grads.layout.params == master.layout.params
    for g, m in zip(grads.layout.groups, master.layout.groups):
        if case.bf16_optimizer:  # the gradient replicated, the master sharded
            assert g.replicated and not m.replicated and g.partition_numel == m.partition_numel * m.world_size
        else:
            assert (g.partition_numel, g.packing, g.replicated) == (m.partition_numel, m.packing, m.replicated)
            assert grads.layout is master.layout  # one geometry: one layout, one plan, whatever the dtypes
    ours.step()
    loss_ours, loss_theirs = loss_ours.detach(), step(theirs, 1)
    assert torch.equal(loss_ours, loss_theirs), (loss_ours, loss_theirs)
    assert_same(ds_full_masters(ours), ds_full_masters(theirs), "masters after the next step")
    assert_same(assemble(master), ds_full_masters(theirs), "our masters after the next step")
    for k in keys:
        assert states[k].is_current()
        assert_same(assemble(states[k]), ds_full_state(theirs, k), f"state {k} after the next step")
    if case.optimizer != "sgd":
        assert [float(s) for s in families.optimizer_steps(ours)] == [4.0] * len(steps)
    assert_same(working_weights(ours), working_weights(theirs), "working weights after the next step")
    return {"groups": len(master.partitions), "describe": master.describe}


def check_steps_validation() -> None:
    engine = build_engine(EngineCase(3, "bf16", zero={"sub_group_size": 600}))
    step(engine, 0)
    steps = families.optimizer_steps(engine)
    assert len(steps) == 2
    for bad in ([1.0], -1, float("nan"), True, ["2", "3"]):
        try:
            families.set_optimizer_steps(engine, bad)
        except ValueError:
            pass
        else:
            raise AssertionError(bad)
    assert [float(s) for s in families.optimizer_steps(engine)] == [1.0, 1.0]  # nothing written
    families.set_optimizer_steps(engine, [5, 6])
    assert [float(s) for s in families.optimizer_steps(engine)] == [5.0, 6.0]


def check_load_checkpoint(case: EngineCase, directory: str) -> None:
    """``engine.load_checkpoint`` copies masters in place (their storage stays current) and gives the optimizer state
    new tensors (its storage turns stale; a new one holds the loaded values)."""
    engine = build_engine(case)
    step(engine, 0)
    master = families.master_storage(engine)
    states = {k: families.optimizer_state_storage(engine, k) for k in families.optimizer_state_keys(engine)}
    saved_master = assemble(master)
    saved = {k: assemble(s) for k, s in states.items()}
    saved_steps = [float(s) for s in families.optimizer_steps(engine)]
    engine.save_checkpoint(directory, tag="t")
    step(engine, 1)  # move away from the saved values
    engine.load_checkpoint(directory, tag="t")
    assert master.is_current()
    assert_same(assemble(master), saved_master, "loaded masters")
    for k, s in states.items():
        assert not s.is_current(), k
        fresh = families.optimizer_state_storage(engine, k)
        assert fresh.is_current()
        assert_same(assemble(fresh), saved[k], f"loaded state {k}")
    assert [float(s) for s in families.optimizer_steps(engine)] == saved_steps


def check_refusals() -> None:
    try:
        families.master_storage(object())
    except TypeError:
        pass
    else:
        raise AssertionError("not an engine")
    engine = build_engine(EngineCase(3))
    opt = engine.optimizer
    opt.swap_optimizer = True  # as with offload_optimizer.device nvme (no NVMe here)
    try:
        for call in (families.master_storage, families.optimizer_state_ready, sync.sync_model_params):
            try:
                call(engine)
            except UnsupportedDeepSpeedError as e:
                assert "nvme" in str(e).lower(), e
            else:
                raise AssertionError(call)
    finally:
        opt.swap_optimizer = False


# ---- issue 45: calls that differ between ranks in what they read or write -------------------------------------------

def _family_bytes(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's partitions of the masters and of every optimizer-state key, copied."""
    out = {f"master {i}": t.detach().clone() for i, t in enumerate(families.master_storage(engine).partitions)}
    for key in families.optimizer_state_keys(engine):
        parts = families.optimizer_state_storage(engine, key).partitions
        out |= {f"{key} {i}": t.detach().clone() for i, t in enumerate(parts)}
    return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _unchanged(engine: Any, before: dict[str, torch.Tensor], what: str) -> None:
    """Every byte of this rank's partitions as in ``before``, compared as bytes: the last rank's partition padding
    is memory DeepSpeed never initialized, and ``torch.equal`` of a NaN pattern there with itself is False (a CI
    run failed on it with nothing written)."""
    after = _family_bytes(engine)
    changed = [k for k in before if not torch.equal(_bytes_of(before[k]), _bytes_of(after[k]))]
    assert not changed, f"{what} wrote {changed} on rank {dist.get_rank()}"


def disagreeing_families(case: EngineCase) -> dict[str, Any]:
    """Issue 45, item 1. Every communicating call of the masters, the optimizer state and clones, with the last
    rank naming the same parameters of *another* tensor (``exp_avg_sq`` beside ``exp_avg``, masters beside
    ``exp_avg``, one clone beside another): :class:`RankDisagreementError` on every rank, nothing written.
    Afterwards every agreeing call still returns DeepSpeed's values (the group is in step)."""
    import zero_dtensor as zd
    from zero_dtensor.errors import RankDisagreementError

    engine = build_engine(case)
    step(engine, 0)
    last = dist.get_rank() == dist.get_world_size() - 1
    master = zd.sharded_master_params(engine)
    avg, sq = zd.sharded_optimizer_state(engine, "exp_avg"), zd.sharded_optimizer_state(engine, "exp_avg_sq")
    ema, snap = master.clone(), master.clone()  # two clones of one family: different tensors too
    first = master.names[0]
    pairs = {  # (what the other ranks use, what the last rank uses)
        "exp_avg / exp_avg_sq": (avg, sq),
        "masters / exp_avg": (master, avg),
        "clone / clone": (ema, snap),
        "masters / its clone": (master, ema),
    }
    calls: dict[str, Any] = {
        "full_tensors": lambda t: t.full_tensors(),
        "full_tensors names": lambda t: t.full_tensors([first]),
        "iter_full": lambda t: list(t.iter_full()),
        "to_dtensors": lambda t: t.to_dtensors(),
        "owned": lambda t: t.owned(),
        "norms": lambda t: t.norms(),
        "global_norm": lambda t: t.global_norm(),
        "stats": lambda t: t.stats(),
        "clip_grad_norm_": lambda t: t.clip_grad_norm_(1e-6),
        "clip_per_param_": lambda t: t.clip_per_param_(1e-6),
        "set_owned_": lambda t: t.set_owned_({}),
        "map_full_": lambda t: t.map_full_(lambda n, x: x * 0),
        "param full_tensor": lambda t: t[first].full_tensor(),
        "set_dtensors_": None,  # below: needs DTensors made by an agreeing call
    }
    before = _family_bytes(engine)
    ema_before, snap_before = ema.full_tensors(), snap.full_tensors()
    messages: dict[str, str] = {}
    for pair, (mine, theirs) in pairs.items():
        use = theirs if last else mine
        for what, call in calls.items():
            if call is None:
                dts = mine.to_dtensors()  # the same on every rank: agrees
                call = lambda t, dts=dts: t.set_dtensors_(dts)  # noqa: E731
            messages[f"{pair}: {what}"] = raises_everywhere(f"{pair}: {what}", lambda: call(use),
                                                             RankDisagreementError)
        messages[f"{pair}: dots"] = raises_everywhere(
            f"{pair}: dots", lambda: master.dots(theirs if last else mine), RankDisagreementError)
        _unchanged(engine, before, pair)
    messages["get_full_optimizer_state"] = raises_everywhere(
        "get_full_optimizer_state",
        lambda: zd.get_full_optimizer_state(engine, "exp_avg_sq" if last else "exp_avg"), RankDisagreementError)
    assert_same(ema.full_tensors(), ema_before, "clone after refusals")
    assert_same(snap.full_tensors(), snap_before, "other clone after refusals")
    # the group is still in step: agreeing calls return DeepSpeed's values
    for key, front in (("exp_avg", avg), ("exp_avg_sq", sq)):
        assert_same(front.full_tensors(dtype=torch.float32), ds_full_state(engine, key), key)
    assert_same(master.full_tensors(dtype=torch.float32), ds_full_masters(engine), "masters")
    return messages


def disagreeing_fp32_writes(case: EngineCase) -> dict[str, Any]:
    """Issue 45, item 6: ``set_full_fp32_params`` with a value on the other ranks and ``{}`` on the last wrote
    part of the parameter (each rank its fragment); other names per rank, or a bad entry on one rank, likewise.
    Now :class:`RankDisagreementError` (the bad entry: its class) on every rank, nothing written, no sync mark;
    an agreeing call costs what it did (one agreement + the sync) and writes DeepSpeed's values."""
    import zero_dtensor as zd
    from zero_dtensor.errors import RankDisagreementError

    engine = build_engine(case)
    step(engine, 0)
    last = dist.get_rank() == dist.get_world_size() - 1
    master = zd.sharded_master_params(engine)
    first = master.names[0]
    before = _family_bytes(engine)
    messages: dict[str, str] = {}
    value = {first: torch.full_like(master.full_tensors([first])[first], 0.25)}
    messages["set_full_fp32_params value / {}"] = raises_everywhere(
        "set_full_fp32_params", lambda: zd.set_full_fp32_params(engine, {} if last else value),
        RankDisagreementError)
    names = list(master.names)
    messages["set_full_fp32_params other names"] = raises_everywhere(
        "set_full_fp32_params names", lambda: zd.set_full_fp32_params(
            engine, {n: torch.zeros(master[n].shape) for n in (names[-1:] if last else names[:1])}),
        RankDisagreementError)
    bad = {first: value[first].flatten()[:1]} if last else value  # a bad entry on one rank: its class everywhere
    messages["set_full_fp32_params bad entry"] = raises_everywhere(
        "set_full_fp32_params bad entry", lambda: zd.set_full_fp32_params(engine, bad), ValueError)
    _unchanged(engine, before, "set_full_fp32_params")
    assert not zd.families.master.needs_sync(engine), "a refused set_full_fp32_params set the sync mark"

    # the group is still in step; the agreeing write costs what it did
    assert_same(master.full_tensors(dtype=torch.float32), ds_full_masters(engine), "masters")
    with count_comms() as mode:
        zd.set_full_fp32_params(engine, value)
    multi = dist.get_world_size() > 1
    assert mode.get_total_counts() == sync_collectives(engine) + int(multi), mode.get_comm_counts()
    assert torch.equal(ds_full_masters(engine)[first], value[first])
    assert torch.equal(zd.get_full_fp32_params(engine, [first])[first], value[first])
    return messages
