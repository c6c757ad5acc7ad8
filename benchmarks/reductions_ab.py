"""The reductions A/B between two source trees on the CPU (issue 42): per call its tensor operations (≈ kernel
launches on a GPU), its host time, and whether its values are bitwise those of the other tree.

    python benchmarks/reductions_ab.py --a /path/to/old/tree --b . [--dtype bf16|fp32] [--hidden 96] [--rounds 2]

Each round runs one process per tree (A then B), each building a world-1 gloo engine of ``TransformerLike(hidden,
16)`` (198 tensors, as ``gpu_check``'s timing model) per ZeRO stage (ZeRO-3 with ``sub_group_size`` half the model:
two flat groups, as on the 1.03B model), and for ``norms``, ``global_norm``, ``clip_grad_norm_`` (coefficient 1),
``clip_per_param_``, ``stats`` and ``dots``: one call, one call under ``tests/workers/op_counts.py``'s ``OpCounter``
(views aside), then ``--reps`` calls timed by the calling thread's CPU time (one torch thread). Prints per call the
operations, the median over rounds of the per-process median times (ms) and whether B's values equal A's
(``torch.equal``, nan equal to nan). A small ``--hidden`` (16) makes host work dominate the CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any


def worker(tree: str, out: str, dtype: str, hidden: int, reps: int, tensors: int = 0,
           stages: tuple[int, ...] = (1, 2, 3)) -> None:
    import time

    here = os.path.dirname(os.path.abspath(__file__))  # the helpers from this checkout, the library from the tree
    sys.path[:0] = [tree, here, os.path.join(os.path.dirname(here), "tests")]
    from gpucheck.runtime import init_world_one, setup_runtime

    setup_runtime("cpu")
    init_world_one("cpu")
    import deepspeed
    import torch

    import zero_dtensor as zd
    from gpucheck.timings import timing_model

    try:
        from workers.op_counts import OpCounter
    except ImportError:  # a tree whose test helpers this checkout's do not fit: no operation counts
        OpCounter = None
    try:
        from zero_dtensor.core.state import state_of
    except ImportError:  # a tree before the folders (e.g. 2d3c932)
        from zero_dtensor.state import state_of

    if not zd.__file__.startswith(os.path.abspath(tree)):
        raise RuntimeError(f"zero_dtensor imported from {zd.__file__}, not from {tree}")
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for stage in stages:
        if tensors:  # the tensor-count sweep's model (zero_dtensor.bench.sweep): tensors // 2 Linear(32, 32)
            from zero_dtensor.bench.sweep import sweep_model

            torch.manual_seed(0)  # the same initial weights in every tree's process (values are compared)
            model = sweep_model(tensors, 32)
        else:
            model = timing_model(hidden, 16, torch.device("cpu"))
        zero: dict[str, Any] = {"stage": stage}
        if stage == 3:
            zero["sub_group_size"] = sum(p.numel() for p in model.parameters()) // 2 + 1
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                  "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 10**9,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-6, "torch_adam": True}}}
        torch.manual_seed(0)
        with contextlib.redirect_stdout(sys.stderr):
            engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        x = torch.randn(2, 32 if tensors else 8, *(() if tensors else (hidden,)),
                        generator=torch.Generator().manual_seed(0))
        engine.backward(engine(x.to(next(engine.module.parameters()).dtype)).float().pow(2).mean())
        grads = zd.sharded_grads(engine)
        other = grads.clone()
        other.mul_(0.5)
        groups = len(state_of(grads).layout.groups)
        calls = {"norms": lambda: grads.norms(), "norms(inf)": lambda: grads.norms(math.inf),
                 "global_norm": lambda: grads.global_norm(), "global_norm(inf)": lambda: grads.global_norm(math.inf),
                 "clip_grad_norm_": lambda: grads.clip_grad_norm_(1e9),
                 "clip_per_param_": lambda: grads.clip_per_param_(1e9), "stats": lambda: grads.stats(),
                 "dots": lambda: grads.dots(other), "dots(with_norms)": lambda: grads.dots(other, with_norms=True)}
        for name, fn in calls.items():
            value = fn()
            ops = -1
            if OpCounter is not None:
                with OpCounter() as counter:
                    fn()
                ops = sum(counter.ops.values())
            times = []
            for _ in range(reps):
                t = time.thread_time()
                fn()
                times.append(time.thread_time() - t)
            results[f"ZeRO-{stage} ({groups} group{'s' if groups > 1 else ''}) {name}"] = {
                "ops": ops, "ms": 1e3 * statistics.median(times), "value": _plain(value)}
        engine.step()
    torch.save(results, out)


def _plain(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    out = {}
    for name, v in dict(value).items():  # ParamValues, or stats' GradStats
        out[name] = v.clone() if isinstance(v, torch.Tensor) else tuple(vars(v).values())
    return out


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", help="the old source tree (required)")
    parser.add_argument("--b", default=".", help="the new source tree")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--hidden", type=int, default=96)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tensors", type=int, default=0,
                        help="instead of the timing model: the sweep's model of this many tensors (e.g. 10000)")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.dtype, args.hidden, args.reps, args.tensors,
               tuple(int(v) for v in args.stages.split(",")))
        return
    if not args.a:
        parser.error("--a (the old source tree) is required")
    import torch

    trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for key, tree in trees.items():
                out = os.path.join(tmp, f"{key}{r}.pt")
                env = dict(os.environ, PYTHONPATH=tree)
                subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", tree, out, "--dtype",
                                args.dtype, "--hidden", str(args.hidden), "--reps", str(args.reps), "--tensors",
                                str(args.tensors), "--stages", args.stages],
                               check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                runs[key].append(torch.load(out, weights_only=False))
    a, b = runs["A"], runs["B"]
    print(f"{'call':42s} {'ops A -> B':>12s} {'host ms A -> B':>18s}  values")
    for name in a[0]:
        ms_a = statistics.median(x[name]["ms"] for x in a)
        ms_b = statistics.median(x[name]["ms"] for x in b)
        same = "same" if _same(a[0][name]["value"], b[0][name]["value"]) else "DIFFER"
        print(f"{name:42s} {a[0][name]['ops']:5d} -> {b[0][name]['ops']:<4d} {ms_a:8.3f} -> {ms_b:<7.3f}  {same}")


if __name__ == "__main__":
    main()
