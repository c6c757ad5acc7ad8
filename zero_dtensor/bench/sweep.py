"""Tensor-count sweep of ``python -m zero_dtensor.bench --tensors 200,2000,10000``: does a bulk call cost more
when the same kind of model has more tensors?

For each ``K`` a model of ``K`` tensors is built from ``Linear(32, 32)`` layers (``K/2`` layers, weight and bias;
2,000 tensors are 1.06M parameters), wrapped in a DeepSpeed engine per stage (``--stages``, fp32 unless
``--dtype bf16``) and timed on ``--nproc`` gloo ranks (or in place under ``torchrun``), one row per call:

- ``full_tensors()``, ``full_tensors(out=prev)``, ``set_full_``, ``clip_grad_norm_``, ``norms``, ``global_norm``,
  ``stats()``;
- ``first sharded_grads`` of a step: a step and a fresh backward before each repetition; only the
  ``zd.sharded_grads(engine)`` call is timed;
- ``ref: bare all_to_all gather`` / ``ref: bare send_recv gather``: what ``strategy="all_to_all"`` /
  ``"send_recv"`` send, bare (:mod:`zero_dtensor.bench.floors`), for a floor of the strategy gloo's ``auto`` picks;
- the floor: one bare ``all_gather_into_tensor`` of the padded flat partitions (copies of them) into a preallocated
  buffer.

Every row: one warm-up, then ``--repeat`` repetitions of the call, each right after one repetition of the floor
(:func:`~zero_dtensor.bench.floors.beside`; as a training loop makes the call, on gradients or values it has just
computed), each starting at a barrier; a repetition's time is the slowest rank's; the row's time is the median.
``÷ floor`` is that median over the median of the floor repetitions timed beside it (a shared machine's speed
drifts within a run: a floor measured once, minutes away from a row, moved ratios by 2x), ``µs/tensor`` is
``(t - floor) / K``: the cost per tensor above the wire time; the floor row shows every floor repetition of the
run. Collectives are counted in one untimed call under
``CommDebugMode``. The layers are applied side by side (``sum(layer(x))``), not stacked, so that every gradient
is of the same magnitude (no vanishing into denormals, which would slow the CPU arithmetic of deep layers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from .common import engine_config, fmt_bytes, run_ranks, timed_call
from .floors import bare_gathers, beside

__all__ = ["ROWS", "main", "sweep_model"]

#: the timed rows, in table order (the floor last)
ROWS = (
    "full_tensors()",
    "full_tensors(out=prev)",
    "set_full_",
    "clip_grad_norm_",
    "norms",
    "global_norm",
    "stats()",
    "first sharded_grads",
    "ref: bare all_to_all gather",
    "ref: bare send_recv gather",
    "floor: bare all_gather",
)
FLOOR = ROWS[-1]


def sweep_model(tensors: int, width: int = 32) -> Any:
    """A model of ``tensors`` tensors: ``tensors // 2`` ``Linear(width, width)`` layers."""
    import torch
    from torch import nn

    class SweepModel(nn.Module):
        """``tensors // 2`` ``Linear(width, width)`` layers applied side by side to the same input."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(max(tensors // 2, 1)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layers[0](x)
            for layer in self.layers[1:]:
                out = out + layer(x)
            return out

    return SweepModel()



def _sweep_stage(args: argparse.Namespace, stage: int, tensors: int, progress: Callable[[str], None]
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import zero_dtensor as zd
    from zero_dtensor.comm.point_to_point import counting_p2p

    rank = dist.get_rank()
    use_cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = sweep_model(tensors, args.sweep_width)

    config = engine_config(stage, args.dtype, lr=1e-6)
    progress(f"ZeRO-{stage}, {tensors} tensors: building the engine")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(2, args.sweep_width, generator=torch.Generator().manual_seed(rank)).to(device=engine.device,
                                                                                         dtype=dtype)

    def backward() -> None:
        engine.backward(engine(x).float().pow(2).mean())

    rows: list[dict[str, Any]] = []
    all_floors: list[float] = []

    def slowest(times: list[float]) -> list[float]:
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a repetition takes as long as its slowest rank
        return t.cpu().tolist()

    def record(name: str, times: list[float], floors: list[float], collectives: int) -> None:
        times = slowest(times)
        row = {"stage": stage, "tensors": tensors, "row": name, "median_s": statistics.median(times),
               "min_s": min(times), "max_s": max(times), "repeat": len(times), "collectives": collectives}
        if floors:
            floors = slowest(floors)
            all_floors.extend(floors)
            row["floor_median_s"] = statistics.median(floors)
        rows.append(row)

    def timed(fn: Callable[[], Any]) -> float:
        return timed_call(fn, device)

    # the floor: one bare all_gather of the same bytes into preallocated buffers. Its inputs are copies of the
    # partitions: holding the partitions themselves would keep the adapter's kept buffers busy.
    backward()
    zd.materialize.clear_calibration()  # each stage calibrates strategy="auto" for itself (gloo)
    grads = zd.sharded_grads(engine)  # also builds the layout (once per engine)
    parts = grads.local_partitions
    sharded = [g for g in grads.layout.groups if g.placement.is_sharded]
    meta = {"stage": stage, "tensors": tensors, "model_tensors": len(grads.layout.params),
            "layers": len(model.layers), "params": sum(p.numel for p in grads.layout.params),
            "groups": len(grads.layout.groups), "stored_dtype": str(parts[0].dtype),
            "stored_bytes": sum(g.flat_numel * parts[g.index].element_size() for g in sharded),
            "optimizer": type(engine.optimizer).__name__}
    floor: Callable[[], Any] | None = None
    bare: dict[str, Callable[[], Any]] = {}
    if sharded:  # copies of the partitions (bench.floors): one coalesced all_gather is what full_tensors() issues
        bare = bare_gathers([parts[g.index] for g in sharded], [g.flat_numel for g in sharded],
                            grads.groups[sharded[0].index].device_mesh.get_group())
        floor = bare["all_gather"]
    del grads, parts

    def repetitions(fn: Callable[[], Any], before: Callable[[], Any] | None = None
                    ) -> tuple[list[float], list[float]]:
        """``--repeat`` timed calls of ``fn``, each right after one timed floor and after ``before()`` (untimed);
        without ``before``, one untimed call of ``fn`` first (a warm-up)."""
        if before is None:
            fn()
        times, floors = beside(fn, {"floor": floor} if floor is not None else {}, timed, args.repeat, before)
        return times, floors.get("floor", [])

    # the first sharded_grads of a step: a step and a fresh backward (untimed) before every repetition
    progress(f"ZeRO-{stage}, {tensors} tensors: first sharded_grads")

    def next_step() -> None:
        engine.step()
        backward()

    next_step()
    zd.sharded_grads(engine)  # warm-up: the first call after a step that followed the layout's build
    firsts, first_floors = repetitions(lambda: zd.sharded_grads(engine), next_step)
    next_step()
    with CommDebugMode() as mode:
        grads = zd.sharded_grads(engine)
    first_comms = int(mode.get_total_counts())

    def measure(name: str, fn: Callable[[], Any]) -> None:
        progress(f"ZeRO-{stage}, {tensors} tensors: {name}")
        fn()  # the first call also calibrates strategy="auto" on gloo: not counted
        with CommDebugMode() as comm, counting_p2p() as p2p:
            fn()
        record(name, *repetitions(fn), int(comm.get_total_counts()) + p2p.batches)

    measure("full_tensors()", lambda: grads.full_tensors())
    state: dict[str, Any] = {"prev": grads.full_tensors()}
    measure("full_tensors(out=prev)", lambda: grads.full_tensors(out=state["prev"]))
    state.clear()  # drop it, so that later rows find the recycled buffer free
    full = {n: t.clone() for n, t in grads.full_tensors().items()}  # writing them back changes nothing
    measure("set_full_", lambda: grads.set_full_(full))
    del full
    measure("clip_grad_norm_", lambda: grads.clip_grad_norm_(1e30))  # a coefficient of 1: values unchanged
    measure("norms", lambda: grads.norms())
    measure("global_norm", lambda: grads.global_norm())
    measure("stats()", lambda: grads.stats())
    record("first sharded_grads", firsts, first_floors, first_comms)
    for kind in ("all_to_all", "send_recv"):  # what strategy="all_to_all" / "send_recv" send, bare
        if kind in bare:
            measure(f"ref: bare {kind} gather", bare[kind])
    meta["auto_strategy"] = ", ".join(sorted(set(zd.materialize.strategy_decisions().values()))) or "all_gather"
    if floor is not None:  # every floor repetition of this run, interleaved with the rows'
        with CommDebugMode() as comm:
            floor()
        floor_comms = int(comm.get_total_counts())
        rows.append({"stage": stage, "tensors": tensors, "row": FLOOR, "median_s": statistics.median(all_floors),
                     "min_s": min(all_floors), "max_s": max(all_floors), "repeat": len(all_floors),
                     "collectives": floor_comms, "floor_median_s": statistics.median(all_floors)})
    n_tensors = meta["model_tensors"]  # K rounded down to even: K // 2 layers
    for r in rows:
        own = r.get("floor_median_s")
        r["ratio_to_floor"] = r["median_s"] / own if own else None
        r["us_per_tensor_above_floor"] = 1e6 * (r["median_s"] - own) / n_tensors if own is not None else None
    del engine, grads
    return meta, rows


def _rank_main(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's deprecated all_gather_into_tensor calls
    show = dist.get_rank() == 0 and not args.no_progress
    start = time.perf_counter()

    def progress(msg: str) -> None:
        if show:
            print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {"runs": [], "rows": []}
    for stage in args.stages:
        for tensors in args.tensors:
            meta, rows = _sweep_stage(args, stage, tensors, progress)
            results["runs"].append(meta)
            results["rows"] += rows
    results["elapsed_s"] = time.perf_counter() - start
    results["world_size"] = dist.get_world_size()
    results["backend"] = dist.get_backend()
    results["torch_threads"] = torch.get_num_threads()
    return results


def render(results: dict[str, Any], console: Any = None) -> None:
    """One rich table per stage: a row per call, for each ``K`` the median ms, ÷ floor and µs per tensor."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    stages = sorted({m["stage"] for m in results["runs"]})
    for stage in stages:
        runs = [m for m in results["runs"] if m["stage"] == stage]
        sizes = ", ".join(f"K={m['tensors']}: {m['params'] / 1e6:.2f}M params, {fmt_bytes(m['stored_bytes'])}"
                          for m in runs)
        table = Table(title=escape(f"ZeRO-{stage} ({runs[0]['optimizer']}), {results['world_size']} ranks on "
                                   f"{results['backend']}, {runs[0]['stored_dtype']} ({sizes}); "
                                   f"strategy=\"auto\" chose {runs[0].get('auto_strategy', '?')}"),
                      title_justify="left")
        table.add_column("row")
        for m in runs:
            k = m["tensors"]
            table.add_column(f"K={k} ms", justify="right")
            table.add_column("÷ floor", justify="right")
            table.add_column("µs/tensor", justify="right")
        by = {(r["tensors"], r["row"]): r for r in results["rows"] if r["stage"] == stage}
        for name in ROWS:
            cells = [escape(name)]
            for m in runs:
                r = by.get((m["tensors"], name))
                if r is None:
                    cells += ["-", "-", "-"]
                    continue
                cells.append(f"{1e3 * r['median_s']:.2f}")
                cells.append(f"{r['ratio_to_floor']:.2f}" if r["ratio_to_floor"] is not None else "-")
                us = r["us_per_tensor_above_floor"]
                cells.append("-" if us is None or name == FLOOR else f"{us:.2f}")
            table.add_row(*cells)
        console.print(table)
    console.print(
        "[dim]Median over --repeat repetitions (after one warm-up) of the slowest rank. ÷ floor: row median / median "
        "of a bare all_gather_into_tensor of the same padded flat partitions, timed before each repetition of the row. "
        "µs/tensor: (row - its floor) / K. "
        "first sharded_grads: a fresh backward before every repetition, only the call timed. CPU timings on a "
        "shared machine are noisy.[/dim]"
    )


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the sweep (``args`` from ``zero_dtensor.bench.cli._parse``): on ``--nproc`` fresh gloo ranks, or in place
    when ``RANK`` and ``WORLD_SIZE`` are set (torchrun), like ``zero_dtensor.bench``."""
    if not hasattr(args, "sweep_width"):
        args.sweep_width = 8 if args.tiny else 32

    results = run_ranks(_rank_main, args)
    if results is None:
        return 0
    results["command"] = " ".join(["python -m zero_dtensor.bench", *(sys.argv[1:] if argv is None else argv)])
    results["config"] = {"tensors": list(args.tensors), "stages": list(args.stages), "width": args.sweep_width,
                         "repeat": args.repeat, "dtype": args.dtype}
    render(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0
