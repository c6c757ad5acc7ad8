"""A/B of the headline rows between two source trees, interleaved: multi-rank gloo pools, one per tree.

    python benchmarks/ab.py --a main --b . --world 2 4 --rounds 5 [--rows full_tensors,norms] [--json out.json]

``--a`` / ``--b``: a path to a source tree (a folder holding ``zero_dtensor/``) or a git revision of this checkout
(checked out with ``git worktree add --detach`` into a temporary folder, removed at the end). For each world size, one
driver process per tree starts a :class:`zero_dtensor.launch.RankPool` whose ranks import ``zero_dtensor`` from that
tree (``PYTHONPATH``) and build the engines once: the benchmark model (``TransformerLike(--hidden, --layers)`` of
``python -m zero_dtensor.bench``, or ``--model linear``: ``--layers`` x ``Linear(--width, --width)``, the bulk check's
20.1M-parameter model at 100 x 448) per ZeRO stage of ``--stages``, and a model of ``--tensors`` tensors
(:func:`zero_dtensor.bench.sweep.sweep_model`, ``Linear(32, 32)`` layers) for the ``10k`` rows. Then, ``--rounds``
times, every row is timed on A and on B one right after the other (the order alternating between rounds): ``--reps``
calls, each started at a barrier, the slowest rank's time, the median of them. Each row's ratio B/A per round; the
table shows the median ratio, its spread (min-max over rounds) and both trees' median times (rich; ``--json``
writes every round).

Rows (``--rows``: comma-separated substrings of row names; all by default), per stage ``z1``/``z2``/``z3``:
``full_tensors``, ``full_tensors out=``, ``to_dtensors``, ``owned``, ``map_full_`` (identity on the matrices),
``masters full_tensors``, ``exp_avg full_tensors``, ``norms``, ``clip_grad_norm_``, ``stats``, and ``floor`` (the
cheapest bare primitive moving the gradients' bytes, :func:`zero_dtensor.bench.floors.cheapest`, chosen once per
stage in each tree; its row gives each tree's ratios to it in ``--json``); the same calls prefixed ``10k`` on the
many-tensor model. A row a tree cannot run (an API it lacks) shows ``-``.

Every rank of a pool shares the machine with the other pool (idle while the other times): on a loaded machine,
rely on the rounds and the spread.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
#: the calls timed per engine (name -> what it calls), in table order
CALLS = ("full_tensors", "full_tensors out=", "to_dtensors", "owned", "map_full_", "masters full_tensors",
         "exp_avg full_tensors", "norms", "clip_grad_norm_", "stats", "floor")

# --- rank side (runs inside the tree under test) ----------------------------------------------------------------
_STATE: dict[str, Any] = {}


def _engine(stage: int, model: Any, x: Any) -> Any:
    import io

    import deepspeed

    # stage3_max_reuse_distance 0: DeepSpeed's ZeRO-3 scans the rest of its module trace for every module it releases
    # (PartitionedParameterCoordinator.__params_to_release), so the first forward after a step is quadratic in the
    # modules (19 s at 1,000 layers on 2 ranks, past 25 minutes at 5,000 on 4); with 0 it takes 0.8 s. It decides
    # only when DeepSpeed frees its gathered working weights, none of what the rows read.
    zero = {"stage": stage, "stage3_max_reuse_distance": 0}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-6, "torch_adam": True}}, "steps_per_print": 10**9}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()  # the optimizer state exists from the first step on
    engine.backward(engine(x).float().pow(2).mean())
    return engine


def _calls(engine: Any, timed: Callable[[Callable[[], Any]], float]) -> dict[str, Callable[[], Any]]:
    """The rows' calls on one engine (those this tree has)."""
    import torch.distributed as dist

    import zero_dtensor as zd

    grads = zd.sharded_grads(engine)
    calls: dict[str, Callable[[], Any]] = {"full_tensors": lambda: grads.full_tensors()}
    kept: dict[str, Any] = {"prev": grads.full_tensors()}
    calls["full_tensors out="] = lambda: grads.full_tensors(out=kept["prev"])
    for name in ("to_dtensors", "owned", "norms", "stats"):
        if hasattr(grads, name):
            calls[name] = getattr(grads, name)
    if hasattr(grads, "clip_grad_norm_"):
        calls["clip_grad_norm_"] = lambda: grads.clip_grad_norm_(1e30)
    if hasattr(grads, "map_full_"):
        matrices = [n for n in grads.names if len(grads[n].shape) == 2]
        calls["map_full_"] = lambda: grads.map_full_(lambda name, g: g, matrices)
    with contextlib.suppress(Exception):
        masters = zd.sharded_master_params(engine)
        calls["masters full_tensors"] = lambda: masters.full_tensors()
    with contextlib.suppress(Exception):
        exp_avg = zd.sharded_optimizer_state(engine, "exp_avg")
        calls["exp_avg full_tensors"] = lambda: exp_avg.full_tensors()
    with contextlib.suppress(Exception):
        from zero_dtensor.bench.floors import bare_gathers, cheapest

        try:
            from zero_dtensor.core.state import state_of
        except ImportError:  # trees before the folders by role (issue 43)
            from zero_dtensor.state import state_of  # type: ignore[no-redef]

        sharded = [g for g in grads.layout.groups if g.placement.is_sharded]
        if sharded and dist.get_world_size() > 1:
            parts = grads.local_partitions
            bare = bare_gathers([parts[g.index] for g in sharded], [g.flat_numel for g in sharded],
                                state_of(grads).storage.process_groups[sharded[0].index])
            chosen, _ = cheapest(bare, timed, _slowest, 3)
            calls["floor"] = bare[chosen]
            calls["floor"].__name__ = chosen  # type: ignore[attr-defined]
    return calls


