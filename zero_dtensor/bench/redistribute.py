"""Redistribution rows for ``python -m zero_dtensor.bench`` (redistribution: ``to_dtensors``, ``owned``,
their writes, and ``map_full_(newton_schulz)`` against the full-everywhere and DeepSpeed-loop versions).

:func:`add_rows` runs on every rank inside :func:`zero_dtensor.bench.cli._bench_stage`, after the core rows (it needs
their ``full_tensors`` row for the ratios), with that function's ``measure``. Bytes per rank are exact, from the
plans (:func:`zero_dtensor.redistribute.traffic`), the most any rank receives; the full-everywhere rows use the ring
model. :func:`render` prints the ratios the issue asks for as a second table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ROWS", "add_rows", "render"]

NS = "map_full_(newton_schulz)"
FULL_NS = "full_tensors+newton_schulz+set_full_"
DS_NS = "ds get loop+newton_schulz+ds set loop"
ROWS = ("to_dtensors", "set_dtensors_", "owned", "set_owned_", NS, FULL_NS, DS_NS)


def _max_over_ranks(value: float, device: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _local_bytes(result: Any) -> int:
    """Bytes of the distinct buffers behind a dict of tensors or DTensors (their local shards)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in (result.values() if isinstance(result, dict) else []):
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def add_rows(grads: Any, engine: Any, measure: Callable[..., None], rows: list[dict[str, Any]], *, args: Any,
             stage: int, full_row: str, ring_bytes: Callable[[str, float, int], float], device: Any) -> None:
    """Measure the redistribution rows; then give each a ``relative`` entry ``{"to": row, "ratio": time ratio,
    "bytes_ratio": ...}`` against the row it is meant to beat."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    from ..redistribute import newton_schulz, traffic

    world = dist.get_world_size()
    moved_rows = traffic(grads, target="rows")
    moved_owners = traffic(grads, target="owners")

    def most(key: str, moved: dict[str, int]) -> float:
        return _max_over_ranks(moved[key], device)

    measure("to_dtensors", grads.to_dtensors, repeat=args.repeat, bytes_per_rank=most("read_received", moved_rows),
            baseline="ds get loop", note="Shard(0) rows, 1 all_to_all", memory=_local_bytes)
    dts = grads.to_dtensors()
    measure("set_dtensors_", lambda: grads.set_dtensors_(dts), repeat=args.repeat,
            bytes_per_rank=most("write_received", moved_rows), baseline=None, note="the reverse",
            memory=lambda _: 0)
    measure("owned", grads.owned, repeat=args.repeat, bytes_per_rank=most("read_received", moved_owners),
            baseline="ds get loop", note="whole params on owners, 1 all_to_all", memory=_local_bytes)
    mine = grads.owned()
    measure("set_owned_", lambda: grads.set_owned_(mine), repeat=args.repeat,
            bytes_per_rank=most("write_received", moved_owners), baseline=None, note="the reverse",
            memory=lambda _: 0)

    matrices = [n for n in grads.names if len(grads[n].shape) == 2]
    moved = traffic(grads, matrices, target="owners")
    element = grads[matrices[0]].dtype.itemsize if matrices else 4
    matrix_bytes = float(sum(grads[n].numel for n in matrices) * element)
    measure(NS, lambda: grads.map_full_(lambda name, g: newton_schulz(g), matrices), repeat=args.ds_repeat,
            bytes_per_rank=most("read_received", moved) + most("write_received", moved), baseline=None,
            note=f"{len(matrices)} matrices, each on one owner", memory=lambda _: 0)

    def everywhere() -> None:
        full = grads.full_tensors(matrices)
        grads.set_full_({n: newton_schulz(t) for n, t in full.items()})

    measure(FULL_NS, everywhere, repeat=args.ds_repeat, bytes_per_rank=ring_bytes("all_gather", matrix_bytes, world),
            baseline=None, note="every matrix on every rank", memory=lambda _: 0)
    params = dict(engine.module.named_parameters())

    def deepspeed_loop() -> None:
        for n in matrices:
            p = params[n]
            value = newton_schulz(safe_get_full_grad(p))
            if stage == 3:  # DeepSpeed's stage-3 set narrows past the end unless the value is padded
                pad = p.partition_numel() * world - value.numel()
                value = torch.cat([value.reshape(-1), value.new_zeros(pad)]) if pad else value
            safe_set_full_grad(p, value)

    per_param = "all_gather" if stage == 3 else "all_reduce"
    measure(DS_NS, deepspeed_loop, repeat=args.ds_repeat,
            bytes_per_rank=ring_bytes(per_param, 4.0 * sum(grads[n].numel for n in matrices), world), baseline=None,
            note="fp32 per param", memory=lambda _: 0)

    by = {r["row"]: r for r in rows if r["stage"] == stage}
    targets = {"to_dtensors": full_row, "owned": full_row, NS: FULL_NS}
    for name, ref in targets.items():
        _relate(by.get(name), by.get(ref))
    if NS in by and DS_NS in by:
        by[NS]["relative_ds"] = _relation(by[NS], by[DS_NS])


def _relation(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    return {"to": ref["row"], "ratio": row["median_s"] / ref["median_s"] if ref["median_s"] > 0 else None,
            "bytes_ratio": row["bytes_per_rank"] / ref["bytes_per_rank"] if ref["bytes_per_rank"] > 0 else None}


def _relate(row: dict[str, Any] | None, ref: dict[str, Any] | None) -> None:
    if row is not None and ref is not None:
        row["relative"] = _relation(row, ref)


def render(results: dict[str, Any], console: Any) -> None:
    """A table of the ratios (time and bytes per rank) of each redistribution row to the row it is meant to beat."""
    from rich.markup import escape
    from rich.table import Table

    related = [r for r in results["rows"] if "relative" in r]
    if not related:
        return
    table = Table(title=escape(f"redistribution vs full materialization, {results['world_size']} ranks "
                               "(ratio < 1: faster / fewer bytes)"), title_justify="left")
    for col, just in (("stage", "right"), ("row", "left"), ("vs", "left"), ("time ratio", "right"),
                      ("bytes ratio", "right")):
        table.add_column(col, justify=just)
    for r in related:
        for rel in (r["relative"], r.get("relative_ds")):
            if rel is None:
                continue
            table.add_row(f"ZeRO-{r['stage']}", escape(r["row"]), escape(rel["to"]),
                          f"{rel['ratio']:.2f}" if rel["ratio"] is not None else "-",
                          f"{rel['bytes_ratio']:.2f}" if rel["bytes_ratio"] is not None else "-")
    console.print(table)
