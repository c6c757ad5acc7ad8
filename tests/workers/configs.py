"""Issue 3, worker side: every DeepSpeed configuration against a single-process fp32 reference.

The reference rebuilds the same model (same seed) as a plain fp32 ``torch.nn.Module``, runs every rank's
micro-batches (``common.batch`` is seeded by ``(micro step, rank)``) and averages, exactly as DeepSpeed does:
``mean over ranks of sum over micro-steps of grad(loss / GAS)``.

Tolerances (relative, ``||ours - ref|| / ||ref||`` per parameter): fp32 1e-5 (summation order only); fp16 5e-3 and
bf16 3e-2, because the engine runs the forward/backward in 16 bits from 16-bit weights while the reference runs in
fp32 (bf16 has an 8-bit mantissa: ~4e-3 per rounding, compounded over three layers).
"""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

import zero_dtensor as zd

from .common import (DTYPES, FROZEN, MODELS, EngineCase, OddModel, TiedModel, build_engine, build_model,  # noqa: F401
                     count_comms, fill_value, forward_backward)

TOL = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}
# the models, FROZEN and build_model live in common.py (one case type, one builder); the names stay importable here


def reference_grads(dtype: str, groups: int, micro_batch: int, gas: int, micro_steps: int | None = None,
                    ranks: list[int] | None = None, model: str = "odd") -> dict[str, torch.Tensor]:
    """True averaged gradient in fp32 of the first ``micro_steps`` (default: all ``gas``) micro-steps."""
    model, _ = build_model(groups, model=model)
    ranks = list(range(dist.get_world_size())) if ranks is None else ranks
    steps = gas if micro_steps is None else micro_steps
    for rank in ranks:
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(micro_batch, 33, generator=g).to(DTYPES[dtype]).float()  # the engine's rounded input
            (model(x).pow(2).mean() / gas).backward()
    return {n: p.grad / len(ranks) for n, p in model.named_parameters() if p.requires_grad}


def assert_close(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float, what: str) -> None:
    assert sorted(ours) == sorted(ref), (what, sorted(ours), sorted(ref))
    for name, value in ours.items():
        value = value.float()
        err = float((value - ref[name]).norm() / ref[name].norm().clamp_min(1e-12))
        assert err <= tol, f"{what}: {name} relative error {err:.2e} > {tol:.0e}"


def _deepspeed_reference_is_right(engine: Any, zero: dict) -> bool:
    """Where DeepSpeed's own safe_get_full_grad returns the right gradient (notes §6): not under round_robin."""
    return not zero.get("round_robin_gradients", False)


def run_case(case: EngineCase) -> dict:
    """Build, run every micro-step, check mid-accumulation behaviour, the boundary values and the stale error."""
    stage, dtype, gas, offload, groups, zero = (case.stage, case.dtype, case.gas, case.offload, case.groups,
                                                dict(case.zero))
    kind_of_model = case.model
    assert case.frozen, "the reference (reference_grads) freezes FROZEN in two-group cases"
    engine = build_engine(case)
    micro = engine.train_micro_batch_size_per_gpu()
    kind = type(engine.optimizer).__name__

    for step in range(gas):
        forward_backward(engine, step)
        if step == gas - 1:
            break
        # mid-accumulation: ZeRO-3 without offload exposes the reduced partial sums, everything else refuses
        if stage == 3 and not offload:
            partial = zd.sharded_grads(engine).full_tensors(dtype=torch.float32)
            ref = reference_grads(dtype, groups, micro, gas, step + 1, model=kind_of_model)
            assert_close(partial, ref, TOL[dtype], "partial sums")
        else:
            with pytest.raises(zd.GradientsNotReadyError, match="accumulation boundary"):
                zd.sharded_grads(engine)
        engine.step()

    grads = zd.sharded_grads(engine)
    ref = reference_grads(dtype, groups, micro, gas, model=kind_of_model)
    full = grads.full_tensors(dtype=torch.float32)
    assert_close(full, ref, TOL[dtype], f"{kind} full_tensors")
    for name in FROZEN if groups == 2 else ():
        assert name not in grads
    if _deepspeed_reference_is_right(engine, zero):
        # DeepSpeed's own per-parameter read (stored values, scaled under fp16), cast to the stored dtype
        params = dict(engine.module.named_parameters())
        for name in grads.names:
            theirs = safe_get_full_grad(params[name]).to(grads[name].dtype).float() / grads.loss_scale
            assert torch.allclose(full[name], theirs, rtol=1e-6, atol=1e-7), name
    # every ParamGrad agrees with the bulk read
    for name in grads.names:
        assert torch.equal(grads[name].full_tensor(dtype=torch.float32), full[name]), name

    engine.step()
    with pytest.raises(zd.StaleGradientsError):
        grads.full_tensors()
    with pytest.raises(zd.GradientsNotReadyError):
        zd.sharded_grads(engine)
    return {"optimizer": kind, "groups": len(grads.layout.groups), "params": len(grads)}


