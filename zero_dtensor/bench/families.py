"""Benchmark rows of the fp32 master weights and the optimizer state (``python -m zero_dtensor.bench --rows
families``): bulk reads against DeepSpeed's per-parameter ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` loops and against one bare all_gather of the same fp32 partitions; the EMA update
against a bare ``lerp_`` of the local partitions; ``to_dtensors`` / ``owned`` of the masters against one bare
``all_to_all_single`` of the same split sizes (every bucket's, with buffers made once). These six rows are timed
round-robin, so that each and its reference see the same machine load. Each of those rows gets
``relative_to_reference`` ``{"to": row, "ratio": time ratio}`` (:func:`render` prints them).

:func:`add_rows` runs on every rank inside :func:`zero_dtensor.bench.cli._bench_stage`, after the gradient rows (it
takes one optimizer step, which creates the optimizer state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ROWS = ("ds fp32 get loop", "masters full_tensors", "masters floor: bare all_gather", "ds exp_avg get loop",
        "exp_avg full_tensors", "ema.lerp_(masters)", "ref: bare lerp_ of the partitions", "masters to_dtensors",
        "masters owned", "ref: bare all_to_all_single (to_dtensors splits)", "ref: bare all_to_all_single (owned splits)")


def add_rows(engine: Any, measure: Callable[..., None], rows: list[dict[str, Any]], *, args: Any,
             ring_bytes: Callable[[str, float, int], float], stage: int | None = None) -> None:
    """Measure :data:`ROWS` (the engine takes one step first), then give each a ``relative`` entry."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import zero_dtensor as zd
    from ..comm.collectives import all_gather_into, all_to_all_into
    from ..redistribute import OWNERS, ROWS as ROW_TARGET, owners, plan_for
    from ..core.state import state_of

    engine.step()  # the optimizer state exists from the first step on
    world = dist.get_world_size()
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    master = zd.sharded_master_params(engine)
    exp_avg = zd.sharded_optimizer_state(engine, "exp_avg")
    storage = state_of(master).storage
    parts = master.local_partitions
    sharded = [g for g in master.layout.groups if g.placement.is_sharded]
    nbytes = float(sum(g.flat_numel * parts[g.index].element_size() for g in sharded))

    measure("ds fp32 get loop", lambda: {n: safe_get_full_fp32_param(p) for n, p in named}, repeat=args.ds_repeat,
            bytes_per_rank=0.0, baseline=None, note="one collective per parameter")
    measure("masters full_tensors", master.full_tensors, repeat=args.repeat,
            bytes_per_rank=ring_bytes("all_gather", nbytes, world), baseline="ds fp32 get loop", note="fp32")
    if sharded:
        pg = storage.process_groups[sharded[0].index]
        ins = [parts[g.index] for g in sharded]
        outs = [torch.empty(g.flat_numel, dtype=parts[g.index].dtype) for g in sharded]
        measure("masters floor: bare all_gather", lambda: all_gather_into(outs, ins, pg), repeat=args.repeat,
                bytes_per_rank=ring_bytes("all_gather", nbytes, world), baseline=None, note="same bytes",
                memory=lambda _: 0)
    measure("ds exp_avg get loop", lambda: {n: safe_get_full_optimizer_state(p, "exp_avg") for n, p in named},
            repeat=args.ds_repeat, bytes_per_rank=0.0, baseline=None, note="one collective per parameter")
    measure("exp_avg full_tensors", exp_avg.full_tensors, repeat=args.repeat,
            bytes_per_rank=ring_bytes("all_gather", nbytes, world), baseline="ds exp_avg get loop", note="fp32")

    ema = master.clone()
    ema_parts, master_parts = ema.local_partitions, master.local_partitions
    timed: list[tuple[str, Callable[[], Any], str]] = [
        ("ema.lerp_(masters)", lambda: ema.lerp_(master, 0.001), "0 comm"),
        ("ref: bare lerp_ of the partitions", lambda: [e.lerp_(m, 0.001) for e, m in zip(ema_parts, master_parts)],
         "torch alone"),
    ]

    selected = list(master.layout.params)
    for row, call, target, assignment in (
            ("masters to_dtensors", master.to_dtensors, ROW_TARGET, None),
            ("masters owned", master.owned, OWNERS, owners(storage, selected))):
        timed.append((row, call, "one all_to_all"))
        plan = plan_for(storage, selected, target, assignment)
        refs = []
        for bucket in plan.buckets:  # every bucket's exchange: the same split sizes and dtype, buffers made once
            pg = storage.process_groups[bucket.groups[0]]
            send = torch.empty(sum(bucket.read.send_counts), dtype=bucket.dtype, device=parts[0].device)
            recv = torch.empty(sum(bucket.read.recv_counts), dtype=bucket.dtype, device=parts[0].device)
            refs.append(lambda r=recv, s=send, b=bucket, g=pg: all_to_all_into(r, s, b.read.recv_counts,
                                                                               b.read.send_counts, g))
        name = "to_dtensors" if target == ROW_TARGET else "owned"
        timed.append((f"ref: bare all_to_all_single ({name} splits)", lambda fs=refs: [f() for f in fs],
                      "the same split sizes"))
    _interleaved(timed, args.repeat, rows, engine.device, stage)

    by = {r["row"]: r for r in rows}
    for row, reference in (("masters full_tensors", "masters floor: bare all_gather"),
                           ("exp_avg full_tensors", "masters floor: bare all_gather"),
                           ("ema.lerp_(masters)", "ref: bare lerp_ of the partitions"),
                           ("masters to_dtensors", "ref: bare all_to_all_single (to_dtensors splits)"),
                           ("masters owned", "ref: bare all_to_all_single (owned splits)")):
        if row in by and reference in by and by[reference]["median_s"] > 0:
            ratio = by[row]["median_s"] / by[reference]["median_s"]
            by[row]["relative_to_reference"] = {"to": reference, "ratio": ratio}


