"""Checkpoint rows: ``zd.save`` / ``zd.load`` against DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` of the
same engine, each once, to a fresh directory that is removed afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

from .measure import Timer
from .world import barrier, rank, shared_dir

ASSUMED_BYTES_PER_S = 0.5e9  # for the budget, before anything was written: a slow disk


def _bytes_in(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def time_checkpoints(engine: Any, timer: Timer, root: str | None, progress: Callable[[str], None]
                     ) -> list[dict[str, Any]]:
    """Four rows: ``zd.save`` (``sync_files=False``, as DeepSpeed's ``torch.save`` does not fsync either),
    ``zd.load``, ``ds save_checkpoint``, ``ds load_checkpoint``, with the bytes each checkpoint holds. The loads
    read what was just written (the file cache is warm)."""
    import zero_dtensor as zd

    progress(f"timing ZeRO-{timer.stage}: checkpoints")
    master = zd.sharded_master_params(engine)
    state_bytes = 3 * 4 * sum(p.numel for p in master.layout.params)  # masters + exp_avg + exp_avg_sq, fp32
    rows: list[dict[str, Any]] = []
    written = ds_written = 0
    base = shared_dir("gpu_check_ckpt_", root)  # one directory every rank writes into
    try:
        ours, theirs = os.path.join(base, "zd"), os.path.join(base, "ds")
        estimate = state_bytes / ASSUMED_BYTES_PER_S
        rows.append(timer.once("zd.save (no fsync)", lambda: zd.save(engine, ours, sync_files=False), estimate))
        written = _bytes_in(ours) if os.path.isdir(ours) else 0
        if written:
            rows.append(timer.once("zd.load", lambda: zd.load(engine, ours), estimate))
        barrier()
        if rank() == 0:
            shutil.rmtree(ours, ignore_errors=True)
        with contextlib.redirect_stdout(sys.stderr):
            rows.append(timer.once("ds save_checkpoint", lambda: engine.save_checkpoint(theirs, tag="t"), estimate))
            ds_written = _bytes_in(theirs) if os.path.isdir(theirs) else 0
            if ds_written:
                rows.append(timer.once("ds load_checkpoint", lambda: engine.load_checkpoint(theirs, tag="t"),
                                       estimate))
    finally:
        barrier()
        if rank() == 0:
            shutil.rmtree(base, ignore_errors=True)
    by = {r["row"]: r for r in rows}
    for mine, ds in (("zd.save (no fsync)", "ds save_checkpoint"), ("zd.load", "ds load_checkpoint")):
        if "median_ms" in by.get(mine, {}) and "median_ms" in by.get(ds, {}):
            by[mine]["speedup_vs_deepspeed"] = by[ds]["median_ms"] / by[mine]["median_ms"]
    for r in rows:
        r["bytes_on_disk"] = written if r["row"].startswith("zd") else ds_written
    return rows
