"""Issue 6 checks, run on every rank: ``zd.on_grads`` in plain DeepSpeed and Accelerate loops, removal, errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

import zero_dtensor as zd
from zero_dtensor.integrations.hooks import GradHookError

from .common import EngineCase, batch, build_engine, build_model, fill_value, forward_backward, params_snapshot

STEPS = 3  # optimizer steps per check


def modify(name: str, g: torch.Tensor) -> torch.Tensor:
    """The gradient edit under test: deterministic, the same on every rank, changes every element."""
    return 0.5 * g.float() + 0.01 * fill_value(name, g.shape)


def hook_modify(grads: zd.ShardedGrads) -> None:
    full = grads.full_tensors(dtype=torch.float32)
    grads.set_full_({n: modify(n, v) for n, v in full.items()})


def reference_modify(engine: Any, stage: int) -> None:
    """DeepSpeed's own way of making the same edit: a safe_get_full_grad / safe_set_full_grad loop."""
    world = dist.get_world_size()
    for name, p in engine.module.named_parameters():
        value = modify(name, safe_get_full_grad(p))
        if stage == 3:  # DeepSpeed's stage-3 set narrows past the end unless the value is padded (its bug 2)
            pn = p.partition_numel()
            value = torch.cat([value.reshape(-1), value.new_zeros(pn * world - value.numel())])
        safe_set_full_grad(p, value)


def reference_run(theirs: Any, stage: int, gas: int) -> Any:
    """Train ``theirs`` for STEPS boundaries on the shared data, editing gradients with DeepSpeed's safe_* loop."""
    for micro in range(STEPS * gas):
        forward_backward(theirs, micro)
        if theirs.is_gradient_accumulation_boundary():
            reference_modify(theirs, stage)
        theirs.step()
    return theirs


