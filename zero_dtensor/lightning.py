"""Lightning integration: gradient clipping, per-layer gradient norms and your own gradient code under
``DeepSpeedStrategy``, once per accumulation boundary.

Under Lightning's ``DeepSpeedStrategy``, DeepSpeed accumulates micro-batches itself: Lightning calls ``engine.step()``
after every micro-batch, so ``on_before_optimizer_step`` fires on every micro-batch, and the reduced gradients live
in DeepSpeed's ZeRO partitions, not in ``p.grad``, where ``lightning.pytorch.utilities.grad_norm(module)`` looks
(Lightning #7490). :class:`ZeroGradCallback` registers on the DeepSpeed engine with :func:`zero_dtensor.on_grads`, so
that its work runs exactly once per accumulation boundary, after DeepSpeed reduced the gradients and before its
optimizer step, on the sharded gradients (:class:`~zero_dtensor.ShardedGrads`), on ZeRO stages 1, 2 and 3.

Needs the optional dependency ``lightning`` (``pip install 'zero_dtensor[lightning]'``; tested with 2.5.0 and 2.6.6);
importing ``zero_dtensor`` does not import this module. The callback subclasses ``lightning.pytorch.Callback``: use
it with ``lightning.pytorch.Trainer`` (the ``pytorch_lightning`` package's Trainer wants its own Callback class).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as _exc:  # pragma: no cover - exercised only where lightning is missing
    raise ImportError(
        "zero_dtensor.lightning needs Lightning 2.x (the `lightning` package): pip install 'zero_dtensor[lightning]'"
    ) from _exc

from .integrations.hooks import GradHookHandle, on_grads
from .families.sharded import ShardedGrads

__all__ = ["ZeroGradCallback"]


class ZeroGradCallback(pl.Callback):
    """Run gradient code once per accumulation boundary under Lightning's ``DeepSpeedStrategy`` (ZeRO 1-3).

    At every accumulation boundary, after DeepSpeed reduced the gradients and before its optimizer step (inside the
    ``engine.step()`` Lightning calls), on every rank, in this order:

    1. ``fn(grads)``, if given, with the step's :class:`~zero_dtensor.ShardedGrads`; its in-place changes are what
       the optimizer uses (see :func:`zero_dtensor.on_grads`).
    2. if ``log_grad_norms`` and this step is logged: per-parameter gradient norms, logged with
       ``pl_module.log_dict`` under the names of Lightning's ``grad_norm`` utility: ``grad_{p}_norm/{name}`` for
       every trainable parameter (``name`` as in ``pl_module.named_parameters()``) and ``grad_{p}_norm_total`` (the
       ``p``-norm of those norms: the norm of all gradients taken together), with ``p = float(norm_type)``
       (``grad_2.0_norm/...``). They are the norms before clipping, as with ``grad_norm`` in
       ``on_before_optimizer_step``. Logged ``on_step=True, on_epoch=False`` from ``on_train_batch_end`` of the batch
       whose boundary computed them, so they reach ``trainer.callback_metrics`` and every logger.
    3. if ``clip_grad_norm``: clip like ``torch.nn.utils.clip_grad_norm_(parameters, clip_grad_norm, norm_type)``
       (scale every gradient by ``min(1, max_norm / (total_norm + 1e-6))``) with
       :meth:`ShardedGrads.clip_grad_norm_`; ``last_total_norm`` is the norm before clipping.

    The gradients are those DeepSpeed's optimizer is about to use. Under Lightning 2.5 with
    ``accumulate_grad_batches=g > 1`` that is the mean gradient divided by ``g``: Lightning divides the
    ``training_step`` loss by ``g`` and DeepSpeed's ``engine.backward`` divides it again (Lightning #6170); choose
    ``clip_grad_norm`` for that scale (the logged norms show it).

    Args:
        fn: ``fn(grads: ShardedGrads) -> Any``, called once per boundary on every rank (it may issue collectives,
            in the same order on every rank). To log values of your own from it, call ``pl_module.log`` (logging is
            allowed there: it runs inside Lightning's ``optimizer_step``).
        clip_grad_norm: clip the total gradient norm to this value (``None``: no clipping). This replaces
            ``Trainer(gradient_clip_val=...)``, which under DeepSpeed hands a 2-norm clip to DeepSpeed's own step;
            setting both clips twice (ours first, then DeepSpeed's): a warning says so.
        norm_type: ``p`` of the norms, for clipping and logging: any ``p > 0``, ``float("inf")`` or ``"inf"``.
        log_grad_norms: log the per-parameter norms and their total.
        log_every_n_steps: when to compute and log the norms. ``None`` (default): at exactly the optimizer steps
            whose metrics Lightning writes to its loggers, ``Trainer(log_every_n_steps=k)``'s steps ``k, 2k, ...``
            (Lightning counts optimizer steps, i.e. accumulation boundaries, also under DeepSpeed): no norm is
            computed that no logger would see. An int ``n``: at optimizer steps ``n, 2n, ...`` instead; Lightning
            still writes only at its own steps, each time the latest value logged so far in the epoch (as for
            anything logged with ``self.log``): choose ``n`` a multiple of ``k``, so that every value is written
            at the step it belongs to (and repeated at Lightning's steps until the next one).
        group_separator: between ``grad_{p}_norm`` and the parameter name, as in ``grad_norm``.
        prog_bar: also show the logged norms in the progress bar.

    Attributes:
        boundaries: accumulation boundaries seen in the current (or last) ``fit``.
        last_total_norm: the total norm before the last clip (0-d float32 tensor, identical on every rank), or None.
        last_logged: the last dict of logged norms (``{name: 0-d tensor}``), or None.

    Returns:
        ZeroGradCallback: pass it in ``Trainer(callbacks=[...])``.

    Raises:
        TypeError: a bad argument; at ``setup``, a strategy that is not a ``DeepSpeedStrategy``.
        ValueError: a bad ``clip_grad_norm``, ``norm_type`` or ``log_every_n_steps``.
        UnsupportedDeepSpeedError: when fitting starts, ZeRO stage 0 (``zd.on_grads`` needs a ZeRO optimizer).
        GradHookError: in ``trainer.fit``, when ``fn`` raised on another rank (no optimizer step runs).

    Communication:
        Per boundary, on the data-parallel group: ``fn``'s own; the norms, on logged steps only, one
        ``all_reduce`` of a ``(k,)`` float32 vector; the clip, one ``all_reduce``; each after the agreement;
        and ``zd.on_grads``' small error agreement after ``fn`` and after the norms and clip. No gradient is
        gathered; nothing runs between boundaries.

    Device and memory:
        As ``norms()`` and ``clip_grad_norm_()``: small per-row partials, scaling in place.

    Example:
        ```python
        callback = ZeroGradCallback(clip_grad_norm=1.0, log_grad_norms=True)
        trainer = lightning.Trainer(strategy="deepspeed_stage_2", callbacks=[callback])
        ```
    """

    def __init__(
        self,
        fn: Callable[[ShardedGrads], Any] | None = None,
        *,
        clip_grad_norm: float | None = None,
        norm_type: float | str = 2.0,
        log_grad_norms: bool = False,
        log_every_n_steps: int | None = None,
        group_separator: str = "/",
        prog_bar: bool = False,
    ) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"ZeroGradCallback(fn): fn must be callable, got {type(fn).__name__}")
        try:
            p = float(norm_type)
        except (TypeError, ValueError):
            p = float("nan")
        if isinstance(norm_type, bool) or not p > 0:  # also refuses nan
            raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
        if clip_grad_norm is not None:
            if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)):
                raise TypeError(f"clip_grad_norm must be a number or None, got {type(clip_grad_norm).__name__}")
            if not (clip_grad_norm > 0 and math.isfinite(clip_grad_norm)):
                raise ValueError(f"clip_grad_norm must be a positive finite number, got {clip_grad_norm!r}")
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(f"log_every_n_steps must be an int >= 1 or None, got {log_every_n_steps!r}")
        self.fn = fn
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.norm_type = p
        self.log_grad_norms = bool(log_grad_norms)
        self.log_every_n_steps = log_every_n_steps
        self.group_separator = group_separator
        self.prog_bar = prog_bar
        self.handles: tuple[GradHookHandle, ...] = ()
        self.boundaries = 0
        self.last_total_norm: torch.Tensor | None = None
        self.last_logged: dict[str, torch.Tensor] | None = None
        self._trainer: Any = None
        self._pending: dict[str, torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        """Whether the gradient hook is registered on the DeepSpeed engine (between fit start and end)."""
        return any(h.active for h in self.handles)

    @property
    def _has_work(self) -> bool:
        return self.fn is not None or self.clip_grad_norm is not None or self.log_grad_norms

    # --- Lightning hooks ---------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a strategy other than ``DeepSpeedStrategy`` before any engine is built. No communication."""
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, DeepSpeedStrategy):
            raise TypeError(
                f"ZeroGradCallback needs Lightning's DeepSpeedStrategy (e.g. Trainer(strategy='deepspeed_stage_2')), "
                f"got {type(strategy).__name__}. Under other strategies the gradients are in p.grad: use "
                "Trainer(gradient_clip_val=...) and lightning.pytorch.utilities.grad_norm in on_before_optimizer_step"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register on the DeepSpeed engine Lightning built (``trainer.strategy.deepspeed_engine``). No
        communication."""
        self._detach()
        self.boundaries = 0
        self.last_total_norm = None
        self.last_logged = None
        self._pending = None
        if not self._has_work:
            return
        engine = trainer.strategy.deepspeed_engine
        if self.clip_grad_norm is not None:
            clipping = engine.gradient_clipping() if callable(getattr(engine, "gradient_clipping", None)) else 0.0
            if clipping:
                rank_zero_warn(
                    f"ZeroGradCallback(clip_grad_norm={self.clip_grad_norm}) and DeepSpeed's gradient_clipping="
                    f"{clipping} (Trainer(gradient_clip_val=...) or the DeepSpeed config) both clip: this callback "
                    "first, then DeepSpeed inside its step"
                )
        self._trainer = trainer
        # two hooks when there is a fn: on_grads agrees on errors after each hook, so an exception from fn on some
        # ranks raises on every rank before any rank enters the norms' or the clip's all_reduce (one hook would let
        # the other ranks wait in those for the failed rank)
        handles = [on_grads(engine, self._count, sync_errors=False)]  # cannot raise: no agreement needed
        if self.fn is not None:
            handles.append(on_grads(engine, self.fn))
        if self.log_grad_norms or self.clip_grad_norm is not None:
            handles.append(on_grads(engine, self._norms_and_clip))
        self.handles = tuple(handles)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Log the norms computed at this batch's boundary, if any (no communication: ``sync_dist=False``, the
        values are already identical on every rank)."""
        pending, self._pending = self._pending, None
        if pending:
            pl_module.log_dict(pending, prog_bar=self.prog_bar, logger=True, on_step=True, on_epoch=False,
                               sync_dist=False, batch_size=1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()

    # --- the gradient hooks -----------------------------------------------------------------------------------------
    def _count(self, grads: ShardedGrads) -> None:
        self.boundaries += 1

    def _norms_and_clip(self, grads: ShardedGrads) -> None:
        index = self.boundaries - 1  # this boundary, 0-based
        if self.log_grad_norms and self._logs_now(index):
            norms = grads.norms(self.norm_type)
            prefix = f"grad_{self.norm_type}_norm"
            logged = {f"{prefix}{self.group_separator}{name}": value for name, value in norms.items()}
            if logged:
                logged[f"{prefix}_total"] = torch.linalg.vector_norm(norms.vector, ord=self.norm_type)
            self._pending = self.last_logged = logged
        if self.clip_grad_norm is not None:
            self.last_total_norm = grads.clip_grad_norm_(self.clip_grad_norm, norm_type=self.norm_type)

    def _logs_now(self, index: int) -> bool:
        if self.log_every_n_steps is not None:
            return (index + 1) % self.log_every_n_steps == 0
        try:  # the check Lightning's own LearningRateMonitor and DeviceStatsMonitor make
            return bool(self._trainer._logger_connector.should_update_logs)
        except AttributeError:  # another Lightning version: log every boundary, Lightning filters what it writes
            return True

    def _detach(self) -> None:
        handles, self.handles = self.handles, ()
        self._trainer = None
        for handle in handles:
            handle.remove()

    def __repr__(self) -> str:
        return (f"ZeroGradCallback(fn={getattr(self.fn, '__qualname__', self.fn)!r}, "
                f"clip_grad_norm={self.clip_grad_norm}, norm_type={self.norm_type}, "
                f"log_grad_norms={self.log_grad_norms}, log_every_n_steps={self.log_every_n_steps}, "
                f"active={self.active})")
