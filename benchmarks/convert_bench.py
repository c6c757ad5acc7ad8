"""Time ``zd.convert`` against DeepSpeed's own tools on one DeepSpeed checkpoint (CPU, one process each).

Builds (once, ``--build``) a bf16 ZeRO-2 (``--stage 3``: ZeRO-3) engine at 2 gloo ranks of ``--layers`` square
Linears of ``--hidden`` (torch Adam), trains one step and ``engine.save_checkpoint``s it under ``--dir``. Then,
interleaved in each of ``--rounds`` rounds (the order rotating from round to round), each in its own process, timed
from its start:

- ``zd.convert(..., to="safetensors")`` and DeepSpeed's ``zero_to_fp32``
  (``convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True)``, which reads lazily, ``lazy_mode``)
  with the same ``--shard-size``;
- ``zd.convert(..., to="dcp")`` (masters and optimizer state; with its fsync per file as ``zd.save``, and with
  ``--no-fsync``) and ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` (its default 4
  extract + 2 merge worker processes; no fsync).

Per row: the median and spread of the wall times, and the peak anonymous resident memory (``RssAnon``, sampled
every 5 ms from ``/proc``: of the process, and summed over it and its child processes for ``ds_to_universal``).
Every run starts after ``os.sync()``, with the checkpoint's files as ``--cache`` says: ``warm`` (default) read
through the page cache again before each run (untimed: another tool's output, 12-24 GB at 1B parameters, evicts
them on a 24 GB machine, and the next tool would read them from the disk); ``cold``: the page cache dropped before
each run (``/proc/sys/vm/drop_caches``, root only); ``asis``: read once before the rounds, then whatever the
previous run left (the state before 2026-12-07). Examples (the tables in docs/benchmarks.md)::

    python benchmarks/convert_bench.py --build --hidden 2048 --layers 60 --rounds 3
    python benchmarks/convert_bench.py --build --stage 3 --hidden 4096 --layers 60 --rounds 0 --dir /work/convbench/1b
    python benchmarks/convert_bench.py --stage 3 --hidden 4096 --layers 60 --rounds 3 --dir /work/convbench/1b \
        --only "zd.convert dcp,ds_to_universal" --cache warm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any


def _build(root: str, hidden: int, layers: int, stage: int = 2) -> None:
    """Runs on each of 2 ranks (``zero_dtensor.launch``). ``stage=3`` builds the model partitioned from the start
    (``deepspeed.zero.Init``, bf16 parameters made as such) with optimizer sub-groups of 1e8 elements, so that a
    rank holds its half of the masters and moments (12 bytes per parameter) and little else: what lets a 1B model
    save on a 24 GB machine (ZeRO-2 holds full bf16 weights and gradients on both ranks besides, and an fp32
    copy of the model while it is built)."""
    import contextlib

    import deepspeed
    import torch

    torch.manual_seed(0)
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(sub_group_size=int(1e8), stage3_param_persistence_threshold=0)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
              "steps_per_print": 10**9}
    partitioned = deepspeed.zero.Init(config_dict_or_path=config) if stage == 3 else contextlib.nullcontext()
    with partitioned:
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False, dtype=torch.bfloat16)
                                      for _ in range(layers)])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    loss = engine(torch.randn(1, hidden, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(root)


def _anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _warm(root: str) -> None:
    """Read every file of ``root`` through the page cache."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                while f.read(1 << 24):
                    pass