def _slowest(times: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - t0
    del result
    return elapsed


def rank_setup(cfg: dict[str, Any]) -> dict[str, Any]:
    """Build every engine of ``cfg`` and its calls on this rank; the row names and this tree's zero_dtensor."""
    import warnings

    import torch
    import torch.distributed as dist

    import zero_dtensor as zd

    warnings.filterwarnings("ignore")
    rows: dict[str, Callable[[], Any]] = {}
    wanted = cfg["rows"]
    for stage in cfg["stages"]:
        torch.manual_seed(0)
        if cfg["model"] == "linear":
            model = torch.nn.Sequential(*[torch.nn.Linear(cfg["width"], cfg["width"]) for _ in range(cfg["layers"])])
            x = torch.randn(2, cfg["width"], generator=torch.Generator().manual_seed(dist.get_rank()))
        else:
            from zero_dtensor.bench.model import TransformerLike

            model = TransformerLike(cfg["hidden"], cfg["layers"])
            x = torch.randn(2, 8, cfg["hidden"], generator=torch.Generator().manual_seed(dist.get_rank()))
        prefixes = [(f"z{stage} ", model, x)]
        if cfg["tensors"]:
            from zero_dtensor.bench.sweep import sweep_model

            torch.manual_seed(0)
            prefixes.append((f"10k z{stage} ", sweep_model(cfg["tensors"]),
                             torch.randn(2, 32, generator=torch.Generator().manual_seed(dist.get_rank()))))
        for prefix, m, inp in prefixes:
            names = [prefix + c for c in CALLS]
            if wanted and not any(w in n for w in wanted for n in names):
                continue
            engine = _engine(stage, m, inp)
            _STATE.setdefault("engines", []).append(engine)
            for call, fn in _calls(engine, _timed).items():
                if not wanted or any(w in prefix + call for w in wanted):
                    rows[prefix + call] = fn
    _STATE["rows"] = rows
    for fn in rows.values():  # warm-up (auto calibrates here)
        fn()
    floors = {n: getattr(fn, "__name__", "") for n, fn in rows.items() if n.endswith("floor")}
    return {"rows": list(rows), "zero_dtensor": zd.__file__, "floors": floors}


def rank_time(row: str, reps: int) -> float | None:
    """The median over ``reps`` calls of ``row`` (each the slowest rank's time), seconds; None if this tree lacks it."""
    fn = _STATE["rows"].get(row)
    if fn is None:
        return None
    times = _slowest([_timed(fn) for _ in range(reps)])
    return statistics.median(times)


# --- driver (one process per tree and world size: owns that tree's pool) -----------------------------------------
def driver(world: int) -> None:
    """Answer the parent's JSON lines on stdin (``setup``, ``time``) with one JSON line each on stdout."""
    sys.path.insert(0, HERE)
    import ab  # the rank functions by an importable name (the pool's ranks are spawned)

    from zero_dtensor.launch import RankPool

    out = os.fdopen(os.dup(1), "w")  # the answer channel; whatever else prints (the ranks inherit fd 1) goes to
    os.dup2(2, 1)  # stderr, so that it stays off it
    with RankPool(world) as pool:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "setup":
                answer: Any = pool.run(ab.rank_setup, cmd["cfg"], timeout=3600)[0]
            else:
                answer = pool.run(ab.rank_time, cmd["row"], cmd["reps"], timeout=1800)[0]
            out.write(json.dumps(answer) + "\n")
            out.flush()


class Driver:
    def __init__(self, tree: str, world: int) -> None:
        env = dict(os.environ, PYTHONPATH=tree)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--driver", str(world)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the driver of a tree ended (exit code {self.proc.wait()}); see its stderr above")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


