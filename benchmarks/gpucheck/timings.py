"""The timing rows of one ZeRO stage at world 1 on the bf16 transformer-like model: gradients, then masters and
optimizer state, each beside its floor and DeepSpeed's own per-parameter loop."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

from .budget import Budget
from .checkpoint_timing import time_checkpoints
from .floors import attach_comm_ratios, attach_ratios, time_comm_floors, time_floors
from .fused import fused_rows
from .measure import Timer, sample, summarize
from .profiling import Profiles
from .runtime import device_of

# DeepSpeed's way to do what a row does, for the speed-up column (clip: get every gradient, then set it back)
DEEPSPEED_OF = {"full_tensors()": ("ds safe_get_full_grad loop",), "set_full_()": ("ds safe_set_full_grad loop",),
                "clip_grad_norm_()": ("ds safe_get_full_grad loop", "ds safe_set_full_grad loop"),
                "masters full_tensors()": ("ds safe_get_full_fp32_param loop",)}


def timing_model(hidden: int, layers: int, device: Any) -> Any:
    import torch

    from zero_dtensor.bench.model import TransformerLike

    torch.manual_seed(0)
    with torch.device(device):
        return TransformerLike(hidden, layers)


def build(stage: int, hidden: int, layers: int, device: Any) -> tuple[Any, Callable[[], None]]:
    """The stage's engine and a ``backward()`` of a fixed batch."""
    import deepspeed
    import torch

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-6, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    model = timing_model(hidden, layers, device)
    with contextlib.redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    x = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(0)).to(device=engine.device,
                                                                                  dtype=torch.bfloat16)

    def backward() -> None:
        engine.backward(engine(x).float().pow(2).mean())

    return engine, backward


