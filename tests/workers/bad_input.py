"""Issue 3, worker side: bad input to set_full_ and to collectives, unsupported engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zero_dtensor as zd
from zero_dtensor import settings
from zero_dtensor.ops import writes
from zero_dtensor.errors import RankDisagreementError

from .common import EngineCase, build_engine, count_comms, fill_value, forward_backward


def deepspeed_storage(engine: Any) -> list[torch.Tensor]:
    """Copies of the gradient memory DeepSpeed's step reads, read straight from its private state (not via us)."""
    opt = engine.optimizer
    kind = type(opt).__name__
    if kind == "BF16_Optimizer":
        return [t.clone() for t in opt.fp32_groups_gradients_flat]
    if kind == "DeepSpeedZeroOptimizer_Stage3":
        if opt.offload_optimizer:
            return [g.grad.clone() for g in opt.fp32_partitioned_groups_flat]
        return [opt.grad_partitions_flat_buffer.clone()]
    if opt.cpu_offload:
        return [g.grad.clone() for g in opt.single_partition_of_fp32_groups]
    out = []
    for i in range(len(opt.bit16_groups)):
        pieces = opt.averaged_gradients[i]
        flat = getattr(pieces, "flat_partition", None)
        out.append(flat.clone() if flat is not None else torch.cat([p.reshape(-1) for p in pieces]))
    return out


def _same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x,
                                           y.view(torch.uint8) if y.dtype != torch.bool else y)
        for x, y in zip(a, b)
    )


def bad_writes(case: EngineCase) -> int:
    offload = case.offload
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    names = list(grads.names)
    good = {n: fill_value(n, grads[n].shape) for n in names}
    first, last = names[0], names[-1]
    shape = tuple(grads[last].shape)
    cases = [
        # (mapping, exception, words the message must contain)
        ({first: good[first], last: torch.zeros(shape[0] + 1, *shape[1:])}, ValueError,
         [repr(last), f"expected {shape}"]),
        ({first: good[first], last: torch.zeros(shape, dtype=torch.int64)}, TypeError,
         [repr(last), "torch.int64", "floating"]),
        ({first: good[first], last: torch.zeros(shape, dtype=torch.bool)}, TypeError, [repr(last), "floating"]),
        ({first: good[first], "no.such.param": torch.zeros(3)}, KeyError, ["'no.such.param'", "known"]),
        ({first: good[first], last: good[last].tolist()}, TypeError, [repr(last), "torch.Tensor", "list"]),
        ({first: good[first], last: None}, TypeError, [repr(last), "NoneType"]),
        ({first: good[first], last: torch.zeros(shape, device="meta")}, ValueError, [repr(last), "meta", "cpu"]),
        ([(first, good[first])], TypeError, ["mapping"]),
    ]
    before = deepspeed_storage(engine)
    for mapping, error, words in cases:
        with pytest.raises(error) as info:
            grads.set_full_(mapping)
        message = str(info.value)
        for word in words:
            assert word in message, (word, message)
        after = deepspeed_storage(engine)
        assert _same_bytes(before, after), f"storage changed by a rejected write: {message}"
        if offload:  # DeepSpeed's precomputed clip norms are untouched too
            pass
    # a good write afterwards still works, and changes the storage
    grads.set_full_(good)
    assert not _same_bytes(before, deepspeed_storage(engine))
    if case.stage == 3 and case.model == "wide":  # every value was staged: the request keeps no per-value record
        assert writes._ACCEPTED.get(writes._request(grads._state, names)) is writes._ALL_STAGED
    for name in names:
        assert torch.equal(grads[name].full_tensor(dtype=torch.float32), good[name].to(grads[name].dtype).float())
    # the same names again: their parameters now come from the kept request, and bad values still raise on every
    # rank before anything is written (a wrong numel, a same-numel wrong shape, an integer dtype, another device),
    # for the first parameter (ZeRO-1/2: held by rank 0 only) and the last (held by the last rank only): a rank
    # that holds nothing of a parameter does not read its value, yet refuses it
    written = deepspeed_storage(engine)
    bad_values = []
    for target in (first, last):
        target_shape = tuple(grads[target].shape)
        bad_values += [(target, torch.zeros(target_shape[0] + 1, *target_shape[1:])),
                       (target, good[target].reshape(-1, 1)),
                       (target, torch.zeros(target_shape, dtype=torch.int64)),
                       (target, torch.zeros(target_shape, device="meta"))]
    for target, bad in bad_values:
        with pytest.raises((ValueError, TypeError), match=repr(target)):
            grads.set_full_({**good, target: bad})
        assert _same_bytes(written, deepspeed_storage(engine)), f"storage changed by a rejected write: {bad.shape}"
    # the same names, shapes, dtypes and devices as the accepted write (a training loop's next step: checked in two
    # passes, the values this rank holds nothing of not read): every value lands on its parameter
    tripled = {n: good[n] * 3 for n in names}
    grads.set_full_(tripled)
    for name in names:
        assert torch.equal(grads[name].full_tensor(dtype=torch.float32),
                           tripled[name].to(grads[name].dtype).float()), name
    # the same names in another order are another request: every value still lands on its parameter
    doubled = {n: good[n] * 2 for n in reversed(names)}
    grads.set_full_(doubled)
    for name in names:
        assert torch.equal(grads[name].full_tensor(dtype=torch.float32),
                           doubled[name].to(grads[name].dtype).float()), name
    return len(cases) + len(bad_values)


