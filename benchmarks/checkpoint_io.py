"""Time ``zero_dtensor.checkpoint.save`` / ``load`` against DeepSpeed's checkpoints (CPU, gloo ranks).

Same world size (``--nproc N``): ``zd.save`` (DCP's default ``fsync`` per file, and ``sync_files=False``, which
is what ``torch.save`` in DeepSpeed's ``save_checkpoint`` does), the blocking part of ``zd.save(async_=True)``,
``zd.load``, ``engine.save_checkpoint``, ``engine.load_checkpoint``, interleaved in each of ``--repeat`` rounds: the
four saves, then the two loads, each in an order that rotates from round to round (every row at every place, after
every other row: the first round writes new files and is slower for every row).

Resume at another world size (``--resume-at M``): the checkpoints written at N ranks are resumed at M ranks, by
``zd.load`` and by DeepSpeed's route, ``python -m deepspeed.checkpoint.ds_to_universal`` (a separate process, timed
from its start; ``--inject_missing_state`` for ZeRO-1/2 engines, which lack the Megatron info it wants) followed by
``load_checkpoint`` with ``"checkpoint": {"load_universal": true}``.

First load in a fresh process (``--fresh``): how a job resumes. A new process group builds the engine and loads
once (``zd.load`` or ``load_checkpoint``, alternating, ``--repeat`` launches of each): the loads above, repeated in
one process, reuse the memory earlier calls freed, which a resuming job does not have.

Every timed call starts after ``os.sync()`` (untimed): the earlier rows' written data is on disk, so an fsync
waits for the call's own data only. Per row: the median and the spread (min-max) of the rounds in seconds, the bytes the checkpoint takes on disk, and
the peak extra resident memory of rank 0 during the call (RSS sampled every 2 ms, minus the RSS before it; for the
conversion: the largest peak RSS of its processes, absolute). Example, the benchmark model at 4 ranks::

    python benchmarks/checkpoint_io.py --nproc 4 --stage 3 --resume-at 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import deepspeed
import psutil
import torch
import torch.distributed as dist

from zero_dtensor.bench.model import TransformerLike, count
from zero_dtensor.checkpoint import load, save
from zero_dtensor.launch import launch


def _engine(hidden: int, layers: int, stage: int, universal: bool = False) -> Any:
    torch.manual_seed(0)
    model = TransformerLike(hidden, layers)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, 8, hidden).to(torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return engine


def fingerprint(engine: Any) -> list[float]:
    """Per parameter the 2-norms of the fp32 master and of Adam's two moments, and the optimizer steps (collective):
    fingerprints equal to 1e-5 relative (norms summed in another order at another world size) after a load say it
    restored the saved values."""
    import zero_dtensor as zd

    vectors = [zd.sharded_master_params(engine).norms().vector]
    vectors += [zd.sharded_optimizer_state(engine, k).norms().vector for k in ("exp_avg", "exp_avg_sq")]
    steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
    return torch.cat(vectors).tolist() + sorted(steps)


class _PeakRSS:
    """Peak resident memory of this process above its value at entry, sampled by a thread."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.extra = 0

    def __enter__(self) -> _PeakRSS:
        self._start = self._proc.memory_info().rss
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        self.extra = self._peak - self._start


def _timed(fn: Callable[[], Any]) -> tuple[float, int]:
    """``fn``'s seconds from a barrier to a barrier after it, and rank 0's peak extra RSS. The page cache is flushed
    first (``os.sync``, untimed), so a call that fsyncs does not also wait for the earlier rows' data."""
    os.sync()
    dist.barrier()
    with _PeakRSS() as peak:
        start = time.perf_counter()
        fn()
        dist.barrier()
        elapsed = time.perf_counter() - start
    return elapsed, peak.extra


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _row(times: list[float], extra: list[int], path: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"median_s": round(statistics.median(times), 3),
                           "spread_s": [round(min(times), 3), round(max(times), 3)],
                           "peak_extra_rss_MB": round(max(extra) / 2**20, 1)}
    if path is not None:
        row["bytes"] = _du(path)
    return row


