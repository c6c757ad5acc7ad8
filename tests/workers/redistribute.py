"""Issue 12, worker side: ``to_dtensors`` / ``set_dtensors_`` / ``owners`` / ``owned`` / ``set_owned_`` /
``map_full_`` against DeepSpeed's own ``safe_get_full_grad`` / ``safe_set_full_grad`` and torch's own DTensor calls.

Each check builds the engine of one ``common.EngineCase`` (world size, stage, dtype, param groups, offload,
``BF16_Optimizer``) with ``common.build_engine`` and runs on every rank. Collective counts are exact: every call issues the always-on
rank agreement (one small collective: ``common.rank_checks`` for reads; for ``set_owned_`` it also says who passed
what; ``map_full_``'s write exchange carries its error codes), and each exchange exactly one ``all_to_all_single``
per (process group, dtype): one here, since every case has one data-parallel group and one stored dtype.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad, safe_set_full_grad
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import zero_dtensor as zd
from zero_dtensor.errors import RankFailedError

from .bad_input import _same_bytes, deepspeed_storage
from .common import (EngineCase, agreement_op, build_engine, count_comms, ds_config, fill_value, forward_backward,
                     make_engine, params_snapshot, patient_recycling, rank_checks)
from .foundation import STEP_BROKEN_0_18, deepspeed_step_broken


def comm_ops(mode: Any) -> Counter[str]:
    """CommDebugMode's counts by short name: ``alltoall_base``, ``allreduce``, ``allgather_base`` ..."""
    return Counter({str(k).split(".")[-1].strip("_"): v for k, v in mode.get_comm_counts().items()})


def sharded(grads: zd.ShardedGrads) -> bool:
    """Whether reads exchange anything: a sharded group on more than one rank."""
    return any(not g.replicated and g.world_size > 1 for g in grads.layout.groups)


def multi(grads: zd.ShardedGrads) -> int:
    return int(grads.layout.groups[0].world_size > 1)


def assert_comms(mode: Any, expected: dict[str, int], what: str) -> None:
    got = comm_ops(mode)
    want = Counter({k: v for k, v in expected.items() if v})
    assert got == want, f"{what}: collectives {dict(got)}, expected {dict(want)}"


def true_refs(engine: Any, grads: zd.ShardedGrads) -> dict[str, torch.Tensor]:
    """DeepSpeed's own full gradients in true units (it returns scaled values under fp16), float32."""
    return {n: safe_get_full_grad(p).float() / grads.loss_scale
            for n, p in engine.module.named_parameters() if n in grads.names}


