"""What checking every tensor entry's CRC-32 costs ``zero_dtensor.checkpoint.load`` (CPU, gloo ranks, one process
per rank): an interleaved A/B in one process. A is the load with the checks patched out (what the load did before
them: deferred entries are not read in the first pass, nothing is CRC-ed, no descriptor is read); B is the load as
it is. Each round runs both, in an order that alternates from round to round, each timed from a barrier to a
barrier after an untimed ``os.sync()`` and barrier, with rank 0's CPU time (user + system, all its threads) over
the load alone (less noisy than wall time on a shared machine). The checkpoint is read from the page cache (it was
just written), so the figures are the CPU cost of the checks, not disk time. Prints rank 0's medians and spreads,
and B / A of the medians (wall and CPU). Example (about 20 s on 2 shared cores)::

    python benchmarks/checkpoint_crc_cost.py --nproc 2 --stage 2 --hidden 256 --layers 4 --repeat 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
from checkpoint_io import _engine  # noqa: E402

from zero_dtensor.bench.model import count  # noqa: E402
from zero_dtensor.checkpoint import load, reader, save  # noqa: E402
from zero_dtensor.launch import launch  # noqa: E402


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """The reader without its CRC-32 checks (the load before them)."""
    read_to = reader._read_to
    with mock.patch.object(reader.DirectReader, "_check_record", lambda *a: None), \
            mock.patch.object(reader.DirectReader, "_recorded", lambda *a: 0), \
            mock.patch.object(reader, "_check_loaded", lambda *a: None), \
            mock.patch.object(reader, "compare", lambda *a, **k: None), \
            mock.patch.object(reader, "_read_to", lambda s, t, i, crc=False: read_to(s, t, i)):
        yield


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """``fn``'s seconds from a barrier to a barrier after it, and this process's CPU seconds in ``fn`` (after an
    untimed ``os.sync()``)."""
    os.sync()
    dist.barrier()
    start, cpu = time.perf_counter(), _cpu()
    fn()
    cpu = _cpu() - cpu
    dist.barrier()
    return time.perf_counter() - start, cpu


def _summary(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 4), "spread": [round(min(values), 4), round(max(values), 4)]}


def ab(hidden: int, layers: int, stage: int, root: str, repeat: int, threads: int | None) -> dict[str, Any]:
    if threads is not None:  # 0: every record CRC-ed inline
        reader._THREADS = threads or 1
        reader._THREADED = reader._THREADED if threads else 1 << 62
    engine = _engine(hidden, layers, stage)
    path = os.path.join(root, "ckpt")
    save(engine, path)
    names = ("A: unchecked", "B: CRC-32 checked")
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in (names if r % 2 == 0 else names[::-1]):
            context = unchecked() if name.startswith("A") else contextlib.nullcontext()
            with context:
                seconds, cpu_seconds = _timed(lambda: load(engine, path))
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
    rows: dict[str, Any] = {name: {"wall_s": _summary(wall[name]), "cpu_s": _summary(cpu[name])} for name in names}
    rows["B / A (medians)"] = {kind: round(statistics.median(d[names[1]]) / statistics.median(d[names[0]]), 3)
                               for kind, d in (("wall", wall), ("cpu", cpu))}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None,
                        help="the reader's CRC-32 threads (default: its own, min(4, CPUs); 0: every record inline)")
    parser.add_argument("--dir", default="/tmp/zd-crc-bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    params, tensors = count(args.hidden, args.layers)
    report = {"params": params, "tensors": tensors, "nproc": args.nproc, "stage": args.stage, "repeat": args.repeat,
              "threads": args.threads, "load_average": os.getloadavg(),
              "rank 0": launch(ab, args.hidden, args.layers, args.stage, args.dir, args.repeat, args.threads,
                               nprocs=args.nproc, timeout=600)}
    print(json.dumps(report))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