def same_world(hidden: int, layers: int, stage: int, root: str, repeat: int) -> dict[str, Any]:
    engine = _engine(hidden, layers, stage)
    names = ("zd.save", "zd.save(sync_files=False)", "zd.save(async_=True), blocking part", "zd.load",
             "ds.save_checkpoint", "ds.load_checkpoint")
    times: dict[str, list[float]] = {k: [] for k in names}
    extra: dict[str, list[int]] = {k: [] for k in names}
    paths = {"zd.save": os.path.join(root, "zd"), "ds.save_checkpoint": os.path.join(root, "ds")}

    def record(name: str, fn: Callable[[], Any]) -> None:
        t, e = _timed(fn)
        times[name].append(t)
        extra[name].append(e)

    futures: list[Any] = []

    def save_async() -> None:
        futures.append(save(engine, paths["zd.save"] + "-async", async_=True))

    saves: dict[str, Callable[[], Any]] = {
        "zd.save": lambda: save(engine, paths["zd.save"]),
        "zd.save(sync_files=False)": lambda: save(engine, paths["zd.save"] + "-nosync", sync_files=False),
        "zd.save(async_=True), blocking part": save_async,
        "ds.save_checkpoint": lambda: engine.save_checkpoint(paths["ds.save_checkpoint"], tag="t")}
    loads: dict[str, Callable[[], Any]] = {
        "zd.load": lambda: load(engine, paths["zd.save"]),
        "ds.load_checkpoint": lambda: engine.load_checkpoint(paths["ds.save_checkpoint"], tag="t")}
    for r in range(repeat):
        for name in _rotated(list(saves), r):
            record(name, saves[name])
            while futures:
                futures.pop().result()
        for name in _rotated(list(loads), r):
            record(name, loads[name])
    return {k: _row(times[k], extra[k], paths.get(k)) for k in names}


def _rotated(names: list[str], r: int) -> list[str]:
    """``names`` started at its ``r``-th (round ``r`` of a benchmark): every row runs at every place in the order,
    after every other row, as often as the rounds allow."""
    k = r % len(names)
    return names[k:] + names[:k]


def write_both(hidden: int, layers: int, stage: int, root: str) -> None:
    """At N ranks: one zd checkpoint and one DeepSpeed checkpoint of the same engine."""
    engine = _engine(hidden, layers, stage)
    save(engine, os.path.join(root, "zd"), sync_files=False)
    engine.save_checkpoint(os.path.join(root, "ds"), tag="t")
    if dist.get_rank() == 0:
        torch.save(fingerprint(engine), os.path.join(root, "fingerprint.pt"))
    else:
        fingerprint(engine)


def resume(hidden: int, layers: int, stage: int, root: str, repeat: int) -> dict[str, Any]:
    """At M ranks: ``zd.load`` of the zd checkpoint and ``load_checkpoint`` of the universal one, interleaved."""
    engine = _engine(hidden, layers, stage, universal=True)
    calls: dict[str, Callable[[], Any]] = {
        "zd.load": lambda: load(engine, os.path.join(root, "zd")),
        "ds.load_checkpoint(load_universal=True)": lambda: engine.load_checkpoint(os.path.join(root, "ds"),
                                                                                  tag="t_uni")}
    times: dict[str, list[float]] = {k: [] for k in calls}
    extra: dict[str, list[int]] = {k: [] for k in calls}
    saved = torch.load(os.path.join(root, "fingerprint.pt"))
    exact: dict[str, bool] = {}
    for _ in range(repeat):
        for name, fn in calls.items():
            t, e = _timed(fn)
            times[name].append(t)
            extra[name].append(e)
            got = fingerprint(engine)
            exact[name] = exact.get(name, True) and len(got) == len(saved) and max(
                abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, saved)) < 1e-5  # every round
    return {k: {**_row(times[k], extra[k]), "restored the saved values": exact[k]} for k in calls}


