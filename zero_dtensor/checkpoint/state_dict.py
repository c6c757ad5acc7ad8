"""A DeepSpeed ZeRO engine's state in the format of torch's ``get_state_dict`` / ``set_state_dict`` for FSDP2.

``get_state_dict(engine) -> (model_state_dict, optimizer_state_dict)``:

* **model**: ``{fqn: value}`` for every parameter of ``engine.module`` (``named_parameters()`` names; a tied
  parameter under each of its names, one value, as torch's ``get_model_state_dict`` gives it; ``set_state_dict``
  reads the first name). Trainable parameters hold the optimizer's **fp32 master weights** (what FSDP2's
  sharded parameters are with a mixed-precision policy: the working bf16/fp16 weights are the masters cast, and
  :func:`set_state_dict` restores them so); frozen parameters (no master) hold their working weights in the
  model dtype.
* **optimizer**: torch's *flattened* form (``StateDictOptions(flatten_optimizer_state_dict=True)``):
  ``state.<fqn>.<key>`` for the optimizer's tensors shaped like the parameter (Adam: ``exp_avg``, ``exp_avg_sq``),
  ``state.<fqn>.step`` a 0-d float32 tensor (the step of the parameter's flat group), and
  ``param_groups.<fqn>.<hyperparameter>`` every hyperparameter of the parameter's group (``lr``, ``betas``, ...).

Sharded values are DTensors of the parameter's shape whose local tensor is a ``LocalShardsWrapper`` of this rank's
pieces as row boxes (:mod:`.boxes`): DCP saves exactly those and reshards them to any world size, ZeRO stage or
FSDP2 layout. They are **DCP containers**, not DTensors to compute with. A rank that holds none of a parameter omits
its entries; ZeRO-1/2 frozen parameters (replicated) are plain tensors. Every value aliases the engine's memory
(masters, state, working weights): nothing is copied, nothing communicates. An engine that has never stepped has no
optimizer state yet: its ``state.*`` entries are then zero-filled tensors of the state the optimizer would create at
its first step (keys learned by a zero-lr step of the optimizer over a scratch parameter, swapped in and out), ``step``
0, and the engine is not changed.

``set_state_dict(engine, model_state_dict, optimizer_state_dict)`` writes such dicts back: values as
``get_state_dict`` makes them (e.g. after ``dcp.load`` into them; pieces already in the engine's memory are not
copied), or plain full tensors. Everything is checked on every rank first (names, shapes, state keys, pieces,
one step and one set of hyperparameters per group) and a failure raises on every rank before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from .._deepspeed import checkpointing as ds
from .._deepspeed import families
from .._deepspeed.sync import sync_model_params
from ..families.master import clear_write_mark
from ..comm.agreement import agree_outcome
from ..comm.signature import collective
from .boxes import boxes
from ..errors import CheckpointMismatchError
from .target import Target, describe, fragment, hyperparameters_by_name, model_dict, optim_dict

__all__ = ["get_state_dict", "set_state_dict"]


def _listing(what: str, names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
    return f"{what}: {shown}"


def state_partitions(engine: Any, target: Target) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per state key, the live partitions (zero-filled new ones before the first step)."""
    if target.ready:
        return {k: families.optimizer_state_storage(engine, k).partitions for k in target.state_keys}
    return {k: tuple(torch.zeros_like(p) for p in target.masters.partitions) for k in target.state_keys}


def current_steps(engine: Any, target: Target) -> tuple[float, ...]:
    if target.ready and target.has_step:
        return tuple(float(s) for s in families.optimizer_steps(engine))
    return (0.0,) * len(target.masters.partitions)


