"""Worker side of ``tests/test_forced_collectives.py`` (issue 52): the main calls of every family (gradients,
fp32 masters, ``exp_avg``) and the checkpoint, run unforced and under ``ZERO_DTENSOR_FORCE_COLLECTIVES=1``.

:func:`family_calls` runs every call of :data:`CALLS` on one engine (stepped once, then a fresh backward: gradients,
masters and optimizer state all readable) and returns, per call, its value (plain CPU tensors and numbers) and the
collectives it issued (``CommDebugMode``, plus the point-to-point batches it does not see). Calls that write act on
a clone or write back the values just read, so every call sees the same state in both runs.

At world 1 the test runs it twice (unforced, forced: the values must be equal), at 2 ranks once, unforced (the
forced world-1 counts must be those).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zero_dtensor as zd
from zero_dtensor.settings import ENV_FORCE_COLLECTIVES

from .common import EngineCase, build_engine, count_comms, forward_backward, pipelining

STRATEGIES = ("all_gather", "all_to_all", "all_reduce", "send_recv", "auto")
CASES = {
    "zero1": EngineCase(stage=1, groups=2, world=1),
    "zero2": EngineCase(stage=2, world=1),
    "zero3": EngineCase(stage=3, groups=2, world=1),
    "bf16_optimizer": EngineCase(stage=1, dtype="bf16", bf16_optimizer=True, world=1),
}


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """``ZERO_DTENSOR_FORCE_COLLECTIVES`` set to ``1`` (``on``) or unset, in this rank's environment."""
    previous = os.environ.get(ENV_FORCE_COLLECTIVES)
    if on:
        os.environ[ENV_FORCE_COLLECTIVES] = "1"
    else:
        os.environ.pop(ENV_FORCE_COLLECTIVES, None)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_FORCE_COLLECTIVES, None)
        else:
            os.environ[ENV_FORCE_COLLECTIVES] = previous


@contextlib.contextmanager
def small_windows() -> Iterator[None]:
    """ZeRO-3 gathers cut into column windows (the test models are far below the default window size)."""
    from workers.materialize import small_windows as windows

    with windows(64):
        yield


def plain(value: Any) -> Any:
    """``value`` as plain CPU data to compare and send back: tensors (DTensors: their local shard) detached on the
    CPU, mappings and sequences element by element, dataclasses as dicts."""
    if isinstance(value, DTensor):
        return ("dtensor", plain(value.to_local()), tuple(map(str, value.placements)))
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "items"):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.is_floating_point() else t


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two :func:`plain` values (nan equal to nan)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return a == b


def _write_back(front: Any) -> Any:
    """``set_full_`` of the values just read (a write that changes nothing), then the values again."""
    values = front.full_tensors()
    front.set_full_({n: v.clone() for n, v in values.items()})
    return front.full_tensors()


def _redistribute(front: Any) -> Any:
    """Rows (``to_dtensors``), written back (``set_dtensors_``); owners (``owned``), written back (``set_owned_``)."""
    rows = front.to_dtensors()
    front.set_dtensors_(rows)
    owned = front.owned()
    front.set_owned_({n: t.clone() for n, t in owned.items()})
    return {"rows": rows, "owned": owned}


def _calls() -> dict[str, Callable[[Any], Any]]:
    calls: dict[str, Callable[[Any], Any]] = {}
    for s in STRATEGIES:
        calls[f"full_tensors[{s}]"] = lambda f, s=s: f.full_tensors(strategy=s)
    for s in ("all_gather", "all_to_all", "all_reduce"):
        calls[f"full_tensors(async_op=True)[{s}]"] = lambda f, s=s: f.full_tensors(async_op=True, strategy=s).wait()
        calls[f"iter_full[{s}]"] = lambda f, s=s: dict(f.iter_full(bucket_bytes=1 << 30, strategy=s))
    calls["full_tensors(dst=0)[all_gather]"] = lambda f: f.full_tensors(dst=0, strategy="all_gather")
    calls["full_tensors(dst=0)[all_reduce]"] = lambda f: f.full_tensors(dst=0, strategy="all_reduce")
    calls["full_tensors[all_gather, pipelined]"] = lambda f: _pipelined(f)
    for s in ("all_gather", "all_to_all", "all_reduce"):
        calls[f"full_tensors[{s}, windowed]"] = lambda f, s=s: _windowed(f, s)
    calls.update({
        "param full_tensor": lambda f: {n: f[n].full_tensor() for n in list(f.names)[:2]},
        "to_dtensors + set_dtensors_ + owned + set_owned_": _redistribute,
        "norms": lambda f: f.norms(),
        "norms(inf)": lambda f: f.norms(float("inf")),
        "global_norm": lambda f: f.global_norm(),
        "dots": lambda f: f.dots(f.clone(), with_norms=True),
        "stats": lambda f: f.stats(),
        "clip_grad_norm_ (on a clone)": lambda f: _clipped(f),
        "set_full_": _write_back,
    })
    return calls


