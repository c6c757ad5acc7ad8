"""The fp32 master weights and the optimizer state as sharded fronts: ``ShardedMasterParams``,
``ShardedOptimizerState``, and the guard that keeps the model's working weights in step with written masters.

Both are :class:`~zero_dtensor.families.tensors.ShardedTensors` over the families of
:mod:`zero_dtensor._deepspeed.families`: the same views, gathers, writes, transforms, reductions and redistribution
as :class:`~zero_dtensor.families.sharded.ShardedGrads`, with the same communication and rank agreement, on the masters'
geometry (the gradient's; ``BF16_Optimizer``: sharded where its gradient is replicated). Unlike gradients they are
valid between optimizer steps too (DeepSpeed updates them in place); they go stale only when DeepSpeed replaces
the tensors (``engine.load_checkpoint`` replaces the optimizer state).

**Writes reach the model only after a sync.** DeepSpeed copies masters into the model's working (bf16/fp16/fp32)
weights at the end of its own ``step()``. Every write through the API into the masters (``set_full_``, the
transforms, ``copy_``, ``set_dtensors_``, ``set_owned_``, ``map_full_``) marks the engine as needing
:func:`sync_model_params`; a forward of ``engine.module`` that starts while the mark is set raises
:class:`~zero_dtensor.errors.ModelParamsNotSyncedError` (a forward pre-hook, installed once per engine by
:func:`~zero_dtensor.api.sharded_master_params`). An applied ``engine.step()`` clears the mark (it copies every
master itself); one skipped for fp16 overflow does not. Writes straight into live views (``to_local()``,
``local_partitions``, ``groups``) are not seen: call :meth:`ShardedMasterParams.mark_written` or
:func:`sync_model_params` after them. Optimizer-state writes need no sync.

:func:`sync_model_params` communicates: the rank agreement (one small collective, :mod:`zero_dtensor.comm.agreement`), then
ZeRO-1/2 and ``BF16_Optimizer``: one ``all_gather_into_tensor`` per param group of the working dtype
(``(N-1)/N·S`` bytes received per rank, ``S`` the group's flat working buffer), in place (ZeRO-1/2 on gloo: one
batch of ``isend``/``irecv`` per param group, the same bytes); ZeRO-3: a local cast copy
master → working partition per sub-group, then DeepSpeed's own bulk gather of the persistent parameters (one
all_gather for all of them, per process group and dtype; the others are gathered by the next forward as usual).
Memory: none beyond DeepSpeed's.

**DeepSpeed's ``engine.save_checkpoint`` syncs first.** It saves the working weights beside the masters (ZeRO-1/2:
the module's state dict), so a save while the mark is set would write stale working weights that
``engine.load_checkpoint`` then runs forward on. Once the masters' front exists, ``engine.save_checkpoint`` (wrapped
on the engine instance by :func:`_install_guard`) starts with one agreement (an ``all_gather`` of 3 int64 per rank,
carrying each rank's mark) and, where any rank's mark is set, runs :func:`sync_model_params` on every rank before
DeepSpeed's save. :func:`zero_dtensor.load` and :func:`zero_dtensor.set_state_dict` refresh the working weights
themselves and clear the mark (:func:`clear_write_mark`); so does DeepSpeed's own ``engine.load_checkpoint`` (wrapped
too: where it returns a load path, it made the masters and the working weights one from the other, and a write
before it is gone; where it loaded nothing, ``(None, None)``, the mark stays). No collective is added to either.

**The guard sees ``engine.module``'s forward only.** A submodule called directly (``engine.module.fc1(x)``) runs no
hook of ``engine.module`` and is not refused: a pre-hook on every submodule would put Python on every module call
of every forward. Sync before such calls as before any forward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._deepspeed import families
from .._deepspeed import sync as _sync
from ..ops import writes
from ..comm.agreement import Refusal, agree, agree_on
from ..comm.signature import internal_call
from ..errors import ModelParamsNotSyncedError, StaleTensorsError
from ..core.storage import FlatStorage
from .tensors import ShardedTensors

__all__ = [
    "ShardedMasterParams",
    "ShardedOptimizerState",
    "clear_write_mark",
    "master_front",
    "needs_sync",
    "optimizer_state_front",
    "set_full_and_sync",
    "sync_model_params",
]


class ShardedMasterParams(ShardedTensors):
    """Every trainable parameter's fp32 master weight, sharded as DeepSpeed's optimizer stores it: a mapping
    ``name -> ParamView`` with everything :class:`~zero_dtensor.families.tensors.ShardedTensors` offers.

    Valid from ``deepspeed.initialize`` on, between steps and inside the ``backward()`` → ``step()`` window alike;
    in-place changes are what the next ``engine.step()`` starts from. After a write, call
    :func:`zero_dtensor.sync_model_params` on every rank before the next forward (see :mod:`zero_dtensor.families.master`);
    a clone (``clone()``, e.g. an EMA) is not the masters: writing it needs no sync. Values are true fp32 values (no
    loss scaling). Memory: none beyond the views.
    """

    def _stale_error(self) -> Exception:
        return StaleTensorsError(
            f"{self._state.storage.describe}: DeepSpeed no longer holds these master tensors; call "
            "zero_dtensor.sharded_master_params(engine) again"
        )

    def mark_written(self) -> None:
        """Tell zero_dtensor that the masters were changed through live views (``to_local()``, ``groups``...).

        The next forward then needs ``zd.sync_model_params(engine)``, as after a write through the API.

        Returns:
            None.

        Raises nothing.

        Communication:
            None.

        Device and memory:
            Nothing allocated.

        Example:
            ```python
            master["fc1.weight"].to_local().zero_()
            master.mark_written()
            zd.sync_model_params(engine)
            ```
        """
        self._state.storage.after_write(self.names)


class ShardedOptimizerState(ShardedTensors):
    """One optimizer-state key (Adam's ``exp_avg`` …) of every trainable parameter, sharded as the masters: a
    mapping ``name -> ParamView`` with everything :class:`~zero_dtensor.families.tensors.ShardedTensors` offers.

    Exists from the first applied optimizer step on (before it :func:`zero_dtensor.sharded_optimizer_state` raises
    :class:`~zero_dtensor.errors.OptimizerStateNotReadyError`); valid between steps until DeepSpeed replaces the
    state tensors (``engine.load_checkpoint``): then every use raises
    :class:`~zero_dtensor.errors.StaleTensorsError`. Writes change what the next ``engine.step()`` uses and need no
    sync. Memory: none beyond the views.
    """

    def _stale_error(self) -> Exception:
        return StaleTensorsError(
            f"{self._state.storage.describe}: DeepSpeed replaced the optimizer state (engine.load_checkpoint does); "
            "call zero_dtensor.sharded_optimizer_state(engine, key) again"
        )


# --- the sync mark -----------------------------------------------------------------------------------------------
@dataclass
class _SyncMark:
    """Per engine: whether masters were written since the working weights were last made from them."""

    pending: bool = False
    #: ``applied_steps(engine)`` when the mark was set: a later applied step copied the masters itself
    at_step: int = 0
    hook: Any = None


_MARKS: weakref.WeakKeyDictionary[Any, _SyncMark] = weakref.WeakKeyDictionary()


def needs_sync(engine: Any) -> bool:
    """Whether a write into ``engine``'s masters has not reached its working weights yet. No communication."""
    mark = _MARKS.get(engine)
    if mark is None or not mark.pending:
        return False
    if _sync.applied_steps(engine) != mark.at_step:  # an applied step copied every master into the model
        mark.pending = False
    return mark.pending


def _mark_written(engine_ref: weakref.ref[Any], names: Sequence[str]) -> None:
    del names  # any write: the working weights of the whole model are refreshed together
    engine = engine_ref()
    if engine is None:
        return
    mark = _MARKS.setdefault(engine, _SyncMark())
    mark.pending = True
    mark.at_step = _sync.applied_steps(engine)


def clear_write_mark(engine: Any) -> None:
    """Clear ``engine``'s write mark: its working weights were just made from its masters (a sync, a load). No
    communication."""
    mark = _MARKS.get(engine)
    if mark is not None:
        mark.pending = False


def _sync_before_save(engine: Any) -> None:
    """What ``engine.save_checkpoint`` runs first: one agreement carrying every rank's write mark, then, where any
    is set, :func:`sync_model_params` on every rank (module docstring)."""
    storage = master_front(engine).__zero_dtensor_state__().storage
    with internal_call("engine.save_checkpoint"):
        marks = agree("engine.save_checkpoint", (), storage.process_groups, storage.device,
                      payload=lambda group: [int(needs_sync(engine))])
        if needs_sync(engine) or any(row[2] for rows in marks.values() for row in rows):  # [hash, code, mark]
            sync_model_params(engine)


def _wrap_method(engine: Any, name: str, before: Callable[[Any], None] | None = None,
                 after: Callable[[Any, Any], None] | None = None) -> None:
    """Wrap ``engine.<name>`` on the instance: ``before(engine)`` first, ``after(engine, result)`` once it returned
    (the engine held weakly: the wrapper keeps no engine alive)."""
    original = engine.__dict__.get(name)
    unbound = getattr(type(engine), name) if original is None else None
    engine_ref = weakref.ref(engine)

    @functools.wraps(getattr(type(engine), name))
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        current = engine_ref()
        if current is None:
            raise ReferenceError("the engine was freed")
        if before is not None:
            before(current)
        result = original(*args, **kwargs) if original is not None else unbound(current, *args, **kwargs)
        if after is not None:
            after(current, result)
        return result

    setattr(engine, name, wrapped)


def _clear_after_load(engine: Any, result: Any) -> None:
    """What ``engine.load_checkpoint`` runs after DeepSpeed's load: where it loaded a checkpoint (a load path
    returned), the working weights and the masters are made one from the other (ZeRO-1/2 and ZeRO-3: the masters
    from the checkpoint, the working weights from them or from the same checkpoint; ``load_module_only`` or
    without optimizer state: the masters from the loaded working weights), so the write mark is cleared. Where
    nothing was loaded (``(None, None)``: no ``latest`` file, no checkpoint) the mark stays. No communication."""
    loaded = result[0] if isinstance(result, tuple) and result else result
    if loaded is not None:
        clear_write_mark(engine)


def _guard_checkpointing(engine: Any) -> None:
    """Wrap ``engine.save_checkpoint`` so that it runs :func:`_sync_before_save` first, and
    ``engine.load_checkpoint`` so that a load clears the write mark (:func:`_clear_after_load`)."""
    _wrap_method(engine, "save_checkpoint", before=_sync_before_save)
    _wrap_method(engine, "load_checkpoint", after=_clear_after_load)


class _ForwardGuard:
    """The forward pre-hook that refuses a forward while ``engine``'s masters wait for a sync. It holds the engine
    weakly; a pickled copy (``torch.save`` of the whole module) guards nothing."""

    def __init__(self, engine: Any) -> None:
        self._engine: Callable[[], Any] = weakref.ref(engine)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        del module, args
        engine = self._engine()
        if engine is not None and needs_sync(engine):
            raise ModelParamsNotSyncedError(
                "the fp32 master weights were written (zero_dtensor set_full_, a transform, copy_, set_dtensors_, "
                "set_owned_ or map_full_) but the model's working weights were not refreshed: call "
                "zero_dtensor.sync_model_params(engine) on every rank before the next forward"
            )

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        del state
        self._engine = _nothing


def _nothing() -> None:
    return None


def _install_guard(engine: Any) -> None:
    """Install :class:`_ForwardGuard` on ``engine.module`` once per engine (prepended, so it runs before DeepSpeed's
    own ZeRO-3 gather hooks and a refused forward gathers nothing), make ``engine.save_checkpoint`` sync first and
    ``engine.load_checkpoint`` clear the mark (:func:`_guard_checkpointing`)."""
    mark = _MARKS.setdefault(engine, _SyncMark())
    if mark.hook is None:
        mark.hook = engine.module.register_forward_pre_hook(_ForwardGuard(engine), prepend=True)
        _guard_checkpointing(engine)


def sync_model_params(engine: Any) -> None:
    """Copy ``engine``'s fp32 master weights into the model's working weights (cast to their dtype) and clear the
    write mark. **Collective**: call on every rank of the data-parallel group, between steps, outside forward and
    backward. Communication (see :mod:`zero_dtensor.families.master`): the rank agreement, then ZeRO-1/2 and
    ``BF16_Optimizer`` one all_gather per param group (ZeRO-1/2 on gloo: one point-to-point batch), ZeRO-3 one
    all_gather of the persistent parameters together after a local copy. Memory: none beyond DeepSpeed's own."""
    storage = master_front(engine).__zero_dtensor_state__().storage
    agree("sync_model_params", (), storage.process_groups, storage.device)
    _sync_agreed(engine)


def _sync_agreed(engine: Any) -> None:
    """:func:`sync_model_params` after its agreement (the caller's)."""
    _sync.sync_model_params(engine)
    clear_write_mark(engine)


def set_full_and_sync(engine: Any, mapping: Any) -> None:
    """Write full fp32 masters (:meth:`~zero_dtensor.families.tensors.ShardedTensors.set_full_`) and refresh the working
    weights, agreeing first on the mapping written: the sync's own agreement, moved before the write and hashing the
    caller's arguments (:mod:`zero_dtensor.comm.signature`: the mapping's names, sorted, and its values' dtypes and
    device types), the masters' family and any rank's refusal of the mapping (every entry's name, type, shape,
    dtype and device checked first). A mapping that
    differs between ranks (one rank a value, another ``{}``) raises on every rank and nothing is written anywhere.
    **Collective**: one agreement, then the sync (:func:`sync_model_params`' communication); no collective more
    than ``set_full_`` + :func:`sync_model_params`."""
    front = master_front(engine)
    state = front.__zero_dtensor_state__()
    state.check_current()
    storage = state.storage
    checked: Any = None
    with Refusal() as refusal:
        checked = writes.validate_full(state, mapping)
        if not checked.exact:
            writes.check_shapes(state, checked)  # the write would check them after the agreement: check them now
    agree_on(storage, "set_full_fp32_params", (), storage.process_groups, refused=refusal.error)
    writes.set_full_(state, checked)
    _sync_agreed(engine)


# --- fronts, one per engine (and key) while DeepSpeed holds their tensors ------------------------------------------
_MASTERS: weakref.WeakKeyDictionary[Any, ShardedMasterParams] = weakref.WeakKeyDictionary()
_STATES: weakref.WeakKeyDictionary[Any, dict[str, ShardedOptimizerState]] = weakref.WeakKeyDictionary()


def master_front(engine: Any) -> ShardedMasterParams:
    """The masters' front of ``engine`` (the same object while DeepSpeed holds the same tensors), its storage's
    ``after_write`` setting the sync mark, and the forward guard installed. No communication."""
    cached = _MASTERS.get(engine.optimizer)
    if cached is not None and cached.is_current():
        return cached
    storage = families.master_storage(engine)
    engine_ref = weakref.ref(engine)
    front = ShardedMasterParams(replace(storage, after_write=lambda names: _mark_written(engine_ref, names)))
    _install_guard(engine)
    _MASTERS[engine.optimizer] = front
    return front


def optimizer_state_front(engine: Any, key: str) -> ShardedOptimizerState:
    """The front of optimizer state ``key`` (the same object while DeepSpeed holds the same tensors). Raises
    :class:`~zero_dtensor.errors.OptimizerStateNotReadyError` before the first step and ``KeyError`` for a key that
    is not a sharded family. No communication."""
    if not isinstance(key, str):
        raise TypeError(f"an optimizer-state key is a str (e.g. 'exp_avg'), got {type(key).__name__}")
    fronts = _STATES.setdefault(engine.optimizer, {})
    cached = fronts.get(key)
    if cached is not None and cached.is_current():
        return cached
    storage: FlatStorage = families.optimizer_state_storage(engine, key)
    front = fronts[key] = ShardedOptimizerState(storage)
    return front
