"""Issue 42: the transforms and reductions of sharded gradients seen as a GPU would see them, on CPU ranks.

:func:`check_devices` runs every transform and reduction with the communication device and the storage device
made different (:func:`~workers.dispatch_probe.simulated_offload`: the engine's device is ``cpu:1``, standing for
CUDA, and the process groups take only it, as NCCL does) under a :class:`~workers.dispatch_probe.DispatchProbe`
that refuses an operation mixing the two as CUDA refuses it. Offloaded partitions are tagged ``"host"``; without
offload they are tagged ``"dev"`` (then a CPU index or a host factor meeting them is refused). User operands (0-d
factors) are on the engine's device, as a CUDA user's are. Each call reports its refusals (recorded, not raised,
so that a refusal on one rank does not leave the ranks in different collectives; or ``None``), where its tensor
result lies, and for the reductions whether its values equal those of the same call without simulation.

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
from zero_dtensor.core.state import state_of

from .common import EngineCase, build_engine, make_engine
from .dispatch_probe import DEV, DispatchProbe, simulated_offload

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


def _run_case(grads: Any, other: Any, offload: bool) -> dict[str, dict[str, Any]]:
    """Every call under simulated devices, in one probe (index tensors a plan caches on the simulated device keep
    their tag from one call to the next, as they keep their device on a GPU): first the reductions (their values
    compared with the same call made before, without simulation, on the same gradients), then the transforms."""
    references = {name: _values(fn(grads, other)) for name, fn in REDUCTIONS.items()}
    storages = [state_of(grads).storage, state_of(other).storage]
    parts = [p for s in storages for p in s.partitions]
    out: dict[str, dict[str, Any]] = {}
    # refusals are recorded, not raised: a refusal on one rank only must not leave the ranks in different calls
    with simulated_offload(storages, offload=offload), DispatchProbe(simulate=True, nccl=True,
                                                                     raise_on_mix=False) as probe:
        probe.tag(parts, "host" if offload else "dev")
        for name, fn in {**REDUCTIONS, **TRANSFORMS}.items():
            seen = len(probe.refused)
            r: dict[str, Any] = {"refused": None, "where": None, "equal": None}
            try:
                result = fn(grads, other)
                r["where"] = _where(probe, result)
                if name in references:
                    r["equal"] = _values(result)  # compared below, outside the probe
            except Exception:  # noqa: BLE001 - any other failure is reported as one too
                r["refused"] = traceback.format_exc(limit=6)
            if len(probe.refused) > seen:
                r["refused"] = "; ".join(probe.refused[seen:seen + 3])
            out[name] = r
    for name, reference in references.items():
        if out[name]["equal"] is not None:
            out[name]["equal"] = _same(reference, out[name]["equal"])
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


def check_devices(stage: int, cases: tuple[tuple[str, bool], ...]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{"dtype[-offload]": {call: {"refused", "where", "equal"}}}`` for every call of :data:`CALLS` on a
    ZeRO-``stage`` engine of each ``(dtype, offload)`` case (``offload_optimizer: cpu`` and partitions tagged
    ``"host"`` when ``offload``, else tagged ``"dev"``) under simulated devices: one backward per engine."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for dtype, offload in cases:
        engine = build_engine(EngineCase(stage, dtype, offload=offload))
        _backward(engine)
        grads = zd.sharded_grads(engine)
        other = grads.clone()
        out[dtype + ("-offload" if offload else "")] = _run_case(grads, other, offload)
        engine.step()
        del engine, grads, other
    return out


class Blocks(torch.nn.Module):
    """``depth`` ``Linear(width, width)`` (default four of 256: about 263K parameters in 8 tensors): the data far
    outweighs what the per-piece reductions handle apart (boundary rows: at most a row per piece), as in real
    models."""

    def __init__(self, width: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


TRAFFIC: dict[str, Call] = {
    "norms": lambda g, o: g.norms(), "norms(1)": lambda g, o: g.norms(1.0),
    "norms(inf)": lambda g, o: g.norms(math.inf), "norms(half)": lambda g, o: g.norms(params=_half(g)),
    "global_norm": lambda g, o: g.global_norm(), "global_norm(inf)": lambda g, o: g.global_norm(math.inf),
    "dots": lambda g, o: g.dots(o), "dots(with_norms)": lambda g, o: g.dots(o, with_norms=True),
    "stats": lambda g, o: g.stats(), "found_inf": lambda g, o: zd.found_inf(g),
    "clip_grad_norm_": lambda g, o: g.clip_grad_norm_(1e9), "clip_per_param_": lambda g, o: g.clip_per_param_(1e9),
}


WARM_UP = ("norms", "norms(half)", "found_inf")  #: the calls whose first run fills every cache the others use


def check_traffic(cases: tuple[tuple[Any, ...], ...], dot_chunk: int | None = 2048,
                  offload: bool = False) -> dict[str, dict[str, Any]]:
    """``{"z{stage}-{dtype}": {call: DispatchProbe.summary()}}`` of each reduction and clip of :data:`TRAFFIC` on a
    :class:`Blocks` engine (two param groups) per ``(stage, dtype)`` (``(stage, dtype, 1)``: one param group, key
    ``"z{stage}-{dtype}-1group"``), measured on its second call (caches filled by the first, also simulated) with
    the gradient partitions (and the clone's, for ``dots``) watched as the data, under simulated devices without
    offload (partitions and results on the simulated accelerator: a read back to the host is a sync).
    ``dot_chunk``: :data:`zero_dtensor.layout.segments.DOT_CHUNK` meanwhile (small, so that a chunk is far smaller than
    this model's data, as it is than a real model's; ``None``: the library's own). ``offload``: the partitions on
    the simulated host instead (``offload_optimizer: cpu``: the reductions run the CPU recipe there), and each call
    also reports ``hidden_largest``, the largest single allocation ``torch.profiler`` sees during one more call
    (allocations a kernel makes inside itself, such as a full float32 copy of bf16 data, included)."""
    from zero_dtensor.layout import segments

    out: dict[str, dict[str, Any]] = {}
    chunk = getattr(segments, "DOT_CHUNK", None)
    if dot_chunk is not None:
        segments.DOT_CHUNK = dot_chunk
    try:
        for stage, dtype, *rest in cases:
            config = EngineCase(stage, dtype).config()
            model = Blocks()
            # two param groups (weights, biases): two flat groups, whose per-parameter rows are put back in
            # selection order (as ZeRO-3's sub-groups of a large model are); or one param group, one flat group
            one = bool(rest) and rest[0] == 1
            groups = None if one else [{"params": [p for n, p in model.named_parameters() if n.endswith(k)]}
                                       for k in ("weight", "bias")]
            engine = make_engine(config, model, model_parameters=groups)
            g = torch.Generator().manual_seed(3 + dist.get_rank())
            x = torch.randn(engine.train_micro_batch_size_per_gpu(), 256, generator=g).to(
                next(engine.module.parameters()).dtype)
            engine.backward(engine(x).float().pow(2).mean())
            grads = zd.sharded_grads(engine)
            other = grads.clone()
            storages = [state_of(grads).storage, state_of(other).storage]
            mine, theirs = list(storages[0].partitions), list(storages[1].partitions)
            rows = {}
            where = "host" if offload else "dev"
            with simulated_offload(storages, offload=offload), DispatchProbe(simulate=True, nccl=True,
                                                                              raise_on_mix=False) as warm:
                # first calls: the caches (plans' index tensors on the simulated device, selection orders) the
                # measured calls use filled, as a GPU run's first call fills them (a call building one of its own
                # shows its host-to-device copy)
                warm.tag(mine + theirs, where)
                for name in WARM_UP:
                    TRAFFIC[name](grads, other)
            for name, fn in TRAFFIC.items():
                with simulated_offload(storages, offload=offload):
                    with DispatchProbe(simulate=True, nccl=True, raise_on_mix=False) as probe:
                        probe.tag(mine + theirs, where).watch(mine + (theirs if name.startswith("dots") else []))
                        fn(grads, other)
                rows[name] = probe.summary()
                if offload:
                    rows[name]["hidden_largest"] = _largest_allocation(lambda: fn(grads, other), storages,
                                                                       mine + theirs)
            out[f"z{stage}-{dtype}" + ("-1group" if one else "")] = rows
            engine.step()
            del engine, grads, other
    finally:
        if chunk is None:  # (a library without chunked dots)
            if hasattr(segments, "DOT_CHUNK"):
                del segments.DOT_CHUNK
        else:
            segments.DOT_CHUNK = chunk
    return out


def _largest_allocation(call: Callable[[], Any], storages: list[Any], partitions: list[torch.Tensor]) -> int:
    """The largest single CPU allocation (bytes) ``torch.profiler`` records during ``call()`` under the same
    simulated offload (partitions tagged ``"host"``, so that no simulated move copies them): it also sees the memory
    an operation allocates inside its kernel (a dispatch mode sees only what operations return)."""
    from torch.profiler import ProfilerActivity, profile

    with simulated_offload(storages, offload=True), DispatchProbe(simulate=True, nccl=True,
                                                                  raise_on_mix=False) as probe:
        probe.tag(partitions, "host")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
    return max([e.self_cpu_memory_usage for e in prof.events()] + [0])


def time_calls(stage: int, dtype: str, width: int, depth: int, reps: int) -> dict[str, list[float]]:
    """Wall seconds of ``reps`` calls each of norms, global_norm, clip_grad_norm_ (coefficient 1), stats and dots
    on a :class:`Blocks` engine (a barrier before each call; for an A/B of two library versions in two pools)."""
    import time

    engine = make_engine(EngineCase(stage, dtype).config(), Blocks(width, depth))
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), width, generator=g).to(
        next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().pow(2).mean())
    grads = zd.sharded_grads(engine)
    other = grads.clone()
    calls: dict[str, Call] = {"norms": TRAFFIC["norms"], "global_norm": TRAFFIC["global_norm"],
                              "clip_grad_norm_": TRAFFIC["clip_grad_norm_"], "stats": TRAFFIC["stats"],
                              "dots": TRAFFIC["dots"]}
    out: dict[str, list[float]] = {name: [] for name in calls}
    for name, fn in calls.items():
        fn(grads, other)
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            fn(grads, other)
            out[name].append(time.perf_counter() - t)
    engine.step()
    return out