def disagreeing_collectives(stage: int, debug_mode: bool) -> list[str]:
    """Ranks calling a collective with different names/order all raise instead of hanging, in debug mode or not:
    the agreement is one small collective per call."""
    engine = build_engine(EngineCase(stage))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    names = list(grads.names)
    rank = dist.get_rank()
    assert not settings.is_debug()
    settings.set_debug(debug_mode)
    seen = []
    try:
        grads.full_tensors(names[:2])  # warm-up: a first call may calibrate its gather strategy
        with count_comms() as mode:
            grads.full_tensors(names[:2])
        assert mode.get_total_counts() == 2, mode.get_comm_counts()  # one all_gather + the agreement

        mine = [names[rank % len(names)]]  # different names on every rank
        with pytest.raises(RankDisagreementError, match="different arguments") as info:
            grads.full_tensors(mine)
        seen.append(str(info.value))
        order = names if rank == 0 else list(reversed(names))  # same names, different order
        with pytest.raises(RankDisagreementError):
            grads.full_tensors(order)
        with pytest.raises(RankDisagreementError):
            grads[mine[0]].full_tensor()
        with pytest.raises(RankDisagreementError):
            grads.full_tensors(names, dtype=torch.float32 if rank == 0 else None)
        with pytest.raises(RankDisagreementError):  # reductions agree too
            grads.norms(params=mine)
        with pytest.raises(RankDisagreementError):
            grads.stats(params=lambda n, r=rank: n == mine[0])
        with pytest.raises(RankDisagreementError):
            grads.iter_full(mine)
        with pytest.raises(RankDisagreementError):
            zd.found_inf(grads) if rank == 0 else grads.norms()
        # and the pool is still usable: an agreeing call afterwards works
        full = grads.full_tensors(names)
        assert sorted(full) == sorted(names)
    finally:
        settings.set_debug(False)
    return seen


def unsupported_stage0() -> str:
    engine = build_engine(EngineCase(0))
    forward_backward(engine)
    with pytest.raises(zd.UnsupportedDeepSpeedError) as info:
        zd.sharded_grads(engine)
    message = str(info.value)
    for word in ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer", "stage"):
        assert word in message, message
    return message


def unsupported_version(version: str) -> str:
    import deepspeed

    engine = build_engine(EngineCase(2))
    forward_backward(engine)
    real = deepspeed.__version__
    deepspeed.__version__ = version
    try:
        with pytest.raises(zd.UnsupportedDeepSpeedError) as info:
            zd.sharded_grads(engine)
    finally:
        deepspeed.__version__ = real
    message = str(info.value)
    assert "0.18.9" in message and version in message, message
    zd.sharded_grads(engine)  # the real version is accepted again
    return message


def unsupported_zero3_multi_group() -> str:
    """ZeRO-3 parameters partitioned over more than one process group (as MoE expert parameters are) are refused.

    Building a real MoE engine on CPU is not cheap; giving one parameter another (equal-membership) partition group
    exercises the same check without communication."""
    engine = build_engine(EngineCase(3))
    forward_backward(engine)
    other = dist.new_group(list(range(dist.get_world_size())))
    param = engine.optimizer.fp16_groups[0][0]
    had = hasattr(param, "ds_process_group")
    saved = getattr(param, "ds_process_group", None)
    param.ds_process_group = other
    try:
        with pytest.raises(zd.UnsupportedDeepSpeedError, match="more than one process group") as info:
            zd.sharded_grads(engine)
    finally:
        if had:
            param.ds_process_group = saved
        else:
            del param.ds_process_group
    zd.sharded_grads(engine)  # the real engine is accepted
    return str(info.value)


