"""Run gradient code at the one meaningful moment: after reduction at an accumulation boundary, before the optimizer.

:func:`on_grads` registers ``fn(grads)`` on a DeepSpeed engine; ``grads`` is the step's
:class:`~zero_dtensor.families.sharded.ShardedGrads`, whose in-place changes are what the optimizer step then uses. It fires
whoever calls ``engine.step()``: a plain DeepSpeed loop, or Hugging Face Accelerate, whose
``DeepSpeedEngineWrapper.backward`` calls ``engine.step()`` itself right after ``engine.backward()`` (so the HF
Trainer's ``on_pre_optimizer_step`` callback comes too late; this hook does not).

Where it hooks (DeepSpeed 0.18.9 / 0.19.x, ``deepspeed/runtime/engine.py``):

* **Managed accumulation** (the default): the reduction finishes inside ``engine.backward()`` at the boundary, so the
  hook wraps the instance's ``engine.step`` and runs *before* the original ``step()`` when
  ``engine.is_gradient_accumulation_boundary()`` is true. Nothing of ``step()`` has run yet, so an exception leaves the
  engine exactly as it was after ``backward()`` (no timers started, no counters moved, no optimizer update).
  Non-boundary micro-steps (``step()`` called after every micro-batch) pass straight through.
* **``managed_gradient_accumulation: false``**: ``backward()`` only accumulates locally; ``step()`` itself finalizes
  (stage 2/3: ``optimizer.finalize_gradient_accumulation_boundary()``; stage 0/1: ``allreduce_gradients()``) and then
  calls ``self._take_model_step(lr_kwargs)``, which runs the optimizer. The hook therefore also wraps the instance's
  ``engine._take_model_step`` and runs there (after the finalize, before ``optimizer.step()``). If the hook raises
  there, the ``step()`` wrapper resets ``_running_engine_step`` and stops the step timers
  (:mod:`zero_dtensor._deepspeed.engine_step` holds these DeepSpeed internals); no update is applied and
  the finalized gradients are discarded (``engine.optimizer.zero_grad()``), as in the managed case.

Errors: hooks run in registration order. After each hook, every rank takes part in one tiny agreement
(:func:`zero_dtensor.comm.agreement.agree_outcome`: one ``all_gather`` of 2 int64 per rank on the engine's device;
latency-bound, a few microseconds on NCCL, tens on gloo), so that an exception on some ranks makes **every** rank
raise, before any rank enters the optimizer step's collectives: the failing rank(s) re-raise their own exception, the others raise
:class:`~zero_dtensor.errors.GradHookError` (a :class:`~zero_dtensor.errors.RankFailedError`) naming the failing
rank(s). The optimizer step does not run and the step's gradients are discarded
(``engine.optimizer.zero_grad()`` on every rank, every stage). Pass ``sync_errors=False`` to skip the collective (then a
rank-dependent exception hangs the job, as any rank-dependent exception in ``torch.distributed`` code does). The
agreement cannot help a hook that raises on one rank *between* collectives the other ranks complete (e.g. before a
``full_tensors()`` the others enter): keep rank-dependent failures before the first or after the last collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._deepspeed import check_engine
from .._deepspeed.engine_step import MODEL_STEP, abandon_step, is_pipeline_engine
from ..api import sharded_grads
from ..comm.agreement import agree_outcome
from ..errors import GradHookError
from ..comm.process_groups import default_backend, is_distributed
from ..families.sharded import ShardedGrads

__all__ = ["GradHookError", "GradHookHandle", "attach_to_trainer", "on_grads", "on_grads_in_trainer"]

GradFn = Callable[[ShardedGrads], Any]

_ATTR = "_zero_dtensor_grad_hooks"
_ids = itertools.count()


class GradHookHandle:
    """Returned by :func:`on_grads`. ``remove()`` unregisters the hook (idempotent); also a context manager."""

    def __init__(self, registry: _Registry, hook_id: int, hook: _Hook) -> None:
        self._registry = registry
        self._hook = hook
        self.id = hook_id
        self.fn = hook.fn

    @property
    def boundaries(self) -> int:
        """Accumulation boundaries seen while registered (``fn`` ran at every ``every``-th of them)."""
        return self._hook.boundaries

    @property
    def active(self) -> bool:
        return self.id in self._registry.hooks

    def remove(self) -> None:
        """Unregister the hook (idempotent).

        When the engine's last hook goes, ``engine.step`` is restored to DeepSpeed's own method.

        Returns:
            None.

        Raises nothing.

        Communication:
            None.

        Device and memory:
            Nothing allocated.

        Example:
            ```python
            handle = zd.on_grads(engine, fn)
            handle.remove()
            ```
        """
        self._registry.remove(self.id)

    def __enter__(self) -> GradHookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"GradHookHandle(id={self.id}, fn={getattr(self.fn, '__qualname__', self.fn)!r}, active={self.active})"


def on_grads(engine: Any, fn: GradFn, *, every: int = 1, sync_errors: bool = True,
             group: dist.ProcessGroup | None = None) -> GradHookHandle:
    """Call ``fn(grads)`` at every gradient-accumulation boundary, after reduction and before the optimizer step.

    The place for gradient code where you do not call ``engine.step()`` yourself: Accelerate's
    ``accelerator.backward()`` runs both backward and step, the HF Trainer and Lightning call the step. ``grads`` is
    ``zd.sharded_grads(engine)``: in-place changes are what the optimizer uses. ``fn`` runs on every rank and may
    issue collectives (in the same order on every rank); its return value is ignored. Values are reduced and
    unclipped (DeepSpeed's ``gradient_clipping`` runs later, on the edited values); under fp16 ``fn`` also runs on
    steps DeepSpeed then skips for overflow. Several hooks run in registration order.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine`` (``deepspeed.initialize``'s, ``accelerator.prepare``'s under its
            DeepSpeed plugin, or ``trainer.model_wrapped`` in the HF Trainer).
        fn: ``fn(grads: ShardedGrads) -> Any``.
        every: call ``fn`` at every ``every``-th boundary only (the first one included); the others cost nothing.
        sync_errors: agree after ``fn`` so that an exception on any rank raises on every rank before the step.
        group: the process group of that agreement (default: the world).

    Returns:
        GradHookHandle: ``handle.remove()``, or ``with zd.on_grads(engine, fn): ...``, unregisters.

    Raises:
        TypeError: ``fn`` not callable, not a DeepSpeed engine, or a ``PipelineEngine``.
        ValueError: a bad ``every``.
        UnsupportedDeepSpeedError: ZeRO stage 0 or an unknown optimizer (at registration).
        GradHookError: at ``engine.step()`` on the ranks where ``fn`` succeeded, when it raised on another rank
            (that rank raises its own exception). No optimizer step runs and the step's gradients are discarded on
            every rank (with ``sync_errors=False``: only on the failing ranks).

    Communication:
        Registering: none. Per call of ``fn``: ``fn``'s own, plus one small error agreement (a few int64).

    Device and memory:
        Nothing beyond what ``fn`` allocates; the first ``sharded_grads`` of a step as documented there.

    Example:
        ```python
        def clip(grads):
            grads.clip_grad_norm_(1.0)
        handle = zd.on_grads(engine, clip)       # engine = accelerator.prepare(model)
        ```
    """
    if not callable(fn):
        raise TypeError(f"on_grads(engine, fn): fn must be callable, got {type(fn).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    if not callable(getattr(engine, "step", None)) or not hasattr(engine, "is_gradient_accumulation_boundary"):
        raise TypeError(
            f"on_grads needs a DeepSpeed engine (with step() and is_gradient_accumulation_boundary()), got "
            f"{type(engine).__name__}; under Accelerate pass the object accelerator.prepare() returned for the model, "
            "in the HF Trainer trainer.model_wrapped (after training started)"
        )
    if is_pipeline_engine(engine):
        raise TypeError(
            "on_grads does not support DeepSpeed's PipelineEngine: train_batch() runs the optimizer through "
            "_take_model_step without engine.step(), and zero_dtensor does not map pipeline-parallel gradients"
        )
    check_engine(engine)  # ZeRO stage 0 or an unknown optimizer is refused now, not at the first step()
    registry = getattr(engine, _ATTR, None)
    if registry is None or not registry.installed:
        registry = _Registry(engine)
    return registry.add(_Hook(fn, every, sync_errors, group))


def attach_to_trainer(trainer: Any, factory: Callable[[Any], Any]) -> Any:
    """Call ``factory(engine)`` when a Hugging Face Trainer's training begins; ``.remove()`` its result at the end.

    The Trainer builds its DeepSpeed engine (``trainer.model_wrapped``) only inside ``train()``, hence a callback.

    Args:
        trainer: a ``transformers.Trainer`` running DeepSpeed.
        factory: ``factory(engine)`` returning anything with a ``remove()`` method, e.g. a ``zd.GradStatsLogger``.

    Returns:
        transformers.TrainerCallback: the added callback; ``callback.attached`` is the factory's current result,
            ``callback.active`` whether it is attached.

    Raises:
        TypeError: at the start of training, if the Trainer is not running DeepSpeed.

    Communication:
        None of its own; ``factory`` and what it attaches may communicate.

    Device and memory:
        Nothing of its own.

    Example:
        ```python
        zd.attach_to_trainer(trainer, lambda engine: zd.GradStatsLogger(engine, every=10, callback=report))
        ```
    """
    from transformers import TrainerCallback

    class _ZeroDTensorAttach(TrainerCallback):
        def __init__(self) -> None:
            self.attached: Any = None

        @property
        def active(self) -> bool:
            return self.attached is not None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            engine = getattr(trainer, "model_wrapped", None)
            if not hasattr(engine, "is_gradient_accumulation_boundary"):
                raise TypeError(
                    "zero_dtensor: the Trainer is not running DeepSpeed (trainer.model_wrapped is "
                    f"{type(engine).__name__}); pass TrainingArguments(deepspeed=...)"
                )
            self.detach()
            self.attached = factory(engine)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.detach()

        def detach(self) -> None:
            if self.attached is not None:
                attached, self.attached = self.attached, None
                attached.remove()

    callback = _ZeroDTensorAttach()
    trainer.add_callback(callback)
    return callback


def on_grads_in_trainer(trainer: Any, fn: GradFn, **kwargs: Any) -> Any:
    """``zd.on_grads(engine, fn, **kwargs)`` for the duration of a Hugging Face ``trainer.train()``.

    A ``TrainerCallback`` such as ``on_pre_optimizer_step`` runs after Accelerate's ``backward()`` already called
    ``engine.step()``, too late to see or change the gradients; this registers ``fn`` on the engine itself once
    the Trainer has built it.

    Args:
        trainer: a ``transformers.Trainer`` running DeepSpeed.
        fn: ``fn(grads: ShardedGrads) -> Any``.
        **kwargs: passed on to ``zd.on_grads`` (``every``, ``sync_errors``, ``group``).

    Returns:
        transformers.TrainerCallback: the added callback; ``callback.attached`` is the ``GradHookHandle`` while
            training runs.

    Raises:
        TypeError: ``fn`` is not callable; at the start of training, the Trainer is not running DeepSpeed.
        GradHookError: as ``zd.on_grads``.

    Communication:
        As ``zd.on_grads``: per call of ``fn``, ``fn``'s own and one small error agreement.

    Device and memory:
        Nothing of its own.

    Example:
        ```python
        zd.on_grads_in_trainer(trainer, lambda grads: grads.clip_grad_norm_(1.0))
        trainer.train()
        ```
    """
    if not callable(fn):
        raise TypeError(f"on_grads_in_trainer(trainer, fn): fn must be callable, got {type(fn).__name__}")
    return attach_to_trainer(trainer, lambda engine: on_grads(engine, fn, **kwargs))


# ---------------------------------------------------------------------------------------------------------------------
_MISSING = object()


class _Hook:
    __slots__ = ("fn", "every", "sync_errors", "group", "boundaries")

    def __init__(self, fn: GradFn, every: int, sync_errors: bool, group: dist.ProcessGroup | None) -> None:
        self.fn, self.every, self.sync_errors, self.group = fn, every, sync_errors, group
        self.boundaries = 0  # accumulation boundaries seen while registered


class _Registry:
    """The hooks of one engine, and the instance attributes they replaced."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.hooks: dict[int, _Hook] = {}
        self.installed = False
        self._saved: dict[str, Any] = {}
        self._wrappers: dict[str, Any] = {}
        self._unmanaged_fired = False

    # --- registration --------------------------------------------------------------------------------------------
    def add(self, hook: _Hook) -> GradHookHandle:
        if not self.installed:
            self._install()
        hook_id = next(_ids)
        self.hooks[hook_id] = hook
        return GradHookHandle(self, hook_id, hook)

    def remove(self, hook_id: int) -> None:
        self.hooks.pop(hook_id, None)
        if not self.hooks and self.installed:
            self._uninstall()

    def _install(self) -> None:
        engine = self.engine
        self._wrap("step", self._step_wrapper)
        self._wrap(MODEL_STEP, self._model_step_wrapper)
        object.__setattr__(engine, _ATTR, self)
        self.installed = True

    def _wrap(self, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        engine = self.engine
        self._saved[name] = engine.__dict__.get(name, _MISSING)
        original = getattr(engine, name)
        wrapper = make(original)
        self._wrappers[name] = wrapper
        object.__setattr__(engine, name, wrapper)

    def _uninstall(self) -> None:
        engine = self.engine
        for name, wrapper in self._wrappers.items():
            if engine.__dict__.get(name) is not wrapper:
                # someone wrapped on top of us: leave their wrapper; ours is now a pass-through (no hooks left)
                continue
            saved = self._saved[name]
            if saved is _MISSING:
                object.__delattr__(engine, name)
            else:
                object.__setattr__(engine, name, saved)
        if engine.__dict__.get(_ATTR) is self:
            object.__delattr__(engine, _ATTR)
        self.installed = False

    # --- the wrappers ----------------------------------------------------------------------------------------------
    def _managed(self) -> bool:
        managed = getattr(self.engine, "managed_gradient_accumulation", None)
        return True if managed is None else bool(managed())

    def _step_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        registry = self

        def step(*args: Any, **kwargs: Any) -> Any:
            engine = registry.engine
            if getattr(engine, "inside_no_sync_ctxt", False):
                return original(*args, **kwargs)  # DeepSpeed refuses step() inside no_sync(); let it say so
            if registry.hooks and registry._managed():
                if engine.is_gradient_accumulation_boundary():
                    registry._fire()  # raises before any part of DeepSpeed's step() ran
                return original(*args, **kwargs)
            registry._unmanaged_fired = False
            try:
                return original(*args, **kwargs)
            except BaseException:
                if registry._unmanaged_fired:
                    abandon_step(registry.engine)
                raise

        step.__wrapped__ = original  # type: ignore[attr-defined]
        step.__doc__ = getattr(original, "__doc__", None)
        return step

    def _model_step_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        registry = self

        def model_step(*args: Any, **kwargs: Any) -> Any:
            if registry.hooks and not registry._managed():
                registry._unmanaged_fired = True
                registry._fire()  # after step() finalized the accumulation, before optimizer.step()
                registry._unmanaged_fired = False
            return original(*args, **kwargs)

        model_step.__wrapped__ = original  # type: ignore[attr-defined]
        return model_step

    def _fire(self) -> None:
        grads: ShardedGrads | None = None
        for hook in list(self.hooks.values()):
            index, hook.boundaries = hook.boundaries, hook.boundaries + 1
            if index % hook.every:
                continue
            fn, sync_errors, group = hook.fn, hook.sync_errors, hook.group
            error: BaseException | None = None
            try:
                if grads is None:
                    grads = sharded_grads(self.engine)
                fn(grads)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank agreed
                error = exc
            if sync_errors:
                world = [group if group is not None else dist.group.WORLD] if is_distributed() else []
                try:
                    agree_outcome(f"on_grads: hook {_fn_name(fn)}", error, world, _device_of(self.engine),
                                  failure=GradHookError, validation_classes=False,
                                  consequence="The optimizer step was not run on any rank.")
                except BaseException:
                    self._discard()
                    raise
            elif error is not None:
                self._discard()
                raise error

    def _discard(self) -> None:
        """A hook failed: drop the step's gradients, the same on every stage (ZeRO-3 would otherwise carry them
        into the next step, ZeRO-1/2 would not). No communication."""
        self.engine.optimizer.zero_grad()


def _device_of(engine: Any) -> torch.device:
    device = getattr(engine, "device", None)
    if device is not None:
        return torch.device(device)
    if is_distributed() and default_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