# --- reads ------------------------------------------------------------------------------------------------------------
def check_reads(case: EngineCase) -> dict:
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    full = grads.full_tensors()
    refs = true_refs(engine, grads)
    for name in grads.names:  # the library's full tensors are DeepSpeed's (exactly: unscaling by 2^k is exact)
        assert torch.equal(full[name].float(), refs[name]), name
    a2a = int(sharded(grads))

    with count_comms() as mode:
        dts = grads.to_dtensors()
    assert_comms(mode, {"alltoall_base": a2a, agreement_op(grads): rank_checks(grads)}, "to_dtensors")
    assert list(dts) == list(grads.names)
    mesh = next(iter(dts.values())).device_mesh
    assert mesh.get_group() is grads._storage.process_groups[0]
    for name, dt in dts.items():
        assert isinstance(dt, DTensor) and dt.placements == (Shard(0),), name
        assert dt.shape == grads[name].shape and dt.dtype == full[name].dtype, name
        assert dt.stride() == full[name].stride(), name
        expected = distribute_tensor(full[name], mesh, [Shard(0)]).to_local()
        assert dt.to_local().shape == expected.shape and torch.equal(dt.to_local(), expected), name
        assert torch.equal(dt.full_tensor(), full[name]), name

    bf16 = grads.to_dtensors(dtype=torch.bfloat16)
    assert all(torch.equal(bf16[n].to_local(), dts[n].to_local().to(torch.bfloat16)) for n in grads.names)
    half = list(grads.names)[::2]
    assert list(grads.to_dtensors(half)) == half

    # torch's own clipping over Shard(0) DTensor gradients (FSDP2's layout) gives the library's total norm
    params = []
    for dt in dts.values():
        p = torch.nn.Parameter(torch.empty_like(dt))
        p.grad = dt.detach().clone()
        params.append(p)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=1e-3)
    ours = float(grads.global_norm())
    theirs = float(total.full_tensor() if isinstance(total, DTensor) else total)
    tolerance = 1e-2 if case.dtype == "bf16" else 1e-5  # torch reduces bf16 gradients in bf16
    assert abs(theirs - ours) <= tolerance * ours, (theirs, ours)

    # owners: deterministic, the same on every rank, balanced; owned: the full gradient on the owner only
    assignment = grads.owners()
    assert assignment == grads.owners() and sorted(assignment) == sorted(grads.names)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, assignment)
    assert all(a == assignment for a in everyone)
    with count_comms() as mode:
        mine = grads.owned()
    assert_comms(mode, {"alltoall_base": a2a, agreement_op(grads): rank_checks(grads)}, "owned")
    me = dist.get_rank()
    assert list(mine) == [n for n in grads.names if assignment[n] == me]
    for name, t in mine.items():
        assert t.shape == grads[name].shape and torch.equal(t, full[name]), name
    loads = Counter({r: 0 for r in range(dist.get_world_size())})
    for name, r in assignment.items():
        loads[r] += grads[name].numel
    biggest = max(grads[n].numel for n in grads.names)
    assert max(loads.values()) - min(loads.values()) <= biggest, loads

    # a user assignment: everything on the last rank
    last = dist.get_world_size() - 1
    given = {n: last for n in grads.names}
    everything = grads.owned(owners=given, dtype=torch.float32)
    assert (list(everything) == list(grads.names)) == (me == last)
    for name, t in everything.items():
        assert t.dtype == torch.float32 and torch.equal(t, full[name].float()), name

    # output memory is recycled only once nothing refers to it: results still held keep their values while later
    # calls (of this family or another of the same geometry) read other values, whatever is dropped in between
    doubled = grads.clone()
    doubled.mul_(2)
    for _ in range(3):
        again, again_owned = doubled.to_dtensors(), doubled.owned()
        for name in grads.names:
            assert torch.equal(again[name].to_local(), dts[name].to_local() * 2), name
            assert torch.equal(dts[name].full_tensor(), full[name]), name
        for name, t in again_owned.items():
            assert torch.equal(t, mine[name] * 2) and torch.equal(mine[name], full[name]), name
        kept_local = {n: d.to_local() for n, d in again.items()}  # a local shard alone keeps its memory too
        del again, again_owned
        _ = grads.to_dtensors(), grads.owned()
        assert all(torch.equal(kept_local[n], dts[n].to_local() * 2) for n in grads.names)
    del doubled, kept_local

    # snapshots: engine.step() changes none of them
    if deepspeed_step_broken(case.stage):
        return {"a2a": a2a, "owned": len(mine)}
    kept = {n: dts[n].to_local().clone() for n in grads.names}
    engine.step()
    assert all(torch.equal(dts[n].to_local(), kept[n]) for n in grads.names)
    with pytest.raises(zd.StaleGradientsError):
        grads.to_dtensors()
    return {"a2a": a2a, "owned": len(mine)}


