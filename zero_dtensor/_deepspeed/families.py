"""DeepSpeed's fp32 master weights and optimizer state as the same sharded storage as its gradients.

Beside the gradient, every ZeRO optimizer keeps two more *families* of flat, sharded tensors with the gradient's
geometry: the fp32 **master weights** (what the inner optimizer updates) and the **optimizer state** (Adam's
``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``, ...), one state dict per master tensor. This module describes
them as :class:`~zero_dtensor.core.storage.FlatStorage` objects, so that everything built on the gradient storage (plans,
views, gathers, DTensors, transforms) applies unchanged. Facts used (DeepSpeed 0.19.8, checked by running;
``S12`` ``runtime/zero/stage_1_and_2.py``, ``S3`` ``runtime/zero/stage3.py``, ``BF`` ``runtime/bf16_optimizer.py``):

==============================  ===================================  ===============================================
optimizer kind                  master tensor, per flat group        layout (geometry of the gradient's partitions)
==============================  ===================================  ===============================================
``DeepSpeedZeroOptimizer``      ``single_partition_of_fp32_groups``  the gradient layout (``RaggedShard``), per param
(ZeRO-1/2, CPU offload)         ``[i]`` (S12:557-584; CPU with       group ``i``: the same flat offsets
                                offload)
``DeepSpeedZeroOptimizer_       ``fp32_partitioned_groups_flat[sg]`` the gradient layout (``ChunkShard``), per
Stage3`` (ZeRO-3, offload)      (S3:1140-1176), one per sub-group    sub-group
``BF16_Optimizer``              ``fp32_groups_flat_partition[i]``    the gradient layout's parameters (same offsets),
                                (BF:176-183)                         but each group **sharded** (``RaggedShard``,
                                                                     ``partition_numel = flat / N``) where the
                                                                     gradient group is ``Replicated``
==============================  ===================================  ===============================================

The state of flat group ``i`` is ``inner.state[master_i]`` (``inner`` = ``engine.optimizer.optimizer``; ZeRO-3
partial offload: or ``engine.optimizer.backup_optimizer``). Its tensor entries shaped like the master form one
family per key (:func:`optimizer_state_keys`, :func:`optimizer_state_storage`). ``step`` is not a family: torch's
optimizers keep it as a 0-d float32 CPU tensor per state dict (DeepSpeedCPUAdam / FusedAdam: a Python int), i.e. one
value per flat group (ZeRO-3: per sub-group), read and written by :func:`optimizer_steps` /
:func:`set_optimizer_steps`.

Each storage's ``partitions[i]`` **is** DeepSpeed's memory (a 1-D ``detach()``ed alias of the master / state tensor:
DeepSpeed's masters are leaves that require grad, which an in-place write outside ``torch.no_grad()`` would refuse):
in-place writes change what the next ``engine.step()`` starts from. A master write does not reach the model's working
(bf16/fp16/fp32) weights by itself: call :func:`zero_dtensor._deepspeed.sync.sync_model_params` afterwards.
``loss_scale`` is always 1.0 (masters and state hold true values). ``is_current()`` stays True across steps (the
masters and state are updated in place) until DeepSpeed replaces the tensors: every ``engine.load_checkpoint`` path
gives the optimizer state new tensors (the masters are copied in place); a storage is then stale and must be made
again. ``after_write`` does nothing here (DeepSpeed keeps no bookkeeping derived from masters or state); the
public front (:mod:`zero_dtensor.families.master`) gives the masters' storage one that marks the engine as needing
:func:`~zero_dtensor.sync_model_params`.

Why :class:`~zero_dtensor.core.storage.FlatStorage` and not a new type: every field already means what a family needs
(a layout; partitions that are the optimizer's memory; process groups; a loss scale, here 1.0; the device; a
currency check; a write hook; view caches), so the gradient machinery (plans, gathers, redistribution, transforms)
takes these storages as they are. Only its name and its ``is_current`` wording say "gradient"; what it cannot carry
comes separately: the family's name is in ``describe``, the per-group ``step`` from :func:`optimizer_steps`.

When the families exist: the masters from ``deepspeed.initialize`` on; the optimizer state only after the inner
optimizer's first ``step()`` (torch creates it lazily; an fp16 step skipped for overflow creates none), before which
every state call raises :class:`OptimizerStateNotReadyError`. ZeRO-3 with ``offload_optimizer.device: nvme`` keeps
masters and state in files between steps: refused with :class:`~zero_dtensor.errors.UnsupportedDeepSpeedError`.

Nothing here communicates. Memory: none beyond the views the storages cut (their view caches keep, per family and
flat group, the tensor DeepSpeed held when the storage was made, until the next call for that family).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist

from ..errors import OptimizerStateNotReadyError, UnsupportedDeepSpeedError
from ..layout.flat import FlatLayout, GroupLayout, Packing
from ..core.storage import FlatStorage
from . import check_engine
from ._common import cached_layout, kept_partition, same_memory

__all__ = [
    "MASTER",
    "StepValue",
    "master_storage",
    "optimizer_state_keys",
    "optimizer_state_ready",
    "optimizer_state_storage",
    "optimizer_steps",
    "set_optimizer_steps",
]

#: the family name of the fp32 master weights (in ``FlatStorage.describe`` and the view-cache keys)
MASTER = "master"

#: one flat group's optimizer step: a live 0-d tensor (torch optimizers) or a number (DeepSpeed's CPU/fused Adam)
StepValue = Union[torch.Tensor, int, float]


@dataclass(frozen=True)
class _Masters:
    """DeepSpeed's master tensors of one engine, and how their storages are described."""

    describe: str
    #: per flat group, DeepSpeed's master tensor (the inner optimizer's parameter; the key of its state)
    tensors: tuple[torch.Tensor, ...]
    process_groups: tuple[dist.ProcessGroup, ...]
    #: the layout of per-group partitions like ``tensors`` (geometry only: one per engine geometry, shared by
    #: every family of that geometry and so is its plan)
    layout: Callable[[tuple[torch.Tensor, ...]], FlatLayout]
    #: the torch optimizers whose ``state`` may hold a master's state (ZeRO-3 partial offload: two)
    optimizers: tuple[Any, ...]
    #: re-reads the master tensors from the optimizer (to detect replaced tensors)
    read: Callable[[], tuple[torch.Tensor, ...]]


