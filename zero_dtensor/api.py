"""Entry points: ``sharded_grads``, ``get_full_model_grads``, ``set_full_model_grads``."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from ._deepspeed import check_engine, grad_storage
from .agreement import agree, install_step_checkpoint
from .settings import is_debug
from .sharded import ShardedGrads

__all__ = ["get_full_model_grads", "set_full_model_grads", "sharded_grads"]

_CURRENT: weakref.WeakKeyDictionary[Any, ShardedGrads] = weakref.WeakKeyDictionary()


def sharded_grads(engine: Any) -> ShardedGrads:
    """The reduced gradients of a DeepSpeed ZeRO ``engine``, sharded as stored. **No communication** (outside
    debug mode).

    Valid after ``engine.backward()`` at a gradient-accumulation boundary, until ``engine.step()``. Calling it again
    in the same window returns the same object (the default ZeRO-1/2 list of views is made contiguous once per step).
    Raises :class:`~zero_dtensor.errors.GradientsNotReadyError` outside the window and
    :class:`~zero_dtensor.errors.UnsupportedDeepSpeedError` for an unknown DeepSpeed version or optimizer (ZeRO
    stage 0 included), ``TypeError`` for anything that is not a DeepSpeed engine. It also installs the
    rank-agreement checkpoint at the optimizer step, which checks only in debug mode (see
    :mod:`zero_dtensor.agreement`); in debug mode the first call of a step is itself one agreement (one small
    all_gather), which arms that checkpoint on every rank.
    """
    check_engine(engine)
    key = engine.optimizer
    cached = _CURRENT.get(key)
    if cached is not None and cached.is_current():
        return cached
    storage = grad_storage(engine)
    install_step_checkpoint(key, storage.process_groups, storage.device)  # checks only in debug mode
    if is_debug():  # arms the step checkpoint on every rank (or raises where a rank differs)
        agree("sharded_grads", (), storage.process_groups, storage.device)
    grads = ShardedGrads(storage)
    _CURRENT[key] = grads
    return grads


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
