"""Issue 10, worker side: nothing silently wrong (lost writes, aliasing results, autograd history, bad arguments,
misuse that hangs, gradients carried over after a failed hook)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

import zero_dtensor as zd
from zero_dtensor.ops import writes
from zero_dtensor.errors import RankDisagreementError

from .bad_input import deepspeed_storage
from .common import EngineCase, build_engine, forward_backward, params_snapshot


def _ds_full(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's own per-parameter reads (fp32 copies)."""
    return {n: safe_get_full_grad(p).float().clone() for n, p in engine.module.named_parameters() if p.requires_grad}


def _assert_params_equal(a: Any, b: Any) -> None:
    pa, pb = params_snapshot(a), params_snapshot(b)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), (name, (pa[name] - pb[name]).abs().max())


# --- 1. keep_full_grads: raw writes reach the step ----------------------------------------------------------------
RAW_WRITES = ("param_to_local", "group_to_local", "local_partitions")


def _raw_halve(grads: zd.ShardedGrads, path: str) -> None:
    if path == "param_to_local":
        for name in grads.names:
            grads[name].to_local().mul_(0.5)
    elif path == "group_to_local":
        for group in grads.groups:
            group.to_local().mul_(0.5)
    else:
        for part in grads.local_partitions:
            part.mul_(0.5)


def check_keep_full_raw_writes(case: EngineCase, path: str) -> None:
    """Halving the gradient through a raw view under keep_full_grads gives the same step as DeepSpeed's own
    get-halve-set loop (``case`` with SGD lr 1: a lost write would be off by exactly the write)."""
    assert case.optimizer == "sgd"
    ours, theirs = build_engine(case), build_engine(case)
    handle = zd.keep_full_grads(ours)
    forward_backward(ours)
    forward_backward(theirs)
    grads = zd.sharded_grads(ours)
    assert all(g.placements[0].is_replicate() for g in grads.groups)
    _raw_halve(grads, path)
    after_write = grads.full_tensors(dtype=torch.float32)
    for name, p in theirs.module.named_parameters():
        safe_set_full_grad(p, safe_get_full_grad(p) * 0.5)
    expected = _ds_full(theirs)
    for name in expected:
        assert torch.equal(after_write[name], expected[name]), name
    ours.step()
    theirs.step()
    _assert_params_equal(ours, theirs)
    handle.remove()


# --- 2. full results are snapshots; views are live ----------------------------------------------------------------
def check_results_are_snapshots(case: EngineCase, keep_full: bool) -> None:
    engine = build_engine(case)
    if keep_full:
        zd.keep_full_grads(engine)
    forward_backward(engine, 0)
    grads = zd.sharded_grads(engine)
    if keep_full or case.bf16_optimizer:
        assert all(g.placements[0].is_replicate() for g in grads.groups)
    name = grads.names[0]
    truth = _ds_full(engine)

    results = {
        "full_tensors": grads.full_tensors(),
        "full_tensors_fp32": grads.full_tensors(dtype=torch.float32),
        "get_full_model_grads": zd.get_full_model_grads(engine),
        "full_tensor": {name: grads[name].full_tensor()},
        "iter_full": dict(grads.iter_full()),
    }
    kept = {k: {n: t.clone() for n, t in r.items()} for k, r in results.items()}
    for kind, result in results.items():  # mutating a result leaves the gradient alone
        for t in result.values():
            t.add_(1000.0)
        now = grads.full_tensors(dtype=torch.float32)
        for n in truth:
            assert torch.equal(now[n], truth[n]), (kind, n)
        assert torch.equal(zd.get_full_model_grads(engine)[name], truth[name]), kind
    for kind, result in results.items():
        for n, t in result.items():
            t.sub_(1000.0)
            kept[kind][n] = t.clone()

    # live view: a write through the API shows in a to_local() view taken before it
    view = grads[name].to_local()
    before_view = view.clone()
    grads.mul_(2.0)
    assert torch.equal(view, before_view * 2.0)
    grads.div_(2.0)

    engine.step()  # results kept across the step and the next backward do not change under the caller
    forward_backward(engine, 1)
    for kind, result in results.items():
        for n, t in result.items():
            assert torch.equal(t, kept[kind][n]), (kind, n)
    assert not torch.equal(zd.get_full_model_grads(engine)[name], truth[name])  # the gradient itself did change