def _check_sizes(describe: str, tensors: Sequence[torch.Tensor], expected: Sequence[int]) -> None:
    for i, (t, n) in enumerate(zip(tensors, expected)):
        if t.dim() != 1 or t.numel() != n or not t.is_contiguous():
            raise UnsupportedDeepSpeedError(
                f"{describe}: the fp32 master of flat group {i} has shape {tuple(t.shape)} (contiguous: "
                f"{t.is_contiguous()}), expected one contiguous 1-D partition of {n} elements; zero_dtensor knows "
                "DeepSpeed 0.18.9 and 0.19.x without NVMe offload"
            )


def _zero12(engine: Any, opt: Any) -> _Masters:
    from . import zero12

    def read() -> tuple[torch.Tensor, ...]:
        return tuple(opt.single_partition_of_fp32_groups)

    describe = f"ZeRO-{2 if opt.partition_gradients else 1}" + (" + CPU offload" if opt.cpu_offload else "")
    tensors = read()
    _check_sizes(describe, tensors, [int(n) for n in opt.partition_size])
    return _Masters(
        describe=describe,
        tensors=tensors,
        process_groups=tuple(opt.real_dp_process_group[i] for i in range(len(tensors))),
        layout=lambda parts: zero12.layout_for(engine, opt, parts)[0],
        optimizers=(opt.optimizer,),
        read=read,
    )


def _zero3(engine: Any, opt: Any) -> _Masters:
    from . import zero3

    if getattr(opt, "swap_optimizer", False):
        raise UnsupportedDeepSpeedError(
            "ZeRO-3 with offload_optimizer.device 'nvme' keeps the fp32 masters and optimizer state in files between "
            "steps; zero_dtensor views memory only: use offload_optimizer.device 'cpu' or 'none'"
        )

    def read() -> tuple[torch.Tensor, ...]:
        return tuple(opt.fp32_partitioned_groups_flat)

    describe = "ZeRO-3" + (" + CPU offload" if opt.offload_optimizer else "")
    tensors = read()
    _check_sizes(describe, tensors, zero3._partition_sizes(opt))
    pg = zero3.layout_for(engine, opt, tensors)[2]
    backup = getattr(opt, "backup_optimizer", None)  # partial offload: sub-groups kept on the accelerator
    return _Masters(
        describe=describe,
        tensors=tensors,
        process_groups=(pg,) * len(tensors),
        layout=lambda parts: zero3.layout_for(engine, opt, parts)[0],
        optimizers=(opt.optimizer,) if backup is None else (opt.optimizer, backup),
        read=read,
    )


