"""The tensor-count sweep's rows (``python -m zero_dtensor.bench --tensors K``) A/B between source trees,
interleaved: each round runs the sweep once per tree (A, B, then B, A in the next round), each in fresh gloo ranks,
and the table gives, per row, each tree's median over rounds of the row's ratio to the bare all_gather timed beside
it (``÷ floor``), with its min-max, and B/A.

    python benchmarks/sweep_ab.py --a /path/to/old/tree --b . [--tensors 10000] [--stages 1] [--nproc 2]
                                  [--repeat 7] [--rounds 3]

Issue 55's limits at 10,000 tensors (2 ranks, ZeRO-1): ``stats()`` <= 1.0, ``clip_grad_norm_`` <= 0.5, first
``sharded_grads`` <= 1.0, ``full_tensors()`` / ``out=`` / ``set_full_`` <= 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="source tree A (holds zero_dtensor/)")
    p.add_argument("--b", default=".", help="source tree B (default: this checkout)")
    p.add_argument("--c", help="optional third tree C (e.g. today's main beside an old tree and a change)")
    p.add_argument("--tensors", default="10000")
    p.add_argument("--stages", default="1")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="fp32")
    args = p.parse_args()
    trees = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    if args.c:
        trees["C"] = os.path.abspath(args.c)
    ratios: dict[str, dict[tuple[int, str], list[float]]] = {key: {} for key in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for key in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                out = os.path.join(tmp, f"{key}{r}.json")
                env = dict(os.environ, PYTHONPATH=trees[key])
                subprocess.run([sys.executable, "-m", "zero_dtensor.bench", "--tensors", args.tensors, "--stages",
                                args.stages, "--nproc", str(args.nproc), "--repeat", str(args.repeat), "--dtype",
                                args.dtype, "--no-progress", "--json", out], env=env, cwd=trees[key], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                with open(out) as f:
                    for row in json.load(f)["rows"]:
                        if row.get("ratio_to_floor") is not None:
                            ratios[key].setdefault((row["stage"], row["row"]), []).append(row["ratio_to_floor"])
    print(f"÷ floor (bare all_gather beside each repetition), median [min-max] of {args.rounds} interleaved rounds; "
          f"{args.nproc} ranks, {args.tensors} tensors, {args.dtype}; " + ", ".join(f"{k}: {v}" for k, v in trees.items()))
    print(f"{'stage':6} {'row':30} " + " ".join(f"{k:>20}" for k in trees) + " "
          + " ".join(f"{k + '/A':>6}" for k in list(trees)[1:]))
    for stage, row in ratios["A"]:
        got = [ratios[k].get((stage, row), []) for k in trees]
        if not all(got):
            continue
        meds = [statistics.median(v) for v in got]
        cells = " ".join(f"{m:6.2f} [{min(v):.2f}-{max(v):.2f}]" for m, v in zip(meds, got))
        print(f"ZeRO-{stage:<1} {row:30} {cells} " + " ".join(f"{m / meds[0]:6.2f}" for m in meds[1:]))

if __name__ == "__main__":
    main()
