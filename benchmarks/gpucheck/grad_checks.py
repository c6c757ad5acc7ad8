"""The gradient checks of one case, at a boundary before the step: full reads against DeepSpeed's
``safe_get_full_grad``, transforms and reductions against the same ops on full tensors, and the redistributions."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from .cases import MEAN_RTOL, NORM_RTOL, READ_ATOL, READ_RTOL
from .runtime import error_text


def attempt(checks: dict[str, dict[str, Any]], name: str, fn: Callable[[], dict[str, Any] | None]) -> None:
    """Run one check; record ``{"passed": bool, ...}`` under ``name`` (the message if it raised)."""
    t0 = time.perf_counter()
    try:
        checks[name] = {"passed": True, **(fn() or {})}
    except Exception as exc:  # noqa: BLE001 - one bad check must not hide the others
        checks[name] = {"passed": False, "error": error_text(exc)}
    checks[name]["seconds"] = time.perf_counter() - t0


def full32(family: Any, **kwargs: Any) -> dict[str, Any]:
    """``full_tensors(dtype=float32)``, cloned (the result may be reused by the next call)."""
    import torch

    return {n: t.clone() for n, t in family.full_tensors(dtype=torch.float32, **kwargs).items()}


def assert_same(ours: dict[str, Any], theirs: dict[str, Any], what: str, exact: bool = True) -> float:
    """Every entry of ``ours`` equals ``theirs`` (shape, values; on ``theirs``' device); returns the max abs diff."""
    import torch

    assert list(ours) == list(theirs), (what, list(ours), list(theirs))
    worst = 0.0
    for name, ref in theirs.items():
        got = ours[name].to(device=ref.device, dtype=ref.dtype)
        assert got.shape == ref.shape, (what, name, got.shape, ref.shape)
        diff = float((got - ref).abs().max()) if ref.numel() else 0.0
        worst = max(worst, diff)
        same = torch.equal(got, ref) if exact else torch.allclose(got, ref, rtol=READ_RTOL, atol=READ_ATOL)
        assert same, f"{what}: {name} differs (max abs diff {diff:g})"
    return worst


def check_reads(engine: Any, grads: Any) -> dict[str, Any]:
    """Every full read of ours equals DeepSpeed's ``safe_get_full_grad`` (cast to the stored dtype, then fp32)."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    assert list(grads.names) == list(params), (grads.names, list(params))
    scale = float(grads.loss_scale)
    exact = scale == 1.0
    refs = {n: safe_get_full_grad(p).to(grads[n].dtype).to(torch.float32) / scale for n, p in params.items()}
    reads = {"full_tensors": full32(grads)}
    for strategy in ("all_gather", "all_to_all", "all_reduce"):
        reads[f"full_tensors[{strategy}]"] = full32(grads, strategy=strategy)
    reads["iter_full"] = {n: t.to(torch.float32).clone() for n, t in grads.iter_full(bucket_bytes=4096)}
    reads["ParamGrad.full_tensor"] = {n: grads[n].full_tensor(dtype=torch.float32) for n in grads.names}
    worst = max(assert_same(values, refs, f"{what} vs safe_get_full_grad", exact) for what, values in reads.items())
    return {"params": len(grads.names), "reads": sorted(reads), "loss_scale": scale,
            "tolerance": "exact" if exact else f"rtol {READ_RTOL:g}, atol {READ_ATOL:g} after unscaling",
            "max_abs_diff": worst}


def _close(a: float, b: float, rtol: float, what: str) -> None:
    assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12), f"{what}: {a!r} vs {b!r}"


def check_transforms(grads: Any) -> dict[str, Any]:
    """``stats``, ``norms``, ``global_norm``, ``dots``, ``mul_`` and ``clip_grad_norm_`` against the same ops on the
    full tensors, in stored units."""
    import torch

    scale = float(grads.loss_scale)
    true = full32(grads)
    # the reference in stored units: exact, because the scale is a power of two and the values came from storage
    stored = {n: (t * scale).to(grads[n].dtype) for n, t in true.items()}

    def as_true() -> dict[str, torch.Tensor]:
        return {n: t.to(torch.float32) / scale for n, t in stored.items()}

    for n, s in grads.stats().items():
        t = true[n].double()
        _close(s.norm, float(torch.linalg.vector_norm(t)), NORM_RTOL, f"stats norm {n}")
        assert s.max_abs == float(t.abs().max()), (n, s.max_abs, float(t.abs().max()))
        _close(s.mean, float(t.mean()), MEAN_RTOL, f"stats mean {n}")
        assert s.nan_count == 0 and s.inf_count == 0 and s.numel == t.numel(), (n, s)
    norms = grads.norms()
    for n, t in true.items():
        _close(float(norms[n]), float(torch.linalg.vector_norm(t.double())), NORM_RTOL, f"norms {n}")
    ref_total = float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in true.values()])))
    _close(float(grads.global_norm()), ref_total, NORM_RTOL, "global_norm")
    twin = grads.clone()
    twin.mul_(-0.5)
    for n, d in grads.dots(twin).items():
        _close(float(d), -0.5 * float(true[n].double().pow(2).sum()), NORM_RTOL, f"dots {n}")

    grads.mul_(0.5)
    stored = {n: t.mul_(0.5) for n, t in stored.items()}
    assert_same(full32(grads), as_true(), "mul_(0.5)")

    ref_total = float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in as_true().values()])))
    max_norm = 0.5 * ref_total
    total = grads.clip_grad_norm_(max_norm)
    _close(float(total), ref_total, NORM_RTOL, "clip_grad_norm_ total")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    stored = {n: t.mul_(coef.to(t.device)) for n, t in stored.items()}
    assert_same(full32(grads), as_true(), "clip_grad_norm_")
    return {"ops": ["stats", "norms", "global_norm", "clone+dots", "mul_(0.5)", "clip_grad_norm_"],
            "total_norm": ref_total}


def _local_piece(full: Any, dtensor: Any) -> Any:
    """This rank's piece of ``full`` as ``dtensor`` places it (``Shard(0)``: ``torch.chunk``'s rows; ``Replicate``:
    the whole), computed locally. ``DTensor.full_tensor()`` is not used: on gloo over CUDA tensors it kills the
    process (SIGSEGV, seen on the H200), while the library's own exchange works there."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    if not any(isinstance(p, Shard) for p in dtensor.placements):
        return full
    chunks = torch.chunk(full, dist.get_world_size(), dim=0)
    rank = dist.get_rank()
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


