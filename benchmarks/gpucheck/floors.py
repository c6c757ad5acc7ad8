"""The floors of the timing rows: bare torch ops on one flat tensor holding the same bytes as the stored family,
timed in the same process (a device copy for reads and writes, a flat ``vector_norm`` for reductions, a flat
``mul_`` for transforms, an fp32 copy for master and optimizer-state reads)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# the floor of each row (rows absent here have none: DeepSpeed's loops, the first sharded_grads)
FLOOR_OF = {
    "full_tensors()": "copy (read)",
    "set_full_()": "copy_ (write)",
    "mul_(1.0)": "mul_",
    "clip_grad_norm_()": "vector_norm + mul_",
    "stats()": "vector_norm",  # one read
    "norms()": "vector_norm",
    "global_norm()": "vector_norm",
    "dots()": "2 x vector_norm",  # it reads two sets
    "stats() fused": "vector_norm",  # zd.set_fused_reductions(True): one read
    "dots() fused": "2 x vector_norm",
    "masters full_tensors()": "fp32 copy (read)",
    "exp_avg full_tensors()": "fp32 copy (read)",
    "masters set_full_()": "fp32 copy_ (write)",
}


def floor_ops(flat: Any, other: Any) -> dict[str, Callable[[], Any]]:
    """The floors over the stored dtype's bytes: ``flat`` and ``other`` (same size and dtype)."""
    import torch

    def norm() -> Any:
        return torch.linalg.vector_norm(flat, dtype=torch.float32)

    def norm_mul() -> Any:
        n = norm()
        flat.mul_(1.0)
        return n

    return {
        "copy (read)": flat.clone,
        "copy_ (write)": lambda: other.copy_(flat),
        "mul_": lambda: flat.mul_(1.0),
        "vector_norm": norm,
        "vector_norm + mul_": norm_mul,
        "2 x vector_norm": lambda: (norm(), torch.linalg.vector_norm(other, dtype=torch.float32)),
    }


def fp32_floor_ops(flat: Any, other: Any) -> dict[str, Callable[[], Any]]:
    """The floors over fp32 bytes (masters, optimizer state)."""
    return {"fp32 copy (read)": flat.clone, "fp32 copy_ (write)": lambda: other.copy_(flat)}


def time_floors(numel: int, dtype: Any, master_numel: int, device: Any,
                measure: Callable[[str, Callable[[], Any]], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every floor, each as a row (``measure(name, fn)``); the flat tensors are freed before returning."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for ops_of, n, dt in ((floor_ops, numel, dtype), (fp32_floor_ops, master_numel, torch.float32)):
        flat = torch.empty(n, dtype=dt, device=device).uniform_(-1, 1)
        other = torch.empty_like(flat).uniform_(-1, 1)
        for name, fn in ops_of(flat, other).items():
            out[name] = measure(name, fn)
        del flat, other
    return out


def attach_ratios(rows: list[dict[str, Any]], floors: dict[str, dict[str, Any]]) -> None:
    """Give each row with a floor ``floor``, ``floor_ms`` and ``ratio`` (median over median)."""
    for r in rows:
        name = FLOOR_OF.get(r["row"])
        f = floors.get(name) if name else None
        if f is None or "median_ms" not in f or "median_ms" not in r:
            continue
        r.update(floor=name, floor_ms=f["median_ms"], ratio=r["median_ms"] / f["median_ms"])