def _bf16(engine: Any, opt: Any) -> _Masters:
    from . import bf16

    def read() -> tuple[torch.Tensor, ...]:
        return tuple(opt.fp32_groups_flat_partition)

    describe = "BF16_Optimizer (ZeRO-1)"
    tensors = read()
    # the gradient layout (every group replicated: the full flat buffer on every rank) gives the parameters' offsets
    grad_layout = bf16.layout_for(engine, opt, tuple(g.view(-1) for g in opt.fp32_groups_gradients_flat))
    expected = []
    for g in grad_layout.groups:
        if g.partition_numel % g.world_size:
            raise UnsupportedDeepSpeedError(f"{describe}: flat group {g.index} of {g.partition_numel} elements does "
                                            f"not split evenly over {g.world_size} ranks")
        expected.append(g.partition_numel // g.world_size)
    _check_sizes(describe, tensors, expected)

    def layout(parts: tuple[torch.Tensor, ...]) -> FlatLayout:
        def build() -> FlatLayout:
            groups = tuple(GroupLayout(g.index, g.world_size, g.rank, part.numel(), Packing.CONTIGUOUS)
                           for g, part in zip(grad_layout.groups, parts))
            return FlatLayout(groups=groups, params=grad_layout.params)

        return cached_layout(opt, ("bf16 sharded", grad_layout), build)

    return _Masters(
        describe=describe,
        tensors=tensors,
        process_groups=tuple(opt.real_dp_process_group[i] for i in range(len(tensors))),
        layout=layout,
        optimizers=(opt.optimizer,),
        read=read,
    )


def _masters(engine: Any) -> _Masters:
    kind = check_engine(engine)
    build = {"zero12": _zero12, "zero3": _zero3, "bf16": _bf16}[kind]
    return build(engine, engine.optimizer)


def _storage(engine: Any, masters: _Masters, family: str, tensors: tuple[torch.Tensor, ...],
             is_current: Callable[[], bool]) -> FlatStorage:
    caches = tuple(kept_partition(engine.optimizer, ("family", family, i), t.detach().view(-1))
                   for i, t in enumerate(tensors))
    partitions = tuple(c.buffer for c in caches)
    return FlatStorage(
        layout=masters.layout(partitions),
        partitions=partitions,
        process_groups=masters.process_groups,
        loss_scale=1.0,
        device=engine.device,
        is_current=is_current,
        describe=f"{masters.describe} {_family_name(family)}",
        view_caches=caches,
        family=_family_name(family),
    )


def _family_name(family: str) -> str:
    """The family's fingerprint (:attr:`~zero_dtensor.core.storage.FlatStorage.family`) and name in messages."""
    return "master weights" if family == MASTER else f"optimizer state {family!r}"


def _same_masters(masters: _Masters) -> bool:
    now = masters.read()
    return len(now) == len(masters.tensors) and all(
        a is b and same_memory(a.view(-1), b.view(-1)) for a, b in zip(now, masters.tensors))


def master_storage(engine: Any) -> FlatStorage:
    """The fp32 master weights of ``engine``'s optimizer: per flat group this rank's master partition, on the
    master's device (CPU under offload), in the gradient's geometry (see the module docstring; ``BF16_Optimizer``:
    sharded where its gradient is replicated). Available from ``deepspeed.initialize`` on; writes change what the
    next ``engine.step()`` starts from, and reach the model's working weights after
    :func:`~zero_dtensor._deepspeed.sync.sync_model_params`. ``is_current()`` answers whether DeepSpeed still holds
    these tensors. No communication; no memory beyond the views."""
    masters = _masters(engine)
    return _storage(engine, masters, MASTER, masters.tensors, lambda: _same_masters(masters))


def _state_dicts(masters: _Masters) -> tuple[dict[str, Any] | None, ...]:
    """Per flat group, the inner optimizer's state dict of its master (``None`` where none exists yet). Read with
    ``.get``: torch's ``state`` is a ``defaultdict``, and a lookup by ``[]`` would create empty entries."""
    found = []
    for master in masters.tensors:
        state = None
        for optimizer in masters.optimizers:
            state = optimizer.state.get(master)
            if state is not None:
                break
        found.append(state)
    return tuple(found)


def optimizer_state_ready(engine: Any) -> bool:
    """Whether ``engine``'s optimizer state exists for every flat group (after the first optimizer step; ZeRO-3
    Muon and Adagrad create theirs at initialization). No communication."""
    return all(state is not None for state in _state_dicts(_masters(engine)))


def _require_state(masters: _Masters) -> tuple[dict[str, Any], ...]:
    states = _state_dicts(masters)
    missing = [i for i, s in enumerate(states) if s is None]
    if missing:
        raise OptimizerStateNotReadyError(
            f"{masters.describe}: the optimizer has no state yet for flat group(s) {missing} of {len(states)}: torch "
            "optimizers create it in their first step(), so read or write it after the first engine.step() (an fp16 "
            "step skipped for overflow creates none)"
        )
    return states  # type: ignore[return-value]


def _is_family(value: Any, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == master.shape and value.is_contiguous()


def _family_keys(masters: _Masters, states: tuple[dict[str, Any], ...]) -> tuple[str, ...]:
    first = sorted(k for k, v in states[0].items() if _is_family(v, masters.tensors[0]))
    return tuple(k for k in first
                 if all(_is_family(s.get(k), m) for s, m in zip(states[1:], masters.tensors[1:])))


def optimizer_state_keys(engine: Any) -> tuple[str, ...]:
    """The optimizer-state keys that form a sharded family: in every flat group's state dict, a contiguous tensor
    shaped like that group's master (torch Adam/AdamW: ``('exp_avg', 'exp_avg_sq')``, ``+ 'max_exp_avg_sq'`` with
    amsgrad; SGD with momentum: ``('momentum_buffer',)``; SGD without: ``()``), sorted (the same order on every rank:
    after DeepSpeed's universal load the state dicts list them in a per-process order). ``step``
    is never one (see :func:`optimizer_steps`). Raises :class:`OptimizerStateNotReadyError` before the state exists.
    No communication."""
    masters = _masters(engine)
    return _family_keys(masters, _require_state(masters))


def optimizer_state_storage(engine: Any, key: str) -> FlatStorage:
    """The optimizer state ``key`` (one of :func:`optimizer_state_keys`): per flat group this rank's partition of
    that state, in the masters' layout, on their device. Writes change what the next ``engine.step()`` uses.
    ``is_current()`` turns False once DeepSpeed replaces the state tensors (every ``engine.load_checkpoint`` does,
    and ``optimizer.load_state_dict``): make the storage again then. Raises
    :class:`OptimizerStateNotReadyError` before the first step, ``KeyError`` for a key that is not a family of
    every flat group. No communication; no memory beyond the views."""
    masters = _masters(engine)
    states = _require_state(masters)
    tensors = tuple(s.get(key) for s in states)
    bad = [i for i, (t, m) in enumerate(zip(tensors, masters.tensors)) if not _is_family(t, m)]
    if bad:
        hint = " ('step' is one value per flat group: optimizer_steps())" if key == "step" else ""
        raise KeyError(
            f"{masters.describe}: optimizer state {key!r} is not a tensor shaped like the master in flat group(s) "
            f"{bad}{hint}; the sharded state keys are {_family_keys(masters, states)}"
        )

    def is_current() -> bool:
        if not _same_masters(masters):
            return False
        now = _state_dicts(masters)
        return all(s is not None and s.get(key) is t for s, t in zip(now, tensors))

    return _storage(engine, masters, key, tensors, is_current)


def optimizer_steps(engine: Any) -> tuple[StepValue | None, ...]:
    """Per flat group (ZeRO-3: per sub-group; the order of the storages' groups), the optimizer's ``step`` entry as
    DeepSpeed holds it: torch optimizers a **live** 0-d float32 tensor (CPU unless ``capturable``/``fused``; the
    optimizer increments it in place), DeepSpeedCPUAdam / FusedAdam a Python int (a value, not a handle); ``None``
    for an optimizer without one (SGD). Usually equal across groups (DeepSpeed steps them together). Not the engine's
    ``global_steps``. Raises :class:`OptimizerStateNotReadyError` before the state exists. No communication."""
    return tuple(s.get("step") for s in _require_state(_masters(engine)))


def set_optimizer_steps(engine: Any, steps: float | Sequence[float]) -> None:
    """Write the optimizer's ``step`` of every flat group: one number for all, or one per group (as
    :func:`optimizer_steps` orders them). Tensor steps are filled in place (their identity is kept); number steps
    are replaced, keeping their type. Everything is validated before anything is written. Leaves the engine's
    ``global_steps`` and learning-rate scheduler alone. No communication."""
    masters = _masters(engine)
    states = _require_state(masters)
    values = [steps] * len(states) if isinstance(steps, (int, float)) else list(steps)
    if len(values) != len(states):
        raise ValueError(f"{masters.describe}: {len(values)} steps given for {len(states)} flat groups")
    for i, (value, state) in enumerate(zip(values, states)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"step of flat group {i}: a finite number >= 0, got {value!r}")
        if state.get("step") is None:
            raise KeyError(f"{masters.describe}: the optimizer keeps no 'step' in flat group {i}")
    seen: dict[int, float] = {}
    for i, (value, state) in enumerate(zip(values, states)):
        current = state["step"]
        if torch.is_tensor(current) and seen.setdefault(id(current), value) != value:
            raise ValueError(f"{masters.describe}: flat groups share one step tensor (e.g. after a universal "
                             f"checkpoint load) and cannot take different values ({seen[id(current)]}, {value})")
    with torch.no_grad():
        for value, state in zip(values, states):
            current = state["step"]
            if torch.is_tensor(current):
                current.fill_(value)
            else:
                state["step"] = type(current)(value)
