"""Issue 42: the transforms and reductions of sharded gradients seen as a GPU would see them, on CPU ranks.

:func:`check_devices` runs every transform and reduction with the communication device and the storage device
made different (:func:`~workers.dispatch_probe.simulated_offload`: the engine's device is ``cpu:1``, standing for
CUDA, and the process groups take only it, as NCCL does) under a :class:`~workers.dispatch_probe.DispatchProbe`
that refuses an operation mixing the two as CUDA refuses it. Offloaded partitions are tagged ``"host"``; without
offload they are tagged ``"dev"`` (then a CPU index or a host factor meeting them is refused). User operands (0-d
factors) are on the engine's device, as a CUDA user's are. Each call reports its refusal (or ``None``), where its
tensor result lies, and for the reductions whether its values equal those of the same call without simulation.

:func:`check_traffic` measures each reduction's memory traffic, largest temporary and host syncs
(:class:`~workers.dispatch_probe.DispatchProbe` watching the gradient partitions).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import zero_dtensor as zd
from zero_dtensor.state import state_of

from .common import EngineCase, build_engine
from .dispatch_probe import DEV, DeviceMixError, DispatchProbe, simulated_offload

__all__ = ["CALLS", "REDUCTIONS", "check_devices", "check_traffic"]


def _t(value: float) -> torch.Tensor:
    """A user's 0-d operand on the engine's (simulated CUDA) device."""
    return torch.tensor(value, device=DEV)


def _half(g: Any) -> list[str]:
    return list(g.names)[::2]


def _per(g: Any, value: float, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    return {n: _t(value * (1 + i % 3)) for i, n in enumerate(names if names is not None else g.names)}


Call = Callable[[Any, Any], Any]

#: transforms: ``fn(grads, other)`` (``other`` a clone)
TRANSFORMS: dict[str, Call] = {
    "mul_(float)": lambda g, o: g.mul_(0.5),
    "mul_(0-d)": lambda g, o: g.mul_(_t(0.5)),
    "mul_(per-param 0-d)": lambda g, o: g.mul_(_per(g, 0.5)),
    "mul_(0-d, half)": lambda g, o: g.mul_(_t(0.5), params=_half(g)),
    "mul_(per-param 0-d, half)": lambda g, o: g.mul_(_per(g, 0.5, _half(g)), params=_half(g)),
    "div_(0-d)": lambda g, o: g.div_(_t(2.0)),
    "div_(per-param mixed)": lambda g, o: g.div_({n: (_t(2.0) if i % 2 else 4.0) for i, n in enumerate(g.names)}),
    "add_(0-d)": lambda g, o: g.add_(_t(0.125)),
    "add_(0-d, per-param alpha)": lambda g, o: g.add_(_t(0.125), alpha=_per(g, 0.5)),
    "add_(0-d, half)": lambda g, o: g.add_(_t(0.125), params=_half(g)),
    "add_(clone, alpha 0-d)": lambda g, o: g.add_(o, alpha=_t(0.5)),
    "add_(clone, per-param alpha)": lambda g, o: g.add_(o, alpha=_per(g, 0.5)),
    "add_(clone, per-param alpha, half)": lambda g, o: g.add_(o, alpha=_per(g, 0.5, _half(g)), params=_half(g)),
    "clamp_(0-d)": lambda g, o: g.clamp_(_t(-1.0), _t(1.0)),
    "clamp_(0-d, half)": lambda g, o: g.clamp_(_t(-1.0), _t(1.0), params=_half(g)),
    "lerp_(clone, 0-d)": lambda g, o: g.lerp_(o, _t(0.5)),
    "lerp_(clone, half)": lambda g, o: g.lerp_(o, _t(0.5), params=_half(g)),
    "lerp_(0-d, 0-d)": lambda g, o: g.lerp_(_t(0.0), _t(0.5)),
    "lerp_(0-d, half)": lambda g, o: g.lerp_(_t(0.0), _t(0.5), params=_half(g)),
    "copy_(clone)": lambda g, o: g.copy_(o),
    "copy_(clone, half)": lambda g, o: g.copy_(o, params=_half(g)),
    "apply_": lambda g, o: g.apply_(lambda x: x.mul_(2.0)),
    "apply_(half)": lambda g, o: g.apply_(lambda x: x.mul_(2.0), params=_half(g)),
    "add_noise_(0-d)": lambda g, o: g.add_noise_(_t(0.01), 3),
    "add_noise_(half)": lambda g, o: g.add_noise_(0.01, 3, params=_half(g)),
    "clone": lambda g, o: g.clone(),
    "clip_grad_norm_": lambda g, o: g.clip_grad_norm_(1e-3),
    "clip_grad_norm_(inf)": lambda g, o: g.clip_grad_norm_(1e-3, math.inf),
    "clip_grad_norm_(half)": lambda g, o: g.clip_grad_norm_(1e-3, params=_half(g)),
    "clip_grad_norm_(error_if_nonfinite)": lambda g, o: g.clip_grad_norm_(1e-3, error_if_nonfinite=True),
    "clip_per_param_": lambda g, o: g.clip_per_param_(1e-3),
    "clip_per_param_(half)": lambda g, o: g.clip_per_param_(1e-3, params=_half(g)),
}


def _vec(result: Any) -> torch.Tensor:
    return result.vector if hasattr(result, "vector") else result


#: reductions (read only): ``fn(grads, other)``; the tensor compared and whose device is reported
REDUCTIONS: dict[str, Call] = {
    "norms": lambda g, o: g.norms(),
    "norms(inf)": lambda g, o: g.norms(math.inf),
    "norms(1)": lambda g, o: g.norms(1.0),
    "norms(half)": lambda g, o: g.norms(params=_half(g)),
    "norms(one)": lambda g, o: g.norms(params=[g.names[-1]]),
    "global_norm": lambda g, o: g.global_norm(),
    "global_norm(inf)": lambda g, o: g.global_norm(math.inf),
    "global_norm(half)": lambda g, o: g.global_norm(params=_half(g)),
    "dots": lambda g, o: g.dots(o),
    "dots(with_norms)": lambda g, o: g.dots(o, with_norms=True),
    "dots(half)": lambda g, o: g.dots(o, params=_half(g)),
    "stats": lambda g, o: g.stats(),
    "stats(half)": lambda g, o: g.stats(params=_half(g)),
    "found_inf": lambda g, o: zd.found_inf(g),
}

CALLS = list(TRANSFORMS) + list(REDUCTIONS)


def _values(result: Any) -> Any:
    """A comparable, picklable form of a reduction's result."""
    if isinstance(result, tuple):
        return tuple(_values(r) for r in result)
    if isinstance(result, torch.Tensor) or hasattr(result, "vector"):
        return _vec(result).detach().clone()
    if isinstance(result, bool):
        return result
    return {n: (s.norm, s.max_abs, s.mean, s.nan_count, s.inf_count) for n, s in result.items()}


