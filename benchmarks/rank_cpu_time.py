"""Rank 0's CPU time per call of one reduction at 10,000 tensors, 2 gloo ranks (issue 55): the sweep's model
(``zero_dtensor.bench.sweep.sweep_model(10000, 32)``), ZeRO-1 fp32, one backward, then ``--calls`` calls, each after
a bare ``all_gather_into_tensor`` of the partition's size and a barrier (cold caches, as in the sweep). Prints the
median wall time and the median and min CPU time of the calling thread (``time.thread_time``), ms. The tree is the
one on ``PYTHONPATH``; run two trees one after the other, alternating, to compare::

    PYTHONPATH=/path/to/tree torchrun --nproc_per_node=2 benchmarks/rank_cpu_time.py --call stats
    PYTHONPATH=/path/to/tree torchrun --nproc_per_node=2 benchmarks/rank_cpu_time.py --call stats --profile

``--profile``: then the torch profiler's table of 10 more calls (rank 0), by operator; ``--cprofile N``: cProfile's
N functions of most own time over 20 more calls (rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

import deepspeed
import torch
import torch.distributed as dist

import zero_dtensor as zd
from zero_dtensor.bench.common import engine_config
from zero_dtensor.bench.sweep import sweep_model

_FULL: dict[str, dict[str, torch.Tensor]] = {}  # set_full_'s values: one full_tensors(), taken at the first call


def _set_full(g) -> None:
    if "values" not in _FULL:
        _FULL["values"] = dict(g.full_tensors())
    g.set_full_(_FULL["values"])


CALLS = {"stats": lambda g: g.stats(), "clip": lambda g: g.clip_grad_norm_(1e9), "norms": lambda g: g.norms(),
         "global_norm": lambda g: g.global_norm(), "owned": lambda g: g.owned(), "to_dtensors": lambda g: g.to_dtensors(),
         "full_tensors": lambda g: g.full_tensors(), "set_full_": _set_full,
         "map_full_": lambda g: g.map_full_(lambda name, full: full, [n for n in g.names if n.endswith("weight")])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--call", choices=sorted(CALLS), default="stats")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--tensors", type=int, default=10000)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="then cProfile 20 more calls (rank 0): the N functions of most own time")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = sweep_model(args.tensors, 32)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=engine_config(args.stage, "fp32", lr=1e-6))
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).float().pow(2).mean())
    grads = zd.sharded_grads(engine)
    call = CALLS[args.call]
    for _ in range(5):
        call(grads)
    numel = sum(p.numel() for p in grads.local_partitions)
    flat, out = torch.randn(numel), torch.empty(numel * dist.get_world_size())
    walls, cpus = [], []
    for _ in range(args.calls):
        dist.all_gather_into_tensor(out, flat)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        call(grads)
        cpus.append(time.thread_time() - c0)
        walls.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"{args.call}: wall median {statistics.median(walls) * 1e3:.2f} ms, CPU median "
              f"{statistics.median(cpus) * 1e3:.2f} ms, min {min(cpus) * 1e3:.2f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                call(grads)
        if rank == 0:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            call(grads)
        profiler.disable()
        if rank == 0:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
