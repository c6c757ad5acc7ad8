"""Host (Python) time per call of the first ``sharded_grads()`` of a step and of ``set_full_()``, A/B between two
source trees, interleaved, on the CPU (issue 42: on a GPU these calls wait for the host, so host time is what a CPU
can measure of them).

    python benchmarks/host_time_ab.py --a /path/to/old/tree --b . [--hidden 16] [--layers 16] [--rounds 5]

Each round runs one process per tree (A then B), each building a world-1 gloo engine of ``TransformerLike(hidden,
layers)`` in bf16 (``12·layers + 6`` tensors: 198 at 16 layers, as ``gpu_check``'s timing model) per ZeRO stage and
timing, over ``--steps`` steps: the first ``sharded_grads()`` of the step, the first ``set_full_()`` of the step
(it cuts the views it writes through once per partition), then ``set_full_()`` again (median of 5). Times are the
CPU time of the calling thread (``time.thread_time``, one torch thread): on a shared machine, wall time would
count what other processes take. They include the CPU's own copies of the (small) data: the default ``hidden``
of 96 keeps the parameters large enough for ``set_full_``'s per-parameter path (as on the 1.03B model) and the
bytes small. Prints, per row and tree, the median over all rounds of the per-process medians (ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROWS = ("first sharded_grads()", "first set_full_() of a step", "set_full_()")


def worker(hidden: int, layers: int, steps: int) -> dict[str, dict[str, float]]:
    import time

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpucheck.runtime import setup_runtime, init_world_one

    setup_runtime("cpu")
    init_world_one("cpu")
    import torch

    import zero_dtensor as zd
    from gpucheck.timings import build

    torch.set_num_threads(1)  # every op on this thread: its CPU time is the call's whole host work
    clock = time.thread_time  # CPU time of this thread: not the time other processes on the machine take from it

    out: dict[str, dict[str, float]] = {}
    for stage in (1, 2, 3):
        engine, backward = build(stage, hidden, layers, torch.device("cpu"))
        times: dict[str, list[float]] = {row: [] for row in ROWS}
        values = None
        for step in range(steps + 1):
            backward()
            t = clock()
            grads = zd.sharded_grads(engine)
            first = clock() - t
            if values is None:
                values = {n: v.clone() for n, v in grads.full_tensors().items()}
            t = clock()
            grads.set_full_(values)
            first_set = clock() - t
            again = []
            for _ in range(5):
                t = clock()
                grads.set_full_(values)
                again.append(clock() - t)
            if step:  # the first step builds layouts and plans
                times[ROWS[0]].append(first)
                times[ROWS[1]].append(first_set)
                times[ROWS[2]].append(statistics.median(again))
            del grads
            engine.step()
        out[f"ZeRO-{stage}"] = {row: 1e3 * statistics.median(v) for row, v in times.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="source tree A (holds zero_dtensor/); required")
    p.add_argument("--b", default=".", help="source tree B (default: this checkout)")
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.hidden, args.layers, args.steps)))
        return
    if args.a is None:
        p.error("--a is required")
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for label, tree in (("A", args.a), ("B", args.b)):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--hidden", str(args.hidden),
                                   "--layers", str(args.layers), "--steps", str(args.steps)],
                                  env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"median ms over {args.rounds} interleaved rounds (A: {args.a}, B: {args.b}); hidden {args.hidden}, "
          f"layers {args.layers} ({12 * args.layers + 6} tensors), world 1, bf16, CPU")
    print(f"{'row':32} {'stage':6} {'A':>8} {'B':>8} {'B/A':>6}")
    for stage in runs["A"][0]:
        for row in ROWS:
            a = statistics.median(r[stage][row] for r in runs["A"])
            b = statistics.median(r[stage][row] for r in runs["B"])
            print(f"{row:32} {stage:6} {a:8.3f} {b:8.3f} {b / a:6.2f}")


if __name__ == "__main__":
    main()