def first_load(hidden: int, layers: int, stage: int, root: str, which: str) -> dict[str, Any]:
    """The first load of a freshly built engine in a new process (how a job resumes): ``zd.load`` of ``root/zd``
    or ``load_checkpoint`` of ``root/ds``; rank 0's time and peak extra RSS."""
    engine = _engine(hidden, layers, stage)
    if which == "zd":
        elapsed, extra = _timed(lambda: load(engine, os.path.join(root, "zd")))
    else:
        elapsed, extra = _timed(lambda: engine.load_checkpoint(os.path.join(root, "ds"), tag="t"))
    return {"s": elapsed, "extra": extra}


def fresh_loads(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` first loads in fresh processes of each kind, alternating (one launch each)."""
    root = os.path.join(args.dir, "fresh")
    os.makedirs(root)
    launch(write_both, args.hidden, args.layers, args.stage, root, nprocs=args.nproc, timeout=3600)
    runs: dict[str, list[dict[str, Any]]] = {"zd.load": [], "ds.load_checkpoint": []}
    for _ in range(args.repeat):
        for which, name in (("zd", "zd.load"), ("ds", "ds.load_checkpoint")):
            runs[name].append(launch(first_load, args.hidden, args.layers, args.stage, root, which,
                                     nprocs=args.nproc, timeout=3600))
    rows: dict[str, Any] = {k: _row([r["s"] for r in v], [r["extra"] for r in v]) for k, v in runs.items()}
    rows["ratio zd.load / ds.load_checkpoint"] = round(rows["zd.load"]["median_s"]
                                                       / rows["ds.load_checkpoint"]["median_s"], 2)
    return rows


def convert(root: str, stage: int, repeat: int) -> dict[str, Any]:
    """``ds_to_universal`` of ``root/ds/t`` into ``root/ds/t_uni``, ``repeat`` times (the last output kept)."""
    src, dst = os.path.join(root, "ds", "t"), os.path.join(root, "ds", "t_uni")
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src,
               "--output_folder", dst] + (["--inject_missing_state"] if stage < 3 else [])
    times = []
    for _ in range(repeat):
        shutil.rmtree(dst, ignore_errors=True)
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    return {"median_s": round(statistics.median(times), 3), "spread_s": [round(min(times), 3), round(max(times), 3)],
            "peak_rss_MB (largest process)": round(peak / 2**20, 1), "bytes": _du(dst)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--resume-at", type=int, default=0, help="also resume at this world size (0: no)")
    parser.add_argument("--skip-same", action="store_true", help="only the --resume-at (and --fresh) rows")
    parser.add_argument("--fresh", action="store_true",
                        help="also time the first load of a new engine in a fresh process (one launch per load)")
    parser.add_argument("--dir", default="/tmp/zd-ckpt-bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    params, tensors = count(args.hidden, args.layers)
    report: dict[str, Any] = {"params": params, "tensors": tensors, "nproc": args.nproc, "stage": args.stage,
                              "repeat": args.repeat}
    if not args.skip_same:
        same = os.path.join(args.dir, "same")
        os.makedirs(same)
        report["same world size (rank 0)"] = launch(same_world, args.hidden, args.layers, args.stage, same,
                                                    args.repeat, nprocs=args.nproc, timeout=3600)
    if args.fresh:
        report["first load in a fresh process (rank 0)"] = fresh_loads(args)
    if args.resume_at:
        other = os.path.join(args.dir, "resume")
        os.makedirs(other)
        launch(write_both, args.hidden, args.layers, args.stage, other, nprocs=args.nproc, timeout=3600)
        conversion = convert(other, args.stage, args.repeat)
        loads = launch(resume, args.hidden, args.layers, args.stage, other, args.repeat, nprocs=args.resume_at,
                       timeout=3600)
        loads["zd.load"]["bytes"] = _du(os.path.join(other, "zd"))
        loads["ds_to_universal"] = conversion
        universal = loads["ds.load_checkpoint(load_universal=True)"]["median_s"]
        loads["ratio (ds_to_universal + universal load) / zd.load"] = round(
            (conversion["median_s"] + universal) / loads["zd.load"]["median_s"], 2)
        report[f"resume {args.nproc} -> {args.resume_at} ranks (rank 0)"] = loads
    print(json.dumps(report, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
