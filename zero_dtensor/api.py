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
    """The reduced gradients of a DeepSpeed ZeRO ``engine``, sharded as DeepSpeed stores them.

    Call it after ``engine.backward()`` at a gradient-accumulation boundary and before ``engine.step()``; calling it
    again in that window returns the same object. Its views are live: in-place changes are what ``engine.step()`` uses.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` with a ZeRO-1/2/3 optimizer (or ``BF16_Optimizer``).

    Returns:
        ShardedGrads: a mapping ``name -> ParamGrad`` over the trainable parameters, model order.

    Raises:
        GradientsNotReadyError: outside the window (mid-accumulation, after ``engine.step()``).
        UnsupportedDeepSpeedError: an unknown DeepSpeed version or optimizer, ZeRO stage 0.
        TypeError: ``engine`` is not a DeepSpeed engine.

    Communication:
        None (in debug mode, ``zd.set_debug``, the first call of a step runs one small agreement collective).

    Device and memory:
        No copy where DeepSpeed's partition is one tensor or its pieces lie in flat order (ZeRO-1, ZeRO-2 from the
        second step, ZeRO-3, offload, ``BF16_Optimizer``); otherwise the first call of a step copies the pieces once
        into a flat partition kept per param group. Views live where DeepSpeed keeps the gradient (the CPU under
        offload).

    Example:
        ```python
        engine.backward(loss)
        grads = zd.sharded_grads(engine)
        grads.clip_grad_norm_(1.0)
        engine.step()
        ```
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
    """Every full gradient at once: a drop-in for ``{n: safe_get_full_grad(p) for n, p in ...}``.

    Args:
        engine: a DeepSpeed ZeRO engine, after ``engine.backward()`` at a boundary and before ``engine.step()``.
        names: parameter names (default: every trainable parameter).
        dtype: result dtype (default float32, as DeepSpeed returns; ``None`` keeps the stored dtype).

    Returns:
        dict[str, torch.Tensor]: ``{name: full gradient}``, a snapshot the caller owns.

    Raises:
        GradientsNotReadyError: outside the window.
        KeyError: an unknown name.
        RankDisagreementError: ranks passed different arguments.

    Communication:
        The agreement, then one ``all_gather`` per process group and dtype in the stored dtype (``(N-1)/N·S`` bytes
        per rank), instead of one fp32 ``all_reduce`` per parameter. Call on every rank with the same ``names``.

    Device and memory:
        Results on the communication device (CUDA under NCCL, also with offload): ``S`` bytes, plus a cast copy
        where ``dtype`` differs from the stored dtype.

    Example:
        ```python
        full = zd.get_full_model_grads(engine)
        ```
    """
    return sharded_grads(engine).full_tensors(names, dtype=dtype)


def set_full_model_grads(engine: Any, mapping: Mapping[str, torch.Tensor]) -> None:
    """Write full gradients back: a drop-in for a ``safe_set_full_grad`` loop.

    Args:
        engine: a DeepSpeed ZeRO engine, in the backward-to-step window.
        mapping: ``{name: full gradient}`` of the parameter's shape, any floating dtype, equal on every rank.

    Returns:
        None.

    Raises:
        GradientsNotReadyError: outside the window.
        KeyError: an unknown name.
        ValueError: a wrong shape; nothing is written.
        TypeError: a value that is not a floating-point tensor.

    Communication:
        None: each rank copies the part it holds.

    Device and memory:
        Writes in place into DeepSpeed's gradient memory; values may be on the engine's device or where the
        gradient is stored.

    Example:
        ```python
        full = zd.get_full_model_grads(engine)
        zd.set_full_model_grads(engine, {n: g.clamp(-1, 1) for n, g in full.items()})
        ```
    """
    sharded_grads(engine).set_full_(mapping)


# --- fp32 master weights and optimizer state ------------------------------------------------------------------------
def sharded_master_params(engine: Any) -> ShardedMasterParams:
    """The fp32 master weights of a DeepSpeed ZeRO ``engine`` (what its optimizer updates), sharded as stored.

    Everything ``ShardedGrads`` offers works on them. Valid from ``deepspeed.initialize`` on, between steps too (the
    same object while DeepSpeed holds the same tensors). Writes change what the next ``engine.step()`` starts from;
    call ``zd.sync_model_params(engine)`` before the next forward so that the model sees them.

    Args:
        engine: a DeepSpeed ZeRO engine.

    Returns:
        ShardedMasterParams: a mapping ``name -> ParamView`` over the trainable parameters.

    Raises:
        UnsupportedDeepSpeedError: an unknown DeepSpeed version or optimizer; ZeRO-3 with NVMe offload.
        TypeError: ``engine`` is not a DeepSpeed engine.

    Communication:
        None.

    Device and memory:
        Views only, where DeepSpeed keeps the masters (the CPU under offload). Installs, once per engine, a forward
        pre-hook on ``engine.module`` that raises ``ModelParamsNotSyncedError`` after an unsynced write, and makes
        ``engine.save_checkpoint`` sync first where a rank is marked.

    Example:
        ```python
        master = zd.sharded_master_params(engine)
        master.mul_(0.5, params=lambda n: n.endswith("weight"))
        zd.sync_model_params(engine)
        ```
    """
    check_engine(engine)
    return _master.master_front(engine)


def sharded_optimizer_state(engine: Any, key: str) -> ShardedOptimizerState:
    """One optimizer-state tensor (e.g. Adam's ``exp_avg``) of every parameter, sharded as the masters.

    Everything ``ShardedGrads`` offers works on it; writes need no sync.

    Args:
        engine: a DeepSpeed ZeRO engine that has taken at least one optimizer step.
        key: one of ``zd.optimizer_state_keys(engine)``.

    Returns:
        ShardedOptimizerState: a mapping ``name -> ParamView``.

    Raises:
        OptimizerStateNotReadyError: before the optimizer's first step.
        KeyError: ``key`` is not a tensor state shaped like the masters (``'step'`` never is).
        StaleTensorsError: on later use, once ``engine.load_checkpoint`` replaced the state (call again).

    Communication:
        None.

    Device and memory:
        Views only, where DeepSpeed keeps the state (the CPU under offload).

    Example:
        ```python
        exp_avg = zd.sharded_optimizer_state(engine, "exp_avg")
        print(exp_avg.norms())
        ```
    """
    check_engine(engine)
    return _master.optimizer_state_front(engine, key)


def optimizer_state_keys(engine: Any) -> tuple[str, ...]:
    """The optimizer-state keys ``zd.sharded_optimizer_state`` takes.

    Args:
        engine: a DeepSpeed ZeRO engine.

    Returns:
        tuple[str, ...]: e.g. ``('exp_avg', 'exp_avg_sq')`` for Adam, ``('momentum_buffer',)`` for SGD with
            momentum (``'step'`` never: it is one value per flat group), sorted: the same order on every rank, so
            a loop over them issues the same collectives everywhere (even after DeepSpeed's universal load, whose
            state dicts list the keys in a per-process order).

    Raises:
        OptimizerStateNotReadyError: before the optimizer's first step.

    Communication:
        None.

    Device and memory:
        Nothing allocated.

    Example:
        ```python
        keys = zd.optimizer_state_keys(engine)      # ('exp_avg', 'exp_avg_sq')
        ```
    """
    return families.optimizer_state_keys(engine)


@collective
def sync_model_params(engine: Any) -> None:
    """Make the model's working weights the (cast) fp32 masters after a write into them.

    Clears the write mark, so that the next forward does not raise ``ModelParamsNotSyncedError``. Call it on every
    rank, between steps.

    Args:
        engine: a DeepSpeed ZeRO engine.

    Returns:
        None.

    Raises:
        RankDisagreementError: not every rank called it.

    Communication:
        The agreement, then ZeRO-1/2 and ``BF16_Optimizer``: one ``all_gather_into_tensor`` per param group in the
        working dtype (``(N-1)/N·S`` bytes per rank); ZeRO-3: a local cast per sub-group, then one gather of the
        persistent parameters.

    Device and memory:
        None beyond DeepSpeed's own buffers.

    Example:
        ```python
        zd.sharded_master_params(engine).mul_(0.9)
        zd.sync_model_params(engine)
        ```
    """
    check_engine(engine)
    _master.sync_model_params(engine)


@collective
def get_full_fp32_params(engine: Any, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Every full fp32 master weight: a drop-in for a ``safe_get_full_fp32_param`` loop.

    Args:
        engine: a DeepSpeed ZeRO engine (between steps).
        names: parameter names (default: every trainable parameter).

    Returns:
        dict[str, torch.Tensor]: ``{name: fp32 master}``, a snapshot the caller owns.

    Raises:
        KeyError: an unknown name.
        RankDisagreementError: ranks passed different arguments.

    Communication:
        The agreement, then one ``all_gather`` per process group (none on a single rank), instead of one
        ``all_reduce`` per parameter.

    Device and memory:
        Results on the communication device: ``S`` bytes of fp32.

    Example:
        ```python
        masters = zd.get_full_fp32_params(engine)
        ```
    """
    return sharded_master_params(engine).full_tensors(names, dtype=torch.float32)


@collective
def set_full_fp32_params(engine: Any, mapping: Mapping[str, torch.Tensor]) -> None:
    """Write full fp32 master weights and refresh the model's working weights from them.

    A drop-in for a ``safe_set_full_fp32_param`` loop followed by the refresh DeepSpeed's step would do: the next
    forward sees the new weights.

    Args:
        engine: a DeepSpeed ZeRO engine (between steps).
        mapping: ``{name: full weight}``, equal on every rank; the same names on every rank.

    Returns:
        None.

    Raises:
        KeyError: an unknown name.
        ValueError: a wrong shape.
        TypeError: a value that is not a floating-point tensor.
        RankDisagreementError: different names on different ranks. Any of these raises on every rank before
            anything is written.

    Communication:
        The agreement (which covers the names written), then ``zd.sync_model_params``' collectives.

    Device and memory:
        Writes in place into the masters; no staging copy.

    Example:
        ```python
        zd.set_full_fp32_params(engine, {"fc1.weight": torch.zeros(64, 33)})
        ```
    """
    check_engine(engine)
    _master.set_full_and_sync(engine, mapping)


@collective
def get_full_optimizer_state(engine: Any, key: str, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """One optimizer-state key of every parameter, full and fp32: a drop-in for ``safe_get_full_optimizer_state``.

    Args:
        engine: a DeepSpeed ZeRO engine that has stepped.
        key: one of ``zd.optimizer_state_keys(engine)``.
        names: parameter names (default: every trainable parameter).

    Returns:
        dict[str, torch.Tensor]: ``{name: full state}``, a snapshot the caller owns.

    Raises:
        OptimizerStateNotReadyError: before the first optimizer step.
        KeyError: an unknown key or name.

    Communication:
        As ``zd.get_full_fp32_params``: the agreement, then one ``all_gather`` per process group.

    Device and memory:
        Results on the communication device: ``S`` bytes of fp32.

    Example:
        ```python
        exp_avg = zd.get_full_optimizer_state(engine, "exp_avg")
        ```
    """
    return sharded_optimizer_state(engine, key).full_tensors(names, dtype=torch.float32)


def set_full_optimizer_state(engine: Any, key: str, mapping: Mapping[str, torch.Tensor]) -> None:
    """Write one optimizer-state key of the named parameters: a drop-in for ``safe_set_full_optimizer_state``.

    Args:
        engine: a DeepSpeed ZeRO engine that has stepped.
        key: one of ``zd.optimizer_state_keys(engine)``.
        mapping: ``{name: full state}``, equal on every rank.

    Returns:
        None.

    Raises:
        OptimizerStateNotReadyError: before the first optimizer step.
        KeyError: an unknown key or name.
        ValueError: a wrong shape; nothing is written.
        TypeError: a value that is not a floating-point tensor.

    Communication:
        None.

    Device and memory:
        Writes in place into the optimizer state; no sync needed.

    Example:
        ```python
        zd.set_full_optimizer_state(engine, "exp_avg", {n: torch.zeros_like(t) for n, t in exp_avg.items()})
        ```
    """
    sharded_optimizer_state(engine, key).set_full_(mapping)