def check_bf16_optimizer(gas: int) -> dict:
    """ZeRO-1 + bf16 + fp32 accumulation builds BF16_Optimizer: Replicate groups, zero-collective reads, writes stick."""
    engine = build_engine(EngineCase(1, "bf16", gas=gas, bf16_optimizer=True))
    assert type(engine.optimizer).__name__ == "BF16_Optimizer"
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(gas):
        forward_backward(engine, step)
        if step < gas - 1:
            with pytest.raises(zd.GradientsNotReadyError, match="accumulation boundary"):
                zd.sharded_grads(engine)
            engine.step()
    with count_comms() as mode:
        grads = zd.sharded_grads(engine)
        full = grads.full_tensors(dtype=torch.float32)
        one = grads[grads.names[0]].full_tensor()
    assert mode.get_total_counts() == 0, mode.get_comm_counts()
    assert all(g.placements[0].is_replicate() for g in grads.groups)
    assert_close(full, reference_grads("bf16", 1, micro, gas), TOL["bf16"], "BF16_Optimizer")
    assert torch.equal(one.float(), full[grads.names[0]])

    values = {n: fill_value(n, grads[n].shape) for n in grads.names}
    grads.set_full_(values)
    # the buffer the step reads now holds the values (DeepSpeed's own safe_set_full_grad would not: bug 4)
    for name, value in values.items():
        assert torch.equal(grads[name].full_tensor(), value), name
    before = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.step()
    with pytest.raises(zd.StaleGradientsError):
        grads.full_tensors()
    with pytest.raises(zd.GradientsNotReadyError):
        zd.sharded_grads(engine)  # the buffer is zeroed now; refusing is the only right answer
    # Adam's first step moves each element by ~lr * sign(grad): the written values' signs decide the direction
    for name, p in engine.module.named_parameters():
        moved = (p.detach().float() - before[name]).sign()
        agree = (moved == -values[name].sign()).float().mean()
        assert agree > 0.9, (name, float(agree))
    return {"replicated": True}


def check_fp16_overflow(stage: int) -> dict:
    """An overflowing fp16 backward: found_inf is True on every rank and the full tensors carry the inf/nan."""
    from zero_dtensor.ops.overflow import found_inf

    engine = build_engine(EngineCase(stage, "fp16"))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    with count_comms() as mode:
        assert found_inf(grads) is False
    assert mode.get_total_counts() == 2, mode.get_comm_counts()  # the flag all_reduce + the rank agreement
    engine.step()

    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 33, generator=torch.Generator().manual_seed(7)).half()
    loss = engine(x).float().pow(2).mean() * 1e8  # times the 1024 loss scale: far beyond fp16's 65504
    engine.backward(loss)
    grads = zd.sharded_grads(engine)
    assert found_inf(grads) is True
    full = grads.full_tensors(dtype=torch.float32)
    assert any(not torch.isfinite(v).all() for v in full.values())
    scale = grads.loss_scale
    before = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()} if stage != 3 else None
    skipped = engine.skipped_steps
    engine.step()  # DeepSpeed skips this step (and lowers the scale after `hysteresis` overflows)
    assert engine.skipped_steps == skipped + 1
    if before is not None:
        for name, p in engine.module.named_parameters():
            assert torch.equal(p.detach().float(), before[name]), name
    return {"scale_before": scale, "scale_after": float(engine.optimizer.loss_scale)}


def check_fp16_writes_rescaled(stage: int) -> None:
    """set_full_ under fp16 stores value x loss_scale: the step equals DeepSpeed's own set of pre-scaled values."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_grad

    ours = build_engine(EngineCase(stage, "fp16"))
    forward_backward(ours)
    grads = zd.sharded_grads(ours)
    assert grads.loss_scale == 1024.0
    values = {n: fill_value(n, grads[n].shape) * 1e-2 for n in grads.names}
    grads.set_full_(values)
    for name, value in values.items():  # reads give back the true (unscaled) value, to fp16 precision
        assert torch.allclose(grads[name].full_tensor(dtype=torch.float32), value, rtol=1e-3, atol=1e-6), name
    ours.step()

    theirs = build_engine(EngineCase(stage, "fp16"))
    forward_backward(theirs)
    scale = theirs.optimizer.loss_scale
    world = dist.get_world_size()
    for name, p in theirs.module.named_parameters():
        value = values[name] * scale
        if stage == 3:  # DeepSpeed's stage-3 set needs a padded value (its narrow bug)
            pn = p.partition_numel()
            value = torch.cat([value.reshape(-1), value.new_zeros(pn * world - value.numel())])
        safe_set_full_grad(p, value)
    theirs.step()
    for (name, p), (_, q) in zip(ours.module.named_parameters(), theirs.module.named_parameters()):
        assert torch.equal(safe_get_full_fp32_param(p), safe_get_full_fp32_param(q)), name


def check_offload_norm_after_write(stage: int, dtype: str = "fp32") -> dict:
    """After set_full_, DeepSpeed's clipping and reported global norm use the written values (offload included)."""
    from deepspeed.utils import safe_get_full_fp32_param

    results = {}
    params_after = {}
    for offload in (False, True):
        engine = build_engine(EngineCase(stage, dtype, offload=offload, extra={"gradient_clipping": 0.5}))
        forward_backward(engine)
        grads = zd.sharded_grads(engine)
        values = {n: fill_value(n, grads[n].shape) * 0.1 for n in grads.names}
        grads.set_full_(values)
        engine.step()
        expected = float(torch.sqrt(sum((v.double() ** 2).sum() for v in values.values())))
        reported = float(engine.get_global_grad_norm())
        assert abs(reported - expected) <= 1e-4 * expected, (offload, reported, expected)
        results[offload] = reported
        params_after[offload] = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    for name in params_after[False]:  # the clipped step is the same with and without offload
        assert torch.allclose(params_after[True][name], params_after[False][name], rtol=1e-5, atol=1e-6), name
    return results


