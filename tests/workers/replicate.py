"""Issue 3, worker side: opt-in Replicate gradients for ZeRO-1/2 (keep_full_grads)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param

import zero_dtensor as zd
from zero_dtensor.families.replicate import keep_full_grads

from .bad_input import deepspeed_storage
from .common import EngineCase, build_engine, count_comms, fill_value, forward_backward
from .configs import TOL, assert_close, reference_grads


def _run_window(engine: Any, gas: int) -> None:
    for step in range(gas):
        forward_backward(engine, step)
        if step < gas - 1:
            engine.step()


def check_keep(case: EngineCase) -> dict:
    dtype, gas, groups = case.dtype, case.gas, case.groups
    engine = build_engine(case)
    with count_comms() as mode:
        handle = keep_full_grads(engine)
    assert mode.get_total_counts() == 0 and handle.active
    _run_window(engine, gas)

    with count_comms() as mode:
        grads = zd.sharded_grads(engine)
        full = grads.full_tensors(dtype=torch.float32)
        one = grads[grads.names[-1]].full_tensor(dtype=torch.float32)
    assert mode.get_total_counts() == 0, mode.get_comm_counts()  # Replicate: no collective at all
    assert all(g.placements[0].is_replicate() for g in grads.groups)
    assert torch.equal(one, full[grads.names[-1]])
    micro = engine.train_micro_batch_size_per_gpu()
    assert_close(full, reference_grads(dtype, groups, micro, gas), TOL[dtype], "keep_full_grads")
    # this rank's slice of the kept buffer is bit-identical to what DeepSpeed itself stored
    ds = deepspeed_storage(engine)
    for i, g in enumerate(grads.layout.groups):
        part = ds[i].reshape(-1)
        mine = grads.local_partitions[i].narrow(0, dist.get_rank() * part.numel(), part.numel())
        assert torch.equal(mine.to(part.dtype).cpu(), part.cpu()), i

    # writes reach DeepSpeed's partition: the step equals that of a plain sharded engine given the same values
    values = {n: fill_value(n, grads[n].shape) * 0.1 for n in grads.names}
    grads.set_full_(values)
    with count_comms() as mode:
        back = grads.full_tensors(dtype=torch.float32)
    assert mode.get_total_counts() == 0
    for name, value in values.items():
        assert torch.allclose(back[name], value.to(grads[name].dtype).float(), rtol=1e-3, atol=1e-6), name
    engine.step()
    with pytest.raises(zd.StaleGradientsError):
        grads.full_tensors()

    plain = build_engine(case)
    _run_window(plain, gas)
    zd.sharded_grads(plain).set_full_(values)
    plain.step()
    for (name, p), (_, q) in zip(engine.module.named_parameters(), plain.module.named_parameters()):
        if p.requires_grad:
            assert torch.equal(safe_get_full_fp32_param(p), safe_get_full_fp32_param(q)), name

    # a second window is captured afresh (buffers zeroed, not summed with the first)
    _run_window(engine, gas)
    again = zd.sharded_grads(engine)
    assert all(g.placements[0].is_replicate() for g in again.groups)
    nbytes = handle.nbytes
    handle.remove()
    assert "average_tensor" not in engine.optimizer.__dict__
    engine.step()
    _run_window(engine, gas)
    after = zd.sharded_grads(engine)
    assert not any(g.placements[0].is_replicate() for g in after.groups)  # back to Shard(0)
    return {"nbytes": nbytes}


def check_refusals() -> list[str]:
    messages = []
    for stage, zero, key in [
        (1, {"contiguous_gradients": False}, "contiguous_gradients"),
        (2, {"use_multi_rank_bucket_allreduce": False}, "use_multi_rank_bucket_allreduce"),
        (3, {}, "ZeRO-3"),
    ]:
        engine = build_engine(EngineCase(stage, zero=zero))
        with pytest.raises(zd.UnsupportedDeepSpeedError, match=key) as info:
            keep_full_grads(engine)
        assert "average_tensor" not in engine.optimizer.__dict__  # nothing installed, config untouched
        messages.append(str(info.value))
    engine = build_engine(EngineCase(1, "bf16", bf16_optimizer=True))
    handle = keep_full_grads(engine)  # BF16_Optimizer: already Replicate, nothing to do
    assert not handle.active
    return messages


def check_late_enable(gas: int) -> None:
    """Enabled mid-window (stage 2, after the first micro-step's reduction): that step falls back to shards."""
    engine = build_engine(EngineCase(2, gas=gas))
    forward_backward(engine, 0)
    if gas > 1:
        engine.step()
    keep_full_grads(engine)
    if gas > 1:
        forward_backward(engine, 1)
    grads = zd.sharded_grads(engine)
    assert not any(g.placements[0].is_replicate() for g in grads.groups)
    micro = engine.train_micro_batch_size_per_gpu()
    assert_close(grads.full_tensors(dtype=torch.float32), reference_grads("fp32", 1, micro, gas), TOL["fp32"], "late")


def check_keep_reads(case: EngineCase) -> None:
    """Reads only (no engine.step(), so this also runs against DeepSpeed 0.18.x, whose stage-1/2 step fails)."""
    dtype = case.dtype
    engine = build_engine(case)
    handle = keep_full_grads(engine)
    forward_backward(engine, 0)
    with count_comms() as mode:
        grads = zd.sharded_grads(engine)
        full = grads.full_tensors(dtype=torch.float32)
    assert mode.get_total_counts() == 0, mode.get_comm_counts()
    assert all(g.placements[0].is_replicate() for g in grads.groups)
    assert_close(full, reference_grads(dtype, 1, engine.train_micro_batch_size_per_gpu(), 1), TOL[dtype], "keep")
    ds = deepspeed_storage(engine)
    for i in range(len(grads.layout.groups)):
        part = ds[i].reshape(-1)
        mine = grads.local_partitions[i].narrow(0, dist.get_rank() * part.numel(), part.numel())
        assert torch.equal(mine.to(part.dtype).cpu(), part.cpu()), i
    handle.remove()
