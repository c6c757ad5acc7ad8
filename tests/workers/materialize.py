"""Issue 5 checks, run on every rank: every full_tensors option and iter_full against the default path and DeepSpeed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

import zero_dtensor as zd
from zero_dtensor import materialize as mz

from .dispatch_probe import DispatchProbe
from .common import DTYPES, EngineCase, build_engine, count_comms, forward_backward, pipelining, rank_checks
from .rows import Rows


@contextlib.contextmanager
def pinned(strategy: str | None) -> Iterator[None]:
    previous = mz.strategy.pinned()
    mz.set_gather_strategy(strategy)
    try:
        yield
    finally:
        mz.set_gather_strategy(previous)


@contextlib.contextmanager
def recording(budget: int | None = None) -> Iterator[mz.AllocationRecorder]:
    """Every buffer zero_dtensor.materialize allocates (the pool's observer hook), and the peak of live bytes. An
    allocation over ``budget`` waits up to 10 s for the backend's thread to let go of the previous bucket (it ends
    as soon as it has): a busy machine does not change the peak."""
    with mz.BUFFERS.observing(mz.AllocationRecorder(budget, wait_s=10.0)) as rec:
        yield rec


def _settle_recycled(timeout: float = 10.0) -> None:
    """Wait until gloo's worker thread has dropped its reference to finished works' buffers (it may hold one a
    moment after a synchronous collective returned, longer on a busy machine); until then the library, correctly,
    does not recycle them."""
    deadline = time.monotonic() + timeout
    while not mz.BUFFERS.idle():
        assert time.monotonic() < deadline, "the backend never let go of a dropped result's buffer"
        time.sleep(0.001)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert list(a) == list(b), (what, list(a), list(b))
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, (what, name)
        assert torch.equal(a[name], b[name]), (what, name)


def _expected_collectives(grads: zd.ShardedGrads, strategy: str, names: list[str] | None = None) -> int:
    """One collective per (process group, dtype, device) bucket of sharded groups holding a requested name (per
    sharded group for all_to_all, which has no coalesced form; one batch of point-to-point ops per bucket for
    send_recv; none on one rank for any strategy), plus the always-on
    rank-agreement check."""
    wanted = {grads.layout.by_name[n].group for n in (names or grads.names)}
    sharded = [i for i in wanted if not grads.layout.groups[i].replicated]
    keys = {(grads._storage.process_groups[i], grads.local_partitions[i].dtype) for i in sharded}
    if dist.get_world_size() == 1:  # one rank, every strategy: the partition is the whole, a local copy
        data = 0
    elif strategy == "all_to_all":
        data = len(sharded)
    elif strategy == "send_recv":  # one batch of point-to-point ops per bucket
        data = len(keys)
    else:
        data = len(keys)
    return data + rank_checks(grads, names)


GATHER_STRATEGIES = ("all_gather", "all_to_all", "all_reduce", "send_recv")
# The rows of check_options, in order: each option's own test (tests/test_materialize.py).
STRATEGY_OPTIONS = ["auto pinned", "strategy=", "subset", "dtype fp32", "out= reuse", "recycling", "user out=", "dst",
                    "async", "async dst fp32"]
OPTION_ROWS = ["default matches DeepSpeed",
               *(f"{strategy} {option}" for strategy in GATHER_STRATEGIES for option in STRATEGY_OPTIONS)]


class _Options:
    """What the rows of one check_options share."""

    def __init__(self, case: EngineCase) -> None:
        engine = build_engine(case)
        forward_backward(engine)
        self.grads = grads = zd.sharded_grads(engine)
        stored = DTYPES[case.dtype]
        self.refs = {n: safe_get_full_grad(p).to(stored) for n, p in engine.module.named_parameters()
                     if p.requires_grad}
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.report: dict[str, Any] = {"groups": len(grads.groups),
                                       "sharded_groups": sum(not g.replicated for g in grads.layout.groups)}
        with pinned("all_gather"):
            self.default = dict(grads.full_tensors())

    def expected(self, strategy: str) -> int:
        return _expected_collectives(self.grads, strategy)


def check_options(case: EngineCase) -> dict:
    """Every option of full_tensors returns what the default path (and DeepSpeed) returns: one row each."""
    st = _Options(case)
    rows = Rows(OPTION_ROWS, on_failure=mz.release_workspace)
    rows.run("default matches DeepSpeed", lambda: _equal(st.default, {n: st.refs[n] for n in st.grads.names},
                                                         "default vs DeepSpeed"))
    for strategy in GATHER_STRATEGIES:
        for option in STRATEGY_OPTIONS:
            rows.run(f"{strategy} {option}", _OPTION_CHECKS[option], st, strategy)
    return rows.report(**st.report)


PIPELINED_ROWS = ["pipelined matches DeepSpeed", *(f"pipelined {option}" for option in STRATEGY_OPTIONS)]


class _PipelinedOptions(_Options):
    """ZeRO-3 with every all_gather pipelined: two all_gathers per transfer instead of one."""

    def expected(self, strategy: str) -> int:
        data = _expected_collectives(self.grads, strategy) - rank_checks(self.grads)
        return (2 if strategy == "all_gather" else 1) * data + rank_checks(self.grads)


def check_pipelined(case: EngineCase) -> dict:
    """ZeRO-3, every all_gather pipelined (two all_gathers, each part reordered once it has arrived):
    every option of full_tensors returns what DeepSpeed and the one-collective path return, bit for bit."""
    assert case.stage == 3, case
    st = _PipelinedOptions(case)  # its default: one all_gather
    with pipelining():
        rows = Rows(PIPELINED_ROWS, on_failure=mz.release_workspace)

        def matches() -> None:
            with pinned("all_gather"), count_comms() as mode:
                got = dict(st.grads.full_tensors())
            _equal(got, st.default, "pipelined vs one all_gather")
            _equal(got, {n: st.refs[n] for n in st.grads.names}, "pipelined vs DeepSpeed")
            assert mode.get_total_counts() == st.expected("all_gather"), mode.get_comm_counts()
            st.report["count_pipelined"] = mode.get_total_counts() - rank_checks(st.grads)

        rows.run("pipelined matches DeepSpeed", matches)
        for option in STRATEGY_OPTIONS:
            rows.run(f"pipelined {option}", _OPTION_CHECKS[option], st, "all_gather")
    return rows.report(**st.report)


def _option_auto_pinned(st: _Options, strategy: str) -> None:
    with pinned(strategy), count_comms() as mode:
        got = st.grads.full_tensors()
    _equal(dict(got), st.default, f"auto pinned to {strategy}")
    assert mode.get_total_counts() == st.expected(strategy), (strategy, mode.get_comm_counts())


def _option_strategy(st: _Options, strategy: str) -> None:
    with count_comms() as mode:
        got = st.grads.full_tensors(strategy=strategy)
    _equal(dict(got), st.default, strategy)
    expected = st.expected(strategy)
    assert mode.get_total_counts() == expected, (strategy, mode.get_comm_counts())
    st.report[f"count_{strategy}"] = mode.get_total_counts() - rank_checks(st.grads)  # the data collectives
    if st.world == 1:  # the partition is the whole: one copy (ZeRO-3: the reorder) into the result, no staging
        result_bytes = sum(p.numel() * p.element_size() for p in st.grads.local_partitions)
        del got
        with DispatchProbe() as probe:
            got = st.grads.full_tensors(strategy=strategy)
        _equal(dict(got), st.default, f"{strategy} one rank")
        assert probe.largest <= result_bytes and probe.written <= result_bytes + 1024, (
            strategy, probe.largest, probe.written, result_bytes)
    if strategy == "send_recv":  # one isend and one irecv per peer and sharded group, all in the one batch
        sharded = sum(not g.replicated for g in st.grads.layout.groups)
        assert mode.p2p_ops == 2 * (st.world - 1) * sharded, mode.get_comm_counts()
        st.report["p2p_ops"] = mode.p2p_ops


def _option_subset(st: _Options, strategy: str) -> None:
    """A subset, in the caller's order."""
    grads = st.grads
    subset = [grads.names[-1], grads.names[0]]
    got = grads.full_tensors(subset, strategy=strategy)
    _equal(dict(got), {n: st.default[n] for n in subset}, f"{strategy} subset")