def get_state_dict(engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine's state in FSDP2's format: ``(model_state_dict, optimizer_state_dict)``.

    Keys ``model.<fqn>``, ``optim.state.<fqn>.<key>``, ``optim.param_groups.<fqn>.<hp>`` (torch's flattened
    optimizer form); values are DTensors that DCP reshards exactly, so ``dcp.save`` / ``dcp.load`` work on them.

    Args:
        engine: a DeepSpeed ZeRO engine.

    Returns:
        tuple[dict, dict]: the model and optimizer state dicts.

    Raises:
        UnsupportedDeepSpeedError: an engine zero_dtensor does not map.

    Communication:
        None.

    Device and memory:
        Views of the engine's memory; before the first step, one zero-filled partition per optimizer-state key.

    Example:
        ```python
        model_sd, optim_sd = zd.get_state_dict(engine)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")
        zd.set_state_dict(engine, model_sd, optim_sd)
        ```
    """
    target = describe(engine)
    model = model_dict(target, target.masters.partitions, {f.name: f.local for f in target.frozen})
    optim = optim_dict(target, state_partitions(engine, target), current_steps(engine, target),
                       hyperparameters_by_name(engine, target))
    return model, optim


# ---- validation --------------------------------------------------------------------------------------------------

def _pieces_of(value: Any, shape: torch.Size, start: int, stop: int, what: str) -> list[tuple[int, torch.Tensor]]:
    """``(position in the fragment, 1-D source)`` pairs that cover elements ``[start, stop)`` of ``value``."""
    if tuple(value.shape) != tuple(shape):
        raise CheckpointMismatchError(f"{what}: shape {tuple(value.shape)}, the engine's is {tuple(shape)}")
    if isinstance(value, DTensor):
        local = value.to_local()
        if not isinstance(local, LocalShardsWrapper):
            raise TypeError(f"{what}: a DTensor over {type(local).__name__}; set_state_dict takes the values "
                            "get_state_dict made (load a checkpoint into them with dcp.load) or full tensors")
        expected = boxes(tuple(shape), start, stop)
        offsets = [tuple(o) for o in local.local_offsets()]
        shards = local.local_shards()
        if offsets != [b.offsets for b in expected] or [tuple(s.shape) for s in shards] != [b.sizes for b in expected]:
            raise CheckpointMismatchError(f"{what}: pieces at {offsets} are not this rank's pieces of the engine "
                                          f"(elements [{start}, {stop}))")
        return [(b.start, s.reshape(-1)) for b, s in zip(expected, shards)]
    if not torch.is_tensor(value):
        raise TypeError(f"{what}: a tensor, got {type(value).__name__}")
    return [(0, value.detach().reshape(-1)[start:stop])]


def _split_key(key: str, prefix: str) -> tuple[str, str] | None:
    if not key.startswith(prefix) or "." not in key[len(prefix):]:
        return None
    fqn, _, name = key[len(prefix):].rpartition(".")
    return fqn, name


def _same(a: Any, b: Any) -> bool:
    if a is b:  # a load unpickles each distinct hyperparameter value once
        return True
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _check_model(target: Target, model: Mapping[str, Any]) -> list[str]:
    shapes = target.shapes()
    problems = []
    extra = sorted(set(model) - set(shapes) - set(target.alias_shapes()))  # a tied parameter's further names: ignored
    held = [p.name for p in target.pieces if p.stop > p.start]
    held += [f.name for f in target.frozen if f.stop > f.start]
    missing = [n for n in held if n not in model]
    if missing:
        problems.append(_listing("model entries missing", missing))
    if extra:
        problems.append(_listing("model entries the engine does not have", extra))
    return problems


def _check_optim(target: Target, optim: Mapping[str, Any], hparams: Mapping[str, Mapping[str, Any]]
                 ) -> tuple[list[str], list[float | None], dict[int, dict[str, Any]]]:
    """Problems, per flat group its step (``None`` where no entry gave one), per inner group the hyperparameters
    to write."""
    problems: list[str] = []
    names = set(target.names)
    keys = set(target.entry_keys())
    extra = []
    expected = {f"state.{n}.{k}" for n in names for k in keys}
    expected.update(f"param_groups.{n}.{h}" for n in names for h in hparams.get(n, ()))
    # every state entry the engine has is expected; so is every hyperparameter it has, and a parameter's other
    # hyperparameters are accepted (not written)
    for key in optim.keys() - expected:
        split = _split_key(key, "param_groups.")
        if split is None or split[0] not in names:
            extra.append(key)
    if extra:
        problems.append(_listing("optimizer entries the engine does not have (another model or optimizer?)",
                                 sorted(extra)))
    missing = [f"state.{p.name}.{k}" for p in target.pieces for k in target.state_keys
               if p.stop > p.start and f"state.{p.name}.{k}" not in optim]
    missing += [f"state.{p.name}.step" for p in target.pieces if target.has_step and f"state.{p.name}.step" not in optim]
    if missing:
        problems.append(_listing("optimizer entries missing", missing))
    steps: list[float | None] = [None] * len(target.masters.partitions)
    step_of: list[str] = [""] * len(steps)
    chosen: dict[int, dict[str, Any]] = {}
    chosen_by: dict[int, str] = {}
    for p in target.pieces:
        value = optim.get(f"state.{p.name}.step")
        if value is not None and target.has_step:
            step = float(value.item() if torch.is_tensor(value) else value)
            if steps[p.group] is None:
                steps[p.group], step_of[p.group] = step, p.name
            elif steps[p.group] != step:
                problems.append(f"step of {p.name} is {step} but {step_of[p.group]}, in the same optimizer flat "
                                f"group, has {steps[p.group]}: DeepSpeed keeps one step per group")
        group = target.param_group[p.group]
        given = {name: optim[f"param_groups.{p.name}.{name}"] for name in hparams[p.name]
                 if f"param_groups.{p.name}.{name}" in optim}
        if group not in chosen:
            chosen[group], chosen_by[group] = given, p.name
        else:
            differ = sorted(k for k in set(given) | set(chosen[group])
                            if k not in given or k not in chosen[group] or not _same(given[k], chosen[group][k]))
            if differ:
                problems.append(f"hyperparameters {differ} of {p.name} differ from those of {chosen_by[group]}, "
                                f"in the same parameter group of the engine")
    return problems, steps, chosen


# ---- writing -----------------------------------------------------------------------------------------------------

def _copy(dst: torch.Tensor, sources: list[tuple[int, torch.Tensor]]) -> None:
    for pos, src in sources:
        out = dst[pos:pos + src.numel()]
        if out.data_ptr() == src.data_ptr() and out.dtype == src.dtype and out.device == src.device:
            continue  # loaded in place
        out.copy_(src)


def _plan_copies(engine: Any, target: Target, model: Mapping[str, Any], optim: Mapping[str, Any]
                 ) -> list[tuple[str, str, Any, list[tuple[int, torch.Tensor]]]]:
    """``(family, name, piece-or-frozen, sources)`` for every value this rank writes (all validated)."""
    copies = []
    for p in target.pieces:
        if p.stop == p.start:
            continue
        copies.append(("master", p.name, p, _pieces_of(model[p.name], p.shape, p.start, p.stop, p.name)))
        for k in target.state_keys:
            key = f"state.{p.name}.{k}"
            copies.append((k, p.name, p, _pieces_of(optim[key], p.shape, p.start, p.stop, key)))
    for f in target.frozen:
        if f.stop > f.start:
            copies.append(("frozen", f.name, f, _pieces_of(model[f.name], f.shape, f.start, f.stop, f.name)))
    return copies


@collective
def set_state_dict(engine: Any, model_state_dict: Mapping[str, Any], optim_state_dict: Mapping[str, Any]) -> None:
    """Write ``zd.get_state_dict``-format dicts into ``engine``, then make the working weights the cast masters.

    Clears the masters' write mark.

    Args:
        engine: a DeepSpeed ZeRO engine.
        model_state_dict: ``{"model.<fqn>": tensor or DTensor}``.
        optim_state_dict: the flattened optimizer state dict.

    Returns:
        None.

    Raises:
        CheckpointMismatchError: the dicts do not fit the engine.
        TypeError: values of another kind. Both raise on every rank before anything is written.

    Communication:
        One agreement after the checks, then the working-weight refresh (ZeRO-1/2: one gather per param group;
        ZeRO-3: one of the persistent parameters).

    Device and memory:
        None beyond the engine's (before the first step, the optimizer state is created by a zero-learning-rate
        step: one master-sized zero gradient at a time).

    Example:
        ```python
        zd.set_state_dict(engine, model_sd, optim_sd)
        ```
    """
    write_state(engine, model_state_dict, optim_state_dict)
    sync_model_params(engine)
    clear_write_mark(engine)  # the refresh made the working weights from the masters: an earlier write is gone


@dataclass(frozen=True)
class CheckedState:
    """What :func:`apply_state` writes: the copies (family, name, where, source pieces), the groups' steps and the
    hyperparameters chosen per group, for the engine described by ``target``."""

    target: Target
    copies: list[tuple[str, str, Any, list[tuple[int, torch.Tensor]]]]
    steps: list[float | None]
    chosen: dict[int, dict[str, Any]]


#: what :func:`check_state` raises on this rank when the dicts do not fit
CHECK_ERRORS = (CheckpointMismatchError, TypeError, ValueError, KeyError)


@torch.no_grad()  # DTensor.to_local() where autograd records: 7.5 us a value (5.6 ms per 750 entries), 40x more
def check_state(engine: Any, model_state_dict: Mapping[str, Any], optim_state_dict: Mapping[str, Any],
                target: Target | None = None) -> CheckedState:
    """:func:`write_state`'s checks and copy plan, on this rank only (one of :data:`CHECK_ERRORS` where the dicts
    do not fit); ``target``: ``engine``'s, where the caller has it. No communication; nothing is written."""
    target = describe(engine) if target is None else target
    hparams = hyperparameters_by_name(engine, target)
    problems = _check_model(target, model_state_dict)
    more, steps, chosen = _check_optim(target, optim_state_dict, hparams)
    problems += more
    if problems:
        raise CheckpointMismatchError("the state does not fit this engine:\n  " + "\n  ".join(problems))
    return CheckedState(target, _plan_copies(engine, target, model_state_dict, optim_state_dict), steps, chosen)


