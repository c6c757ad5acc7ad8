"""The checks of one case between steps: fp32 masters and optimizer state against DeepSpeed's ``safe_get_*``, a
``zd.save`` / ``zd.load`` round trip, master writes reaching the model's forward, and an EMA (``clone`` + ``lerp_``)."""

from __future__ import annotations

import os
from typing import Any

from .cases import Case, batch, small_model, train
from .grad_checks import assert_same, full32

STATE_KEYS = ("exp_avg", "exp_avg_sq")
LOW_PRECISION_RTOL = {"fp32": 1e-6, "bf16": 2e-2, "fp16": 2e-3}  # a forward in another kernel order


def trainable(engine: Any) -> dict[str, Any]:
    return {n: p for n, p in engine.module.named_parameters() if p.requires_grad}


def deepspeed_view(engine: Any, keys: tuple[str, ...] = ("master", *STATE_KEYS)) -> dict[str, dict[str, Any]]:
    """DeepSpeed's own full fp32 masters and optimizer state (``safe_get_full_*``, one collective per parameter on
    ZeRO-3), on the CPU: ``{"master": {...}, "exp_avg": {...}, "exp_avg_sq": {...}}`` (those in ``keys``)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = trainable(engine)
    out = {}
    for key in keys:
        get = safe_get_full_fp32_param if key == "master" else lambda p, k=key: safe_get_full_optimizer_state(p, k)
        out[key] = {n: get(p).to(torch.float32).cpu() for n, p in params.items()}
    return out


def working_weights(engine: Any) -> dict[str, Any]:
    """The model's full working (fp32/bf16/fp16) weights, gathered under ZeRO-3, cloned."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def check_masters(engine: Any, memo: dict[str, Any]) -> dict[str, Any]:
    """``sharded_master_params`` and ``sharded_optimizer_state`` (every key) ``full_tensors()``, and the drop-ins
    ``get_full_fp32_params`` / ``get_full_optimizer_state``, exactly equal DeepSpeed's ``safe_get_full_*``
    (kept in ``memo["view"]`` for the next check)."""
    import zero_dtensor as zd

    theirs = memo["view"] = deepspeed_view(engine)
    keys = zd.optimizer_state_keys(engine)
    assert set(STATE_KEYS) <= set(keys), keys
    assert_same(full32(zd.sharded_master_params(engine)), theirs["master"], "masters vs safe_get_full_fp32_param")
    assert_same(zd.get_full_fp32_params(engine), theirs["master"], "get_full_fp32_params")
    for key in STATE_KEYS:
        assert_same(full32(zd.sharded_optimizer_state(engine, key)), theirs[key],
                    f"{key} vs safe_get_full_optimizer_state")
        assert_same(zd.get_full_optimizer_state(engine, key), theirs[key], f"get_full_optimizer_state({key})")
    storage = zd.sharded_master_params(engine).local_partitions[0].device
    return {"keys": list(keys), "params": len(theirs["master"]), "tolerance": "exact", "stored_on": str(storage)}