# --- identity round trips -----------------------------------------------------------------------------------------------
def check_round_trips(case: EngineCase) -> dict:
    """Writing back what was read leaves DeepSpeed's gradient memory bit-identical, with the counted collectives."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    before = deepspeed_storage(engine)
    n, a2a = multi(grads), int(sharded(grads))

    dts = grads.to_dtensors()
    with count_comms() as mode:
        grads.set_dtensors_(dts)
    assert_comms(mode, {"alltoall_base": n, agreement_op(grads): n}, "set_dtensors_")
    assert _same_bytes(before, deepspeed_storage(engine)), "set_dtensors_(to_dtensors())"

    grads.set_dtensors_(grads.to_dtensors(dtype=torch.float32))
    assert _same_bytes(before, deepspeed_storage(engine)), "set_dtensors_(to_dtensors(dtype=float32))"

    mine = grads.owned()
    with count_comms() as mode:
        grads.set_owned_(mine)
    assert_comms(mode, {"alltoall_base": n, "allgather_base": n}, "set_owned_")
    assert _same_bytes(before, deepspeed_storage(engine)), "set_owned_(owned())"

    with count_comms() as mode:
        grads.map_full_(lambda name, g: g)
    assert_comms(mode, {"alltoall_base": a2a + n, agreement_op(grads): n}, "map_full_")
    assert _same_bytes(before, deepspeed_storage(engine)), "map_full_(identity)"

    # expanded values (stride 0 once flattened) are written as values, never sent as a view as they lie
    saved = {name: v.clone() for name, v in grads.owned().items()}
    grads.set_owned_({name: torch.full((1,), 3.0).expand(v.shape) for name, v in saved.items()})
    assert all(bool((g == 3.0).all()) for g in grads.full_tensors().values()), "set_owned_(expanded values)"
    grads.set_owned_(saved)
    assert _same_bytes(before, deepspeed_storage(engine)), "set_owned_(a clone of owned())"

    grads.set_owned_({})  # nothing passed anywhere: nothing changes, no exchange
    assert _same_bytes(before, deepspeed_storage(engine)), "set_owned_({})"
    return {"a2a": a2a}


# --- a modifying round trip, then step, against DeepSpeed's own loop ------------------------------------------------------
def modify(name: str, g: torch.Tensor) -> torch.Tensor:
    """The edit under test (true units): deterministic, the same on every rank, changes every element."""
    return 0.5 * g.float() + 0.01 * fill_value(name, g.shape)


def _modified_dtensors(grads: zd.ShardedGrads) -> dict[str, DTensor]:
    """The edit made with DTensor math on Shard(0) gradients (elementwise: no communication inside)."""
    out = {}
    for name, dt in grads.to_dtensors().items():
        fill = distribute_tensor(fill_value(name, dt.shape), dt.device_mesh, [Shard(0)])
        out[name] = 0.5 * dt.float() + 0.01 * fill
    return out


def _deepspeed_modify(engine: Any, stage: int) -> None:
    """The same edit with DeepSpeed's own safe_get_full_grad / safe_set_full_grad loop (stored units under fp16)."""
    scale = float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0) if engine.fp16_enabled() else 1.0
    world = dist.get_world_size()
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        value = modify(name, safe_get_full_grad(p).float() / scale) * scale
        if stage == 3:  # DeepSpeed's stage-3 set narrows past the end unless the value is padded (its bug 2)
            pn = p.partition_numel()
            value = torch.cat([value.reshape(-1), value.new_zeros(pn * world - value.numel())])
        safe_set_full_grad(p, value)


def check_modify_then_step(case: EngineCase, how: str) -> str | None:
    """The write lands (read back exactly), then ``step()`` equals DeepSpeed's own loop + step on a twin engine.
    Returns a skip reason where DeepSpeed 0.18.x cannot step a ZeRO-1/2 engine under torch 2.13."""
    ours = build_engine(case)
    forward_backward(ours)
    grads = zd.sharded_grads(ours)
    expected = {n: modify(n, t) for n, t in true_refs(ours, grads).items()}
    if how == "map_full_":
        grads.map_full_(modify)
    elif how == "set_owned_":
        grads.set_owned_({n: modify(n, t) for n, t in grads.owned().items()})
    else:
        grads.set_dtensors_(_modified_dtensors(grads))
    written = grads.full_tensors(dtype=torch.float32)
    for name, value in expected.items():
        stored = (value * grads.loss_scale).to(grads[name].dtype).float() / grads.loss_scale
        assert torch.equal(written[name], stored), name
    if deepspeed_step_broken(case.stage):
        return STEP_BROKEN_0_18
    ours.step()

    theirs = build_engine(case)
    forward_backward(theirs)
    if case.bf16_optimizer:  # DeepSpeed's safe_set_full_grad is a no-op for BF16_Optimizer (notes §6 bug 4)
        zd.sharded_grads(theirs).set_full_(expected)
    else:
        _deepspeed_modify(theirs, case.stage)
    theirs.step()
    mine, reference = params_snapshot(ours), params_snapshot(theirs)
    for name in mine:
        assert torch.equal(mine[name], reference[name]), name
    return None


