"""The per-call benchmark's tables (:mod:`zero_dtensor.bench.cli`): one per stage, then the redistribution and
the families' tables. Rank 0 only; nothing here is timed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import fmt_bytes

__all__ = ["render"]


def render(results: dict[str, Any], args: argparse.Namespace | None = None, console: Any = None) -> None:
    """Print the results as rich tables (one per stage)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 150)
    for stage, meta in results["stages"].items():
        table = Table(
            title=escape(f"ZeRO-{stage} ({meta['optimizer']}), {results['world_size']} ranks on {results['backend']}: "
                   f"{meta['params'] / 1e6:.1f}M params, {meta['tensors']} tensors, {meta['stored_dtype']}, "
                   f"{fmt_bytes(meta['stored_bytes'])} flat; cheapest bare primitive: "
                   f"{meta.get('floor_primitive', 'all_gather')}"),
            title_justify="left",
        )
        for col, just in (("row", "left"), ("median ms", "right"), ("min ms", "right"), ("max ms", "right"),
                          ("collectives", "right"), ("bytes/rank", "right"), ("× DeepSpeed", "right"),
                          ("÷ floor", "right"), ("÷ cheapest", "right"), ("memory", "right")):
            table.add_column(col, justify=just)
        for r in results["rows"]:
            if r["stage"] != stage:
                continue
            ops = ", ".join(f"{v} {k}" for k, v in r["collective_ops"].items())
            table.add_row(
                escape(r["row"]), f"{1e3 * r['median_s']:.1f}", f"{1e3 * r['min_s']:.1f}", f"{1e3 * r['max_s']:.1f}",
                f"{r['collectives']}" + (f" {ops.split(' ', 1)[1]}" if ops and len(r["collective_ops"]) == 1 else ""),
                fmt_bytes(r["bytes_per_rank"]),
                f"{r['speedup_vs_deepspeed']:.2f}" if r["speedup_vs_deepspeed"] else "-",
                f"{r['ratio_to_floor']:.2f}" if r["ratio_to_floor"] else "-",
                f"{r['ratio_to_cheapest']:.2f}" if r.get("ratio_to_cheapest") else "-",
                fmt_bytes(r["memory_bytes"]),
            )
        console.print(table)
    from .redistribute import render as render_redistribution

    render_redistribution(results, console)
    from .families import render as render_families

    render_families(results, console)
    console.print(
        "[dim]Times: slowest rank per repetition, median/min/max over --repeat runs after one warm-up. collectives: "
        "counted with CommDebugMode in a separate untimed run. bytes/rank: ring-model estimate (all_gather (N-1)/N·S,"
        " all_reduce 2(N-1)/N·S). × DeepSpeed: DeepSpeed loop median / row median (set_full_ vs the set loop, clip vs "
        "get+set loops). ÷ floor: row median / median of a bare all_gather_into_tensor of the same partitions timed "
        "beside it (one before each repetition); ÷ cheapest: the same against the cheapest bare primitive of the "
        "run (all_gather_into_tensor, all_to_all_single or batched isend/irecv; named in the title). memory: bytes of new tensors held by the "
        "result (storages other than DeepSpeed's), for iter_full the peak of its live bucket buffers; allocations "
        f"inside torch/the backend are not seen. Process max RSS (rank 0): {fmt_bytes(results['maxrss_bytes'])}. "
        "CPU timings on a shared machine are noisy.[/dim]"
    )