def _prepare(root: str, cache: str) -> None:
    """The page cache before a run (``--cache``; module docstring)."""
    os.sync()
    if cache == "warm":
        _warm(root)
    elif cache == "cold":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def _run(command: list[str]) -> tuple[float, int, int]:
    """Wall seconds, peak RssAnon of the process, peak RssAnon summed over it and its children."""
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, peak_tree = [0], [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            own = _anon(proc.pid)
            tree = own + sum(_anon(c) for c in _children(proc.pid))
            peak[0], peak_tree[0] = max(peak[0], own), max(peak_tree[0], tree)
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    thread.join()
    if proc.returncode:
        raise RuntimeError(f"{command} failed:\n{err.decode()[-3000:]}")
    return wall, peak[0], peak_tree[0]


def _commands(root: str, out: str, shard: str) -> dict[str, list[str]]:
    py = sys.executable
    tag = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
    return {
        "zd.convert safetensors": [py, "-m", "zero_dtensor.convert", root, f"{out}/zd-st", "--to", "safetensors",
                                   "--max-shard-size", shard, "--quiet"],
        "zero_to_fp32 safetensors": [py, "-c", "import sys; from deepspeed.utils.zero_to_fp32 import "
                                     "convert_zero_checkpoint_to_fp32_state_dict as c; "
                                     "c(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], safe_serialization=True)",
                                     root, f"{out}/z2f", shard],
        "zd.convert dcp": [py, "-m", "zero_dtensor.convert", root, f"{out}/zd-dcp", "--quiet"],
        "zd.convert dcp --no-fsync": [py, "-m", "zero_dtensor.convert", root, f"{out}/zd-dcp", "--quiet",
                                      "--no-fsync"],
        "ds_to_universal": [py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag,
                            "--output_folder", f"{out}/uni", "--inject_missing_state"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-size", default="5GB")
    parser.add_argument("--dir", default="/tmp/zd-convert-bench")
    parser.add_argument("--build", action="store_true", help="build and save the checkpoint first")
    parser.add_argument("--stage", type=int, default=2, choices=(2, 3),
                        help="ZeRO stage of the built engine (3: partitioned from the start; a 1B model fits 24 GB)")
    parser.add_argument("--only", default="", help="comma-separated row names to run (default: every row)")
    parser.add_argument("--cache", default="warm", choices=("warm", "cold", "asis"),
                        help="the checkpoint's pages before each run: read into the page cache again (warm), dropped "
                             "(cold, root only), or as the previous run left them (asis)")
    args = parser.parse_args()
    root, out = os.path.join(args.dir, "ds"), os.path.join(args.dir, "out")
    if args.build:
        from zero_dtensor.launch import launch

        shutil.rmtree(root, ignore_errors=True)
        launch(_build, root, args.hidden, args.layers, args.stage, nprocs=2, timeout=3600)
    if args.cache == "asis":
        _warm(root)
    commands = _commands(root, out, args.shard_size)
    if args.only:
        commands = {k: v for k, v in commands.items() if k in args.only.split(",")}
    rows: dict[str, list[tuple[float, int, int]]] = {name: [] for name in commands}
    names = list(commands)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            _prepare(root, args.cache)
            rows[name].append(_run(commands[name]))
            print(name, rows[name][-1], file=sys.stderr, flush=True)
    shutil.rmtree(out, ignore_errors=True)
    params = args.hidden * args.hidden * args.layers
    result: dict[str, Any] = {"cache": args.cache, "params": params,
                              "largest_param_fp32_MiB": args.hidden**2 * 4 / 2**20,
                              "checkpoint_bytes": sum(os.path.getsize(os.path.join(d, f))
                                                      for d, _, fs in os.walk(root) for f in fs)}
    for name, runs in rows.items():
        if not runs:  # --rounds 0: only the build
            continue
        walls = [w for w, _, _ in runs]
        result[name] = {"median_s": round(statistics.median(walls), 2),
                        "spread_s": [round(min(walls), 2), round(max(walls), 2)],
                        "peak_RssAnon_MiB": round(max(p for _, p, _ in runs) / 2**20, 1),
                        "peak_RssAnon_with_children_MiB": round(max(t for _, _, t in runs) / 2**20, 1)}
    ratios = {"safetensors time ratio zd / zero_to_fp32": ("zd.convert safetensors", "zero_to_fp32 safetensors"),
              "dcp speedup ds_to_universal / zd": ("ds_to_universal", "zd.convert dcp"),
              "dcp speedup ds_to_universal / zd --no-fsync": ("ds_to_universal", "zd.convert dcp --no-fsync")}
    for label, (a, b) in ratios.items():
        if a in result and b in result:
            result[label] = round(result[a]["median_s"] / result[b]["median_s"], 2)
    if "zd.convert safetensors" in result and "zero_to_fp32 safetensors" in result:
        ours, theirs = result["zd.convert safetensors"], result["zero_to_fp32 safetensors"]
        result["safetensors RssAnon ratio zd / zero_to_fp32"] = round(
            ours["peak_RssAnon_MiB"] / theirs["peak_RssAnon_MiB"], 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