# --- 3. writes never record autograd history ----------------------------------------------------------------------
def check_writes_record_no_history(case: EngineCase) -> None:
    engine = build_engine(case)
    weights = {}
    for step in range(2):  # the second step proves ZeRO-3 views still work after a write with requires_grad
        forward_backward(engine, step)
        grads = zd.sharded_grads(engine)
        full = grads.full_tensors(dtype=torch.float32)
        for n, t in full.items():
            weights.setdefault(n, torch.full(t.shape, 0.5, requires_grad=True))
        values = {n: full[n] * weights[n] for n in full}
        assert all(v.requires_grad for v in values.values())
        grads.set_full_(values)
        factor = torch.tensor(1.0, requires_grad=True)
        grads.mul_(factor)
        grads.apply_(lambda x: x * factor)
        for part in grads.local_partitions:
            assert part.grad_fn is None and not part.requires_grad
        for n in grads.names:
            one = grads[n].full_tensor(dtype=torch.float32)
            assert not one.requires_grad and one.grad_fn is None
            assert torch.equal(one, (full[n] * 0.5).detach().to(grads[n].dtype).float()), n
        again = grads.full_tensors()
        assert not any(t.requires_grad for t in again.values())
        for storage in deepspeed_storage(engine):
            assert storage.grad_fn is None and not storage.requires_grad
        engine.step()


class _PlainSubclass(torch.Tensor):
    """A tensor subclass with no dispatch of its own, as user code makes them."""


def check_tensor_subclass_values(case: EngineCase) -> dict[str, bool]:
    """``set_full_`` takes ``nn.Parameter`` values (leaves that require grad) and other plain tensor subclasses as
    it takes tensors: the whole request, every other parameter in reverse order, one entry alone (the per-parameter
    path), each with new values and then the same ones again (a repeated request's checks); where the parameters
    are small some of these are staged (``"staged"``: on this rank). What is read back is what was written, and
    DeepSpeed's storage records no history."""
    writes._ROW_WRITES.clear()
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    full = grads.full_tensors(dtype=torch.float32)
    first = grads.names[0]
    wraps = {"parameter": torch.nn.Parameter, "subclass": lambda t: t.as_subclass(_PlainSubclass)}
    for kind, wrap in wraps.items():
        for scale in (2.0, 3.0, 3.0):
            values = {n: wrap(t * scale) for n, t in full.items()}
            subset = {n: wrap(full[n] * (scale + 0.25)) for n in reversed(grads.names[1::2])}  # not in model order
            alone = {first: wrap(full[first] * (scale + 0.5))}
            assert type(values[first]) is not torch.Tensor and values[first].requires_grad == (kind == "parameter")
            for request in (values, subset, alone):
                grads.set_full_(request)
            staged = any(w is not None for w in writes._ROW_WRITES.values())
            got = grads.full_tensors(dtype=torch.float32)
            for n in full:
                factor = scale + 0.5 if n == first else scale + 0.25 if n in subset else scale
                assert torch.equal(got[n], (full[n] * factor).to(grads[n].dtype).float()), (kind, scale, n)
    for storage in deepspeed_storage(engine):
        assert storage.grad_fn is None and not storage.requires_grad
    return {"staged": staged}


# --- 4. bad arguments get a clear error ------------------------------------------------------------------------------
def check_bad_arguments(stage: int) -> list[str]:
    engine = build_engine(EngineCase(stage))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    name = grads.names[0]
    messages = []
    with pytest.raises(TypeError, match="single string") as info:
        grads.full_tensors(names=name)
    messages.append(str(info.value))
    with pytest.raises(TypeError, match="single string"):
        list(grads.iter_full(names=name))
    with pytest.raises(TypeError, match="single string"):
        zd.get_full_model_grads(engine, name)  # type: ignore[arg-type]
    for bad in (torch.int8, torch.int64, torch.bool, torch.uint8):
        with pytest.raises(TypeError, match="floating") as info:
            grads.full_tensors(dtype=bad)
        with pytest.raises(TypeError, match="floating"):
            grads[name].full_tensor(dtype=bad)
        with pytest.raises(TypeError, match="floating"):
            list(grads.iter_full(dtype=bad))
    messages.append(str(info.value))
    with pytest.raises(TypeError, match="torch.dtype"):
        grads.full_tensors(dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="more than once"):
        grads.full_tensors(names=[name, name])
    with pytest.raises(TypeError, match="DeepSpeed engine") as info:
        zd.sharded_grads(engine.module)
    messages.append(str(info.value))
    with pytest.raises(TypeError, match="DeepSpeed engine"):
        zd.get_full_model_grads(torch.nn.Linear(2, 2))
    # everything above raised before any collective: the ranks are still in step
    full = grads.full_tensors(dtype=torch.float32)
    truth = _ds_full(engine)
    assert all(torch.equal(full[n], truth[n]) for n in truth)
    return messages