# --- one rank refuses: every rank raises at the agreement check -----------------------------------------------------
#: row -> (the call: fn(state, bad) with ``bad`` True on the refusing rank, the exception, its message)
REFUSALS: dict[str, tuple[Any, type[Exception], str]] = {
    "full_tensors out= entry": (
        lambda s, bad: s.grads.full_tensors(out={s.names[0]: torch.zeros(3)} if bad else s.prev),
        ValueError, "must be a tensor of shape"),
    "full_tensors name": (
        lambda s, bad: s.grads.full_tensors([s.names[0], "no.such.param"] if bad else s.names[:2]),
        KeyError, "no.such.param"),
    "full_tensors dtype": (
        lambda s, bad: s.grads.full_tensors(dtype=torch.int32 if bad else None), TypeError, "floating dtype"),
    "full_tensors strategy": (
        lambda s, bad: s.grads.full_tensors(strategy="bogus" if bad else "auto"), ValueError, "strategy"),
    "full_tensors dst": (
        lambda s, bad: s.grads.full_tensors(dst=dist.get_world_size() if bad else 0), ValueError, "dst"),
    "iter_full bucket_bytes": (
        lambda s, bad: s.grads.iter_full(bucket_bytes=0 if bad else 2**20), ValueError, "bucket_bytes"),
    "to_dtensors name": (
        lambda s, bad: s.grads.to_dtensors(["no.such.param"] if bad else s.names[:2]), KeyError, "no.such.param"),
    "owned owners": (
        lambda s, bad: s.grads.owned(s.names[:2], owners=[1] if bad else None), TypeError, "owners="),
    "map_full_ fn": (
        lambda s, bad: s.grads.map_full_(None if bad else (lambda name, t: t), s.names[:2]), TypeError, "function"),
    "set_dtensors_ mapping": (
        lambda s, bad: s.grads.set_dtensors_([1] if bad else s.dtensors), TypeError, "mapping"),
    "ParamGrad.full_tensor dtype": (
        lambda s, bad: s.grads[s.names[0]].full_tensor(dtype=torch.int32 if bad else None),
        TypeError, "floating dtype"),
}
REFUSAL_ROWS = [*REFUSALS, "every rank refuses alike"]
#: the rows whose call communicates on a replicated engine (``BF16_Optimizer``) too; the others' calls communicate
#: nothing there, so the refusing rank raises alone and the other ranks' calls return (nothing waits)
COMMUNICATES_REPLICATED = frozenset({"map_full_ fn", "set_dtensors_ mapping"})


@dataclass(frozen=True)
class _Refusing:
    """What the refusal rows share: the gradients, their names, a previous full_tensors result (``out=``) and
    DTensors to write back (``set_dtensors_``)."""

    grads: Any
    names: list[str]
    prev: Any
    dtensors: dict[str, Any]


def _row_refusal(st: _Refusing, label: str, replicated: bool) -> None:
    call, error, match = REFUSALS[label]
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = rank == world - 1  # the last rank refuses; every other rank passes good arguments
    agreed = not replicated or label in COMMUNICATES_REPLICATED  # the call checks agreement: every rank raises
    raises = bad or agreed
    prev = st.prev
    before = {n: t.clone() for n, t in prev.items()}
    if raises:
        with pytest.raises(error) as info:
            call(st, bad)
    else:  # a replicated engine's call that communicates nothing: it is made here
        call(st, bad)
    if bad:  # its own error, with a note that every rank raised where they did
        message = str(info.value)
        assert match in message, message
        noted = any("raised on every rank" in note for note in getattr(info.value, "__notes__", []))
        assert noted == agreed, (agreed, info.value)
    elif agreed:  # the refusing rank's class, naming it and its message
        message = str(info.value)
        assert f"rank(s) [{world - 1}] refused" in message and match in message, message
    if raises:
        assert all(torch.equal(prev[n], before[n]) for n in prev), "a refused call wrote into out="
    # nothing is left pending: the next agreeing collective lines up on every rank
    full = st.grads.full_tensors(st.names[:2])
    assert sorted(full) == sorted(st.names[:2])


def _row_refused_alike(grads: Any, names: list[str], replicated: bool) -> None:
    with count_comms() as mode:
        with pytest.raises(KeyError, match="no.such.param") as info:
            grads.full_tensors(["no.such.param"])
    assert "refused the call's arguments" not in str(info.value)  # each rank raises its own, no one else's
    # the agreement's one small collective (none where the call communicates nothing: replicated groups)
    assert mode.get_total_counts() == (0 if replicated else 1), mode.get_comm_counts()
    assert sorted(grads.full_tensors(names[:2])) == sorted(names[:2])


def one_rank_refusals(case: EngineCase) -> dict[str, Any]:
    """A call whose arguments one rank refuses (an unknown name, a bad ``out=`` entry, ...) raises on every rank at
    the rank-agreement check: there its own error, elsewhere the same class naming it; nothing is written, nothing
    hangs, and the next call lines up. On a replicated engine a call that communicates nothing raises on the
    refusing rank alone."""
    from .rows import Rows

    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    names = list(grads.names)
    prev = grads.full_tensors()
    grads.mul_(2.0)  # the gradients now differ from prev: a write into it would show
    st = _Refusing(grads, names, prev, grads.to_dtensors(names[:2]))
    rows = Rows(REFUSAL_ROWS)
    for label in REFUSALS:
        rows.run(label, _row_refusal, st, label, case.bf16_optimizer)
    rows.run("every rank refuses alike", _row_refused_alike, grads, names, case.bf16_optimizer)
    return rows.report()
