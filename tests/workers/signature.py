"""Issue 51, the generated test, worker side: every argument of every collective call, different on one rank.

The calls and their arguments come from the code: :data:`zero_dtensor.comm.signature.COLLECTIVE_CALLS` (every call
marked ``@collective``: the families' methods, the API functions, ``zd.save`` / ``zd.load``) and each one's
``inspect.signature``. An argument the agreement leaves out (:data:`~zero_dtensor.comm.signature.NOT_BY_VALUE`
without an encoder) is not varied; :data:`REVIEWED_EXCLUSIONS` is the list of those a reviewer accepted (the test
side fails where the table and it differ, so leaving an argument out of the agreement fails the test).

For each case ``call.argument`` (on each family for the families' methods) the worker calls the call once with
base values on every rank (it must pass), then again with the argument's other value on the last rank only, and
asserts :class:`~zero_dtensor.errors.RankDisagreementError` on every rank with nothing written (every family's
partitions and the module's weights bitwise; for ``save`` the checkpoint directories unchanged). The values come
from :data:`GENERATORS`, one entry per argument name (the arguments' types, in this API) plus two fallbacks by the
default's type (a bool flips, a float moves one ulp); an argument with no generator fails the collection, naming it.
"""

from __future__ import annotations

import inspect
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zero_dtensor as zd
from zero_dtensor.comm.signature import COLLECTIVE_CALLS, NOT_BY_VALUE
from zero_dtensor.errors import RankDisagreementError

from .common import EngineCase, build_engine, forward_backward
from .rows import Rows

#: the arguments left out of the agreement, as a reviewer accepted them (``NOT_BY_VALUE`` entries without encoder)
REVIEWED_EXCLUSIONS = {("*", "engine"), ("TensorOwners.map_full_", "fn"), ("TensorOwners.set_owned_", "mapping"),
                       ("save", "client_state"), ("set_state_dict", "model_state_dict")}

#: the receiver of each class's marked methods: every family, or one parameter's view of it
FAMILY_CLASSES = {"ShardedTensors", "TensorMath", "TensorReductions", "TensorOwners"}
VIEW_CLASSES = {"ParamView"}
FAMILIES = ("grads", "masters", "exp_avg")


@dataclass
class Context:
    """What the generators read: the engine, its families, two clones of each, checkpoint directories."""

    engine: Any
    families: dict[str, Any]
    clones: dict[str, tuple[Any, Any]]
    saves: tuple[str, str]  # empty directories for save
    checkpoints: tuple[str, str]  # two checkpoints of this engine for load
    call: str = ""
    family: Any = None
    done: set[tuple[str, str]] = field(default_factory=set)  # (call, family) whose base call ran

    @property
    def names(self) -> list[str]:
        return list(self.families["grads"].names)


def _fewer(ctx: Context, default: Any) -> tuple[Any, Any]:
    return default, ctx.names[:-1]


def _dtype(ctx: Context, default: Any) -> tuple[Any, Any]:
    return default, torch.float32 if default == torch.float64 else torch.float64


def _strategy(ctx: Context, default: Any) -> tuple[Any, Any]:
    return default, "all_reduce" if default == "all_gather" else "all_gather"


def _owners(ctx: Context, default: Any) -> tuple[Any, Any]:
    moved = ctx.families["grads"].owners()
    first = next(iter(moved))
    moved[first] = (moved[first] + 1) % dist.get_world_size()
    return default, moved


def _other(ctx: Context, default: Any) -> tuple[Any, Any]:
    label = next(k for k, f in ctx.families.items() if f is ctx.family) if ctx.family is not None else "grads"
    return ctx.clones[label]


def _mapping(ctx: Context, default: Any) -> tuple[Any, Any]:
    if ctx.call == "TensorOwners.set_dtensors_":
        base = ctx.family.to_dtensors()
    elif ctx.call == "set_full_fp32_params":
        base = ctx.families["masters"].full_tensors()
    elif ctx.call == "TensorOwners.set_owned_":  # left out of the agreement: only its base value is needed
        return {}, None
    else:
        raise LookupError(f"no generator of a mapping for {ctx.call}")
    return base, {n: base[n] for n in list(base)[:-1]}


