"""Issue 11 checks, run on every rank: how many tensor operations one bulk call dispatches, for a model of 8
parameters and one of 64 (the same single param group).

:class:`OpCounter` is a ``TorchDispatchMode`` that counts every aten operation the call dispatches except views
(``OpOverload.is_view``: ``view``, ``narrow``, ``split``, ``unbind``, ``as_strided`` ...), ``detach``/``alias``/
``lift_fresh`` and metadata-only namespaces (``prim``/``prims``); collectives (``c10d``) are counted on their own
with ``CommDebugMode``. So it counts what a per-parameter Python loop would multiply: copies, kernels, allocations,
host syncs (``_local_scalar_dense``) and collectives. Not seen: tensors made from Python numbers on the CPU
(``torch.tensor`` / ``as_tensor`` dispatch only a ``lift_fresh`` view; on a GPU their copy would count).

Determinism: both models run the same sequence — a fresh backward, ``sharded_grads``, then per row its
preparation (not counted: operands, clones, previous results), the call once to fill one-time caches, a pause
until the backend has let go of that call's buffers (a gloo worker thread may hold a finished work, and so the
buffer of a dropped result, a moment after the call returned: whether the next call recycles it must not depend
on timing), then the call again under the counters; the counts of the second call are returned.
:func:`count_variant` measures every row of a configuration on one backward per (storage dtype, model size) (the
counts do not depend on the values); :func:`count_row` measures one row after its own step and backward. Engines
are built once per (configuration, model size) and reused (:func:`release` drops them).
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import zero_dtensor as zd

from .common import ds_config, make_engine, patient_recycling, pipelining

SIZES = (4, 32)  # Linear(7, 5) layers: 8 and 64 parameters
IN, OUT = 7, 5
VARIANTS = ("zero1", "zero2", "zero3", "bf16_optimizer")
_SKIPPED = {"detach", "alias", "lift_fresh"}
_SKIPPED_NAMESPACES = {"prim", "prims", "c10d", "_c10d_functional", "c10d_functional"}


class Wide(torch.nn.Module):
    """``layers`` ``Linear(7, 5)`` applied side by side to the same input (2 parameters each)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(IN, OUT) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers[0](x)
        for layer in self.layers[1:]:
            out = out + layer(x)
        return out


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten operations, views aside (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if counted(func):
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def counted(func: Any) -> bool:
    if getattr(func, "namespace", "aten") in _SKIPPED_NAMESPACES:
        return False
    if getattr(func, "is_view", False):
        return False
    return func.overloadpacket.__name__ not in _SKIPPED


# --- engines -----------------------------------------------------------------------------------------------------
_ENGINES: dict[tuple[str, str, int], Any] = {}


def _config(variant: str, dtype: str) -> dict:
    if variant == "bf16_optimizer":  # stage 1 + bf16 + fp32 accumulation: DeepSpeed's BF16_Optimizer (replicated)
        config = ds_config(1, "bf16")
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        return config
    return ds_config(int(variant[-1]), dtype)


def engine_for(variant: str, dtype: str, layers: int) -> Any:
    key = (variant, "bf16" if variant == "bf16_optimizer" else dtype, layers)
    engine = _ENGINES.get(key)
    if engine is None:
        engine = _ENGINES[key] = make_engine(_config(variant, dtype), Wide(layers))
    return engine


def release() -> int:
    """Drop the cached engines (end of the test module). Returns how many there were."""
    n = len(_ENGINES)
    _ENGINES.clear()
    return n


def backward(engine: Any) -> None:
    g = torch.Generator().manual_seed(17 + dist.get_rank())
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), IN, generator=g).to(dtype)
    engine.backward(engine(x).float().pow(2).mean())


# --- rows --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpRow:
    """One bulk call: ``fn(grads, ctx)`` with ``ctx = prep(grads)`` made beforehand (not counted). ``dtype`` is the
    configuration's (``bf16`` storage for the ``dtype=`` read, ``fp16`` for ``found_inf``; the BF16_Optimizer
    variant always uses its own)."""

    name: str
    fn: Callable[[Any, dict], Any]
    prep: Callable[[Any], dict] = field(default=lambda grads: {})
    dtype: str = "fp32"


def _half(grads: Any) -> list[str]:
    """Every other layer's weight and bias: half of the parameters, spread over the whole flat buffer."""
    return [n for n in grads.names if int(n.split(".")[1]) % 2 == 0]


def _with_clone(grads: Any) -> dict:
    return {"other": grads.clone()}


def _with_values(grads: Any) -> dict:
    return {"values": {n: t.clone() for n, t in grads.full_tensors(dtype=torch.float32).items()}}


def _iterate(grads: Any, strategy: str) -> int:
    n = 0
    for _, t in grads.iter_full(bucket_bytes=1 << 30, strategy=strategy):  # one bucket for the whole model
        n += 1
        del t
    return n


