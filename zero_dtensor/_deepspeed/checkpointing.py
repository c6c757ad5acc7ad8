"""What an elastic checkpoint needs from a DeepSpeed engine beyond the masters and the optimizer state
(:mod:`.families`): parameter groups and their hyperparameters, frozen parameters, the optimizer-state keys of a
never-stepped engine, a zero-learning-rate step that creates the state, the engine's step counters, its learning-rate
scheduler and its fp16 loss scaler. DeepSpeed 0.19.8 (``S12`` ``runtime/zero/stage_1_and_2.py``, ``S3``
``runtime/zero/stage3.py``, ``ENG`` ``runtime/engine.py``).

Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedDeepSpeedError
from ..comm.process_groups import rank_in
from . import check_engine
from .checkpoint_files import scaler_numbers
from .families import _masters, master_storage

__all__ = [
    "FrozenParam",
    "COUNTERS",
    "engine_counters",
    "frozen_params",
    "group_hyperparameters",
    "init_optimizer_state",
    "loss_scaler_state",
    "lr_scheduler_state",
    "micro_steps_into_accumulation",
    "param_group_of_flat_groups",
    "probe_state_keys",
    "set_engine_counters",
    "set_group_hyperparameters",
    "set_loss_scaler_state",
    "set_lr_scheduler_state",
]

#: the engine's step counters that ``engine.save_checkpoint`` saves and ``load_checkpoint`` restores (ENG:5377-5404)
COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def micro_steps_into_accumulation(engine: Any) -> tuple[int, int]:
    """``(micro-steps since the last optimizer step, gradient accumulation steps)``: the first is 0 at a gradient
    accumulation boundary (``engine.step()`` counts every micro-step in ``micro_steps`` and steps the optimizer at
    each multiple of the second; the gradients of the micro-steps between are held until then)."""
    gas = int(engine.gradient_accumulation_steps())
    return int(engine.micro_steps) % gas, gas


@dataclass(frozen=True)
class FrozenParam:
    """A parameter the optimizer does not own (``requires_grad=False``): its working weights are its only copy.
    ``local`` is this rank's 1-D piece (a view of the working memory) holding elements ``[start, stop)`` of the
    flattened parameter: ZeRO-1/2 the whole parameter (replicated), ZeRO-3 this rank's ``ceil(numel/N)`` chunk."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start: int
    stop: int
    local: torch.Tensor
    replicated: bool


def frozen_params(engine: Any, trainable: set[str]) -> tuple[FrozenParam, ...]:
    """The module's parameters outside ``trainable`` (model order; a tied parameter once). No communication."""
    zero3 = check_engine(engine) == "zero3"
    found = []
    for name, p in engine.module.named_parameters():
        if name in trainable:
            continue
        if zero3 and hasattr(p, "ds_tensor"):
            shape, numel = torch.Size(p.ds_shape), int(p.ds_numel)
            chunk = p.ds_tensor.numel()
            rank = rank_in(p.ds_process_group) if p.ds_process_group is not None else 0
            start = min(rank * chunk, numel)
            stop = min(start + chunk, numel)
            local = p.ds_tensor.data.view(-1)[: stop - start]
            found.append(FrozenParam(name, shape, p.ds_tensor.dtype, start, stop, local, False))
        else:
            found.append(FrozenParam(name, p.shape, p.dtype, 0, p.numel(), p.data.view(-1), True))
    return tuple(found)


def _inner(engine: Any) -> Any:
    return engine.optimizer.optimizer


def param_group_of_flat_groups(engine: Any) -> tuple[int, ...]:
    """Per flat group of :func:`~.families.master_storage` (ZeRO-3: per sub-group), the index of the inner
    optimizer's parameter group it belongs to."""
    kind = check_engine(engine)
    opt = engine.optimizer
    n = len(master_storage(engine).partitions)
    if kind == "zero3":
        return tuple(int(opt.sub_group_to_group_id[sg]) for sg in range(n))
    return tuple(range(n))


def group_hyperparameters(engine: Any) -> tuple[dict[str, Any], ...]:
    """Per inner parameter group, its hyperparameters (everything but ``params``): the live values (a copy of the
    dicts)."""
    return tuple({k: v for k, v in g.items() if k != "params"} for g in _inner(engine).param_groups)