def _path(ctx: Context, default: Any) -> tuple[Any, Any]:
    if ctx.call == "save":
        return ctx.saves
    if ctx.call == "load":
        return ctx.checkpoints
    raise LookupError(f"no generator of a path for {ctx.call}")


def _optim_state(ctx: Context, default: Any) -> tuple[Any, Any]:
    """``get_state_dict``'s optimizer dict, and the same with one hyperparameter one ulp larger (for every
    parameter: its group's parameters must agree)."""
    base = zd.get_state_dict(ctx.engine)[1]
    key = next(k for k, v in base.items() if k.startswith("param_groups.") and isinstance(v, float) and v > 0)
    hyper = "." + key.rsplit(".", 1)[1]
    return base, {k: math.nextafter(v, math.inf) if k.startswith("param_groups.") and k.endswith(hyper) else v
                  for k, v in base.items()}


#: per argument name: ``(ctx, default) -> (base value, another valid value)``; keep it small
GENERATORS: dict[str, Callable[[Context, Any], tuple[Any, Any]]] = {
    "names": _fewer,
    "params": _fewer,
    "dtype": _dtype,
    "strategy": _strategy,
    "owners": _owners,
    "other": _other,
    "grads": _other,
    "mapping": _mapping,
    "path": _path,
    "out": lambda ctx, default: (default, {}),
    "dst": lambda ctx, default: (default, 0),
    "bucket_bytes": lambda ctx, default: (default, default // 2),
    "max_norm": lambda ctx, default: (1.0, math.nextafter(1.0, math.inf)),
    "key": lambda ctx, default: ("exp_avg", "exp_avg_sq"),
    "model_state_dict": lambda ctx, default: (zd.get_state_dict(ctx.engine)[0], None),  # left out: a base only
    "optim_state_dict": _optim_state,
    "engine": lambda ctx, default: (ctx.engine, None),
    "fn": lambda ctx, default: (lambda name, full: full, None),
}


def _generator(name: str, default: Any) -> Callable[[Context, Any], tuple[Any, Any]] | None:
    if name in GENERATORS:
        return GENERATORS[name]
    if isinstance(default, bool):
        return lambda ctx, d: (d, not d)
    if isinstance(default, float):
        return lambda ctx, d: (d, math.nextafter(d, math.inf))
    return None


def excluded(call: str, arg: str) -> bool:
    rule = NOT_BY_VALUE.get((call, arg)) or NOT_BY_VALUE.get(("*", arg))
    return rule is not None and rule[1] is None


def _parameters(call: str) -> list[inspect.Parameter]:
    params = list(inspect.signature(COLLECTIVE_CALLS[call]).parameters.values())
    return params[1:] if "." in call else params  # a method's receiver is given by the case


def _receivers(call: str) -> tuple[str, ...]:
    owner = call.split(".")[0] if "." in call else None
    if owner is None:
        return ("",)
    if owner in FAMILY_CLASSES or owner in VIEW_CLASSES:
        return FAMILIES
    raise LookupError(f"{call}: a collective method of {owner}, which this test cannot make: add it to "
                      "FAMILY_CLASSES / VIEW_CLASSES")


def cases() -> list[str]:
    """Every case, ``call.argument`` (``@family`` for the families' methods), from the registry and the
    signatures; raises ``LookupError`` naming every argument without a generator."""
    rows, missing = [], []
    for call in sorted(COLLECTIVE_CALLS):
        for p in _parameters(call):
            default = None if p.default is inspect.Parameter.empty else p.default
            if excluded(call, p.name):  # not varied: a base value is needed where there is no default
                if p.default is inspect.Parameter.empty and p.name not in GENERATORS:
                    missing.append(f"{call}({p.name}) (a base value)")
                continue
            if _generator(p.name, default) is None:
                missing.append(f"{call}({p.name})")
            rows += [f"{call}.{p.name}" + (f"@{r}" if r else "") for r in _receivers(call)]
    if missing:
        raise LookupError(f"no generator of another valid value for {missing}: add one to GENERATORS in "
                          f"{__name__} (every argument of a collective call must be varied by the generated test)")
    return rows


ROWS = cases()


def _consume(result: Any) -> Any:
    if hasattr(result, "wait") and callable(result.wait):
        return result.wait()
    if isinstance(result, Iterator):
        return list(result)
    return result


def _snapshot(ctx: Context) -> list[Any]:
    families = [*ctx.families.values(), zd.sharded_optimizer_state(ctx.engine, "exp_avg_sq")]
    parts = [p.clone() for f in families for p in f.local_partitions]
    parts += [p.detach().clone() for p in ctx.engine.module.parameters()]
    files = []
    for d in (*ctx.saves, *ctx.checkpoints):
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            stat = entry.stat()
            files.append((d, entry.name, stat.st_size, stat.st_mtime_ns))
    return [parts, files]


def _same(a: list[Any], b: list[Any]) -> bool:
    return a[1] == b[1] and len(a[0]) == len(b[0]) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[0], b[0]))