def check_redistribute(family: Any) -> dict[str, Any]:
    """``to_dtensors`` (each rank's pieces) and ``owned`` against ``full_tensors``; ``map_full_`` (x2) and ``set_dtensors_`` (back) seen
    by ``full_tensors``. Leaves the values as they were."""
    import torch.distributed as dist

    exact = float(family.loss_scale) == 1.0
    full = full32(family)
    dts = family.to_dtensors()
    assert_same({n: d.to_local() for n, d in dts.items()}, {n: _local_piece(full[n], d) for n, d in dts.items()},
                "to_dtensors() local pieces", exact)
    owned = family.owned()
    owners = family.owners()
    assert sorted(owned) == sorted(n for n, r in owners.items() if r == dist.get_rank()), sorted(owned)
    assert_same(owned, {n: full[n] for n in owned}, "owned()", exact)
    family.map_full_(lambda _name, t: t * 2)
    assert_same(full32(family), {n: t * 2 for n, t in full.items()}, "map_full_(x2)", exact)
    family.set_dtensors_(dts)
    assert_same(full32(family), full, "set_dtensors_ of to_dtensors()", exact)
    return {"calls": ["to_dtensors", "owners", "owned", "map_full_", "set_dtensors_"], "owned_here": len(owned),
            "dtensor_dtype": str(next(iter(dts.values())).dtype) if dts else None,
            "placements": sorted({str(d.placements) for d in dts.values()}), "exact": exact,
            "device": str(next(iter(dts.values())).device) if dts else None}
