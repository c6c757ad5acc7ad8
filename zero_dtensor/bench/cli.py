"""Benchmark: read/write every ZeRO gradient with DeepSpeed's per-parameter API vs zero_dtensor.

    python -m zero_dtensor.bench                       # 2 CPU ranks on gloo, ~24M params / 198 tensors, stages 1-3
    python -m zero_dtensor.bench --nproc 4 --json out.json
    torchrun --nproc-per-node 8 -m zero_dtensor.bench  # in place (NCCL on GPUs when available)

For each ZeRO stage it builds a DeepSpeed engine around a transformer-like model, runs one forward/backward, and
times (``--repeat`` times after one warm-up, every repetition starting at a barrier; a repetition's time is the
slowest rank's):

- ``ds safe_get_full_grad loop`` / ``ds safe_set_full_grad loop``: DeepSpeed's per-parameter API over every parameter;
- ``full_tensors()`` (``strategy="auto"``; its buffer is recycled between calls once the previous result is dropped),
  the same with a fresh buffer every call (what a first call costs), ``full_tensors(out=prev)`` (reused memory), the
  explicit strategies,
  ``iter_full`` (streaming), ``set_full_``, and ``clip_grad_norm_`` if this zero_dtensor has it;
- the floors (:mod:`zero_dtensor.bench.floors`): the bare primitives that move the same partitions into
  preallocated buffers (``all_gather_into_tensor``, ``all_to_all_single``, batched ``isend``/``irecv``); the
  cheapest is chosen in the run, and every row's repetitions are each timed right after one of the bare all_gather
  (``÷ floor``) and one of the cheapest (``÷ cheapest``).

Collectives are counted in a separate, untimed run under ``CommDebugMode``. Progress and the final table are printed
by rank 0 (rich); ``--json PATH`` writes the same figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from .common import engine_config, run_ranks, timed_call
from .floors import CANDIDATES, bare_gathers, beside, cheapest
from .table import render
from .sweep import main as sweep_main

SIZES = {"tiny": (32, 2), "small": (128, 4), "default": (352, 16)}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m zero_dtensor.bench",
        description="Time reading/writing every DeepSpeed ZeRO gradient: DeepSpeed's per-parameter safe_get/"
        "safe_set_full_grad loops vs zero_dtensor (full_tensors, out= reuse, iter_full, set_full_, "
        "clip_grad_norm_) vs the floor (one bare all_gather of the same bytes).",
    )
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks to start on gloo (ignored under torchrun/deepspeed,"
                   " i.e. when RANK and WORLD_SIZE are set). Default 2")
    p.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages. Default 1,2,3")
    p.add_argument("--size", choices=sorted(SIZES), default="default",
                   help="model preset: tiny (32 hidden, 2 blocks, 30 tensors), small (128, 4), "
                        "default (352 hidden, 16 blocks: 24.1M params, 198 tensors)")
    p.add_argument("--tiny", action="store_true", help="same as --size tiny (CI smoke test)")
    p.add_argument("--hidden", type=int, help="hidden size (overrides the preset)")
    p.add_argument("--layers", type=int, help="transformer blocks, 12 tensors each (+6 others; overrides the preset)")
    p.add_argument("--params", type=float, help="target parameter count, e.g. 25e6: picks --hidden for --layers")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="model dtype. Default fp32")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per row (after 1 warm-up). Default 5")
    p.add_argument("--ds-repeat", type=int, help="repetitions for DeepSpeed's loops (slow). Default: --repeat, at "
                   "most 3")
    p.add_argument("--bucket-mb", type=float, default=16.0, help="iter_full bucket size in MiB. Default 16")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--rows", choices=("all", "core", "families"), default="all", help="families: the core rows, "
                   "then the fp32 master weights' and optimizer state's (zero_dtensor.bench.families). "
                   "all (default): also the redistribution "
                   "rows (zero_dtensor.bench.redistribute: to_dtensors, owned, their writes, map_full_(newton_schulz)"
                   " vs full_tensors and vs DeepSpeed's loops); core: without them")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed. Default 1800")
    p.add_argument("--tensors", metavar="K,K,...", help="instead: the tensor-count sweep (zero_dtensor.bench.sweep),"
                   " e.g. 200,2000,10000: per K a model of K tensors from Linear(32, 32) layers, a row per call, the"
                   " floor in the same run and µs per tensor above it (uses --nproc, --stages, --repeat, --dtype,"
                   " --json; --tiny: Linear(8, 8))")
    args = p.parse_args(argv)
    if args.tensors is not None:
        try:
            args.tensors = [int(k) for k in str(args.tensors).split(",") if k.strip()]
        except ValueError:
            args.tensors = []
        if not args.tensors or any(k < 2 for k in args.tensors):
            p.error("--tensors takes comma-separated tensor counts of at least 2, e.g. 200,2000,10000")
    hidden, layers = SIZES["tiny" if args.tiny else args.size]
    args.layers = args.layers or layers
    if args.params:
        from .model import count

        per_layer_params = args.params / max(args.layers, 1)
        hidden = max(8, int((per_layer_params / 12) ** 0.5))
        while count(hidden, args.layers)[0] > args.params and hidden > 8:
            hidden -= 1
    args.hidden = args.hidden or hidden
    args.stages = [int(s) for s in str(args.stages).split(",") if s.strip()]
    if any(s not in (1, 2, 3) for s in args.stages):
        p.error("--stages takes 1, 2 and/or 3")
    args.ds_repeat = args.ds_repeat or min(args.repeat, 3)
    return args


# --- rank side -----------------------------------------------------------------------------------------------------
def _ring_bytes(kind: str, full_bytes: float, world: int) -> float:
    """Bytes per rank for a collective whose full size is ``full_bytes`` (ring model)."""
    if world <= 1:
        return 0.0
    return {"all_gather": (world - 1) / world, "all_to_all": (world - 1) / world, "send_recv": (world - 1) / world,
            "all_reduce": 2 * (world - 1) / world, "none": 0.0}[kind] * full_bytes


def _ratio(row: dict[str, Any], kind: str, bare_rows: dict[str, dict[str, Any] | None]) -> float | None:
    """``row``'s median over that of the bare ``kind`` timed beside it; for rows timed alone (DeepSpeed's loops,
    the bare primitives), over the bare ``kind``'s own row."""
    floor = row.get("floors_beside_s", {}).get(kind)
    if floor is None:
        own = bare_rows.get(kind)
        floor = own["median_s"] if own is not None else None
    return row["median_s"] / floor if floor else None