def _pipelined(front: Any) -> Any:
    with pipelining():
        return front.full_tensors(strategy="all_gather")


def _windowed(front: Any, strategy: str) -> Any:
    with small_windows():
        return front.full_tensors(strategy=strategy)


def _clipped(front: Any) -> Any:
    clone = front.clone()
    norm = clone.clip_grad_norm_(1e-3)
    return {"norm": norm, "values": clone.full_tensors()}


CALLS = _calls()


def _fronts(engine: Any) -> dict[str, Any]:
    return {"grads": zd.sharded_grads(engine), "masters": zd.sharded_master_params(engine),
            "exp_avg": zd.sharded_optimizer_state(engine, "exp_avg")}


def _run(fronts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for family, front in fronts.items():
        for name, call in CALLS.items():
            call(front)  # one-time caches (plans, calibration): the counted call is the steady one
            with count_comms() as counts:
                value = call(front)
            out[f"{family}: {name}"] = {"value": plain(value),
                                        "comms": {str(k): int(v) for k, v in counts.get_comm_counts().items()}}
    return out


def _checkpoint(engine: Any, path: str) -> dict[str, Any]:
    """``zd.save`` then ``zd.load`` into the same engine: their collectives, and the masters and ``exp_avg`` after."""
    if dist.get_rank() == 0 and os.path.exists(path):
        shutil.rmtree(path)
    dist.barrier()
    with count_comms() as counts:
        zd.save(engine, path)
    saved = {str(k): int(v) for k, v in counts.get_comm_counts().items()}
    with count_comms() as counts:
        zd.load(engine, path)
    loaded = {str(k): int(v) for k, v in counts.get_comm_counts().items()}
    with count_comms() as counts:
        zd.sync_model_params(engine)
    refresh = {str(k): int(v) for k, v in counts.get_comm_counts().items()}
    fronts = _fronts(engine)
    return {"zd.save": {"value": None, "comms": saved},
            "working-weight refresh (part of zd.load)": {"value": None, "comms": refresh},
            "zd.load": {"value": {f: plain(fronts[f].full_tensors()) for f in ("masters", "exp_avg")},
                        "comms": loaded}}


def family_calls(variant: str, modes: tuple[bool, ...], root: str) -> dict[bool, dict[str, dict[str, Any]]]:
    """Per mode (``False``: unforced, ``True``: ``ZERO_DTENSOR_FORCE_COLLECTIVES=1``), every call of
    :data:`CALLS` on the gradients, the masters and ``exp_avg`` of ``variant``'s engine (at this pool's world size),
    then ``zd.save`` / ``zd.load`` under ``root``: ``{call: {"value", "comms"}}``. Both modes read the same state."""
    case = dataclasses.replace(CASES[variant], world=dist.get_world_size())
    engine = build_engine(case)
    forward_backward(engine, 0)
    engine.step()
    forward_backward(engine, 1)
    out: dict[bool, dict[str, dict[str, Any]]] = {}
    for mode in modes:
        with forced(mode):
            out[mode] = _run(_fronts(engine))
    for mode in modes:  # after every read: a load refreshes the engine (its gradients are then stale)
        with forced(mode):
            out[mode].update(_checkpoint(engine, os.path.join(root, f"{variant}-w{dist.get_world_size()}-{mode}")))
    return out


def op_count_collectives(variant: str) -> dict[str, dict[int, Any]]:
    """``tests/workers/op_counts.py``'s rows of ``variant`` measured under ``ZERO_DTENSOR_FORCE_COLLECTIVES=1`` on this
    pool (world 1): per row and model size, the collectives (``CommDebugMode``) or the error. The engines are
    dropped after."""
    from . import op_counts

    try:
        with forced(True):
            measured = op_counts.count_variant(variant)
    finally:
        op_counts.release()
    return {row: {n: c.get("comm_ops", {"error": c.get("error")}) for n, c in sizes.items()}
            for row, sizes in measured.items()}