def _option_dtype(st: _Options, strategy: str) -> None:
    """An output dtype."""
    got = st.grads.full_tensors(dtype=torch.float32, strategy=strategy)
    _equal(dict(got), {n: t.float() for n, t in st.default.items()}, f"{strategy} fp32")


def _option_out_reuse(st: _Options, strategy: str) -> None:
    """out=: the returned dict reused; same memory, same collectives."""
    grads = st.grads
    first = grads.full_tensors(strategy=strategy)
    ptrs = {n: t.data_ptr() for n, t in first.items()}
    buffers = {k: b.data_ptr() for k, b in first.buffers.items()}
    with count_comms() as mode, recording() as rec:
        second = grads.full_tensors(out=first, strategy=strategy)
    assert second is first
    assert rec.sizes == [], (strategy, rec.sizes)  # nothing allocated by zero_dtensor
    assert {n: t.data_ptr() for n, t in second.items()} == ptrs
    assert {k: b.data_ptr() for k, b in second.buffers.items()} == buffers
    assert mode.get_total_counts() == st.expected(strategy), mode.get_comm_counts()
    _equal(dict(second), st.default, f"{strategy} out= reuse")


def _option_recycling(st: _Options, strategy: str) -> None:
    """Without out=: the flat buffer is recycled once the previous result is gone, never while it lives."""
    grads, default = st.grads, st.default
    mz.release_workspace()
    a = grads.full_tensors(strategy=strategy)
    a_ptrs = sorted(t.data_ptr() for t in a.buffers.values())
    kept = {n: t.clone() for n, t in a.items()}
    b = grads.full_tensors(strategy=strategy)
    b_ptrs = sorted(t.data_ptr() for t in b.buffers.values())
    assert not set(a_ptrs) & set(b_ptrs), "a live result's memory was reused"
    _equal(dict(a), kept, f"{strategy} live result unchanged")
    del a, b
    _settle_recycled()
    c = grads.full_tensors(strategy=strategy)  # the most recently handed out free buffer: b's
    assert sorted(t.data_ptr() for t in c.buffers.values()) == b_ptrs, "buffer not recycled"
    _equal(dict(c), default, f"{strategy} recycled")
    one = c[grads.names[0]]
    del c  # a single kept tensor pins the buffer when it is a view of it (ZeRO-1/2, ZeRO-3 under all_reduce)
    d = grads.full_tensors(strategy=strategy)
    if one._base is not None and any(one.untyped_storage().data_ptr() == p for p in b_ptrs):
        assert not set(b_ptrs) & {t.data_ptr() for t in d.buffers.values()}
    assert torch.equal(one, default[grads.names[0]])
    del one, d
    mz.release_workspace()