@contextlib.contextmanager
def source_tree(spec: str) -> Iterator[str]:
    """``spec`` as a folder holding ``zero_dtensor/``: itself, or a git revision checked out into a temporary
    worktree (removed afterwards)."""
    if os.path.isdir(os.path.join(spec, "zero_dtensor")):
        yield os.path.abspath(spec)
        return
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ab-tree-") as tmp:
        path = os.path.join(tmp, "tree")
        subprocess.run(["git", "worktree", "add", "--detach", path, spec], cwd=repo, check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", path], cwd=repo, capture_output=True)


def measure(trees: dict[str, str], cfg: dict[str, Any], world: int, rounds: int, reps: int,
            progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every row of ``cfg`` on both trees, interleaved: ``{"rows": {row: {"A": [s...], "B": [s...]}}, ...}``."""
    drivers = {label: Driver(tree, world) for label, tree in trees.items()}
    try:
        setups = {label: d.ask(cmd="setup", cfg=cfg) for label, d in drivers.items()}
        rows = list(dict.fromkeys(r for s in setups.values() for r in s["rows"]))
        times: dict[str, dict[str, list[float | None]]] = {r: {"A": [], "B": []} for r in rows}
        for round_ in range(rounds):
            order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
            for row in rows:
                progress(f"world {world}, round {round_ + 1}/{rounds}: {row}")
                for label in order:
                    times[row][label].append(drivers[label].ask(cmd="time", row=row, reps=reps))
    finally:
        for d in drivers.values():
            d.close()
    return {"world": world, "rows": times, "zero_dtensor": {k: s["zero_dtensor"] for k, s in setups.items()},
            "floors": {k: s["floors"] for k, s in setups.items()}}


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row: both trees' median times, the median ratio B/A over rounds and its min-max."""
    out = []
    floors = {}
    for row, t in result["rows"].items():
        a = [x for x in t["A"] if x is not None]
        b = [x for x in t["B"] if x is not None]
        ratios = [y / x for x, y in zip(t["A"], t["B"]) if x and y]
        entry = {"world": result["world"], "row": row, "a_ms": 1e3 * statistics.median(a) if a else None,
                 "b_ms": 1e3 * statistics.median(b) if b else None,
                 "ratio": statistics.median(ratios) if ratios else None,
                 "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None}
        if row.endswith("floor"):
            floors[row[:-len("floor")]] = entry
        out.append(entry)
    for entry in out:  # each tree's time over its own floor of the same engine
        floor = floors.get(entry["row"].rsplit(" ", 1)[0] + " ") or next(
            (f for p, f in floors.items() if entry["row"].startswith(p)), None)
        if floor is not None and not entry["row"].endswith("floor"):
            for side in ("a", "b"):
                if entry[f"{side}_ms"] and floor[f"{side}_ms"]:
                    entry[f"{side}_floor"] = entry[f"{side}_ms"] / floor[f"{side}_ms"]
    return out


def render(summary: list[dict[str, Any]], labels: dict[str, str], rounds: int) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    table = Table(title=f"B/A over {rounds} interleaved rounds (A: {labels['A']}, B: {labels['B']})")
    for col in ("world", "row", "A ms", "B ms", "B/A", "spread", "A ÷ floor", "B ÷ floor"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for e in summary:
        table.add_row(str(e["world"]), e["row"], fmt(e["a_ms"], ".1f"), fmt(e["b_ms"], ".1f"), fmt(e["ratio"], ".2f"),
                      "-" if e["ratio"] is None else f"{e['ratio_min']:.2f}-{e['ratio_max']:.2f}",
                      fmt(e.get("a_floor"), ".2f"), fmt(e.get("b_floor"), ".2f"))
    Console(width=140).print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=False, help="tree A: a source folder or a git revision (e.g. main)")
    p.add_argument("--b", default=os.path.dirname(HERE), help="tree B (default: this checkout)")
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="rank counts. Default 2 4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="calls per row per round (their median). Default 3")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--rows", default="", help="comma-separated substrings of the rows to run (default: all)")
    p.add_argument("--model", choices=("bench", "linear"), default="bench")
    p.add_argument("--hidden", type=int, default=352, help="bench model hidden size. Default 352 (24.1M params)")
    p.add_argument("--layers", type=int, help="bench model blocks (default 16) or linear layers (default 100)")
    p.add_argument("--width", type=int, default=448, help="linear model width. Default 448")
    p.add_argument("--tensors", type=int, default=10000, help="tensors of the 10k rows' model (0: none)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--driver", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.driver is not None:
        driver(args.driver)
        return 0
    if not args.a:
        p.error("--a is required")
    cfg = {"stages": [int(s) for s in args.stages.split(",") if s.strip()], "model": args.model,
           "hidden": args.hidden, "width": args.width, "tensors": args.tensors,
           "layers": args.layers or (100 if args.model == "linear" else 16),
           "rows": [r.strip() for r in args.rows.split(",") if r.strip()]}
    results = []
    with source_tree(args.a) as a, source_tree(args.b) as b:
        for world in args.world:
            results.append(measure({"A": a, "B": b}, cfg, world, args.rounds, args.reps,
                                   lambda msg: print(msg, file=sys.stderr, flush=True)))
    summary = [e for r in results for e in summarize(r)]
    render(summary, {"A": args.a, "B": args.b}, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": args.a, "b": args.b, "config": cfg, "rounds": args.rounds, "results": results,
                       "summary": summary, "load": os.getloadavg()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