def _where(probe: DispatchProbe, result: Any) -> str | None:
    if isinstance(result, tuple):
        result = result[0]
    if isinstance(result, torch.Tensor) or hasattr(result, "vector"):
        return probe.where(_vec(result))
    return None


def _backward(engine: Any) -> None:
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 33, generator=g).to(dtype)
    engine.backward(engine(x).float().pow(2).mean())


def _one(engine: Any, name: str, fn: Call, offload: bool) -> dict[str, Any]:
    """One call under simulated devices, on a fresh backward (transforms change the gradients)."""
    _backward(engine)
    grads = zd.sharded_grads(engine)
    other = grads.clone()
    reference = _values(fn(grads, other)) if name in REDUCTIONS else None
    storages = [state_of(grads).storage, state_of(other).storage]
    parts = [p for s in storages for p in s.partitions]
    out: dict[str, Any] = {"refused": None, "where": None, "equal": None}
    with simulated_offload(storages, offload=offload), DispatchProbe(simulate=True, nccl=True) as probe:
        probe.tag(parts, "host" if offload else "dev")
        try:
            result = fn(grads, other)
            out["where"] = _where(probe, result)
        except DeviceMixError as e:
            out["refused"] = str(e)
            result = None
        except Exception:  # noqa: BLE001 - any other failure is reported as one too
            out["refused"] = traceback.format_exc(limit=6)
            result = None
    if reference is not None and result is not None:
        got = _values(result)
        out["equal"] = _same(reference, got)
    engine.step()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b) or torch.allclose(a, b, rtol=1e-6, atol=0, equal_nan=True))
    if isinstance(a, dict):
        return all(_same_stats(a[k], b[k]) for k in a) and a.keys() == b.keys()
    return a == b


def _same_stats(a: tuple, b: tuple) -> bool:
    return all((x == y) or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
               or (isinstance(x, float) and math.isclose(x, y, rel_tol=1e-6)) for x, y in zip(a, b))


def check_devices(stage: int, dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16"), offload: bool = True,
                  names: tuple[str, ...] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """``{dtype: {call: {"refused", "where", "equal"}}}`` for every call of :data:`CALLS` (or ``names``) on a
    ZeRO-``stage`` engine (2 ranks, ``offload_optimizer: cpu`` when ``offload``) under simulated devices."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for dtype in dtypes:
        engine = build_engine(EngineCase(stage, dtype, offload=offload))
        calls = {**TRANSFORMS, **REDUCTIONS}
        out[dtype] = {name: _one(engine, name, calls[name], offload) for name in (names or CALLS)}
        del engine
    return out


def check_traffic(stage: int, dtype: str) -> dict[str, dict[str, Any]]:
    """``{call: DispatchProbe.summary()}`` of each reduction and clip (second call: caches filled by the first),
    with the gradient partitions (and the clone's, for ``dots``) watched as the data."""
    engine = build_engine(EngineCase(stage, dtype, model="wide"))
    _backward(engine)
    grads = zd.sharded_grads(engine)
    other = grads.clone()
    calls: dict[str, Call] = {
        "norms": REDUCTIONS["norms"], "norms(1)": REDUCTIONS["norms(1)"], "norms(inf)": REDUCTIONS["norms(inf)"],
        "norms(half)": REDUCTIONS["norms(half)"], "global_norm": REDUCTIONS["global_norm"],
        "global_norm(inf)": REDUCTIONS["global_norm(inf)"], "dots": REDUCTIONS["dots"],
        "dots(with_norms)": REDUCTIONS["dots(with_norms)"], "stats": REDUCTIONS["stats"],
        "found_inf": REDUCTIONS["found_inf"],
        "clip_grad_norm_": lambda g, o: g.clip_grad_norm_(1e9), "clip_per_param_": lambda g, o: g.clip_per_param_(1e9),
    }
    out = {}
    for name, fn in calls.items():
        fn(grads, other)
        data = list(state_of(grads).storage.partitions)
        if name.startswith("dots"):
            data += list(state_of(other).storage.partitions)
        with DispatchProbe() as probe:
            probe.watch(data)
            fn(grads, other)
        out[name] = probe.summary()
    engine.step()
    return out