def _option_user_out(st: _Options, strategy: str) -> None:
    """out=: a user-made dict (fp32 outputs): filled in place; the workspace is allocated once."""
    grads = st.grads
    mine = {n: torch.full(t.shape, float("nan")) for n, t in st.default.items()}
    ptrs = {n: t.data_ptr() for n, t in mine.items()}
    mz.release_workspace()
    got = grads.full_tensors(out=mine, dtype=torch.float32, strategy=strategy)
    with recording() as rec:
        got = grads.full_tensors(out=mine, dtype=torch.float32, strategy=strategy)
    assert got is mine and rec.sizes == []
    assert {n: t.data_ptr() for n, t in mine.items()} == ptrs
    _equal(dict(mine), {n: t.float() for n, t in st.default.items()}, f"{strategy} user out=")
    mz.release_workspace()


def _option_dst(st: _Options, strategy: str) -> None:
    """dst: only the destination receives."""
    grads = st.grads
    for dst in (0, st.world - 1):
        with count_comms() as mode:
            got = grads.full_tensors(dst=dst, strategy=strategy)
        if st.rank == dst:
            _equal(dict(got), st.default, f"{strategy} dst={dst}")
        else:
            assert dict(got) == {}, (strategy, dst, list(got))
        groups = {grads.layout.by_name[n].group for n in grads.names}
        n_sharded = sum(1 for i in groups if not grads.layout.groups[i].replicated)
        # gather (all_gather and all_to_all alike): one per group; reduce: per bucket (both + the agreement check);
        # one rank: none
        want = (n_sharded + rank_checks(grads) if strategy != "all_reduce" and st.world > 1
                else st.expected(strategy))
        assert mode.get_total_counts() == want, (strategy, dst, mode.get_comm_counts())


def _option_async(st: _Options, strategy: str) -> None:
    with count_comms() as mode:
        handle = st.grads.full_tensors(async_op=True, strategy=strategy)
        got = handle.wait()
    assert handle.wait() is got
    _equal(dict(got), st.default, f"{strategy} async")
    assert mode.get_total_counts() == st.expected(strategy)


def _option_async_dst(st: _Options, strategy: str) -> None:
    handle = st.grads.full_tensors(async_op=True, strategy=strategy, dst=st.world - 1, dtype=torch.float32)
    got = handle.wait()
    if st.rank == st.world - 1:
        _equal(dict(got), {n: t.float() for n, t in st.default.items()}, f"{strategy} async dst fp32")
    else:
        assert dict(got) == {}


_OPTION_CHECKS = {
    "auto pinned": _option_auto_pinned, "strategy=": _option_strategy, "subset": _option_subset,
    "dtype fp32": _option_dtype, "out= reuse": _option_out_reuse, "recycling": _option_recycling,
    "user out=": _option_user_out, "dst": _option_dst, "async": _option_async, "async dst fp32": _option_async_dst,
}
assert list(_OPTION_CHECKS) == STRATEGY_OPTIONS