def write_state(engine: Any, model_state_dict: Mapping[str, Any], optim_state_dict: Mapping[str, Any]) -> None:
    """:func:`set_state_dict` without the working-weight refresh (the caller runs
    :func:`~zero_dtensor._deepspeed.sync.sync_model_params` next, on every rank): :func:`check_state`, one
    agreement, :func:`apply_state`. Keeps no reference to the dicts' values once it returns."""
    error: BaseException | None = None
    checked: CheckedState | None = None
    try:
        checked = check_state(engine, model_state_dict, optim_state_dict)
    except CHECK_ERRORS as exc:
        error = exc
    target = describe(engine)
    agree_outcome("checkpoint.set_state_dict", error, [target.process_group], target.masters.device,
                  consequence="Nothing was written into the engine on any rank.", signature=())
    assert checked is not None
    apply_state(engine, checked)


def apply_state(engine: Any, checked: CheckedState) -> None:
    """Write what :func:`check_state` planned (after an agreement that every rank's check passed). No
    communication."""
    _write(engine, checked.target, checked.copies, checked.steps, checked.chosen)


def _write(engine: Any, target: Target, copies: list[tuple[str, str, Any, list[tuple[int, torch.Tensor]]]],
           steps: list[float | None], chosen: dict[int, dict[str, Any]]) -> None:
    if not target.ready:
        ds.init_optimizer_state(engine)
    states = {k: families.optimizer_state_storage(engine, k).partitions for k in target.state_keys}
    with torch.no_grad():
        for family, _, where, sources in copies:
            if family == "frozen":
                _copy(where.local, sources)
            else:
                partitions = target.masters.partitions if family == "master" else states[family]
                _copy(fragment(target, where, partitions), sources)
    if target.has_step and all(s is not None for s in steps):
        families.set_optimizer_steps(engine, [float(s) for s in steps])  # type: ignore[arg-type]
    for group, values in chosen.items():
        ds.set_group_hyperparameters(engine, group, values)