def check_save_load(ours: Any, twin: Any, case: Case, path: str, memo: dict[str, Any]) -> dict[str, Any]:
    """``zd.save(ours)``; the twin (equal so far) is moved away (its masters and state halved in place, through the
    live ``local_partitions``: its working weights go stale unseen), then ``zd.load``: its masters, state, working
    weights and step counter equal ``ours``' exactly; then both take the same step and their masters stay equal.
    (Halving through the API instead would set the masters' write mark, which ``zd.load`` does not clear: the next
    forward raises ``ModelParamsNotSyncedError`` though the load refreshed the working weights.)"""
    import torch

    import zero_dtensor as zd

    before = memo.get("view") or deepspeed_view(ours)
    zd.save(ours, path, client_state={"case": case.name}, sync_files=False)  # no fsync: correctness only
    for family in (zd.sharded_master_params(twin), *(zd.sharded_optimizer_state(twin, k) for k in STATE_KEYS)):
        torch._foreach_mul_(list(family.local_partitions), 0.5)  # the twin moves away from the saved state
    client = zd.load(twin, path)
    assert client == {"case": case.name}, client
    loaded = deepspeed_view(twin)
    for what, values in before.items():
        assert_same(loaded[what], values, f"loaded {what}")
    assert_same(working_weights(twin), working_weights(ours), "loaded working weights")
    assert twin.global_steps == ours.global_steps, (twin.global_steps, ours.global_steps)
    for engine in (ours, twin):
        train(engine, case, lambda *_: None, steps=1, first_micro=70)
    after_ours, after_twin = deepspeed_view(ours, ("master",)), deepspeed_view(twin, ("master",))
    assert_same(after_twin["master"], after_ours["master"], "masters after a step from the loaded state")
    assert any(not torch.equal(after_ours["master"][n], t) for n, t in before["master"].items()), "no step happened"
    files = sorted(os.listdir(path))
    return {"files": len(files), "bytes": sum(os.path.getsize(os.path.join(path, f)) for f in files),
            "tolerance": "exact", "then": "one step, equal masters"}


def check_master_writes(engine: Any, case: Case) -> dict[str, Any]:
    """``set_full_fp32_params`` of new values: DeepSpeed's ``safe_get_full_fp32_param`` sees them, the working
    weights are them cast (exactly), and a forward gives a plain model's output with those weights."""
    import torch

    import zero_dtensor as zd

    old = full32(zd.sharded_master_params(engine))
    new = {n: (t * 0.5 + 0.01).to(engine.device) for n, t in old.items()}
    x = batch(engine, 90)
    with torch.no_grad():
        out_old = engine(x)
    zd.set_full_fp32_params(engine, new)
    assert_same(deepspeed_view(engine, ("master",))["master"], {n: t.cpu() for n, t in new.items()},
                "safe_get_full_fp32_param after set_full_fp32_params")
    weights = working_weights(engine)
    dtype = next(iter(weights.values())).dtype
    assert_same(weights, {n: t.to(dtype) for n, t in new.items()}, "working weights vs the cast written masters")
    plain = small_model().to(device=engine.device, dtype=dtype)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(weights[n])
        expected, out = plain(x), engine(x)
    exact = torch.equal(out, expected)
    rtol = LOW_PRECISION_RTOL[case.dtype]
    assert exact or torch.allclose(out.float(), expected.float(), rtol=rtol, atol=rtol), \
        f"forward after set_full_fp32_params: max abs diff {float((out.float() - expected.float()).abs().max()):g}"
    assert not torch.allclose(out_old.float(), expected.float(), rtol=rtol, atol=rtol), \
        "the forward before the write already gave the written weights' output: the check cannot tell them apart"
    return {"forward": "exact" if exact else f"rtol {rtol:g}", "params": len(new)}


def check_ema(engine: Any) -> dict[str, Any]:
    """An EMA on the masters: ``ema = master.clone()``, ``other = master.clone().mul_(0.5)``, ``ema.lerp_(other,
    0.25)`` equals ``torch.lerp`` of the full tensors (on the storage device, exactly) and leaves the masters alone."""
    import torch

    import zero_dtensor as zd

    master = zd.sharded_master_params(engine)
    start = full32(master)
    ema = master.clone()
    other = master.clone()
    other.mul_(0.5)
    ema.lerp_(other, 0.25)
    device = ema.local_partitions[0].device
    ref = {n: torch.lerp(t.to(device), t.to(device) * 0.5, 0.25) for n, t in start.items()}
    assert_same(full32(ema), ref, "ema.lerp_ vs torch.lerp")
    assert_same(full32(master), start, "masters after the EMA's clone + lerp_ (must be untouched)")
    return {"ops": ["clone", "mul_(0.5)", "lerp_(other, 0.25)"], "stored_on": str(device), "tolerance": "exact"}