def assert_params_equal(mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], exact: bool = True) -> None:
    assert mine.keys() == reference.keys()
    for name in mine:
        if exact:
            assert torch.equal(mine[name], reference[name]), name
        else:
            torch.testing.assert_close(mine[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def assert_params_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert any(not torch.equal(a[n], b[n]) for n in a), "the hook's edit did not change the parameters"


# --- plain DeepSpeed --------------------------------------------------------------------------------------------------
def check_fires_once_per_boundary(case: EngineCase) -> dict:
    """The hook fires once per boundary, with the reduced gradient (== safe_get_full_grad), never mid-accumulation."""
    gas = case.gas
    engine = build_engine(case)
    seen: list[tuple[int, int]] = []

    def fn(grads: zd.ShardedGrads) -> None:
        assert engine.is_gradient_accumulation_boundary()
        seen.append((engine.micro_steps, engine.global_steps))
        full = grads.full_tensors(dtype=torch.float32)
        for name, p in engine.module.named_parameters():
            assert torch.equal(full[name], safe_get_full_grad(p)), name

    handle = zd.on_grads(engine, fn)
    sparse: list[int] = []
    every_other = zd.on_grads(engine, lambda g: sparse.append(engine.global_steps), every=2)
    for micro in range(STEPS * gas):
        forward_backward(engine, micro)
        engine.step()
    handle.remove()
    every_other.remove()
    assert seen == [((s + 1) * gas - 1, s) for s in range(STEPS)], seen
    assert engine.global_steps == STEPS
    assert sparse == list(range(0, STEPS, 2)) and every_other.boundaries == handle.boundaries == STEPS
    return {"fired": len(seen)}


def check_edit_reaches_optimizer(case: EngineCase) -> None:
    """Parameters after steps with a hook edit == a safe_get/set_full_grad loop doing the same edit."""
    stage, gas = case.stage, case.gas
    ours = build_engine(case)
    untouched = params_snapshot(ours)
    with zd.on_grads(ours, hook_modify):
        for micro in range(STEPS * gas):
            forward_backward(ours, micro)
            ours.step()

    theirs = reference_run(build_engine(case), stage, gas)
    mine = params_snapshot(ours)
    assert_params_equal(mine, params_snapshot(theirs))
    assert_params_differ(mine, untouched)


def check_several_hooks_in_order() -> None:
    engine = build_engine(EngineCase(2))
    order: list[str] = []

    def first(grads: zd.ShardedGrads) -> None:
        order.append("first")
        grads.set_full_({n: torch.ones(grads[n].shape) for n in grads.names})

    def second(grads: zd.ShardedGrads) -> None:
        order.append("second")
        full = grads.full_tensors(dtype=torch.float32)
        assert all(torch.equal(v, torch.ones_like(v)) for v in full.values())  # sees the first hook's edit

    h1, h2 = zd.on_grads(engine, first), zd.on_grads(engine, second)
    forward_backward(engine)
    engine.step()
    h1.remove()
    assert "step" in engine.__dict__  # h2 still registered
    forward_backward(engine, 1)
    with pytest.raises(AssertionError):  # without `first`, the gradients are no longer all ones
        engine.step()
    h2.remove()
    assert "step" not in engine.__dict__
    assert order == ["first", "second", "second"]


def check_rejects_non_engines() -> None:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    with pytest.raises(TypeError, match="PipelineEngine"):
        zd.on_grads(PipelineEngine.__new__(PipelineEngine), hook_modify)
    with pytest.raises(TypeError, match="DeepSpeed engine"):
        zd.on_grads(torch.nn.Linear(2, 2), hook_modify)
    engine = build_engine(EngineCase(1))
    with pytest.raises(TypeError, match="callable"):
        zd.on_grads(engine, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every"):
        zd.on_grads(engine, hook_modify, every=0)
    assert "step" not in engine.__dict__


# --- removal ----------------------------------------------------------------------------------------------------------
def check_remove_restores(stage: int) -> None:
    engine = build_engine(EngineCase(stage))
    assert "step" not in engine.__dict__ and "_take_model_step" not in engine.__dict__
    handle = zd.on_grads(engine, hook_modify)
    assert engine.step.__wrapped__.__func__ is DeepSpeedEngine.step  # type: ignore[attr-defined]
    handle.remove()
    handle.remove()  # idempotent
    assert not handle.active
    assert "step" not in engine.__dict__ and "_take_model_step" not in engine.__dict__
    assert engine.step.__func__ is DeepSpeedEngine.step and engine.step.__self__ is engine
    assert engine._take_model_step.__func__ is DeepSpeedEngine._take_model_step
    assert not hasattr(engine, "_zero_dtensor_grad_hooks")

    # context-manager form: fires inside, not after
    fired: list[int] = []
    with zd.on_grads(engine, lambda g: fired.append(engine.global_steps)) as h:
        assert h.active
        forward_backward(engine, 0)
        engine.step()
    assert "step" not in engine.__dict__
    forward_backward(engine, 1)
    engine.step()
    assert fired == [0]

    never = build_engine(EngineCase(stage))
    for micro in range(2):
        forward_backward(never, micro)
        never.step()
    assert_params_equal(params_snapshot(engine), params_snapshot(never))


def check_instance_attribute_preserved() -> None:
    """A ``step`` someone set on the instance before us comes back on remove; one set on top of us is left alone."""
    engine = build_engine(EngineCase(1))
    calls: list[str] = []
    original = engine.step

    def theirs(*a: Any, **k: Any) -> Any:
        calls.append("theirs")
        return original(*a, **k)

    engine.step = theirs
    handle = zd.on_grads(engine, lambda g: calls.append("hook"))
    forward_backward(engine)
    engine.step()
    assert calls == ["hook", "theirs"]
    handle.remove()
    assert engine.step is theirs

    handle = zd.on_grads(engine, lambda g: calls.append("hook2"))
    ours = engine.step
    on_top = lambda *a, **k: ours(*a, **k)  # noqa: E731
    engine.step = on_top
    handle.remove()
    assert engine.step is on_top  # not torn out from under the later wrapper; ours is now a pass-through
    forward_backward(engine, 1)
    engine.step()
    assert calls == ["hook", "theirs", "theirs"]


# --- errors -----------------------------------------------------------------------------------------------------------
def check_error_on_one_rank(stage: int, failing_rank: int, after_collective: bool = False) -> None:
    """fn raises on one rank: every rank raises, nothing hangs, no optimizer update; the engine steps fine after."""
    engine = build_engine(EngineCase(stage))
    before = params_snapshot(engine)

    def fn(grads: zd.ShardedGrads) -> None:
        if after_collective:
            grads.full_tensors()  # every rank completes this collective; then one rank fails
        if dist.get_rank() == failing_rank:
            raise ValueError("bad gradients on this rank")

    handle = zd.on_grads(engine, fn)
    forward_backward(engine)
    micro, steps = engine.micro_steps, engine.global_steps
    if dist.get_rank() == failing_rank:
        with pytest.raises(ValueError, match="bad gradients"):
            engine.step()
    else:
        with pytest.raises(GradHookError, match=rf"rank\(s\) \[{failing_rank}\]") as info:
            engine.step()
        assert info.value.failed_ranks == [failing_rank]
    assert (engine.micro_steps, engine.global_steps) == (micro, steps)  # step() did not begin
    assert_params_equal(params_snapshot(engine), before)
    handle.remove()

    # the engine is not half-stepped: stepping now equals an engine that never had a hook
    engine.step()
    never = build_engine(EngineCase(stage))
    forward_backward(never)
    never.step()
    assert_params_equal(params_snapshot(engine), params_snapshot(never))


def check_error_on_all_ranks() -> None:
    engine = build_engine(EngineCase(2))
    before = params_snapshot(engine)

    def fn(grads: zd.ShardedGrads) -> None:
        raise KeyError(f"rank {dist.get_rank()}")

    with zd.on_grads(engine, fn):
        forward_backward(engine)
        with pytest.raises(KeyError, match=f"rank {dist.get_rank()}"):
            engine.step()
    assert_params_equal(params_snapshot(engine), before)


# --- unmanaged accumulation -------------------------------------------------------------------------------------------
def check_unmanaged(stage: int) -> None:
    """``managed_gradient_accumulation: false``: step() finalizes; the hook runs after that, before the optimizer."""
    gas = 2
    unmanaged = EngineCase(stage, gas=gas, extra={"managed_gradient_accumulation": False})
    ours = build_engine(unmanaged)
    seen: list[int] = []

    def fn(grads: zd.ShardedGrads) -> None:
        seen.append(ours.global_steps)
        hook_modify(grads)

    with zd.on_grads(ours, fn):
        for s in range(STEPS):
            for m in range(gas):
                forward_backward(ours, s * gas + m)
            ours.step()
    assert seen == list(range(STEPS))

    # reference: managed accumulation, same data, the same edit made by DeepSpeed's safe_* loop
    theirs = reference_run(build_engine(EngineCase(stage, gas=gas)), stage, gas)
    assert_params_equal(params_snapshot(ours), params_snapshot(theirs), exact=False)

    # an error inside step(): every rank raises, no update, step() state undone
    engine = build_engine(unmanaged)
    before = params_snapshot(engine)

    def bad(grads: zd.ShardedGrads) -> None:
        if dist.get_rank() == 1:
            raise ValueError("bad")

    with zd.on_grads(engine, bad):
        forward_backward(engine)
        with pytest.raises((ValueError, GradHookError)):
            engine.step()
    assert engine._running_engine_step is False and engine.global_steps == 0
    assert_params_equal(params_snapshot(engine), before)


# --- Accelerate -------------------------------------------------------------------------------------------------------
def _accelerate_engine(stage: int, gas: int) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    # one Accelerator per check in a reused rank process: drop the singletons the previous check left
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # the config without an optimizer: the client optimizer below, as an Accelerate user passes it
    config = EngineCase(stage, gas=gas, optimizer="client_adam").config()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=gas)
    model, _ = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(engine, DeepSpeedEngine)
    assert str(accelerator.distributed_type) == "DistributedType.DEEPSPEED"
    # accelerate on CPU counts one process per rank (no backend without a GPU unless cpu=True, which disables the
    # DeepSpeed plugin); DeepSpeed itself trains on the whole world, which is what the hook depends on
    assert engine.dp_world_size == dist.get_world_size() == 2
    return accelerator, engine, optimizer


def check_accelerate(case: EngineCase) -> dict:
    """Under Accelerate's DeepSpeed plugin (engine.step() runs inside accelerator.backward()), the hook fires once per
    boundary and its edit reaches the optimizer (== a plain engine with the safe_* loop making the same edit)."""
    stage, gas = case.stage, case.gas
    accelerator, engine, optimizer = _accelerate_engine(stage, gas)
    seen: list[int] = []
    steps_called: list[bool] = []
    inner_step = engine.step

    def fn(grads: zd.ShardedGrads) -> None:
        seen.append(engine.global_steps)
        hook_modify(grads)

    with zd.on_grads(engine, fn):
        engine_step = engine.step
        for micro in range(STEPS * gas):
            with accelerator.accumulate(engine):
                loss = engine(batch(engine, micro)).float().pow(2).mean()
                steps_called.append(accelerator.sync_gradients)
                accelerator.backward(loss)  # DeepSpeedEngineWrapper.backward: engine.backward(loss); engine.step()
                optimizer.step()  # no-ops under DeepSpeed
                optimizer.zero_grad()
        assert engine.step is engine_step
    assert engine.step.__func__ is inner_step.__func__
    assert seen == list(range(STEPS)), seen
    assert engine.global_steps == STEPS

    theirs = reference_run(build_engine(EngineCase(stage, gas=gas, optimizer="client_adam")), stage, gas)
    assert_params_equal(params_snapshot(engine), params_snapshot(theirs))
    return {"fired": len(seen), "sync": steps_called}


# --- GradStatsLogger --------------------------------------------------------------------------------------------------
def check_stats_logger(case: EngineCase, every: int) -> dict:
    """Values equal statistics of safe_get_full_grad taken at the same moment; logged every ``every`` boundaries;
    callback on rank 0 only; stats cost at most two collectives."""
    from .common import count_comms

    gas = case.gas  # bf16: stage 1 with BF16_Optimizer (replicated fp32 grads)
    engine = build_engine(case)
    references: list[dict[str, torch.Tensor]] = []
    calls: list[tuple[int, dict[str, float]]] = []
    zd.on_grads(engine, lambda g: references.append(
        {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}))
    logger = zd.GradStatsLogger(engine, every=every, callback=lambda m, s: calls.append((s, m)))
    logged: list[tuple[int | None, dict[str, float]]] = []
    boundaries = 3
    for micro in range(boundaries * gas):
        forward_backward(engine, micro)
        engine.step()
        if engine.micro_steps % gas == 0 and (engine.micro_steps // gas - 1) % every == 0:
            logged.append((logger.latest_step, dict(logger.latest)))
    logger.remove()
    assert logger.boundaries == boundaries and not logger.active
    expected_steps = list(range(1, boundaries + 1, every))
    assert [s for s, _ in logged] == expected_steps
    for (step, latest) in logged:
        ref = references[step - 1]
        assert all(isinstance(v, float) for v in latest.values())
        total = 0.0
        for name, g in ref.items():
            torch.testing.assert_close(latest[f"grad/{name}/norm"], g.norm().item(), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(latest[f"grad/{name}/max_abs"], g.abs().max().item(), rtol=1e-6, atol=0.0)
            torch.testing.assert_close(latest[f"grad/{name}/mean"], g.mean().item(), rtol=1e-4, atol=1e-8)
            assert latest[f"grad/{name}/nan_count"] == 0.0 and latest[f"grad/{name}/inf_count"] == 0.0
            total += g.double().pow(2).sum().item()
        torch.testing.assert_close(latest["grad/global_norm"], total**0.5, rtol=1e-5, atol=1e-7)
        assert len(latest) == 5 * len(ref) + 3
    if dist.get_rank() == 0:
        assert [s for s, _ in calls] == expected_steps
        assert calls[-1][1] == logged[-1][1]
    else:
        assert calls == []

    # cost: the statistics take at most two collectives per step, plus the rank agreement
    engine2 = build_engine(dataclasses.replace(case, gas=1))
    probe = zd.GradStatsLogger(engine2, metrics=("norm",))
    probe.remove()
    counts: list[int] = []

    def counted(grads: zd.ShardedGrads) -> None:
        with count_comms() as mode:
            probe._on_grads(grads)
        counts.append(mode.get_total_counts())

    with zd.on_grads(engine2, counted):
        forward_backward(engine2)
        engine2.step()
    assert counts and counts[0] <= 3, counts
    assert set(probe.latest) == {f"grad/{n}/norm" for n, _ in engine2.module.named_parameters()} | {
        "grad/global_norm", "grad/nan_count", "grad/inf_count"}
    return {"steps": [s for s, _ in logged], "optimizer": type(engine.optimizer).__name__}


def check_stats_logger_nan_and_callback_error() -> None:
    engine = build_engine(EngineCase(2))

    def poison(grads: zd.ShardedGrads) -> None:
        value = grads.full_tensors(["fc2.bias"], dtype=torch.float32)["fc2.bias"].clone()
        value[3] = float("nan")
        value[5] = float("inf")
        grads.set_full_({"fc2.bias": value})

    zd.on_grads(engine, poison)

    def callback(metrics: dict[str, float], step: int) -> None:
        raise RuntimeError("tracker down")

    before = params_snapshot(engine)
    logger = zd.GradStatsLogger(engine, callback=callback)
    forward_backward(engine)
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="tracker down"):
            engine.step()
    else:
        with pytest.raises(GradHookError):
            engine.step()
    assert_params_equal(params_snapshot(engine), before)  # the callback failed: no optimizer step
    latest = logger.latest
    assert latest["grad/fc2.bias/nan_count"] == 1.0 and latest["grad/fc2.bias/inf_count"] == 1.0
    assert latest["grad/nan_count"] == 1.0 and latest["grad/inf_count"] == 1.0
    assert latest["grad/fc1.weight/nan_count"] == 0.0
    with pytest.raises(ValueError):
        zd.GradStatsLogger(engine, every=0)
    with pytest.raises(ValueError):
        zd.GradStatsLogger(engine, metrics=("median",))


def check_accelerate_error() -> None:
    """A hook failing on one rank inside accelerator.backward(): every rank raises there, no optimizer update."""
    accelerator, engine, _ = _accelerate_engine(2, 1)
    before = params_snapshot(engine)

    def fn(grads: zd.ShardedGrads) -> None:
        if dist.get_rank() == 1:
            raise ValueError("rank 1 objects")

    with zd.on_grads(engine, fn):
        loss = engine(batch(engine)).float().pow(2).mean()
        expected = ValueError if dist.get_rank() == 1 else GradHookError
        with pytest.raises(expected):
            accelerator.backward(loss)
    assert engine.global_steps == 0 and engine.micro_steps == 0
    assert_params_equal(params_snapshot(engine), before)


def check_discard_after_error(stage: int) -> None:
    """After a hook error, ``engine.optimizer.zero_grad()`` discards the step: training on equals an engine that
    never saw that batch."""
    engine = build_engine(EngineCase(stage))

    def fn(grads: zd.ShardedGrads) -> None:
        raise ValueError("reject this batch")

    with zd.on_grads(engine, fn):
        forward_backward(engine, 0)
        with pytest.raises(ValueError):
            engine.step()
    engine.optimizer.zero_grad()
    forward_backward(engine, 1)
    engine.step()

    never = build_engine(EngineCase(stage))
    forward_backward(never, 1)
    never.step()
    assert engine.global_steps == never.global_steps == 1
    assert_params_equal(params_snapshot(engine), params_snapshot(never))


def check_unmanaged_discard_after_error(stage: int) -> None:
    """Unmanaged accumulation: after a hook error inside step(), ``optimizer.zero_grad()`` discards the finalized
    gradients; training on equals an engine that never saw those micro-batches."""
    case = EngineCase(stage, gas=2, extra={"managed_gradient_accumulation": False})

    def fn(grads: zd.ShardedGrads) -> None:
        raise ValueError("reject")

    engine = build_engine(case)
    with zd.on_grads(engine, fn):
        forward_backward(engine, 0)
        forward_backward(engine, 1)
        with pytest.raises(ValueError):
            engine.step()
    engine.optimizer.zero_grad()
    forward_backward(engine, 2)
    forward_backward(engine, 3)
    engine.step()

    never = build_engine(case)
    forward_backward(never, 2)
    forward_backward(never, 3)
    never.step()
    assert engine.global_steps == never.global_steps == 1
    assert_params_equal(params_snapshot(engine), params_snapshot(never), exact=False)