def _interleaved(timed: list[tuple[str, Callable[[], Any], str]], repeat: int, rows: list[dict[str, Any]],
                 device: Any, stage: int | None) -> None:
    """Time ``timed`` (row, call, note) round-robin, ``repeat`` rounds after one warm-up round, each call starting at
    a barrier; a repetition takes as long as its slowest rank. Round-robin so that a row and its reference see the
    same machine load (a shared machine drifts over seconds); every other round in reverse order, so that no row
    always runs right after the same other one. Appends one row each, as ``measure`` does."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from .common import sync

    counts = []
    for _, call, _ in timed:
        call()  # warm-up
        with CommDebugMode() as mode:
            result = call()
        del result
        counts.append(mode)
    times: list[list[float]] = [[] for _ in timed]
    for round_ in range(repeat):
        order = range(len(timed)) if round_ % 2 == 0 else range(len(timed) - 1, -1, -1)
        for i in order:
            call = timed[i][1]
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            result = call()
            sync(device)
            times[i].append(time.perf_counter() - t0)
            del result
    for (row, _, note), mode, ts in zip(timed, counts, times):
        t = torch.tensor(ts, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts = t.cpu().tolist()
        ops = {str(k).split(".")[-1].strip("_") or str(k): v for k, v in mode.get_comm_counts().items()}
        rows.append({"stage": stage, "row": row, "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
                     "repeat": repeat, "collectives": int(mode.get_total_counts()), "collective_ops": ops,
                     "bytes_per_rank": 0.0, "memory_bytes": 0, "baseline": None, "note": note + ", interleaved"})


def render(results: dict[str, Any], console: Any) -> None:
    """One table of the rows measured against a reference of their own (nothing when there are none)."""
    from rich.markup import escape
    from rich.table import Table

    rows = [r for r in results["rows"] if "relative_to_reference" in r]
    if not rows:
        return
    table = Table(title="fp32 masters and optimizer state: time ratio to the reference in the same run")
    for column in ("stage", "row", "ratio", "reference"):
        table.add_column(column)
    for r in rows:
        rel = r["relative_to_reference"]
        table.add_row(str(r["stage"]), escape(r["row"]), f"{rel['ratio']:.2f}", escape(rel["to"]))
    console.print(table)