# --- bad input: raises on every rank, nothing written ---------------------------------------------------------------------
def _raises_everywhere(grads: zd.ShardedGrads, engine: Any, before: list, call: Any, errors: Any, what: str,
                       words: str = "") -> str:
    with pytest.raises(errors) as info:
        call()
    assert _same_bytes(before, deepspeed_storage(engine)), f"{what}: something was written"
    message = str(info.value)
    assert words in message, (what, message)
    return f"{what}: {type(info.value).__name__}"


def check_bad_inputs(case: EngineCase) -> list[str]:
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    before = deepspeed_storage(engine)
    me, world = dist.get_rank(), dist.get_world_size()
    last = world - 1
    names = list(grads.names)
    first = names[0]
    good = grads.to_dtensors()
    seen = []

    def run(call: Any, errors: Any, what: str, words: str = "") -> None:
        seen.append(_raises_everywhere(grads, engine, before, call, errors, what, words))

    # set_dtensors_: rank-dependent (one rank's local shard), then rank-independent faults
    wrong_local = dict(good)
    if me == last:
        dt = good[first]
        local = torch.zeros(dt.to_local().shape[0] + 1, *dt.shape[1:], dtype=dt.dtype)
        wrong_local[first] = DTensor.from_local(local, dt.device_mesh, [Shard(0)], run_check=False,
                                                shape=dt.shape, stride=dt.stride())
    run(lambda: grads.set_dtensors_(wrong_local), ValueError, "set_dtensors_ local shard on the last rank",
        "local shard" if me == last else f"rank(s) [{last}]")
    replicated = {**good, first: good[first].redistribute(placements=[Replicate()])}
    run(lambda: grads.set_dtensors_(replicated), ValueError, "set_dtensors_ Replicate", "placements")
    run(lambda: grads.set_dtensors_({**good, first: good[first].full_tensor()}), TypeError,
        "set_dtensors_ plain tensor", "must be a DTensor")
    matrix = next(n for n in names if len(grads[n].shape) == 2)
    flat = good[matrix]
    wrong_shape = DTensor.from_local(flat.to_local().reshape(-1), flat.device_mesh, [Shard(0)], run_check=False,
                                     shape=torch.Size([flat.numel()]), stride=(1,))
    run(lambda: grads.set_dtensors_({**good, matrix: wrong_shape}), ValueError, "set_dtensors_ shape", "shape")
    ints = DTensor.from_local(good[first].to_local().to(torch.int32), good[first].device_mesh, [Shard(0)],
                              run_check=False, shape=good[first].shape, stride=good[first].stride())
    run(lambda: grads.set_dtensors_({first: ints}), TypeError, "set_dtensors_ int dtype", "floating")
    run(lambda: grads.set_dtensors_({"nope": good[first]}), KeyError, "set_dtensors_ unknown name")
    run(lambda: grads.set_dtensors_([good[first]]), TypeError, "set_dtensors_ not a mapping", "mapping")

    # owners=
    run(lambda: grads.owned(owners={first: 0}), KeyError, "owned owners= incomplete", "owners=")
    run(lambda: grads.owned(owners={n: world for n in names}), ValueError, "owned owners= rank out of range",
        "not in its data-parallel")

    # set_owned_
    mine = grads.owned()
    assignment = grads.owners()
    others = [n for n in names if assignment[n] != me]
    stolen = {**mine, **({others[0]: torch.zeros(grads[others[0]].shape)} if me == 0 and others else {})}
    if world > 1:
        run(lambda: grads.set_owned_(stolen, owners=assignment), ValueError, "set_owned_ not the owner")
        everyone = {first: torch.zeros(grads[first].shape)}
        run(lambda: grads.set_owned_(everyone), ValueError, "set_owned_ passed twice", "more than one rank")
    bad_shape = dict(mine)
    if me == last:
        bad_shape[first] = torch.zeros(3)
    run(lambda: grads.set_owned_(bad_shape), ValueError, "set_owned_ shape on the last rank")
    unknown = {"nope": torch.zeros(1)} if me == 0 else {}
    run(lambda: grads.set_owned_(unknown), KeyError, "set_owned_ unknown name on rank 0")
    run(lambda: grads.set_owned_({first: good[first]} if me == assignment[first] else {}), TypeError,
        "set_owned_ DTensor value")

    # map_full_: a failing function on one rank, a bad result on another
    def boom(name: str, g: torch.Tensor) -> torch.Tensor:
        if me == 0:
            raise RuntimeError("boom on rank 0")
        return g

    run(lambda: grads.map_full_(boom), RuntimeError if me == 0 or world == 1 else RankFailedError,
        "map_full_ fn raises on rank 0", "boom" if me == 0 else "rank(s) [0]")
    owner = assignment[first]
    run(lambda: grads.map_full_(lambda n, g: g.reshape(-1) if n == first else g), ValueError,
        "map_full_ bad result on the owner", "shape" if me == owner else f"rank(s) [{owner}]")
    run(lambda: grads.map_full_("not callable"), TypeError, "map_full_ not callable")

    # the process group still works and a good write still writes
    grads.set_dtensors_(good)
    assert _same_bytes(before, deepspeed_storage(engine))
    grads.map_full_(lambda n, g: g * 2)
    assert not _same_bytes(before, deepspeed_storage(engine))
    return seen


