"""The rich table on stdout: check results (stages as columns), then timings with their ratio to the floor, the
checkpoint rows, and one line per failure, rank death or budget skip."""

from __future__ import annotations

from typing import Any

from .budget import SKIPPED
from .cases import DTYPES, STAGES, VARIANTS

STATUS_CELL = {"passed": "[green]pass[/green]", "not run": "[yellow]not run[/yellow]",
               "skipped": "[yellow]skipped: budget[/yellow]"}


def fmt_bytes(n: float | None) -> str:
    from zero_dtensor.bench.common import fmt_bytes as fmt

    return "n/a" if n is None else fmt(n)


def check_cell(c: dict[str, Any] | None) -> str:
    from rich.markup import escape

    if c is None:
        return "[dim]-[/dim]"
    if c["status"] in STATUS_CELL:
        return STATUS_CELL[c["status"]]
    bad = (["error"] if c["reason"] else []) + [k for k, v in c["checks"].items()
                                                 if not v.get("passed") and v.get("error") != "not reached"]
    return f"[red]FAIL {escape(','.join(bad))}[/red]"


def timing_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "[red]error[/red]"
    if str(r.get("status", "")).startswith("skipped"):  # the budget, or why the row cannot run here
        return f"[yellow]{SKIPPED if r['status'] == SKIPPED else 'skipped'}[/yellow]"
    text = f"{r['median_ms']:.2f} ms"
    if r.get("ratio") is not None:
        text += f" [bold]{r['ratio']:.2f}x[/bold] floor"
    if r.get("comm_ratio") is not None:
        text += f" {r['comm_ratio']:.2f}x coll"
    if r.get("speedup_vs_deepspeed"):
        text += f" {r['speedup_vs_deepspeed']:.1f}x DS"
    return text + f" · {fmt_bytes(r.get('peak_bytes'))}"


def _timing_section(table: Any, label: str, rows: list[dict[str, Any]]) -> None:
    from rich.markup import escape

    names = list(dict.fromkeys(r["row"] for r in rows))
    by_row = {(r["row"], r["stage"]): r for r in rows}
    for i, row in enumerate(names):
        table.add_row(label if i == 0 else "", escape(row), *[timing_cell(by_row.get((row, s))) for s in STAGES])


def _comm_floor_section(table: Any, model: dict[str, Any]) -> None:
    """The bare collectives timed in the same run: median ms and bus bandwidth, per stage."""
    from rich.markup import escape

    per_stage = {s: (model.get(f"zero{s}") or {}).get("comm_floors") or {} for s in STAGES}
    names = list(dict.fromkeys(n for floors in per_stage.values() for n in floors))
    for i, name in enumerate(names):
        cells = []
        for s in STAGES:
            f = per_stage[s].get(name)
            cells.append("-" if not f or f.get("median_ms") is None else
                         f"{f['median_ms']:.2f} ms · {fmt_bytes(f['bytes'])} · bus {f['busbw_GBps']:.1f} GB/s")
        table.add_row("collective floors" if i == 0 else "", escape(name), *cells)


def render(results: dict[str, Any], console: Any) -> None:
    """One table: a section of check results, a section of timings (stages as columns), the checkpoint rows."""
    from rich.markup import escape
    from rich.table import Table

    env = results["environment"]
    world = results.get("world_size", 1)
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    forced = ", forced collectives" if results.get("forced_collectives") else ""
    table = Table(title=escape(f"gpu_check on {env['device_name']} ({env['device_type']}, {ranks}, "
                               f"{results.get('backend', env.get('backend_world_1'))}{forced}): torch {env['torch']}, "
                               f"DeepSpeed {env['deepspeed']}"), title_justify="left")
    table.add_column("part")
    table.add_column("case / call")
    for stage in STAGES:
        table.add_column(f"ZeRO-{stage}", justify="right")
    by_case = {(c["world"], c["stage"], c["dtype"], c["variant"]): c for c in results["checks"]}
    for world in sorted({c["world"] for c in results["checks"]}):
        for dtype in DTYPES:
            for variant in VARIANTS:
                cells = [check_cell(by_case.get((world, stage, dtype, variant))) for stage in STAGES]
                if any(cell != "[dim]-[/dim]" for cell in cells):
                    table.add_row(f"checks, {world} rank{'s' if world > 1 else ''}", f"{dtype}, {variant}", *cells)
    if results["timings"]:
        table.add_section()
        model = results["timing_model"]
        _timing_section(table, f"timing, {ranks}, {model['params'] / 1e6:.1f}M bf16 / {model['tensors']} tensors",
                        results["timings"])
        _comm_floor_section(table, model)
    if results.get("checkpoint_timings"):
        table.add_section()
        _timing_section(table, f"checkpoints, {ranks}", results["checkpoint_timings"])
    console.print(table)
    s = results["summary"]
    console.print(f"checks: {s['passed']} passed, {s['failed']} failed, {s['not_run']} not run, {s['skipped']} "
                  f"skipped (budget)" + (f"; timing errors: {s['timing_errors']}" if s["timing_errors"] else "")
                  + f"; {s['elapsed_s']:.0f} s")
    console.print("[dim]timing cells: median ms over the repetitions, its ratio to the floor timed in the same run "
                  "(a flat torch op on the same bytes: see the JSON's floor), speed-up over DeepSpeed's loop (clip: "
                  "over its get + set loops), peak extra CUDA memory of a call after the first (n/a on CPU); the "
                  "JSON also has min/max, the first call, the floors and collectives counted with "
                  "CommDebugMode.[/dim]")
    _failures(results, console)


def _failures(results: dict[str, Any], console: Any) -> None:
    from rich.markup import escape

    for c in results["checks"]:
        if c["status"] not in ("passed", "skipped"):
            details = [f"{k}: {v['error']}" for k, v in c["checks"].items() if not v.get("passed")]
            text = "; ".join(([c["reason"]] if c["reason"] else []) + details)
            console.print(f"[{'yellow' if c['status'] == 'not run' else 'red'}]{c['case']} {c['status']}[/]: "
                          f"{escape(text)}")
    multi = results.get("multi_rank") or {}
    for op, err in (multi.get("kill_the_process") or {}).items():
        console.print(f"[yellow]probe: {escape(op)} on gloo over {multi.get('tensors')} tensors {escape(err)}[/]")
    for r in results["timings"] + results.get("checkpoint_timings", []):
        if "error" in r:
            console.print(f"[red]timing ZeRO-{r['stage']} {escape(r['row'])} failed[/red]: {escape(r['error'])}")
    reasons = sorted({f"{r['row']}: {r['status']}" for r in results["timings"]
                      if str(r.get("status", "")).startswith("skipped") and r["status"] != SKIPPED})
    for reason in reasons:
        console.print(f"[yellow]{escape(reason)}[/yellow]")
    skipped = results["summary"].get("skipped_parts") or []
    if skipped:
        console.print(f"[yellow]{SKIPPED}[/yellow]: {escape(', '.join(skipped))}")