def check_stage0_refused() -> str:
    engine = build_engine(EngineCase(0))
    with pytest.raises(zd.UnsupportedDeepSpeedError, match="stage 0") as info:
        zd.on_grads(engine, lambda grads: None)
    assert "step" not in engine.__dict__  # nothing registered
    with pytest.raises(zd.UnsupportedDeepSpeedError, match="stage"):
        zd.sharded_grads(engine)
    return str(info.value)


# --- 5. misuse that used to hang -------------------------------------------------------------------------------------
def check_skip_then_step_raises(stage: int) -> str:
    """Debug mode: rank 1 skips full_tensors() and goes on to engine.step(); every rank raises."""
    engine = build_engine(EngineCase(stage))
    forward_backward(engine)
    zd.set_debug(True)
    try:
        grads = zd.sharded_grads(engine)
        with pytest.raises(RankDisagreementError) as info:
            if dist.get_rank() == 0:
                grads.full_tensors()
            else:
                engine.step()
        assert "engine.step" in str(info.value) and "full_tensors" in str(info.value)
    finally:
        zd.set_debug(False)
    assert engine.global_steps == 0
    return str(info.value)


def check_different_groups_raise(stage: int) -> str:
    """Default mode (no debug): ranks asking for names in different flat groups raise, instead of garbage."""
    engine = build_engine(EngineCase(stage, groups=2))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    assert len(grads.layout.groups) == 2
    first = [p.name for p in grads.layout.params if p.group == 0][:1]
    second = [p.name for p in grads.layout.params if p.group == 1][:1]
    with pytest.raises(RankDisagreementError) as info:
        grads.full_tensors(first if dist.get_rank() == 0 else second)
    with pytest.raises(RankDisagreementError):
        list(grads.iter_full(first if dist.get_rank() == 0 else second))
    full = grads.full_tensors(first + second, dtype=torch.float32)  # the group still works after a caught mismatch
    truth = _ds_full(engine)
    assert all(torch.equal(full[n], truth[n]) for n in first + second)
    return str(info.value)


def skipped_call_times_out(timeout: float) -> str:
    """Run under zd.launch (fresh processes): rank 1 never calls full_tensors(); rank 0 raises after ``timeout``."""
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    engine = build_engine(EngineCase(2))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    zd.set_debug(True, timeout=timeout)
    if dist.get_rank() == 1:
        time.sleep(timeout * 1.5)  # stays alive, in no collective, past the timeout (then waits for the next task)
        return "skipped"
    with pytest.raises(RankDisagreementError, match="within") as info:
        grads.full_tensors()
    return str(info.value)


# --- 6. a failed hook discards the step's gradients on every stage --------------------------------------------------
def check_failed_hook_discards(case: EngineCase) -> None:
    """A hook raising on one rank: no step, and the batch's gradient is gone on every rank (no zero_grad by the
    user): training on equals an engine that never saw that batch."""

    def make() -> Any:
        return build_engine(case)

    def fail(grads: zd.ShardedGrads) -> None:
        if dist.get_rank() == 0:
            raise ValueError("reject this batch")

    engine = make()
    with zd.on_grads(engine, fail):
        forward_backward(engine, 0)
        with pytest.raises((ValueError, zd.GradHookError)):
            engine.step()
    forward_backward(engine, 1)  # no zero_grad by the user
    engine.step()

    never = make()
    forward_backward(never, 1)
    never.step()
    assert engine.global_steps == never.global_steps == 1
    _assert_params_equal(engine, never)


def check_unmanaged_failed_hook_discards(stage: int) -> None:
    case = EngineCase(stage, gas=2, extra={"managed_gradient_accumulation": False})

    def fail(grads: zd.ShardedGrads) -> None:
        raise ValueError("reject")

    engine = build_engine(case)
    with zd.on_grads(engine, fail):
        forward_backward(engine, 0)
        forward_backward(engine, 1)
        with pytest.raises(ValueError):
            engine.step()
    forward_backward(engine, 2)  # no zero_grad by the user
    forward_backward(engine, 3)
    engine.step()
    never = build_engine(case)
    forward_backward(never, 2)
    forward_backward(never, 3)
    never.step()
    pa, pb = params_snapshot(engine), params_snapshot(never)
    for n in pa:
        assert torch.allclose(pa[n], pb[n], rtol=1e-5, atol=1e-7), n




# --- fuzz: set_full_ / full_tensors arguments --------------------------------------------------------------------
VALUE_KINDS = ("good", "transposed", "requires_grad", "fp16", "bf16", "fp64", "wrong_shape", "int", "bool", "list",
               "none", "meta", "scalar")
BAD_VALUE = {"wrong_shape": ValueError, "int": TypeError, "bool": TypeError, "list": TypeError, "none": TypeError,
             "meta": ValueError, "scalar": ValueError}