@contextlib.contextmanager
def restore_deepspeed_groups() -> Any:
    """Undo DeepSpeed's process-global group state (``deepspeed.utils.groups``: ``mpu``, hpZ groups, ...) that an
    engine built with ``mpu=`` or ``zero_hpz_partition_size`` leaves behind, so later engines in the same reused rank
    pool are not built against it."""
    from deepspeed.utils import groups

    saved = {k: (copy.copy(v) if isinstance(v, (dict, list, set)) else v) for k, v in vars(groups).items()
             if not k.startswith("__") and not callable(v) and not isinstance(v, types.ModuleType)}
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(groups, k, v)


class TinyMPU:
    """A model-parallel unit for ``deepspeed.initialize(mpu=...)``: 4 ranks as dp 2 x mp 2.

    Data-parallel groups {0, 2} and {1, 3}; "model-parallel" groups {0, 1} and {2, 3} (the model is simply replicated
    across them, which is enough to make DeepSpeed partition ZeRO state over a DP group that is not the world).
    """

    def __init__(self, mp: int = 2) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.dp_ranks = [r for r in range(world) if r % mp == rank % mp]
        self.mp_ranks = [r for r in range(world) if r // mp == rank // mp]
        self.dp_group = self.mp_group = None
        for first in range(mp):  # every rank creates every group, in the same order
            group = dist.new_group([r for r in range(world) if r % mp == first])
            if rank % mp == first:
                self.dp_group = group
        for first in range(0, world, mp):
            group = dist.new_group(list(range(first, first + mp)))
            if rank // mp == first // mp:
                self.mp_group = group

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    def get_model_parallel_group(self):
        return self.mp_group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.mp_group)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.mp_group)

    # newer DeepSpeed asks for the tensor-parallel names too
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size


def check_sub_world_dp(case: EngineCase) -> dict:
    """4 ranks as 2 (data parallel) x 2: meshes are built on DeepSpeed's DP group, values average over it only."""
    with restore_deepspeed_groups():
        return _check_sub_world_dp(case)


def _check_sub_world_dp(case: EngineCase) -> dict:
    dtype, gas = case.dtype, case.gas
    mpu = TinyMPU()
    engine = build_engine(case, mpu=mpu)
    for step in range(gas):
        forward_backward(engine, step)
        if step < gas - 1:
            engine.step()
    grads = zd.sharded_grads(engine)
    for dt in grads.groups:
        mesh = dt.device_mesh
        assert mesh.get_group() is mpu.dp_group or sorted(mesh.mesh.tolist()) == mpu.dp_ranks
        assert mesh.mesh.tolist() == mpu.dp_ranks, (mesh.mesh.tolist(), mpu.dp_ranks)
    assert all(g.world_size == 2 for g in grads.layout.groups)
    full = grads.full_tensors(dtype=torch.float32)
    micro = engine.train_micro_batch_size_per_gpu()
    ref = reference_grads(dtype, 1, micro, gas, ranks=mpu.dp_ranks)
    assert_close(full, ref, TOL[dtype], "2x2 dp")
    # the other DP group averaged other data: our values are not the world average
    world_ref = reference_grads(dtype, 1, micro, gas)
    assert any(not torch.allclose(full[n], world_ref[n], rtol=1e-3, atol=1e-5) for n in full)
    values = {n: fill_value(n, grads[n].shape) for n in grads.names}
    grads.set_full_(values)
    for name, value in values.items():
        assert torch.equal(grads[name].full_tensor(), value.to(grads[name].dtype)), name
    engine.step()
    return {"dp_ranks": mpu.dp_ranks}


def check_hpz() -> dict:
    """ZeRO-3 with hpZ (zero_hpz_partition_size 2 of 4): gradients are still partitioned over the whole DP group."""
    with restore_deepspeed_groups():
        return _check_hpz()


def _check_hpz() -> dict:
    engine = build_engine(EngineCase(3, world=4, zero={"zero_hpz_partition_size": 2}))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    assert all(g.world_size == dist.get_world_size() for g in grads.layout.groups)
    full = grads.full_tensors(dtype=torch.float32)
    assert_close(full, reference_grads("fp32", 1, engine.train_micro_batch_size_per_gpu(), 1), TOL["fp32"], "hpZ")
    engine.step()
    return {"groups": len(grads.layout.groups)}