class _Row:
    def __init__(self, name: str, stage: int, **info: Any) -> None:
        self.name, self.stage, self.info = name, stage, info


def _bench_stage(args: argparse.Namespace, stage: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad
    from torch.distributed.tensor.debug import CommDebugMode

    import zero_dtensor as zd
    from zero_dtensor import materialize as mz
    from zero_dtensor.bench.model import TransformerLike
    from zero_dtensor.comm.point_to_point import counting_p2p
    from zero_dtensor.core.state import state_of

    world, rank = dist.get_world_size(), dist.get_rank()
    use_cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = TransformerLike(args.hidden, args.layers)
    config = engine_config(stage, args.dtype, lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(2, 8, args.hidden, generator=torch.Generator().manual_seed(rank)).to(device=engine.device,
                                                                                      dtype=dtype)
    engine.backward(engine(x).float().pow(2).mean())
    grads = zd.sharded_grads(engine)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    parts = grads.local_partitions
    stored_bytes = sum(g.flat_numel * parts[g.index].element_size() for g in grads.layout.groups if not g.replicated)
    numel = sum(p.numel for p in grads.layout.params)
    known = {t.untyped_storage().data_ptr() for t in parts}

    def new_bytes(result: Any) -> int:
        seen: set[int] = set()
        total = 0
        for t in (result.values() if isinstance(result, dict) else []):
            s = t.untyped_storage()
            if s.data_ptr() not in known and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    rows: list[dict[str, Any]] = []

    def timed(fn: Callable[[], Any]) -> float:
        return timed_call(fn, device)

    def slowest(times: list[float]) -> list[float]:
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a repetition takes as long as its slowest rank
        return t.cpu().tolist()

    # the floors: the bare primitives moving the same bytes, the cheapest chosen here; every row is timed beside
    # the bare all_gather and the cheapest (each repetition right after one of each)
    sharded = [g for g in grads.layout.groups if g.placement.is_sharded]
    bare: dict[str, Callable[[], Any]] = {}
    floors: dict[str, Callable[[], Any]] = {}
    chosen, candidates = "all_gather", {}
    if sharded:
        bare = bare_gathers([parts[g.index] for g in sharded], [g.flat_numel for g in sharded],
                            state_of(grads).storage.process_groups[sharded[0].index])
        chosen, candidates = cheapest(bare, timed, slowest, args.repeat)
        floors = {name: bare[name] for name in dict.fromkeys(("all_gather", chosen))}

    def measure(name: str, fn: Callable[[], Any], *, repeat: int, bytes_per_rank: float, baseline: str | None,
                note: str = "", memory: Callable[[Any], int] | None = None, beside_floors: bool = True) -> None:
        progress(f"stage {stage}: {name}")
        result = fn()  # warm-up (also calibrates strategy="auto" on gloo)
        with CommDebugMode() as mode, counting_p2p() as p2p:
            result = fn()
        counts = {str(k).split(".")[-1].strip("_") or str(k): v for k, v in mode.get_comm_counts().items()}
        if p2p.batches:
            counts["p2p batch"] = p2p.batches
        mem = memory(result) if memory is not None else new_bytes(result)
        del result
        own, floor_times = beside(fn, floors if beside_floors else {}, timed, repeat)
        flat = slowest(own + [t for ts in floor_times.values() for t in ts])
        times = flat[:repeat]
        floor_s = {k: statistics.median(flat[repeat * (i + 1):repeat * (i + 2)]) for i, k in enumerate(floor_times)}
        rows.append({
            "stage": stage, "row": name, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "repeat": repeat, "collectives": int(mode.get_total_counts()) + p2p.batches,
            "collective_ops": counts, "bytes_per_rank": float(bytes_per_rank), "memory_bytes": int(mem),
            "baseline": baseline, "note": note, "floors_beside_s": floor_s,
        })

    # DeepSpeed's per-parameter loops
    ds_get_bytes = 0.0
    for _, p in named:
        if stage == 3:
            ds_get_bytes += _ring_bytes("all_gather", 4.0 * p.partition_numel() * world, world)
        else:
            ds_get_bytes += _ring_bytes("all_reduce", 4.0 * p.numel(), world)
    measure("ds get loop", lambda: {n: safe_get_full_grad(p) for n, p in named},
            repeat=args.ds_repeat, bytes_per_rank=ds_get_bytes, baseline=None,
            note="fp32 per param" + (" all_gather" if stage == 3 else " all_reduce"), beside_floors=False)
    values = {n: safe_get_full_grad(p) for n, p in named}
    ds_values = {}
    for n, p in named:
        v = values[n]
        if stage == 3:  # DeepSpeed's stage-3 set narrows past the end unless the value is padded
            pad = p.partition_numel() * world - v.numel()
            v = torch.cat([v.reshape(-1), v.new_zeros(pad)]) if pad else v
        ds_values[n] = v

    def ds_set() -> None:
        for n, p in named:
            safe_set_full_grad(p, ds_values[n])

    measure("ds set loop", ds_set, repeat=args.ds_repeat, bytes_per_rank=0.0, baseline=None,
            note="0 comm", beside_floors=False)
    grads = zd.sharded_grads(engine)  # DeepSpeed's writes went to the same memory; the view is still current

    # zero_dtensor
    storage = state_of(grads).storage
    first = grads.layout.groups[0]
    mz.clear_calibration()  # each stage calibrates strategy="auto" for itself (gloo) ...
    grads.full_tensors()  # ... here, so that the label says what full_tensors() chose
    decided = sorted(set(mz.strategy_decisions().values()))  # one transfer: at most one decision
    auto = (decided[0] if decided else "all_gather") if first.placement.is_sharded else "none"
    measure(f"full_tensors [auto={auto}]", lambda: grads.full_tensors(), repeat=args.repeat,
            bytes_per_rank=_ring_bytes(auto, stored_bytes, world), baseline="ds get loop",
            note="stored dtype")

    def fresh() -> Any:
        mz.BUFFERS.recycle = False
        mz.release_workspace()
        try:
            return grads.full_tensors()
        finally:
            mz.BUFFERS.recycle = True

    measure("full_tensors [auto, fresh buffer]", fresh, repeat=args.repeat,
            bytes_per_rank=_ring_bytes(auto, stored_bytes, world), baseline="ds get loop",
            note="no recycling: allocates S every call (like a first call)")
    for strategy in ("all_gather", "all_to_all", "all_reduce", "send_recv"):
        measure(f"full_tensors {strategy}", lambda s=strategy: grads.full_tensors(strategy=s),
                repeat=args.repeat, bytes_per_rank=_ring_bytes(strategy, stored_bytes, world),
                baseline="ds get loop")
    state: dict[str, Any] = {"prev": grads.full_tensors()}
    measure("full_tensors out=prev", lambda: grads.full_tensors(out=state["prev"]), repeat=args.repeat,
            bytes_per_rank=_ring_bytes(auto, stored_bytes, world), baseline="ds get loop",
            note="reused memory", memory=lambda r: 0 if r is state["prev"] else new_bytes(r))
    state.clear()  # drop it, so that later rows find the recycled buffer free
    bucket = int(args.bucket_mb * 2**20)

    def stream() -> mz.AllocationRecorder:
        with mz.BUFFERS.observing(mz.AllocationRecorder()) as peak:  # the same recorder the tests use
            total = 0
            for _, t in grads.iter_full(bucket_bytes=bucket):
                total += t.numel()
                del t
        return peak

    stream_kind = mz.strategy.stream_strategy("auto", storage.process_groups[0], first.placement.param_order_gather,
                                              storage.partitions[0].device)
    measure(f"iter_full {args.bucket_mb:g}MiB [{stream_kind}]", stream, repeat=args.repeat,
            bytes_per_rank=_ring_bytes(stream_kind, stored_bytes, world), baseline="ds get loop",
            note="peak of live bucket buffers", memory=lambda peak: peak.peak)
    full = {n: t.clone() for n, t in grads.full_tensors(dtype=torch.float32).items()}
    measure("set_full_", lambda: grads.set_full_(full), repeat=args.repeat, bytes_per_rank=0.0,
            baseline="ds set loop", note="0 comm")
    if hasattr(grads, "clip_grad_norm_"):
        measure("clip_grad_norm_", lambda: grads.clip_grad_norm_(1e30), repeat=args.repeat,
                bytes_per_rank=8.0 * len(grads.layout.params), baseline="ds get+set loops",
                note="baseline: DS get loop + set loop")

    if getattr(args, "rows", "all") == "all":  # the redistribution rows, with their ratios
        from .redistribute import add_rows

        add_rows(grads, engine, measure, rows, args=args, stage=stage, full_row=f"full_tensors [auto={auto}]",
                 ring_bytes=_ring_bytes, device=device)

    # the bare primitives as rows of their own (not timed beside the floors: they are the floors)
    if sharded:
        pg = storage.process_groups[sharded[0].index]
        for kind in CANDIDATES:
            label = "floor: bare all_gather" if kind == "all_gather" else f"ref: bare {kind} gather"
            measure(label, bare[kind], repeat=args.repeat,
                    bytes_per_rank=_ring_bytes("all_gather", stored_bytes, world),
                    baseline=None, note=f"same bytes, no unpack; median when chosen {1e3 * candidates[kind]:.1f} ms",
                    memory=lambda _: 0, beside_floors=False)
        full_buf = torch.zeros(sum(g.flat_numel for g in sharded), dtype=parts[0].dtype, device=parts[0].device)
        measure("ref: bare all_reduce", lambda: dist.all_reduce(full_buf, group=pg),
                repeat=args.repeat, bytes_per_rank=_ring_bytes("all_reduce", stored_bytes, world), baseline=None,
                note="the zero-padded strategy's collective", memory=lambda _: 0, beside_floors=False)

    if getattr(args, "rows", "all") == "families":  # the masters and the optimizer state (takes a step)
        from .families import add_rows as add_family_rows

        add_family_rows(engine, measure, rows, args=args, ring_bytes=_ring_bytes, stage=stage)

    by = {r["row"]: r for r in rows}
    bare_rows = {kind: by.get("floor: bare all_gather" if kind == "all_gather" else f"ref: bare {kind} gather")
                 for kind in CANDIDATES}
    for r in rows:
        base = r.pop("baseline")
        if base == "ds get+set loops":
            ref = by["ds get loop"]["median_s"] + by["ds set loop"]["median_s"]
        else:
            ref = by[base]["median_s"] if base in by else None
        r["speedup_vs_deepspeed"] = (ref / r["median_s"]) if ref and r["median_s"] > 0 else None
        r["ratio_to_floor"] = _ratio(r, "all_gather", bare_rows)  # the bare all_gather timed beside it
        r["ratio_to_cheapest"] = _ratio(r, chosen, bare_rows)  # the cheapest bare primitive timed beside it
    meta = {"stage": stage, "params": numel, "tensors": len(named), "groups": len(grads.layout.groups),
            "stored_dtype": str(parts[0].dtype), "stored_bytes": stored_bytes, "optimizer": state_of(grads).storage.describe,
            "floor_primitive": chosen, "floor_candidates_s": candidates}
    del engine, grads
    return [{"meta": meta}] + rows


def _rank_main(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated all_gather_into_tensor calls
    rank = dist.get_rank()
    show = rank == 0 and not args.no_progress
    results: dict[str, Any] = {"stages": {}, "rows": []}
    progress_cm: Any = None
    if show:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress_cm = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                               console=Console(stderr=True), transient=True)
    steps_per_stage = 12
    start = time.perf_counter()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if progress_cm is not None:
        progress_cm.start()
        task = progress_cm.add_task("starting", total=steps_per_stage * len(args.stages))
    try:
        for stage in args.stages:
            def progress(msg: str) -> None:
                if progress_cm is not None:
                    progress_cm.update(task, description=msg, advance=1)

            out = _bench_stage(args, stage, progress)
            results["stages"][stage] = out[0]["meta"]
            results["rows"] += out[1:]
    finally:
        if progress_cm is not None:
            progress_cm.stop()
    results["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results["maxrss_start_bytes"] = rss0 * 1024
    results["elapsed_s"] = time.perf_counter() - start
    results["world_size"] = dist.get_world_size()
    results["backend"] = dist.get_backend()
    results["torch_threads"] = torch.get_num_threads()
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.tensors is not None:  # the tensor-count sweep
        return sweep_main(args, argv)
    results = run_ranks(_rank_main, args)
    if results is None:
        return 0
    results["command"] = " ".join(["python -m zero_dtensor.bench", *(sys.argv[1:] if argv is None else argv)])
    results["config"] = {"hidden": args.hidden, "layers": args.layers, "repeat": args.repeat,
                         "ds_repeat": args.ds_repeat, "dtype": args.dtype, "bucket_mb": args.bucket_mb}
    render(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