def _arguments(ctx: Context, call: str, varied: str | None) -> dict[str, Any]:
    """The call's arguments by name: base values, ``varied``'s other value on the last rank."""
    last = dist.get_rank() == dist.get_world_size() - 1
    kwargs: dict[str, Any] = {}
    for p in _parameters(call):
        default = None if p.default is inspect.Parameter.empty else p.default
        if p.name != varied and p.name not in GENERATORS and p.default is not inspect.Parameter.empty:
            kwargs[p.name] = p.default
            continue
        generator = _generator(p.name, default)
        assert generator is not None, (call, p.name)
        base, other = generator(ctx, default)
        kwargs[p.name] = other if p.name == varied and last else base
    return kwargs


def _run(ctx: Context, call: str, kwargs: dict[str, Any]) -> Any:
    fn = COLLECTIVE_CALLS[call]
    if "." not in call:
        return _consume(fn(**kwargs))
    receiver = ctx.family if call.split(".")[0] not in VIEW_CLASSES else ctx.family[ctx.family.names[0]]
    return _consume(fn(receiver, **kwargs))


def _case(ctx: Context, row: str) -> None:
    target, _, label = row.partition("@")
    call, _, arg = target.rpartition(".")
    ctx.call, ctx.family = call, ctx.families[label] if label else None
    if (call, label) not in ctx.done:  # the base call passes on every rank
        _run(ctx, call, _arguments(ctx, call, None))
        ctx.done.add((call, label))
    kwargs = _arguments(ctx, call, arg)
    before = _snapshot(ctx)
    try:
        _run(ctx, call, kwargs)
    except RankDisagreementError as exc:
        assert "rank" in str(exc), str(exc)
    else:
        raise AssertionError(f"{row}: another value on rank {dist.get_world_size() - 1} did not raise "
                             "RankDisagreementError")
    assert _same(before, _snapshot(ctx)), f"{row}: something was written"


def _shared_dir() -> str:
    made = [tempfile.mkdtemp(prefix="zd-signature-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, 0)
    return made[0]


def generated(case: EngineCase) -> dict[str, Any]:
    """Every row of :data:`ROWS` on one engine, in the backward → step window after one applied step."""
    engine = build_engine(case)
    forward_backward(engine)
    engine.step()
    forward_backward(engine, 1)
    families = {"grads": zd.sharded_grads(engine), "masters": zd.sharded_master_params(engine),
                "exp_avg": zd.sharded_optimizer_state(engine, "exp_avg")}
    clones = {k: (f.clone(), f.clone()) for k, f in families.items()}
    root = _shared_dir()
    saves = (os.path.join(root, "save_a"), os.path.join(root, "save_b"))
    checkpoints = (os.path.join(root, "ckpt_a"), os.path.join(root, "ckpt_b"))
    if dist.get_rank() == 0:
        for d in saves:
            os.makedirs(d)
    for d in checkpoints:
        zd.save(engine, d)
    dist.barrier()
    ctx = Context(engine, families, clones, saves, checkpoints)
    rows = Rows(ROWS)
    for row in ROWS:
        rows.run(row, _case, ctx, row)
    return rows.report()
