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


#: issue 52: the collective each row's communication amounts to, timed bare on the same bytes in the same run
#: (at world 1 with forced collectives: over the one rank)
COMM_FLOOR_OF = {
    "full_tensors()": "all_gather_into_tensor",
    "masters full_tensors()": "all_gather_into_tensor (fp32)",
    "exp_avg full_tensors()": "all_gather_into_tensor (fp32)",
    "to_dtensors()": "all_to_all_single (partition)",
}
#: bus bandwidth over algorithm bandwidth (NCCL's tests' definition, per collective, N ranks)
BUS_FACTOR = {"all_gather_into_tensor": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
              "all_to_all_single": lambda n: (n - 1) / n}


def comm_floor_ops(part: Any, world: int) -> dict[str, tuple[Callable[[], Any], str, int]]:
    """The bare collectives over the bytes a gather of ``part`` (this rank's partition) moves: ``{name: (fn, kind,
    bytes)}``, ``bytes`` the size NCCL's tests call the message (the gathered ``N·|part|`` bytes; the
    partition-sized all_to_all: ``|part|``)."""
    import torch
    import torch.distributed as dist

    full = torch.empty(world * part.numel(), dtype=part.dtype, device=part.device)
    reduced = torch.zeros_like(full)
    spread = full.clone()
    size = full.numel() * full.element_size()
    suffix = " (fp32)" if part.dtype == torch.float32 and part.element_size() == 4 else ""
    out = {
        f"all_gather_into_tensor{suffix}": (lambda: dist.all_gather_into_tensor(full, part), "all_gather_into_tensor",
                                            size),
        f"all_reduce{suffix}": (lambda: dist.all_reduce(reduced), "all_reduce", size),
        f"all_to_all_single{suffix}": (lambda: dist.all_to_all_single(full, spread), "all_to_all_single", size),
    }
    if not suffix:  # the redistribution's exchange: each rank sends and receives a partition's bytes
        rows = part.clone()
        peer = torch.empty_like(part)
        out["all_to_all_single (partition)"] = (lambda: dist.all_to_all_single(peer, rows), "all_to_all_single",
                                                part.numel() * part.element_size())
    return out


def time_comm_floors(part_numel: int, dtype: Any, master_part_numel: int, device: Any, world: int,
                     measure: Callable[[str, Callable[[], Any]], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every collective floor (:func:`comm_floor_ops`) on this rank's stored partition (``part_numel`` elements of
    ``dtype``) and its fp32 masters' partition, each a row with ``bytes``, ``algbw_GBps`` (bytes over the median
    time) and ``busbw_GBps`` (times :data:`BUS_FACTOR`: 0 at one rank, where nothing crosses a link)."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for n, dt in ((part_numel, dtype), (master_part_numel, torch.float32)):
        part = torch.empty(n, dtype=dt, device=device).uniform_(-1, 1)
        for name, (fn, kind, size) in comm_floor_ops(part, world).items():
            row = measure(name, fn)
            if "median_ms" in row:
                algbw = size / (row["median_ms"] / 1e3) / 1e9
                row.update(bytes=size, algbw_GBps=algbw, busbw_GBps=algbw * BUS_FACTOR[kind](world),
                           collective=kind, world=world)
            out[name] = row
        del part
    return out


def attach_comm_ratios(rows: list[dict[str, Any]], floors: dict[str, dict[str, Any]]) -> None:
    """Give each row with a collective floor ``comm_floor``, ``comm_floor_ms`` and ``comm_ratio``."""
    _attach(rows, floors, COMM_FLOOR_OF, "comm_")


def attach_ratios(rows: list[dict[str, Any]], floors: dict[str, dict[str, Any]]) -> None:
    """Give each row with a floor ``floor``, ``floor_ms`` and ``ratio`` (median over median)."""
    _attach(rows, floors, FLOOR_OF, "")


def _attach(rows: list[dict[str, Any]], floors: dict[str, dict[str, Any]], floor_of: dict[str, str],
            prefix: str) -> None:
    """Each row whose floor (``floor_of``) was measured gets ``<prefix>floor``, ``<prefix>floor_ms`` and
    ``<prefix>ratio`` (its median over the floor's)."""
    for r in rows:
        name = floor_of.get(r["row"])
        f = floors.get(name) if name else None
        if f is None or "median_ms" not in f or "median_ms" not in r:
            continue
        r.update({f"{prefix}floor": name, f"{prefix}floor_ms": f["median_ms"],
                  f"{prefix}ratio": r["median_ms"] / f["median_ms"]})
