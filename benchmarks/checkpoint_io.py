"""Time ``zero_dtensor.checkpoint.save`` / ``load`` against DeepSpeed's ``engine.save_checkpoint`` /
``load_checkpoint`` at the same world size (CPU, gloo): ``python benchmarks/checkpoint_io.py [--hidden 512]
[--layers 8] [--nproc 2] [--stage 2] [--dir /tmp/zd-ckpt-bench]``. Medians of ``--repeat`` runs, in seconds."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist

from zero_dtensor.bench.model import TransformerLike, count
from zero_dtensor.checkpoint import load, save
from zero_dtensor.launch import launch


def _engine(hidden: int, layers: int, stage: int) -> object:
    torch.manual_seed(0)
    model = TransformerLike(hidden, layers)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(2, 8, hidden).to(torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    return engine


def _timed(fn: object) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def run(hidden: int, layers: int, stage: int, root: str, repeat: int) -> dict[str, float]:
    engine = _engine(hidden, layers, stage)
    times: dict[str, list[float]] = {k: [] for k in ("zd.save", "zd.save async (blocking part)", "zd.load",
                                                     "ds.save_checkpoint", "ds.load_checkpoint")}
    for i in range(repeat):
        zd_path, ds_path = os.path.join(root, f"zd{i}"), os.path.join(root, f"ds{i}")
        times["zd.save"].append(_timed(lambda: save(engine, zd_path)))
        futures = []
        times["zd.save async (blocking part)"].append(
            _timed(lambda: futures.append(save(engine, zd_path + "a", async_=True))))
        futures[0].result()
        times["zd.load"].append(_timed(lambda: load(engine, zd_path)))
        times["ds.save_checkpoint"].append(_timed(lambda: engine.save_checkpoint(ds_path, tag="t")))
        times["ds.load_checkpoint"].append(_timed(lambda: engine.load_checkpoint(ds_path, tag="t")))
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/zd-ckpt-bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    results = launch(run, args.hidden, args.layers, args.stage, args.dir, args.repeat, nprocs=args.nproc)
    params, tensors = count(args.hidden, args.layers)
    print(json.dumps({"params": params, "tensors": tensors, "nproc": args.nproc, "stage": args.stage,
                      "rank0": results}, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
