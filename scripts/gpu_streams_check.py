"""Stream discipline on one GPU (issue 52): every family's main calls under ``ZERO_DTENSOR_FORCE_COLLECTIVES=1``
(every NCCL call of the library, over one rank), their results saved for a bitwise comparison between runs with
``CUDA_LAUNCH_BLOCKING=0`` and ``=1``, and the calls that promise no host sync run under
``torch.cuda.set_sync_debug_mode``.

    python scripts/gpu_streams_check.py run --out DIR --tag lb0      # one run: DIR/streams-lb0.pt, DIR/streams-lb0.json
    python scripts/gpu_streams_check.py compare DIR/streams-lb0.pt DIR/streams-lb1.pt

``run`` builds a bf16 ZeRO-1, -2 and -3 engine (a 16-block transformer-like model, ``--hidden`` 512: 198 tensors,
about 50M parameters), steps once, takes a fresh backward, and calls on the gradients, the fp32 masters and
``exp_avg`` what ``tests/workers/forced.py`` calls at forced world 1 on the CPU (every gather strategy, async,
``iter_full``, ``dst=``, pipelined and windowed ZeRO-3 gathers, the redistribution both ways, the reductions,
clipping on a clone, ``set_full_``). Then, without forcing (world 1: no agreement reads back), ``norms``,
``norms(inf)``, ``global_norm``, ``dots``, ``clip_grad_norm_`` and ``clip_per_param_`` (on a clone) under
``set_sync_debug_mode("error")``; and forced, under ``"warn"``, where the only host syncs allowed are the
agreement's (its upload of a few int64 and its read-back: ``zero_dtensor/comm/``). Exit code 1 on any failure.
Needs DeepSpeed and a CUDA device; world 1, NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/workers/forced.py: the calls, plain() and same()

#: the calls that promise no host sync: ``name -> (prepare(grads) -> operand, call(grads, operand))``; what they need
#: (a clone) is made beforehand, outside the checked call
NO_SYNC: dict[str, tuple[Any, Any]] = {
    "norms": (lambda g: None, lambda g, _: g.norms()),
    "norms(inf)": (lambda g: None, lambda g, _: g.norms(float("inf"))),
    "global_norm": (lambda g: None, lambda g, _: g.global_norm()),
    "dots": (lambda g: g.clone(), lambda g, other: g.dots(other)),
    "clip_grad_norm_": (lambda g: g.clone(), lambda g, clone: clone.clip_grad_norm_(1e-3)),
    "clip_per_param_": (lambda g: g.clone(), lambda g, clone: clone.clip_per_param_(1e-3)),
}
ALLOWED_SYNC_FILES = ("zero_dtensor/comm/agreement.py", "zero_dtensor/comm/collectives.py")


def _init(device_type: str) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", device_type)
    import deepspeed
    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if device_type == "cuda":
        torch.cuda.set_device(0)
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo", auto_mpi_discovery=False,
                                   verbose=False)
    return torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")


def _engine(stage: int, hidden: int, device: Any) -> Any:
    import deepspeed
    import torch

    from zero_dtensor.bench.model import TransformerLike

    torch.manual_seed(0)
    with torch.device(device):
        model = TransformerLike(hidden, 16)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9}
    with contextlib.redirect_stdout(sys.stderr):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    x = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch.bfloat16)
    for _ in range(2):
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    engine.backward(engine(x).float().pow(2).mean())
    return engine


def _extra_calls() -> dict[str, Any]:
    return {"clip_per_param_": lambda f: (lambda c: {"norms": c.clip_per_param_(1e-3), "values": c.full_tensors()})(
        f.clone())}


@contextlib.contextmanager
def _sync_sites() -> Any:
    """Record, for each synchronizing CUDA call torch warns about (``set_sync_debug_mode("warn")``), the innermost
    zero_dtensor frame that led to it."""
    import torch

    sites: list[str] = []
    previous = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            return previous(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack() if "zero_dtensor/" in f.filename.replace(os.sep, "/")]
        where = frames[-1] if frames else None
        path = "" if where is None else where.filename.replace(os.sep, "/").split("zero_dtensor/", 1)[-1]
        sites.append("outside zero_dtensor" if where is None else f"{path}:{where.lineno} ({where.name})")
        return None

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous


def run(out: Path, tag: str, hidden: int, device_type: str) -> int:
    import torch

    from workers import forced as fw
    from zero_dtensor.settings import ENV_FORCE_COLLECTIVES

    import zero_dtensor as zd

    device = _init(device_type)
    cuda = device.type == "cuda"
    calls = {**fw.CALLS, **_extra_calls()}
    values: dict[str, Any] = {}
    report: dict[str, Any] = {"tag": tag, "CUDA_LAUNCH_BLOCKING": os.environ.get("CUDA_LAUNCH_BLOCKING", ""),
                              "errors": {}, "sync_error_mode": {}, "sync_warn_mode": {},
                              "device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke run: no stream, no "
                              "sync check)", "torch": torch.__version__}
    for stage in (1, 2, 3):
        engine = _engine(stage, hidden, device)
        fronts = {"grads": zd.sharded_grads(engine), "masters": zd.sharded_master_params(engine),
                  "exp_avg": zd.sharded_optimizer_state(engine, "exp_avg")}
        with fw.forced(True):
            for family, front in fronts.items():
                for name, call in calls.items():
                    key = f"z{stage} {family}: {name}"
                    try:
                        values[key] = fw.plain(call(front))
                    except Exception as exc:  # noqa: BLE001 - reported, the others still run
                        report["errors"][key] = f"{type(exc).__name__}: {exc}"
        grads = fronts["grads"]
        if not cuda:  # the smoke run: the sync-checked calls run once, unchecked
            for name, (prepare, call) in NO_SYNC.items():
                call(grads, prepare(grads))
        for name, (prepare, call) in NO_SYNC.items() if cuda else ():
            # world 1 unforced: no agreement, so no host sync at all is allowed
            operand = prepare(grads)
            call(grads, operand)  # one-time caches first (plans, index tensors)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                call(grads, operand)
                report["sync_error_mode"][f"z{stage} {name}"] = "no host sync"
            except RuntimeError as exc:
                report["sync_error_mode"][f"z{stage} {name}"] = f"SYNC: {exc}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
        with fw.forced(True):
            for name, (prepare, call) in NO_SYNC.items() if cuda else ():
                # forced: the agreement's upload and read-back only
                operand = prepare(grads)
                call(grads, operand)
                torch.cuda.synchronize()
                with _sync_sites() as sites:
                    call(grads, operand)
                bad = [s for s in sites if not any(s.startswith(a.split("zero_dtensor/", 1)[1])
                                                   for a in ALLOWED_SYNC_FILES)]
                report["sync_warn_mode"][f"z{stage} {name}"] = {"sites": sites, "outside the agreement": bad}
        del engine, fronts, grads
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    os.environ.pop(ENV_FORCE_COLLECTIVES, None)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(values, out / f"streams-{tag}.pt")
    failed = (bool(report["errors"])
              or any(v != "no host sync" for v in report["sync_error_mode"].values())
              or any(v["outside the agreement"] for v in report["sync_warn_mode"].values()))
    report["calls"] = len(values)
    report["ok"] = not failed
    (out / f"streams-{tag}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("tag", "calls", "ok", "errors")}, indent=2))
    for key, verdict in report["sync_error_mode"].items():
        if verdict != "no host sync":
            print(f"{key}: {verdict}")
    return 0 if not failed else 1


def compare(a: Path, b: Path) -> int:
    import torch

    from workers import forced as fw

    va, vb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    differ = sorted(k for k in va.keys() | vb.keys() if k not in va or k not in vb or not fw.same(va[k], vb[k]))
    print(json.dumps({"compared": len(va.keys() & vb.keys()), "bitwise_equal": not differ, "differ": differ},
                     indent=2))
    return 0 if not differ and va else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--tag", required=True)
    r.add_argument("--hidden", type=int, default=512)
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the script (gloo)")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    return run(args.out, args.tag, args.hidden, args.device) if args.what == "run" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