def _pipelined(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every ZeRO-3 all_gather pipelined whatever its size (``PIPELINE_MIN_BYTES`` 0 meanwhile)."""
    def run(*args: Any) -> Any:
        with pipelining():
            return fn(*args)
    return run


def _per_parameter(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with ``set_full_``'s staging declined (``writes._row_write`` answers ``None``): its per-parameter
    path, which large parameters take."""
    def run(*args: Any) -> Any:
        from zero_dtensor.ops import writes

        real, writes._row_write = writes._row_write, lambda *a: None
        try:
            return fn(*args)
        finally:
            writes._row_write = real
    return run


def _rows() -> list[OpRow]:
    rows: list[OpRow] = []
    for s in ("all_gather", "all_to_all", "all_reduce", "auto"):
        rows.append(OpRow(f"full_tensors[{s}]", lambda g, c, s=s: g.full_tensors(strategy=s)))
    for s in ("all_gather", "all_to_all", "all_reduce"):
        rows += [
            OpRow(f"full_tensors(dtype=float32)[{s}, bf16 storage]",
                  lambda g, c, s=s: g.full_tensors(dtype=torch.float32, strategy=s), dtype="bf16"),
            OpRow(f"full_tensors(out=prev)[{s}]", lambda g, c, s=s: g.full_tensors(out=c["prev"], strategy=s),
                  prep=lambda g, s=s: {"prev": g.full_tensors(strategy=s)}),
            OpRow(f"full_tensors(dst=0)[{s}]", lambda g, c, s=s: g.full_tensors(dst=0, strategy=s)),
            OpRow(f"full_tensors(async_op=True).wait()[{s}]",
                  lambda g, c, s=s: g.full_tensors(async_op=True, strategy=s).wait()),
            OpRow(f"iter_full(one bucket)[{s}]", lambda g, c, s=s: _iterate(g, s)),
        ]
    # ZeRO-3 all_gathers pipelined (two collectives, reordered piece by piece), forced on these small models
    rows += [
        OpRow("full_tensors[all_gather, pipelined]", _pipelined(lambda g, c: g.full_tensors(strategy="all_gather"))),
        OpRow("full_tensors(out=prev)[all_gather, pipelined]",
              _pipelined(lambda g, c: g.full_tensors(out=c["prev"], strategy="all_gather")),
              prep=_pipelined(lambda g, c=None: {"prev": g.full_tensors(strategy="all_gather")})),
        OpRow("full_tensors(dtype=float32)[all_gather, pipelined, bf16 storage]",
              _pipelined(lambda g, c: g.full_tensors(dtype=torch.float32, strategy="all_gather")), dtype="bf16"),
        OpRow("full_tensors(async_op=True).wait()[all_gather, pipelined]",
              _pipelined(lambda g, c: g.full_tensors(async_op=True, strategy="all_gather").wait())),
    ]
    rows.append(OpRow("set_full_", lambda g, c: g.set_full_(c["values"]), prep=_with_values))
    rows.append(OpRow("set_full_[per-parameter path]", _per_parameter(lambda g, c: g.set_full_(c["values"])),
                      prep=_with_values))
    transforms: list[tuple[str, Callable, Callable]] = [
        ("mul_", lambda g, c, p: g.mul_(0.5, params=p), lambda g: {}),
        ("div_", lambda g, c, p: g.div_(2.0, params=p), lambda g: {}),
        ("add_(scalar)", lambda g, c, p: g.add_(0.25, params=p), lambda g: {}),
        ("add_(clone, alpha=0.5)", lambda g, c, p: g.add_(c["other"], alpha=0.5, params=p), _with_clone),
        ("add_(clone)", lambda g, c, p: g.add_(c["other"], params=p), _with_clone),
        ("clamp_", lambda g, c, p: g.clamp_(-0.1, 0.1, params=p), lambda g: {}),
        ("zero_", lambda g, c, p: g.zero_(params=p), lambda g: {}),
        ("lerp_(clone)", lambda g, c, p: g.lerp_(c["other"], 0.5, params=p), _with_clone),
        ("lerp_(scalar)", lambda g, c, p: g.lerp_(0.0, 0.5, params=p), lambda g: {}),
        ("copy_(clone)", lambda g, c, p: g.copy_(c["other"], params=p), _with_clone),
        ("apply_", lambda g, c, p: g.apply_(lambda x: x.mul_(2.0), params=p), lambda g: {}),
        ("add_noise_", lambda g, c, p: g.add_noise_(0.01, 3, params=p), lambda g: {}),
    ]
    for name, fn, prep in transforms:
        rows.append(OpRow(name, lambda g, c, fn=fn: fn(g, c, None), prep=prep))
        rows.append(OpRow(f"{name}[params=half]", lambda g, c, fn=fn: fn(g, c, c["half"]),
                          prep=lambda g, prep=prep: {**prep(g), "half": _half(g)}))
    rows += [
        OpRow("clone", lambda g, c: g.clone()),
        OpRow("norms", lambda g, c: g.norms()),
        OpRow("norms(inf)", lambda g, c: g.norms(float("inf"))),
        OpRow("global_norm", lambda g, c: g.global_norm()),
        OpRow("dots(clone)", lambda g, c: g.dots(c["other"]), prep=_with_clone),
        OpRow("dots(clone, with_norms=True)", lambda g, c: g.dots(c["other"], with_norms=True), prep=_with_clone),
        OpRow("stats", lambda g, c: g.stats()),
        OpRow("clip_grad_norm_", lambda g, c: g.clip_grad_norm_(1e-3)),
        OpRow("clip_per_param_", lambda g, c: g.clip_per_param_(1e-3)),
        OpRow("found_inf[fp16]", lambda g, c: zd.found_inf(g), dtype="fp16"),
        OpRow("first sharded_grads of a step", lambda g, c: None),  # special-cased in count_row
    ]
    return rows


ROWS = {row.name: row for row in _rows()}
FIRST = "first sharded_grads of a step"


def settle(timeout: float = 0.1) -> None:
    """Wait (at most ``timeout``) until no finished collective still holds a buffer of a dropped result: until
    every recycled buffer of ``zero_dtensor.materialize.BUFFERS`` is idle. A live result (``out=prev``) keeps its
    buffer busy; the wait then simply ends at the timeout, the same on both models. Young garbage is collected
    first (a result caught in a reference cycle); a full collection would scan every engine's objects (slow)."""
    gc.collect(1)
    try:
        from zero_dtensor.materialize import BUFFERS
    except ImportError:  # a version without the shared allocator: give the backend thread a moment
        time.sleep(0.05)
        return
    deadline = time.monotonic() + timeout
    while not BUFFERS.idle() and time.monotonic() < deadline:
        time.sleep(0.001)


#: rows whose Python-level work is counted too (:func:`python_calls`: one more call)
PY_ROWS = ("set_full_", "set_full_[per-parameter path]")


def _measure(fn: Callable[[], Any], python: bool = False) -> dict[str, Any]:
    settle()
    with patient_recycling(), CommDebugMode() as comm:
        with OpCounter() as counter:
            result = fn()
    del result
    comms = {str(k): int(v) for k, v in comm.get_comm_counts().items()}
    return {"ops": sum(counter.ops.values()), "by_op": dict(counter.ops), "comms": sum(comms.values()),
            "comm_ops": comms, **({"py_calls": python_calls(fn)} if python else {})}


def python_calls(fn: Callable[[], Any]) -> int:
    """Function calls the interpreter makes in one more call of ``fn`` (Python functions, and C functions called
    from Python; a C-level ``map`` over many values counts once), outside the counting modes above (a mode makes
    every tensor attribute read a Python call)."""
    settle()
    calls = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    with patient_recycling():
        sys.setprofile(count)
        try:
            result = fn()
        finally:
            sys.setprofile(None)
    del result
    return calls[0]


def _count(engine: Any, row: OpRow) -> dict[str, Any]:
    if row.name == FIRST:
        backward(engine)
        zd.sharded_grads(engine)  # the same warm-up on both models: the first step after building the layout
        engine.step()
        backward(engine)
        counts = _measure(lambda: zd.sharded_grads(engine))
        engine.step()
        return counts
    backward(engine)
    grads = zd.sharded_grads(engine)
    ctx = row.prep(grads)
    row.fn(grads, ctx)  # one-time caches (plans, workspaces, per-step pieces)
    counts = _measure(lambda: row.fn(grads, ctx))
    del ctx
    engine.step()
    return counts


def count_row(variant: str, name: str) -> dict[int, dict[str, Any]]:
    """``{parameters: {"ops", "by_op", "comms", "comm_ops"}}`` of the call ``name`` for the 8- and 64-parameter
    models on configuration ``variant`` (this rank's counts)."""
    row = ROWS[name]
    out = {}
    for layers in SIZES:
        engine = engine_for(variant, row.dtype, layers)
        out[2 * layers] = _count(engine, row)
    return out


def count_variant(variant: str) -> dict[str, dict[int, dict[str, Any]]]:
    """Every row's counts on configuration ``variant`` in one call (``{row: {parameters: counts}}``): one backward
    per (storage dtype, model size) serves all the rows measured on it (the counts do not depend on the values)."""
    out: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in ROWS}
    for layers in SIZES:
        for dtype in sorted({row.dtype for row in ROWS.values()}):
            rows = [row for row in ROWS.values() if row.dtype == dtype and row.name != FIRST]
            engine = engine_for(variant, dtype, layers)
            backward(engine)
            grads = zd.sharded_grads(engine)
            for row in rows:
                try:  # a call that raises fails its own test only (the error is reported there)
                    ctx = row.prep(grads)
                    row.fn(grads, ctx)  # one-time caches (plans, workspaces, per-step pieces)
                    out[row.name][2 * layers] = _measure(lambda: row.fn(grads, ctx), row.name in PY_ROWS)
                    del ctx
                except Exception:  # noqa: BLE001
                    out[row.name][2 * layers] = {"error": traceback.format_exc()}
            engine.step()
        try:
            out[FIRST][2 * layers] = _count(engine_for(variant, ROWS[FIRST].dtype, layers), ROWS[FIRST])
        except Exception:  # noqa: BLE001
            out[FIRST][2 * layers] = {"error": traceback.format_exc()}
    return out