def _value(kind: str, name: str, shape: torch.Size, salt: int) -> Any:
    base = torch.randn(shape, generator=torch.Generator().manual_seed(salt * 7919 + len(name)))
    if kind == "good":
        return base
    if kind == "transposed":  # same shape, non-contiguous strides
        return base.reshape(-1).flip(0).reshape(shape) if len(shape) < 2 else base.t().contiguous().t()
    if kind == "requires_grad":
        return base.requires_grad_(True) * 1.0
    if kind in ("fp16", "bf16", "fp64"):
        return base.to({"fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}[kind])
    if kind == "wrong_shape":
        return torch.zeros(shape.numel() + 1)
    if kind == "int":
        return base.to(torch.int32)
    if kind == "bool":
        return base > 0
    if kind == "list":
        return base.tolist()
    if kind == "none":
        return None
    if kind == "meta":
        return torch.empty(shape, device="meta")
    return torch.tensor(1.0) if shape.numel() != 1 or len(shape) != 0 else torch.zeros(2)


def fuzz_arguments(case: EngineCase, examples: int = 40) -> dict[str, int]:
    """Hypothesis over set_full_ / full_tensors arguments: a clear error and nothing written, or the right result.
    Derandomized, so every rank draws the same examples (and all of them raise, or none, before any collective)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    names = list(grads.names)
    original = grads.full_tensors()
    outcomes = {"errors": 0, "writes": 0, "reads": 0}
    config = settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck))
    key = st.one_of(st.sampled_from(names), st.sampled_from(["no.such.param", ""]), st.integers(0, 3))

    @config
    @given(entries=st.lists(st.tuples(key, st.sampled_from(VALUE_KINDS)), max_size=4),
           as_pairs=st.booleans().map(lambda b: b and False) | st.just(False), salt=st.integers(0, 1000))
    def writes(entries: list[tuple[Any, str]], as_pairs: bool, salt: int) -> None:
        mapping = {}
        for name, kind in entries:
            shape = grads[name].shape if name in names else torch.Size([3])
            mapping[name] = _value(kind, str(name), shape, salt)
        expected: type[Exception] | None = None
        for name, value in mapping.items():  # the first bad entry decides; any bad entry means an error
            kind = next(k for n, k in reversed(entries) if n == name)
            if name not in names:
                expected = expected or KeyError
            elif kind in BAD_VALUE:
                expected = expected or BAD_VALUE[kind]
        before = deepspeed_storage(engine)
        if expected is not None:
            with pytest.raises((TypeError, ValueError, KeyError)):
                grads.set_full_(mapping)
            after = deepspeed_storage(engine)
            assert all(torch.equal(a, b) for a, b in zip(before, after)), entries
            outcomes["errors"] += 1
            return
        grads.set_full_(mapping)
        read = grads.full_tensors(list(mapping) or None, dtype=torch.float32)
        for name, value in mapping.items():
            want = value.detach().to(grads[name].dtype).float()
            assert torch.equal(read[name], want), (name, entries)
        grads.set_full_(original)  # every example starts from the same gradient
        outcomes["writes"] += 1

    dtype_choice = st.sampled_from([None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                    torch.bool, "float32"])
    names_choice = st.one_of(
        st.none(),
        st.lists(st.sampled_from(names), max_size=4),
        st.sampled_from(names),  # a single string
        st.lists(st.one_of(st.sampled_from(names), st.just("no.such.param"), st.integers(0, 2)), max_size=3),
        st.lists(st.sampled_from(names), min_size=1, max_size=3).map(tuple),
    )

    @config
    @given(requested=names_choice, dtype=dtype_choice,
           strategy=st.sampled_from(["auto", "all_gather", "all_to_all", "all_reduce", "bogus"]))
    def reads(requested: Any, dtype: Any, strategy: str) -> None:
        bad = (isinstance(requested, str)
               or (requested is not None and (len(set(requested)) != len(requested)
                                              or any(n not in names for n in requested)))
               or not (dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point))
               or strategy == "bogus")
        before = deepspeed_storage(engine)
        if bad:
            with pytest.raises((TypeError, ValueError, KeyError)):
                grads.full_tensors(requested, dtype=dtype, strategy=strategy)
        else:
            result = grads.full_tensors(requested, dtype=dtype, strategy=strategy)
            wanted = names if requested is None else list(requested)
            assert list(result) == wanted
            for name in wanted:
                want = original[name] if dtype is None else original[name].to(dtype)
                assert result[name].dtype == want.dtype and torch.equal(result[name], want), name
            outcomes["reads"] += 1
        after = deepspeed_storage(engine)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        if bad:
            outcomes["errors"] += 1

    writes()
    reads()
    return outcomes