def check_streaming(case: EngineCase, bucket_elements: int = 512) -> dict:
    """iter_full yields the same tensors, one collective per bucket, within its memory budget."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    bucket_bytes = bucket_elements * grads.local_partitions[0].element_size()
    with pinned("all_gather"):
        default = dict(grads.full_tensors())
    report: dict[str, Any] = {}
    for strategy in GATHER_STRATEGIES:  # all_to_all windows travel by all_gather
        plan = mz.plan_windows(grads, bucket_bytes=bucket_bytes, strategy=strategy)
        esize = grads.local_partitions[0].element_size()
        budget = max(bucket_bytes, max(w["elements"] for w in plan) * esize)
        oversized = [w["names"] for w in plan if w["elements"] * esize > bucket_bytes]
        for w in plan:
            if w["elements"] * esize > bucket_bytes:
                assert len(w["names"]) == 1, w  # only a single parameter may exceed the bucket
        seen: dict[str, torch.Tensor] = {}
        with count_comms() as mode, recording(budget) as rec:
            for name, tensor in grads.iter_full(bucket_bytes=bucket_bytes, strategy=strategy):
                assert torch.equal(tensor, default[name]), (strategy, name)
                seen[name] = tensor.sum().float()  # keep a scalar, drop the tensor
                del tensor
        assert sorted(seen) == sorted(default)
        assert mode.get_total_counts() - rank_checks(grads) == len(plan) == sum(w["collectives"] for w in plan), \
            mode.get_comm_counts()
        assert rec.peak <= budget, (strategy, rec.peak, budget, rec.sizes)
        assert rec.settled_live(timeout=10.0) == 0
        report[strategy] = {"buckets": len(plan), "bucket_bytes": bucket_bytes, "peak": rec.peak, "budget": budget, "oversized": oversized,
                            "full": sum(t.numel() * t.element_size() for t in default.values())}

        # a subset and a dtype
        subset = list(grads.names[1::2])
        got = dict(grads.iter_full(subset, bucket_bytes=bucket_bytes, dtype=torch.float32, strategy=strategy))
        assert sorted(got) == sorted(subset)
        for n in subset:
            assert got[n].dtype == torch.float32 and torch.equal(got[n], default[n].float()), n
    # auto (pinned) and one huge bucket: one collective for the whole group
    with pinned("all_gather"), count_comms() as mode:
        got = dict(grads.iter_full(bucket_bytes=1 << 30))
    assert mode.get_total_counts() == 1 + rank_checks(grads)
    assert all(torch.equal(got[n], default[n]) for n in default)
    return report


def check_fp16(stage: int, pipelined: bool = False) -> None:
    """Under fp16 loss scaling every option returns true (unscaled) gradients, equal to the default path
    (``pipelined``: ZeRO-3 all_gathers pipelined whatever their size)."""
    with pipelining(pipelined):
        _check_fp16(stage)


def _check_fp16(stage: int) -> None:
    engine = build_engine(EngineCase(stage, "fp16"))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    assert grads.loss_scale != 1.0
    refs = {n: safe_get_full_grad(p).float() / grads.loss_scale for n, p in engine.module.named_parameters()}
    with pinned("all_gather"):
        default = dict(grads.full_tensors())
    _equal(default, refs, "fp16 default vs DeepSpeed/scale")
    for strategy in GATHER_STRATEGIES:
        got = grads.full_tensors(strategy=strategy)
        _equal(dict(got), default, f"fp16 {strategy}")
        again = grads.full_tensors(out=got, strategy=strategy)
        _equal(dict(again), default, f"fp16 {strategy} out=")
        got = grads.full_tensors(dst=0, strategy=strategy, dtype=torch.bfloat16)
        if dist.get_rank() == 0:
            _equal(dict(got), {n: t.to(torch.bfloat16) for n, t in default.items()}, f"fp16 {strategy} dst bf16")
        got = grads.full_tensors(async_op=True, strategy=strategy).wait()
        _equal(dict(got), default, f"fp16 {strategy} async")
        got = dict(grads.iter_full(bucket_bytes=1024, strategy=strategy))
        _equal({n: got[n] for n in default}, default, f"fp16 {strategy} iter_full")


def check_calibration(stage: int, pipelined: bool = False, groups: int = 1) -> dict:
    """auto on gloo: the first call per size bucket calibrates (``CALIBRATION_COLLECTIVES`` extra collectives, and
    ``CALIBRATION_ALL_TO_ALL_COLLECTIVES`` more where the transfer is one flat group: ``groups=1``, and
    ``CALIBRATION_SEND_RECV_BATCHES`` point-to-point batches), later calls
    reuse the decision, and every rank takes the same one; on ZeRO-3 the calibration also times the reordering copy
    (the decision's key says so). ``pipelined``: ZeRO-3 all_gathers pipelined whatever their size, so the
    calibration times the pipelined gather (``CALIBRATION_PIPELINED_COLLECTIVES``)."""
    with pipelining(pipelined):
        return _check_calibration(stage, pipelined, groups)


def _check_calibration(stage: int, pipelined: bool, groups: int) -> dict:
    engine = build_engine(EngineCase(stage, groups=groups, frozen=False) if groups > 1 else EngineCase(stage))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    with pinned("all_gather"):
        default = dict(grads.full_tensors())
    previous_min = mz.strategy.CALIBRATION_MIN_BYTES
    mz.strategy.CALIBRATION_MIN_BYTES = 0
    mz.clear_calibration()
    try:
        with pinned(None), count_comms() as first:
            got = grads.full_tensors()
        _equal(dict(got), default, "auto (calibrating)")
        with pinned(None), count_comms() as second:
            got = grads.full_tensors()
        _equal(dict(got), default, "auto (calibrated)")
        decisions = list(mz.strategy_decisions().values())
        reorders = [key[-1] for key in mz.strategy_decisions()]
        pipelines = [key[-2] for key in mz.strategy_decisions()]
        one_groups = [key[-3] for key in mz.strategy_decisions()]
    finally:
        mz.strategy.CALIBRATION_MIN_BYTES = previous_min
        mz.clear_calibration()
    checks = rank_checks(grads)
    assert one_groups == [groups == 1], one_groups
    calls = 2 if pipelined and decisions == ["all_gather"] else 1  # the call's own data collectives
    calibration = mz.CALIBRATION_PIPELINED_COLLECTIVES if pipelined else mz.CALIBRATION_COLLECTIVES
    if groups == 1:  # a transfer of one flat group also times the all_to_all
        calibration += mz.CALIBRATION_ALL_TO_ALL_COLLECTIVES
    calibration += mz.CALIBRATION_SEND_RECV_BATCHES  # on gloo every transfer also times send_recv
    assert first.get_total_counts() == calls + calibration + checks, first.get_comm_counts()
    assert second.get_total_counts() == calls + checks, second.get_comm_counts()
    # below the threshold, auto does not calibrate (and uses all_gather)
    with pinned(None), count_comms() as small:
        grads.full_tensors()
    assert small.get_total_counts() == (2 if pipelined else 1) + checks and mz.strategy_decisions() == {}
    return {"decisions": decisions, "reorders": reorders, "pipelines": pipelines, "one_group": one_groups}


def check_errors() -> None:
    engine = build_engine(EngineCase(2))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    name = grads.names[0]
    import pytest

    with pytest.raises(ValueError, match="strategy"):
        grads.full_tensors(strategy="bogus")
    with pytest.raises(ValueError, match="must be a tensor of shape"):
        grads.full_tensors(out={name: torch.zeros(3)})
    with pytest.raises(ValueError, match="dst"):
        grads.full_tensors(dst=dist.get_world_size())
    with pytest.raises(TypeError, match="out="):
        grads.full_tensors(out=[1, 2])
    with pytest.raises(ValueError, match="bucket_bytes"):
        grads.iter_full(bucket_bytes=0)
    with pytest.raises(ValueError):
        mz.set_gather_strategy("nope")
    # nothing above communicated: the next collective still lines up on every rank
    with pinned("all_gather"):
        assert len(grads.full_tensors()) == len(grads)


@contextlib.contextmanager
def gloo_as_if_cuda() -> Iterator[None]:
    """Make every tensor answer as a CUDA one to :func:`zero_dtensor.comm.process_groups.comm_support` (the device seam
    of the one capability decision), and make the exchanges gloo cannot run on CUDA tensors raise instead of
    aborting: point-to-point ops (``batch_isend_irecv``, ``isend``, ``irecv``) and the coalescing manager. The old
    code has no seam (``create=True``): there the patches still catch every point-to-point op or coalescing
    manager it issues."""
    from unittest import mock

    from zero_dtensor.comm import process_groups

    def refused(what: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{what} issued for (faked) CUDA tensors on gloo")
        return fail

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(process_groups, "device_type_of", lambda device: "cuda", create=True))
        for what in ("batch_isend_irecv", "isend", "irecv", "_coalescing_manager"):
            stack.enter_context(mock.patch.object(dist, what, refused(what)))
        yield


def check_gloo_over_cuda(stage: int, groups: int = 1, world: int = 2) -> dict:
    """Gloo with tensors that answer as CUDA ones: ``auto`` (calibrating too), ``iter_full``, the ZeRO-3
    gathers and ``sync_model_params`` use the plain collectives only (no point-to-point op, no coalescing
    manager) and return exactly what the CPU path returns; an explicit or pinned ``send_recv`` raises
    ``ValueError`` on every rank before anything moves."""
    import pytest

    case = EngineCase(stage, world=world, groups=groups, frozen=False) if groups > 1 else EngineCase(stage, world=world)
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    with pinned("all_gather"):
        default = dict(grads.full_tensors())
    previous_min = mz.strategy.CALIBRATION_MIN_BYTES
    report: dict[str, Any] = {}
    with gloo_as_if_cuda():
        mz.strategy.CALIBRATION_MIN_BYTES = 0  # calibrate even the small test model
        mz.clear_calibration()
        try:
            with pinned(None):
                _equal(dict(grads.full_tensors()), default, "auto, calibrating")
                report["decisions"] = sorted(set(mz.strategy_decisions().values()))
                _equal(dict(grads.full_tensors()), default, "auto, calibrated")
        finally:
            mz.strategy.CALIBRATION_MIN_BYTES = previous_min
            mz.clear_calibration()
        for strategy in ("all_gather", "all_to_all", "all_reduce"):
            _equal(dict(grads.full_tensors(strategy=strategy)), default, strategy)
        with pipelining():
            _equal(dict(grads.full_tensors(strategy="all_gather")), default, "pipelined all_gather")
        bucket = 512 * grads.local_partitions[0].element_size()
        for strategy in ("auto", "all_gather", "all_reduce"):
            streamed = dict(grads.iter_full(bucket_bytes=bucket, strategy=strategy))
            assert sorted(streamed) == sorted(default)
            assert all(torch.equal(streamed[n], default[n]) for n in default), strategy
        for call in (lambda: grads.full_tensors(strategy="send_recv"),
                     lambda: grads.iter_full(strategy="send_recv")):
            with pytest.raises(ValueError, match="send_recv"):
                call()
        with pinned("send_recv"), pytest.raises(ValueError, match="send_recv"):
            grads.full_tensors()
    engine.step()  # DeepSpeed's own step: not under test here
    master = zd.sharded_master_params(engine)
    with pinned("all_gather"):
        before = dict(master.full_tensors())
    master.mul_(2.0)  # a write: marks the engine
    with gloo_as_if_cuda():
        zd.sync_model_params(engine)
    # the working weights are the written masters, and nothing above left a collective unmatched
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        working = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for name, value in before.items():
        assert torch.equal(working[name], (2.0 * value).to(working[name].dtype)), name
    return report


@contextlib.contextmanager
def small_windows(nbytes: int) -> Iterator[None]:
    """ZeRO-3 gathers of more than ``nbytes`` travel in bounded windows (``WINDOW_BYTES``; the test models are far
    below the default). On code without windows the attribute is made (``create=True``) and changes nothing."""
    from unittest import mock

    with mock.patch.object(mz.strategy, "WINDOW_BYTES", nbytes, create=True):
        yield


def windows(sharded: Any, window: int) -> int:
    """The column windows the library cuts the sharded groups into for a staging buffer of ``window`` bytes (one
    collective each): of half of it where two in flight keep the count within its bound, else of all of it
    (``window_cut``; one transfer here)."""
    from zero_dtensor.core.state import state_of

    state = state_of(sharded)
    sharded_groups = [g for g, group in enumerate(state.layout.groups) if group.placement.is_sharded]
    try:
        from zero_dtensor.materialize.transfers import window_cut
    except ImportError:  # code before issue 55: windows of the whole buffer
        from zero_dtensor.materialize.transfers import window_pieces

        return sum(len(window_pieces(state, g, window)) for g in sharded_groups)
    return sum(map(len, window_cut(state, sharded_groups, window)[0]))


def check_windowed(case: EngineCase) -> dict:
    """ZeRO-3, every gather strategy in bounded windows (forced small), for the gradients and then (after a step)
    the fp32 masters: values bit for bit those of one all_gather; the pool allocates the result and at most one
    window (``max(WINDOW_BYTES, result/8)``) besides, never a staging twin of the result; one collective per window,
    at most about ``2·result/window`` of them (send_recv: one
    point-to-point batch per window); async, ``out=`` and ``dtype`` too."""
    assert case.stage == 3, case
    engine = build_engine(case)
    forward_backward(engine)
    report = {"grads": _check_windowed(zd.sharded_grads(engine))}
    engine.step()
    report["masters"] = _check_windowed(zd.sharded_master_params(engine))
    return report


def _check_windowed(sharded: Any) -> dict:
    with pinned("all_gather"):
        default = dict(sharded.full_tensors())
    world = dist.get_world_size()
    result_bytes = sum(p.numel() * p.element_size() for p in sharded.local_partitions) * world
    esize = sharded.local_partitions[0].element_size()
    widest = max(world * -(-sharded[n].numel // world) for n in sharded.names) * esize  # an (N, chunk) block
    window = max(result_bytes // 4, 2 * widest)  # two halves, each holding the widest parameter
    assert window < result_bytes, (window, result_bytes)  # a staging twin of the result would exceed the bound
    limit = max(window, -(-result_bytes // 8))  # a window holds max(WINDOW_BYTES, result / 8)
    report: dict[str, Any] = {"result_bytes": result_bytes, "window_bytes": window}
    with small_windows(window):
        for strategy in ("all_gather", "all_to_all", "send_recv"):
            mz.release_workspace()
            _settle_recycled()
            with count_comms() as mode, recording() as rec, DispatchProbe() as probe:
                got = sharded.full_tensors(strategy=strategy)
            _equal(dict(got), default, f"windowed {strategy}")
            # no single allocation larger than the result (today: one buffer of twice it); the bytes written
            # locally are the one reorder into the result, plus the agreement's few bytes: send_recv receives only
            # the peers' columns and puts this rank's own straight into place (issue 55); all_gather copies this
            # rank's partition into its row first, all_to_all into its repeated input
            report[strategy + " probe"] = {"largest": probe.largest, "written": probe.written}
            assert probe.largest <= result_bytes, (strategy, probe.largest, result_bytes)
            own_row = 0 if strategy == "send_recv" else result_bytes // world
            assert probe.written <= result_bytes + own_row + 1024, (strategy, probe.written)
            data = mode.get_total_counts() - rank_checks(sharded)  # send_recv: its point-to-point batches
            report[strategy] = {"peak": rec.peak, "collectives": data}
            assert rec.peak <= result_bytes + limit, (strategy, rec.peak, result_bytes, limit, rec.sizes)
            # one collective per window, and few of them: two consecutive windows of a group hold more than one
            # window's bytes, so a group of S_g bytes has at most 2·S_g/limit + 1 (here 2·4 + 1 per group); the
            # library cuts windows of half the staging buffer (two in flight, issue 55) only where that holds
            groups = sum(p.numel() > 0 for p in sharded.local_partitions)
            assert data == windows(sharded, limit) > 1, (strategy, data, mode.get_comm_counts())
            assert data <= 2 * result_bytes / limit + groups, (strategy, data, result_bytes, limit)
            del got
            # async: the later windows travel from wait(); out= reuses the result; a dtype converts once
            handle = sharded.full_tensors(strategy=strategy, async_op=True)
            got = handle.wait()
            _equal(dict(got), default, f"windowed {strategy} async")
            again = sharded.full_tensors(strategy=strategy, out=got)
            _equal(dict(again), default, f"windowed {strategy} out=")
            as_fp64 = sharded.full_tensors(strategy=strategy, dtype=torch.float64)
            assert all(torch.equal(as_fp64[n], default[n].double()) for n in default), strategy
            del got, again, as_fp64, handle
    # issue 55: a larger staging buffer (half the result) where the library cuts windows of half of it, two in flight
    # (the next window's collective beside the reorder of the one before): the same values, memory and count bounds
    from zero_dtensor.core.state import state_of
    from zero_dtensor.materialize.transfers import window_cut

    state = state_of(sharded)
    wide = result_bytes // 2
    assert window_cut(state, [g for g, p in enumerate(sharded.local_partitions) if p.numel()], wide)[1] == 2
    with small_windows(wide):
        for strategy in ("all_gather", "all_to_all", "send_recv"):
            mz.release_workspace()
            _settle_recycled()
            with count_comms() as mode, recording() as rec:
                got = sharded.full_tensors(strategy=strategy)
            _equal(dict(got), default, f"windowed {strategy}, two in flight")
            data = mode.get_total_counts() - rank_checks(sharded)
            assert rec.peak <= result_bytes + wide, (strategy, rec.peak, result_bytes, wide, rec.sizes)
            assert data == windows(sharded, wide) > 1, (strategy, data)
            assert data <= 2 * result_bytes / wide + len(sharded.local_partitions), (strategy, data)
            report[strategy + " two in flight"] = {"peak": rec.peak, "collectives": data}
            del got
    return report


def check_set_full_copies(stages: tuple[int, ...] = (1, 2, 3)) -> dict:
    """``set_full_`` of every parameter (gradients, then fp32 masters after a step) on ZeRO-1/2/3, counted by
    :class:`DispatchProbe` with the partitions watched: the bytes written into DeepSpeed's partitions are at most
    what this rank holds (each byte once); on the per-parameter path (forced with ``STAGE_BELOW = 0``; on this
    model the default takes it too: its rows do not pay for staging) nothing else is written and nothing is
    allocated: one ``_foreach_copy_``."""
    from unittest import mock

    from zero_dtensor.ops import direct_write, writes

    report: dict[str, Any] = {}
    for stage in stages:
        engine = build_engine(EngineCase(stage, world=dist.get_world_size(), model="deep"))  # small parameters
        forward_backward(engine)
        families = {"grads": zd.sharded_grads(engine)}
        for name, family in list(families.items()) + [("masters", None)]:
            if family is None:
                engine.step()
                family = zd.sharded_master_params(engine)
            values = dict(family.full_tensors(strategy="all_gather"))
            held = sum(p.numel() * p.element_size() for p in family.local_partitions)
            for path, below in (("default", writes.STAGE_BELOW), ("direct", 0)):
                with mock.patch.object(writes, "STAGE_BELOW", below), \
                        mock.patch.object(direct_write, "FOREACH_DEVICES", frozenset()):  # as on an accelerator
                    family.set_full_(values)  # warm: kept staging buffers, cached plans
                    with DispatchProbe() as probe:
                        probe.watch(family.local_partitions)
                        family.set_full_(values)
                got = dict(family.full_tensors(strategy="all_gather"))
                _equal(got, values, f"z{stage} {name} {path}")
                row = {"held": held, "data_written": probe.data_written, "written": probe.written,
                       "largest": probe.largest, "ops": probe.ops, "by_op": dict(probe.by_op)}
                report[f"z{stage} {name} {path}"] = row
                assert probe.data_written <= held, row  # each byte of the partition written at most once
                if path == "direct":
                    assert probe.written == probe.data_written and probe.largest == 0, row
                    # the fragments are one run of the partition: one concatenation into it (one kernel on CUDA)
                    assert row["by_op"] == {"aten.cat.out": 1}, row
            with mock.patch.object(writes, "STAGE_BELOW", 0), DispatchProbe() as probe:  # the CPU's own recipe
                family.set_full_(values)
            assert dict(probe.by_op) == {"aten._foreach_copy_.default": 1}, dict(probe.by_op)
            report[f"z{stage} {name} fallbacks"] = _check_direct_write_fallbacks(family, values, stage)
    return report


def _check_direct_write_fallbacks(family: Any, values: dict[str, torch.Tensor], stage: int) -> dict[str, dict]:
    """Where one ``cat`` into the run cannot be used, the per-parameter path copies value by value (one
    ``_foreach_copy_``), with the same result: on ZeRO-1/2 a non-contiguous value (``flatten`` would copy it) and
    a value that is a live view of the partition itself (``cat`` refuses an input overlapping its output). ZeRO-3
    over two ranks holds every parameter in part: non-contiguous values are reshaped (copied) first, as before, and
    the parts then concatenated, the last rank's padding gaps included (zeros)."""
    from unittest import mock

    from zero_dtensor.ops import direct_write, writes

    cases = {"non-contiguous": {n: (v.t().contiguous().t() if v.dim() == 2 else v) for n, v in values.items()}}
    assert any(not v.is_contiguous() for v in cases["non-contiguous"].values())
    if stage in (1, 2):
        layout = family.layout
        for p in layout.params:
            group = layout.groups[p.group]
            start = p.offset - group.local_start
            if 0 <= start and start + p.numel <= group.partition_numel and p.numel:
                live = family.local_partitions[p.group].narrow(0, start, p.numel).view(p.shape)
                cases["live view"] = {**values, p.name: live}
                break
        assert "live view" in cases, "no parameter held whole on this rank"
    out = {}
    for case, mapping in cases.items():
        family.set_full_(values)
        with mock.patch.object(writes, "STAGE_BELOW", 0), DispatchProbe() as probe, \
                mock.patch.object(direct_write, "FOREACH_DEVICES", frozenset()):
            family.set_full_(mapping)
        _equal(dict(family.full_tensors(strategy="all_gather")), values, f"z{stage} {case}")
        ops = {k.split(".")[1]: n for k, n in probe.by_op.items()}
        if stage in (1, 2):  # (a partly held non-contiguous value is reshaped: a copy, as before)
            assert ops.get("_foreach_copy_") == 1 and "cat" not in ops, (case, dict(probe.by_op))
        else:  # ZeRO-3 over 2 ranks holds every parameter in part: the parts are reshaped copies, then one cat
            assert ops.get("cat") == 1 and "_foreach_copy_" not in ops, (case, dict(probe.by_op))
        out[case] = dict(probe.by_op)
    return out


def check_async_polled(case: EngineCase, deadline_s: float = 30.0) -> dict:
    """Issue 51 item 4: a poll-then-wait loop over ``full_tensors(async_op=True)`` terminates, over the window
    threshold (forced small) too, for every gather strategy, the gradients and (after a step) the fp32 masters,
    with DeepSpeed's values: ``is_completed()`` turns true without ``wait()`` (today's code issued the later windows
    only from ``wait()``: the loop spun until the deadline), and ``wait()`` then issues no collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    engine = build_engine(case)
    forward_backward(engine)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    report: dict[str, Any] = {}
    for family in ("grads", "masters"):
        if family == "masters":
            engine.step()
            sharded = zd.sharded_master_params(engine)
            want = {n: safe_get_full_fp32_param(p).reshape(-1) for n, p in named}
        else:
            sharded = zd.sharded_grads(engine)
            want = {n: safe_get_full_grad(p).reshape(-1) for n, p in named}
        result_bytes = sum(p.numel() * p.element_size() for p in sharded.local_partitions) * dist.get_world_size()
        with small_windows(result_bytes // 4):
            for strategy in ("all_gather", "all_to_all", "send_recv"):
                handle = sharded.full_tensors(strategy=strategy, async_op=True)
                polls, start = 0, time.monotonic()
                while not handle.is_completed():  # the standard torch.distributed pattern: poll, work, then wait
                    polls += 1
                    if time.monotonic() - start > deadline_s:
                        raise AssertionError(f"{family} {strategy}: is_completed() still False after {deadline_s} s "
                                             f"({polls} polls) without wait()")
                    time.sleep(0.001)
                with count_comms() as mode:
                    got = handle.wait()
                assert mode.get_total_counts() == 0, (family, strategy, mode.get_comm_counts())  # wait() is local
                for n, _ in named:
                    assert torch.equal(got[n].reshape(-1).to(want[n].dtype), want[n]), (family, strategy, n)
                report[f"{family} {strategy}"] = {"polls": polls, "windows": windows(sharded, result_bytes // 8)}
                del got, handle
    return report
