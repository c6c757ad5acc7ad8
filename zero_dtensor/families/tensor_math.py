"""The transforms (no communication) and reductions (one collective) of every :class:`~zero_dtensor.families.tensors.
ShardedTensors` family, as a mixin: elementwise ``mul_`` … ``add_noise_``, ``clone``, ``norms``, ``global_norm``,
``dots``, ``stats``, ``clip_*``.

The mixin uses the host's ``_state`` (:class:`~zero_dtensor.core.state.FlatState`), ``_agreed_selection`` and
``_check_same_layout``; the work is done by :mod:`zero_dtensor.ops.transforms` and :mod:`zero_dtensor.ops.reductions`. A
write (every in-place method here) ends with the storage's ``after_write`` (for fp32 masters: the model's working
weights need :func:`zero_dtensor.sync_model_params` before the next forward).
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..ops import reductions, transforms
from ..core.param_values import ParamValues
from ..ops.reductions import GradStats
from ..core.state import FlatState, ParamSelection, Selection
from ..ops.transforms import Scalar
from ..comm.signature import collective

__all__ = ["TensorMath"]

#: per source family, the numbers of its clones (made in the same order on every rank, as every call is)
_CLONES: dict[str, itertools.count] = {}


def _clone_family(source: str) -> str:
    """A new clone's family fingerprint: numbered per source family in the order this process makes clones of it,
    so two clones (an EMA and a snapshot) never share one, and the k-th clone of a family is the same one on every
    rank that made its clones in the same order."""
    return f"clone #{next(_CLONES.setdefault(source, itertools.count(1)))} of {source}"


class TensorMath:
    """Transforms and reductions of a sharded family (see the module docstring)."""

    _state: FlatState

    if TYPE_CHECKING:
        def _agreed_selection(self, what: str, params: ParamSelection, *, norm_type: Any = None) -> Selection: ...

        def _check_same_layout(self, other: Any) -> None: ...

        def _check_current(self) -> None: ...

    def mul_(self, factor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Multiply the selected values by ``factor``: a number, a 0-d tensor, or a mapping ``name -> factor``
        (per-parameter factors; it must cover every selected parameter). **No communication.** Returns ``self``."""
        sel = self._state.pick(params)
        transforms.mul_(self._state, sel, transforms.per_param(self._state, factor, sel, "factor"))
        return self

    def div_(self, divisor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Divide the selected values by ``divisor`` (number, 0-d tensor or per-parameter mapping).
        **No communication.** Returns ``self``."""
        sel = self._state.pick(params)
        transforms.div_(self._state, sel, transforms.per_param(self._state, divisor, sel, "divisor"))
        return self

    def zero_(self, *, params: ParamSelection = None):
        """Set the selected values to zero. **No communication.** Returns ``self``."""
        transforms.zero_(self._state, self._state.pick(params))
        return self

    def add_(self, other: Any, *, alpha: Scalar | Mapping[str, Scalar] = 1.0, params: ParamSelection = None):
        """``g += alpha * other`` in true units. **No communication.** Returns ``self``.

        With a ``ShardedTensors`` operand and ``alpha != 1``, ``alpha * other`` is formed in float32 and then added
        (one rounding to the stored dtype), so results do not depend on how fragments fall on vector boundaries.

        ``other``: a number or 0-d tensor (added to every element), or another ``ShardedTensors``/clone with the same
        layout (its own loss scale is taken into account). ``alpha``: a number, 0-d tensor, or a mapping
        ``name -> alpha`` (per-parameter, e.g. PCGrad projection coefficients).
        """
        sel = self._state.pick(params)
        per_alpha = transforms.per_param(self._state, alpha, sel, "alpha")
        if isinstance(other, TensorMath):
            self._check_same_layout(other)
            transforms.add_other_(self._state, other._state, sel, per_alpha)
        else:
            transforms.add_scalar_(self._state, sel, transforms.scalar(other, "other"), per_alpha)
        return self

    def clamp_(self, min: Scalar | None = None, max: Scalar | None = None, *, params: ParamSelection = None):
        """Clamp the selected true values to ``[min, max]`` (numbers or 0-d tensors; the stored values are clamped
        to the bounds × ``loss_scale``). **No communication.** Returns ``self``."""
        if min is None and max is None:
            raise ValueError("clamp_: give at least one of min, max")
        lo = None if min is None else transforms.scalar(min, "min")
        hi = None if max is None else transforms.scalar(max, "max")
        transforms.clamp_(self._state, self._state.pick(params), lo, hi)
        return self

    def lerp_(self, end: Any, weight: Scalar, *, params: ParamSelection = None):
        """``g = g + weight * (end - g)`` (``torch.lerp``) in true units, e.g. an EMA ``ema.lerp_(master, 1 - beta)``.

        ``end``: another ``ShardedTensors``/clone with the same layout, or a number/0-d tensor. **No communication.**
        Returns ``self``.
        """
        w = transforms.scalar(weight, "weight")
        sel = self._state.pick(params)
        if isinstance(end, TensorMath):
            self._check_same_layout(end)
            transforms.lerp_other_(self._state, end._state, sel, w)
        else:
            transforms.lerp_scalar_(self._state, sel, transforms.scalar(end, "end"), w)
        return self

    def copy_(self, other: Any, *, params: ParamSelection = None):
        """Overwrite the selected values with those of ``other`` (a ``ShardedTensors`` or clone with the same
        layout, e.g. a snapshot from :meth:`clone`), converting between loss scales. **No communication.**
        Returns ``self``."""
        if not isinstance(other, TensorMath):
            raise TypeError(
                f"copy_ takes another ShardedTensors or a clone with the same layout, got {type(other).__name__} "
                "(to write full tensors use set_full_)"
            )
        self._check_same_layout(other)
        transforms.copy_(self._state, other._state, self._state.pick(params))
        return self

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor | None], *, params: ParamSelection = None):
        """Apply a user function to the selected values. **No communication.**

        Contract for ``fn(x)``: it must be **elementwise** (each output element depends only on the input element at
        the same position, never on its neighbours, position, length or rank) and **shape-preserving**. ``x`` is a
        1-D tensor holding some of this rank's elements of one flat group: when every parameter of the group is
        selected, the whole local partition including its padding (a view of the stored tensor without loss
        scaling; the padding is reset to zero afterwards), else the selected fragments concatenated (a copy, written
        back afterwards). ``fn`` runs once per flat group, whatever the number of parameters. Values are in true
        units (under fp16 loss scaling ``x`` is an unscaled float32 copy). ``fn`` may modify ``x`` in place and
        return ``None``, or return a tensor of ``x``'s shape, which is cast and written back.

        The selection is validated before ``fn`` first runs; if ``fn`` raises or returns a wrong shape, groups
        already processed stay modified (with one flat group, nothing is written). Returns ``self``.
        """
        if not callable(fn):
            raise TypeError(f"apply_ takes a callable, got {type(fn).__name__}")
        transforms.apply_(self._state, self._state.pick(params), fn)
        return self

    def add_noise_(self, std: Scalar, seed: int, *, params: ParamSelection = None):
        """Add Gaussian noise ``std · N(0, 1)`` (true units) that does not depend on how the tensor is sharded.

        Element ``j`` of the flattened parameter ``name`` receives ``std · counter_normal(seed, name, numel)[j]``
        (see :func:`~zero_dtensor.ops.noise.counter_normal`): the noise depends only on ``(seed, parameter name, element
        position)``, so results are identical at every world size and ZeRO stage, and equal a single-process
        reference built with ``counter_normal`` on the full parameter. Each rank computes only its own elements,
        for all selected parameters at once. Under fp16 the noise is multiplied by ``loss_scale``. Use a new
        ``seed`` per step. **No communication.** Returns ``self``.
        """
        std_v = transforms.scalar(std, "std")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"add_noise_: seed must be an int, got {type(seed).__name__}")
        transforms.add_noise_(self._state, self._state.pick(params), std_v, int(seed))
        return self

    def clone(self, *, dtype: torch.dtype | None = None):
        """A sharded copy: a new ``ShardedTensors`` with the same layout, backed by a copy of this rank's partitions.

        **No communication.** The clone keeps the loss scale of the moment (its values stay ``true × that scale``),
        is never stale (it stays valid after ``engine.step()`` and across steps), is not seen by the optimizer, and
        supports every ``ShardedTensors`` operation: views, ``full_tensors()`` (collective), reductions, and serving as
        the ``other`` of :meth:`add_`, :meth:`lerp_`, :meth:`copy_` and :meth:`dots` (e.g. keep the previous step's
        tensor, or an EMA, without gathering). ``dtype`` stores the copy in another floating dtype (e.g. an fp32
        EMA of bf16 values). Memory: the local partition sizes, in that dtype.
        """
        self._check_current()
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"clone: dtype must be floating, got {dtype}")
        storage = transforms.clone_storage(self._state, dtype)
        return type(self)(replace(storage, family=_clone_family(self._state.storage.family)))

    @collective
    def norms(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> ParamValues:
        """``{name: norm of the true values}`` as 0-d float32 tensors (on the communication device, the engine's,
        also when the partitions are offloaded; no host sync; one read of the local data): a
        read-only mapping (:class:`~zero_dtensor.ParamValues`) whose ``.vector`` is every norm as one ``(k,)``
        tensor in result order; entries are made when read (``dict(result)`` for a plain dict).

        ``norm_type``: any ``p > 0`` or ``inf``. **Communication: one all_reduce of a (k,) float32 vector per process
        group** (sum of ``|g|^p`` partials; ``max`` for inf), none for replicated or single-rank groups.
        """
        sel = self._agreed_selection("norms", params, norm_type=norm_type)
        return reductions.norms(self._state, sel, float(norm_type))

    @collective
    def global_norm(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> torch.Tensor:
        """The norm of all selected true values taken together (as ``torch.nn.utils.get_total_norm``), a 0-d
        float32 tensor on the communication device (no host sync; one read of the local data). **Communication: one
        all_reduce of a (k,) float32 vector per process group.**"""
        sel = self._agreed_selection("global_norm", params, norm_type=norm_type)
        return reductions.global_norm(self._state, sel, float(norm_type))

    @collective
    def dots(self, other: Any, *, params: ParamSelection = None, with_norms: bool = False):
        """Per-parameter dot products ``{name: <g, other_g>}`` of true values (0-d float32 tensors), e.g. for
        PCGrad conflict tests. ``other``: a ``ShardedTensors``/clone with the same layout.

        With ``with_norms=True`` returns ``(dots, self_norms, other_norms)`` (2-norms), still in one collective.
        Each is a read-only :class:`~zero_dtensor.ParamValues` mapping (``.vector``: one ``(k,)`` tensor).
        **Communication: one all_reduce of a (k,) — (3k,) with norms — float32 vector per process group.**
        """
        if not isinstance(other, TensorMath):
            raise TypeError(f"dots takes another ShardedTensors or a clone, got {type(other).__name__}")
        self._check_same_layout(other)
        sel = self._agreed_selection("dots", params)
        return reductions.dots(self._state, other._state, sel, with_norms)

    @collective
    def stats(self, *, params: ParamSelection = None) -> Mapping[str, GradStats]:
        """``{name: GradStats}``: 2-norm, max ``|g|``, mean, nan and inf counts of parameter's true values, as Python
        numbers (one host sync); a read-only mapping whose ``GradStats`` are made when read. **Communication: at
        most two all_reduces per process group** (a (k, 4) float64 sum vector and a (k,) float32 max vector), none
        for replicated or single-rank groups.
        """
        return reductions.stats(self._state, self._agreed_selection("stats", params))

    @collective
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        params: ParamSelection = None,
    ) -> torch.Tensor:
        """Clip the selected values together, like ``torch.nn.utils.clip_grad_norm_``; returns the total (true)
        norm before clipping as a 0-d float32 tensor.

        Every selected tensor is multiplied by ``clamp(max_norm / (total_norm + 1e-6), max=1.0)`` (torch's
        formula). **Communication: the rank agreement, then one all_reduce of a (k,) float32 vector per process
        group**; the multiply is local (the coefficient moves to the storage device once). The agreement covers
        every argument (``max_norm`` and ``norm_type`` bit for bit, ``error_if_nonfinite``, the selection): where
        one differs between ranks (a ``max_norm`` adapted from rank-local history), every rank raises
        :class:`~zero_dtensor.errors.RankDisagreementError` before anything is reduced or written. Returns on the
        communication device; reads the local data once for the norm, then reads and writes it once to scale; no
        host sync unless ``error_if_nonfinite`` (then, the norm being the same on every rank, every rank raises
        ``RuntimeError`` for a non-finite norm, nothing scaled).
        """
        sel = self._agreed_selection("clip_grad_norm_", params, norm_type=norm_type)
        return reductions.clip_grad_norm_(self._state, sel, max_norm, float(norm_type), error_if_nonfinite)

    @collective
    def clip_per_param_(
        self, max_norm: float, norm_type: float = 2.0, *, params: ParamSelection = None
    ) -> ParamValues:
        """Clip each selected tensor on its own to norm ``max_norm`` (coefficient
        ``clamp(max_norm / (norm + 1e-6), max=1.0)`` per parameter); returns ``{name: norm before clipping}`` (a
        :class:`~zero_dtensor.ParamValues` mapping).
        **Communication: the rank agreement, then one all_reduce of a (k,) float32 vector per process group.** The
        agreement covers every argument (``max_norm`` and ``norm_type`` bit for bit, the selection): where one
        differs between ranks, every rank raises :class:`~zero_dtensor.errors.RankDisagreementError` before
        anything is reduced or written.
        """
        sel = self._agreed_selection("clip_per_param_", params, norm_type=norm_type)
        return reductions.clip_per_param_(self._state, sel, max_norm, float(norm_type))