def grad_rows(engine: Any, backward: Callable[[], None], timer: Timer, ds_repeat: int,
              progress: Callable[[str], None], fused_cpu: bool, facts: dict[str, Any]) -> list[dict[str, Any]]:
    """The gradient rows, between a backward and the step (the fused reductions' rows last: :mod:`.fused`)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    import zero_dtensor as zd

    stage = timer.stage
    progress(f"timing ZeRO-{stage}: first sharded_grads of a step")
    firsts = []
    for _ in range(timer.repeat + 1):  # a fresh backward (and a step after) around every call
        backward()
        firsts.append(sample(lambda: zd.sharded_grads(engine), timer.device))
        engine.step()
    rows = [summarize("first sharded_grads() of a step", stage, firsts[0], firsts[1:], 0)]
    backward()
    pieces = engine.optimizer.averaged_gradients.get(0) if stage in (1, 2) else None
    grads = zd.sharded_grads(engine)
    if pieces is not None and not engine.optimizer.cpu_offload:  # DeepSpeed's own memory, or the library's copy
        facts["first sharded_grads in place"] = (
            grads.local_partitions[0].untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr())
    del pieces
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    world = dist.get_world_size()
    progress(f"timing ZeRO-{stage}: full reads and writes")
    rows.append(timer.measure("ds safe_get_full_grad loop", lambda: {n: safe_get_full_grad(p) for n, p in named},
                              ds_repeat))
    rows.append(timer.measure("full_tensors()", grads.full_tensors))
    values = {n: t.clone() for n, t in grads.full_tensors().items()}  # writing them back changes nothing
    ds_values = {}
    for n, p in named:
        v = values[n]
        if stage == 3:
            pad = p.partition_numel() * world - v.numel()
            v = torch_cat_padded(v, pad)
        ds_values[n] = v

    def ds_set() -> None:
        for n, p in named:
            safe_set_full_grad(p, ds_values[n])

    rows.append(timer.measure("ds safe_set_full_grad loop", ds_set, ds_repeat))
    rows.append(timer.measure("set_full_()", lambda: grads.set_full_(values)))
    values.clear()  # frees the copies (the rows' closures keep the emptied dicts)
    ds_values.clear()
    progress(f"timing ZeRO-{stage}: transforms and reductions")
    rows.append(timer.measure("mul_(1.0)", lambda: grads.mul_(1.0)))
    rows.append(timer.measure("clip_grad_norm_()", lambda: grads.clip_grad_norm_(1e30)))
    rows.append(timer.measure("stats()", grads.stats))
    rows.append(timer.measure("norms()", grads.norms))
    rows.append(timer.measure("global_norm()", grads.global_norm))
    rows.append(dots_row(grads, timer))
    rows.append(timer.measure("to_dtensors()", grads.to_dtensors))
    progress(f"timing ZeRO-{stage}: fused reductions")
    rows += fused_rows(grads, timer, timer.budget, fused_cpu, facts)
    engine.step()
    return rows


def dots_row(grads: Any, timer: Timer) -> dict[str, Any]:
    """``dots()`` against a clone (a second set of the same bytes, freed on return)."""
    other = grads.clone()
    return timer.measure("dots()", lambda: grads.dots(other))


def torch_cat_padded(v: Any, pad: int) -> Any:
    """``v`` flattened with ``pad`` zeros after it (DeepSpeed's stage-3 set needs the padded length)."""
    import torch

    return torch.cat([v.reshape(-1), v.new_zeros(pad)]) if pad else v


def master_rows(engine: Any, timer: Timer, ds_repeat: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """The fp32 master and optimizer-state rows, between steps (the masters are written back unchanged)."""
    from deepspeed.utils import safe_get_full_fp32_param

    import zero_dtensor as zd

    progress(f"timing ZeRO-{timer.stage}: masters and optimizer state")
    named = [p for p in engine.module.parameters() if p.requires_grad]
    master = zd.sharded_master_params(engine)
    exp_avg = zd.sharded_optimizer_state(engine, "exp_avg")
    rows = [timer.measure("ds safe_get_full_fp32_param loop", lambda: [safe_get_full_fp32_param(p) for p in named],
                          ds_repeat),
            timer.measure("masters full_tensors()", master.full_tensors),
            timer.measure("exp_avg full_tensors()", exp_avg.full_tensors)]
    values = {n: t.clone() for n, t in master.full_tensors().items()}
    rows.append(timer.measure("masters set_full_()", lambda: master.set_full_(values)))
    values.clear()
    zd.sync_model_params(engine)
    return rows


def facts_of(engine: Any) -> dict[str, Any]:
    import zero_dtensor as zd

    master = zd.sharded_master_params(engine)
    return {"optimizer": type(engine.optimizer).__name__, "params": sum(p.numel for p in master.layout.params),
            "tensors": len(master.layout.params),
            "master_bytes": sum(t.numel() * t.element_size() for t in master.local_partitions)}


def time_stage(stage: int, args: Any, device_type: str, budget: Budget, profiles: Profiles,
               progress: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """``(rows, checkpoint rows, facts)`` of one ZeRO stage. Floors are timed first, in the same process."""
    import torch
    import torch.distributed as dist

    import zero_dtensor as zd

    device = device_of(device_type)
    engine, backward = build(stage, args.hidden, args.layers, device)
    timer = Timer(stage, device, args.repeat, budget, profiles)
    backward()
    grads = zd.sharded_grads(engine)
    stored = grads.local_partitions[0].dtype
    numel = sum(t.numel() for t in grads.local_partitions)
    stored_bytes = sum(t.numel() * t.element_size() for t in grads.local_partitions)
    engine.step()
    facts = {**facts_of(engine), "stored_dtype": str(stored), "stored_bytes": stored_bytes}
    progress(f"timing ZeRO-{stage}: floors")
    floor_timer = Timer(stage, device, args.repeat, budget, Profiles(None))
    floors = time_floors(numel, stored, facts["params"], device,
                         lambda name, fn: floor_timer.measure(name, fn, count_collectives=False))
    master_part = sum(t.numel() for t in zd.sharded_master_params(engine).local_partitions)
    comm_floors = time_comm_floors(numel, stored, master_part, device, dist.get_world_size(),
                                   lambda name, fn: floor_timer.measure(name, fn, count_collectives=False))
    rows = grad_rows(engine, backward, timer, args.ds_repeat, progress, args.fused_cpu, facts)
    rows += master_rows(engine, timer, args.ds_repeat, progress)
    attach_ratios(rows, floors)
    attach_comm_ratios(rows, comm_floors)
    by = {r["row"]: r for r in rows}
    for r in rows:
        base = DEEPSPEED_OF.get(r["row"])
        ok = base and "median_ms" in r and all("median_ms" in by.get(b, {}) for b in base)
        r["speedup_vs_deepspeed"] = sum(by[b]["median_ms"] for b in base) / r["median_ms"] if ok else None
    facts["floors"] = {name: {k: f.get(k) for k in ("median_ms", "min_ms", "peak_bytes", "status")}
                       for name, f in floors.items()}
    facts["comm_floors"] = {name: {k: f.get(k) for k in ("median_ms", "min_ms", "bytes", "algbw_GBps", "busbw_GBps",
                                                         "collective", "world", "status")}
                            for name, f in comm_floors.items()}
    checkpoints = []
    if stage in args.checkpoint_stages:
        checkpoints = time_checkpoints(engine, timer, args.checkpoint_dir, progress)
    del engine, grads
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows, checkpoints, facts