# --- a fixed number of tensor operations whatever the number of parameters -------------------------------------------
class OpCounter(TorchDispatchMode):
    """Counts dispatched aten operations except views, ``detach``/``alias`` and collectives (as workers/op_counts)."""

    _SKIPPED = {"detach", "alias", "lift_fresh"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (getattr(func, "namespace", "aten") == "aten" and not func.is_view
                and func.overloadpacket.__name__ not in self._SKIPPED):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class Wide(torch.nn.Module):
    """``layers`` ``Linear(7, 5)`` side by side (2 parameters each)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(7, 5) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


CALLS = ("to_dtensors", "set_dtensors_", "owned", "set_owned_", "map_full_")


def _call(grads: zd.ShardedGrads, name: str, prepared: dict) -> None:
    if name == "to_dtensors":
        grads.to_dtensors()
    elif name == "set_dtensors_":
        grads.set_dtensors_(prepared)
    elif name == "owned":
        grads.owned()
    elif name == "set_owned_":
        grads.set_owned_(prepared)
    else:
        grads.map_full_(lambda n, g: g)


def count_ops(stage: int, dtype: str = "fp32", bf16_optimizer: bool = False) -> dict[str, dict[int, dict]]:
    """Per call, per model size (8 and 64 parameters): non-view aten ops and collectives of the second call."""
    with patient_recycling():
        return _count_ops(stage, dtype, bf16_optimizer)


def _count_ops(stage: int, dtype: str, bf16_optimizer: bool) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for layers in (4, 32):
        config = ds_config(stage, dtype)
        if bf16_optimizer:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        engine = make_engine(config, Wide(layers))
        g = torch.Generator().manual_seed(17 + dist.get_rank())
        x = torch.randn(4, 7, generator=g).to(next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        grads = zd.sharded_grads(engine)
        for name in CALLS:
            prepared = grads.to_dtensors() if name == "set_dtensors_" else grads.owned()
            _call(grads, name, prepared)  # fills the one-time caches (plans, meshes)
            with OpCounter() as ops, count_comms() as mode:
                _call(grads, name, prepared)
            out.setdefault(name, {})[2 * layers] = {"ops": sum(ops.ops.values()), "by_op": dict(ops.ops),
                                                    "comms": dict(comm_ops(mode))}
        del engine, grads
    return out


# --- issue 44: local copies and allocations per byte exchanged (DispatchProbe) ---------------------------------------
def _delivered(family: Any, call: str, names: list[str], assignment: dict[str, int] | None) -> dict[str, int]:
    """From the call's plan: bytes this rank ends with (reads: the result; writes: what lands in its partitions),
    sends to / receives from other ranks, and keeps (its own share); ``scattered``: whether the pieces a read sends
    the other ranks lie scattered in the partitions (not one run of one: then they are packed somewhere)."""
    from zero_dtensor.redistribute import OWNERS, ROWS, plan_for
    from zero_dtensor.redistribute.plan import one_run

    storage = family._storage
    selected = [storage.layout.by_name[n] for n in names]
    kind = ROWS if "dtensors" in call else OWNERS
    plan = plan_for(storage, selected, kind, assignment if kind == OWNERS else None)
    out = {"result": 0, "sent": 0, "received": 0, "own": 0, "scattered": False}
    directions = {"to_dtensors": ("read",), "owned": ("read",), "map_full_": ("read", "write")}.get(call, ("write",))
    for bucket in plan.buckets:
        size = torch.empty(0, dtype=bucket.dtype).element_size()
        for direction in directions:
            transfer = getattr(bucket, direction)
            out["sent"] += size * transfer.sent_elements
            out["received"] += size * transfer.received_elements
            out["own"] += size * (sum(transfer.recv_counts) - transfer.received_elements)
            peers_sent = transfer.peer_pieces()[0]
            out["scattered"] |= direction == "read" and bool(peers_sent) and one_run(peers_sent) is None
        out["result"] += size * bucket.out_numel if "read" in directions else 0
    return out


def _probe_call(family: Any, call: str, arg: Any, offload: bool) -> tuple[Any, dict]:
    """``call`` once to fill the caches, the workspace released (kept buffers are allocated again, so that what a
    call needs shows), then once under :class:`DispatchProbe`. ``offload``: under simulated devices (partitions on
    the host, the exchange on the simulated accelerator, NCCL's rules: a device mix raises)."""
    import contextlib

    from zero_dtensor import materialize as mz

    from .dispatch_probe import DispatchProbe, simulated_offload

    fn = {"to_dtensors": lambda: family.to_dtensors(), "owned": lambda: family.owned(),
          "set_dtensors_": lambda: family.set_dtensors_(arg), "set_owned_": lambda: family.set_owned_(arg),
          "map_full_": lambda: family.map_full_(lambda n, g: g)}[call]
    simulated = simulated_offload([family._storage]) if offload else contextlib.nullcontext()
    with simulated:
        fn()
        mz.release_workspace()
        with DispatchProbe(simulate=offload, nccl=offload) as probe:
            if offload:
                probe.tag(family.local_partitions, "host")
            result = fn()
    return result, probe.summary()


def check_copies(cases: tuple[tuple, ...]) -> dict:
    """Issue 44: per ``(stage, offload[, model])`` case (model: a key of ``MODELS``, default ``"odd"``), family
    (gradients, then fp32 masters after a step) and call, under :class:`~workers.dispatch_probe.DispatchProbe`: the
    bytes local operations write or return
    (``written + produced``: every local copy, collectives aside) and allocate, beside the plan's figures (bytes
    this rank keeps, sends and receives in the call's exchanges; map_full_: both). The writes get what the reads
    returned (``set_dtensors_(to_dtensors())``, ``set_owned_(owned())``, ``map_full_(lambda n, g: g)``): values
    unchanged, checked. Offloaded cases run under simulated devices (:func:`~workers.dispatch_probe.
    simulated_offload`): a move between the host and the exchange's device counts as the copy it is."""
    report: dict[str, Any] = {}
    for stage, offload, *model in cases:
        model = model[0] if model else "odd"
        engine = build_engine(EngineCase(stage, world=dist.get_world_size(), offload=offload, model=model))
        forward_backward(engine)
        for fam in ("grads", "masters"):
            if fam == "masters":
                engine.step()
                family = zd.sharded_master_params(engine)
            else:
                family = zd.sharded_grads(engine)
            names = list(family.names)
            assignment = family.owners()
            before = dict(family.full_tensors())
            dts = owned = None
            for call in ("to_dtensors", "set_dtensors_", "owned", "set_owned_", "map_full_"):
                result, probe = _probe_call(family, call, dts if call == "set_dtensors_" else owned, offload)
                if call == "to_dtensors":
                    dts = result
                elif call == "owned":
                    owned = result
                row = {k: probe[k] for k in ("written", "produced", "allocated", "largest", "by_op", "refused")}
                row.update(_delivered(family, call, names, assignment))
                label = f"z{stage}{'-offload' if offload else ''}{'' if model == 'odd' else '-' + model}"
                report[f"{label} {fam} {call}"] = row
            after = dict(family.full_tensors())
            assert all(torch.equal(before[n], after[n]) for n in before), (stage, offload, fam)
            dts = owned = None
        del engine
    return report