def set_group_hyperparameters(engine: Any, index: int, values: Mapping[str, Any]) -> None:
    """Write hyperparameters of inner parameter group ``index`` (keys it already has only; ``params`` never)."""
    group = _inner(engine).param_groups[index]
    for key, value in values.items():
        if key != "params" and key in group:
            group[key] = value


def _zero_lr_groups(group: Mapping[str, Any], params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{**group, "params": params, "lr": 0.0}]


def probe_state_keys(engine: Any) -> tuple[tuple[str, ...], bool]:
    """``(tensor keys shaped like the parameter, has_step)`` that the inner optimizer creates at its first step,
    learned by one inner ``step()`` with learning rate 0 over a 2-element scratch parameter (the masters' dtype and
    device) swapped in as its only group; the groups are swapped back and the scratch state dropped, so the engine
    keeps no trace."""
    inner = _inner(engine)
    saved_groups = inner.param_groups
    like = _masters(engine).tensors[0]
    scratch = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
    scratch.grad = torch.zeros_like(scratch)
    try:
        inner.param_groups = _zero_lr_groups(saved_groups[0], [scratch])
        inner.step()
    except Exception as exc:  # noqa: BLE001 - any failure means the class cannot be probed
        raise UnsupportedDeepSpeedError(
            f"cannot learn the optimizer state of {type(inner).__qualname__} before its first step ({exc}); take "
            "one engine.step() before loading a checkpoint"
        ) from exc
    finally:
        inner.param_groups = saved_groups
        state = inner.state.pop(scratch, {})
    keys = tuple(sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == scratch.shape))
    return keys, "step" in state


def init_optimizer_state(engine: Any) -> None:
    """Create the inner optimizer's state of a never-stepped engine as its first step would: per flat group one
    inner ``step()`` with learning rate 0 over the master with a zero gradient (the group's list swapped in and
    out as DeepSpeed's own step does, S12:2967-2984). The masters are not changed (a zero-lr step adds 0); the
    state's values are meant to be overwritten (a checkpoint load). Memory: one master-sized zero gradient at a
    time."""
    inner = _inner(engine)
    masters = _masters(engine).tensors
    saved_groups = inner.param_groups
    groups = param_group_of_flat_groups(engine)
    try:
        for master, g in zip(masters, groups):
            if inner.state.get(master) is not None:
                continue
            previous = master.grad
            master.grad = torch.zeros_like(master)
            inner.param_groups = _zero_lr_groups(saved_groups[g], [master])
            try:
                inner.step()
            finally:
                master.grad = previous
    finally:
        inner.param_groups = saved_groups


def engine_counters(engine: Any) -> dict[str, int]:
    """The engine's :data:`COUNTERS` as ints."""
    return {name: int(getattr(engine, name)) for name in COUNTERS}


def set_engine_counters(engine: Any, values: Mapping[str, int]) -> None:
    for name in COUNTERS:
        if name in values:
            setattr(engine, name, int(values[name]))


def lr_scheduler_state(engine: Any) -> dict[str, Any] | None:
    """``engine.lr_scheduler.state_dict()``, or ``None`` without a scheduler."""
    scheduler = getattr(engine, "lr_scheduler", None)
    return None if scheduler is None else scheduler.state_dict()


def set_lr_scheduler_state(engine: Any, state: Mapping[str, Any] | None) -> None:
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and state is not None:
        scheduler.load_state_dict(dict(state))


def loss_scaler_state(engine: Any) -> dict[str, Any] | None:
    """The fp16 loss scaler's numeric attributes (``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
    ``cur_hysteresis``, ...), or ``None`` where the optimizer has none."""
    return scaler_numbers(getattr(engine.optimizer, "loss_scaler", None))


def set_loss_scaler_state(engine: Any, state: Mapping[str, Any] | None) -> None:
    """Write back what :func:`loss_scaler_state` read (attributes this scaler has; tensors filled in place)."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None or state is None:
        return
    for key, value in state.items():
        if not hasattr(scaler, key):
            continue
        current = getattr(scaler, key)
        if torch.is_tensor(current):
            current.fill_(value)
        else:
            setattr(scaler, key, value)
