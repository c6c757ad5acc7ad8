"""Entry points: ``sharded_grads``, ``get_full_model_grads``, ``set_full_model_grads``; the fp32 master weights and
optimizer state (``sharded_master_params``, ``sharded_optimizer_state``, ``optimizer_state_keys``,
``sync_model_params``) and their drop-ins for DeepSpeed's ``safe_get/set_full_fp32_param`` and
``safe_get/set_full_optimizer_state`` loops."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .families import master as _master
from ._deepspeed import check_engine, families, grad_storage
from .comm.agreement import agree, install_step_checkpoint
from .comm.signature import collective
from .families.master import ShardedMasterParams, ShardedOptimizerState
from .settings import is_debug
from .families.sharded import ShardedGrads

__all__ = [
    "get_full_fp32_params",
    "get_full_model_grads",
    "get_full_optimizer_state",
    "optimizer_state_keys",
    "set_full_fp32_params",
    "set_full_model_grads",
    "set_full_optimizer_state",
    "sharded_grads",
    "sharded_master_params",
    "sharded_optimizer_state",
    "sync_model_params",
]

_CURRENT: weakref.WeakKeyDictionary[Any, ShardedGrads] = weakref.WeakKeyDictionary()


@collective
def sharded_grads(engine: Any) -> ShardedGrads:
    """The reduced gradients of a DeepSpeed ZeRO ``engine``, sharded as stored. **No communication** (outside
    debug mode).

    Valid after ``engine.backward()`` at a gradient-accumulation boundary, until ``engine.step()``. Calling it again
    in the same window returns the same object. Memory: none where DeepSpeed's partition already is one tensor
    (ZeRO-3, offload, the compact fp32 buffer, ``BF16_Optimizer``) or its ZeRO-1/2 pieces lie in order in one buffer
    (``contiguous_gradients``, the default: used in place, no copy; the first call makes DeepSpeed lay ZeRO-2's
    buffer in flat order, with a last rank's zero padding after the pieces, from the next backward on). Otherwise
    (ZeRO-2's first step, whose pieces lie in the order gradients arrived; ``contiguous_gradients: false``;
    ``parameter_alignment`` padding) the first call of a step copies them once into a flat partition allocated once
    per param group and reused across steps (a second one only while a caller still holds views of the first;
    dropped once the pieces are used in place); that copy replaces the flattening DeepSpeed's step would do.
    Raises :class:`~zero_dtensor.errors.GradientsNotReadyError` outside the window and
    :class:`~zero_dtensor.errors.UnsupportedDeepSpeedError` for an unknown DeepSpeed version or optimizer (ZeRO
    stage 0 included), ``TypeError`` for anything that is not a DeepSpeed engine. It also installs the
    rank-agreement checkpoint at the optimizer step, which checks only in debug mode (see
    :mod:`zero_dtensor.comm.agreement`); in debug mode the first call of a step is itself one agreement (one small
    collective), which arms that checkpoint on every rank.
    """
    kind = check_engine(engine)
    key = engine.optimizer
    cached = _CURRENT.get(key)
    if cached is not None and cached.is_current():
        return cached
    storage = grad_storage(engine, kind)
    install_step_checkpoint(key, storage.process_groups, storage.device)  # checks only in debug mode
    if is_debug():  # arms the step checkpoint on every rank (or raises where a rank differs)
        agree("sharded_grads", (), storage.process_groups, storage.device)
    grads = ShardedGrads(storage)
    _CURRENT[key] = grads
    return grads


@collective
def get_full_model_grads(
    engine: Any, names: list[str] | None = None, *, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """``{name: full gradient}``, a drop-in for ``{n: safe_get_full_grad(p) for n, p in ...}``. **Collective.**

    One ``all_gather`` per process group and dtype (coalesced), in the stored dtype, instead of one fp32
    ``all_reduce`` per parameter; results are cast to ``dtype`` (fp32 by default, as DeepSpeed returns; ``None``
    keeps the stored dtype). Call on every rank with the same ``names``.
    """
    return sharded_grads(engine).full_tensors(names, dtype=dtype)


def set_full_model_grads(engine: Any, mapping: Mapping[str, torch.Tensor]) -> None:
    """Write full gradients back, a drop-in for a ``safe_set_full_grad`` loop. **No communication.**

    Validates every entry before writing any; see :meth:`ShardedGrads.set_full_`.
    """
    sharded_grads(engine).set_full_(mapping)


# --- fp32 master weights and optimizer state ------------------------------------------------------------------------
def sharded_master_params(engine: Any) -> ShardedMasterParams:
    """The fp32 master weights of a DeepSpeed ZeRO ``engine`` (what its optimizer updates), sharded as stored, with
    everything ``ShardedGrads`` offers. **No communication**; no memory beyond the views.

    Valid from ``deepspeed.initialize`` on, between steps too (the same object while DeepSpeed holds the same
    tensors). Writes change what the next ``engine.step()`` starts from and mark the engine: call
    :func:`sync_model_params` on every rank before the next forward, or that forward raises
    :class:`~zero_dtensor.errors.ModelParamsNotSyncedError` (a forward pre-hook on ``engine.module``, installed
    here once per engine; a submodule called directly, ``engine.module.fc1(x)``, is not guarded). From here on
    ``engine.save_checkpoint`` syncs first where any rank is marked (one small agreement per call, see
    :mod:`zero_dtensor.families.master`). ``BF16_Optimizer`` keeps its masters sharded (its gradient is replicated). ZeRO-3 with
    NVMe offload is refused (:class:`~zero_dtensor.errors.UnsupportedDeepSpeedError`).
    """
    check_engine(engine)
    return _master.master_front(engine)


def sharded_optimizer_state(engine: Any, key: str) -> ShardedOptimizerState:
    """The optimizer state ``key`` (one of :func:`optimizer_state_keys`, e.g. Adam's ``'exp_avg'``), sharded as the
    masters, with everything ``ShardedGrads`` offers; writes need no sync. **No communication**; no memory beyond
    the views. Raises :class:`~zero_dtensor.errors.OptimizerStateNotReadyError` before the optimizer's first step,
    ``KeyError`` for a key that is not a tensor shaped like the masters (``'step'`` never is: one value per flat
    group). Stale (:class:`~zero_dtensor.errors.StaleTensorsError`) once ``engine.load_checkpoint`` replaces the
    state: call again."""
    check_engine(engine)
    return _master.optimizer_state_front(engine, key)


def optimizer_state_keys(engine: Any) -> tuple[str, ...]:
    """The optimizer-state keys :func:`sharded_optimizer_state` takes (Adam: ``('exp_avg', 'exp_avg_sq')``; SGD with
    momentum: ``('momentum_buffer',)``). Raises :class:`~zero_dtensor.errors.OptimizerStateNotReadyError` before the
    first step. No communication."""
    return families.optimizer_state_keys(engine)


@collective
def sync_model_params(engine: Any) -> None:
    """Make the model's working weights the (cast) fp32 masters after a write into them, and clear the write mark.
    **Collective**: every rank of the data-parallel group, between steps. Communication: the rank agreement (one
    small collective, :mod:`zero_dtensor.comm.agreement`), then ZeRO-1/2 and ``BF16_Optimizer`` one
    ``all_gather_into_tensor`` per param group (``(N-1)/N·S`` bytes received per rank in the working dtype; ZeRO-1/2
    on gloo: one batch of ``isend``/``irecv`` per param group, the same bytes); ZeRO-3
    a local cast copy per sub-group, then DeepSpeed's bulk gather of the persistent parameters (one all_gather).
    Memory: none beyond DeepSpeed's own."""
    check_engine(engine)
    _master.sync_model_params(engine)


@collective
def get_full_fp32_params(engine: Any, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """``{name: full fp32 master weight}``, a drop-in for ``{n: safe_get_full_fp32_param(p) for n, p in ...}`` over
    trainable parameters. **Collective**: one ``all_gather`` per process group (coalesced; + the rank agreement, on
    ``names``) instead of one ``all_reduce`` per parameter; none for a single rank. Memory: the results (fp32, ``S``)."""
    return sharded_master_params(engine).full_tensors(names, dtype=torch.float32)


@collective
def set_full_fp32_params(engine: Any, mapping: Mapping[str, torch.Tensor]) -> None:
    """Write full fp32 master weights and refresh the model's working weights from them, a drop-in for a
    ``safe_set_full_fp32_param`` loop followed by the refresh DeepSpeed's step would do. **Collective**: the rank
    agreement, then the sync (:func:`sync_model_params`' collectives; the write itself communicates nothing). The
    agreement comes first and hashes the mapping (its names, and its values' dtypes and device types): every entry
    is validated on every rank, and a bad entry on any rank, or names that differ between ranks (one rank a value,
    another ``{}``), raise on every rank before anything is written."""
    check_engine(engine)
    _master.set_full_and_sync(engine, mapping)


@collective
def get_full_optimizer_state(engine: Any, key: str, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """``{name: full optimizer state key}`` (fp32), a drop-in for a ``safe_get_full_optimizer_state(p, key)``
    loop. **Collective**: as :func:`get_full_fp32_params` (``key`` is agreed too)."""
    return sharded_optimizer_state(engine, key).full_tensors(names, dtype=torch.float32)


def set_full_optimizer_state(engine: Any, key: str, mapping: Mapping[str, torch.Tensor]) -> None:
    """Write full optimizer state ``key``, a drop-in for a ``safe_set_full_optimizer_state(p, value, key)`` loop.
    **No communication**; every entry is validated before anything is written."""
    sharded_optimizer_state(engine, key).set_full_(mapping)
