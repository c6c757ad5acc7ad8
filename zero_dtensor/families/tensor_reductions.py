"""The reductions (one collective each) of every :class:`~zero_dtensor.families.tensors.ShardedTensors` family, as a
mixin: ``norms``, ``global_norm``, ``dots``, ``stats``, ``clip_grad_norm_``, ``clip_per_param_``.

The mixin uses the host's ``_state`` (:class:`~zero_dtensor.core.state.FlatState`), ``_agreed_selection`` and
``_check_same_layout``; the work is done by :mod:`zero_dtensor.ops.reductions`. The clipping methods write in place
and end with the storage's ``after_write``, as the transforms of :mod:`.tensor_math` do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..ops import reductions
from ..core.param_values import ParamValues
from ..ops.reductions import GradStats
from ..core.state import FlatState, ParamSelection, Selection
from .tensor_math import TensorMath
from ..comm.signature import collective

__all__ = ["TensorReductions"]


class TensorReductions:
    """Reductions of a sharded family (see the module docstring)."""

    _state: FlatState

    if TYPE_CHECKING:
        def _agreed_selection(self, what: str, params: ParamSelection, *, norm_type: Any = None) -> Selection: ...

        def _check_same_layout(self, other: Any) -> None: ...

    @collective
    def norms(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> ParamValues:
        """Per-parameter norms of the true values: one collective for all parameters.

        Args:
            norm_type: any ``p > 0`` or ``inf``.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ParamValues: a read-only mapping ``{name: 0-d float32 tensor}``; ``.vector`` holds all of them as one
                ``(k,)`` tensor.

        Raises:
            KeyError: an unknown name in ``params``.
            ValueError: a bad ``norm_type``.
            RankDisagreementError: the ranks' calls differ (raised on every rank before data moves).
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            The agreement, then one ``all_reduce`` of a ``(k,)`` float32 vector per process group (gloo below 4 ranks:
            one ``all_gather``); none for replicated or single-rank groups.

        Device and memory:
            Results on the communication device, no host sync; one read of the local data; small per-row partials.

        Example:
            ```python
            norms = grads.norms()
            log({f"grad_norm/{n}": float(v) for n, v in norms.items()})
            ```
        """
        sel = self._agreed_selection("norms", params, norm_type=norm_type)
        return reductions.norms(self._state, sel, float(norm_type))

    @collective
    def global_norm(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> torch.Tensor:
        """The norm of all selected true values together, as ``torch.nn.utils.get_total_norm``.

        Args:
            norm_type: any ``p > 0`` or ``inf``.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            torch.Tensor: a 0-d float32 tensor.

        Raises:
            KeyError: an unknown name in ``params``.
            ValueError: a bad ``norm_type``.
            RankDisagreementError: the ranks' calls differ (raised on every rank before data moves).
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            The agreement, then one ``all_reduce`` per process group.

        Device and memory:
            On the communication device, no host sync; one read of the local data.

        Example:
            ```python
            total = grads.global_norm()
            ```
        """
        sel = self._agreed_selection("global_norm", params, norm_type=norm_type)
        return reductions.global_norm(self._state, sel, float(norm_type))

    @collective
    def dots(self, other: Any, *, params: ParamSelection = None, with_norms: bool = False):
        """Per-parameter dot products ``<g, other_g>`` of true values (PCGrad conflict tests), one collective.

        Args:
            other: another family or clone with the same layout.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.
            with_norms: also return both sets' 2-norms, in the same collective.

        Returns:
            ParamValues: ``{name: 0-d float32}``; with ``with_norms``, ``(dots, self_norms, other_norms)``.

        Raises:
            KeyError: an unknown name in ``params``.
            ValueError: a bad ``norm_type``.
            RankDisagreementError: the ranks' calls differ (raised on every rank before data moves).
            StaleTensorsError: the values are no longer DeepSpeed's.
            ValueError: ``other`` has another layout (e.g. a replicated gradient beside sharded masters).

        Communication:
            The agreement, then one ``all_reduce`` of a ``(k,)`` (``(3k,)`` with norms) float32 vector per process group.

        Device and memory:
            On the communication device; float32 chunks of at most 1/16 of the data per set.

        Example:
            ```python
            conflict = {n: float(d) < 0 for n, d in grads.dots(previous).items()}
            ```
        """
        if not isinstance(other, TensorMath):
            raise TypeError(f"dots takes another ShardedTensors or a clone, got {type(other).__name__}")
        self._check_same_layout(other)
        sel = self._agreed_selection("dots", params)
        return reductions.dots(self._state, other._state, sel, with_norms)

    @collective
    def stats(self, *, params: ParamSelection = None) -> Mapping[str, GradStats]:
        """Per-parameter statistics: 2-norm, max ``|g|``, mean, nan and inf counts, as Python numbers.

        Args:
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            Mapping[str, GradStats]: a read-only mapping of ``GradStats`` records. Sums of squares accumulate in
            float32 over runs of 64 elements (float64 data: float64), as ``torch.linalg.vector_norm`` of float32
            data does, and in float64 above them: a parameter whose magnitudes are all below about 1e-19 (squares
            under float32's range) or above about 1e18 reads an inexact norm (0, inf, or that of some of its
            elements).

        Raises:
            KeyError: an unknown name in ``params``.
            RankDisagreementError: the ranks' calls differ.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            The agreement, then at most two ``all_reduce`` per process group (sums and maxima; gloo: one
            ``all_gather``).

        Device and memory:
            Three reads of the local data, a few per-row vectors, one host sync (the result copy).

        Example:
            ```python
            bad = [n for n, s in grads.stats().items() if s.nan_count or s.inf_count]
            ```
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
        """Clip the selected values together, like ``torch.nn.utils.clip_grad_norm_``.

        Every selected tensor is multiplied by ``clamp(max_norm / (total_norm + 1e-6), max=1)`` (torch's formula).

        Args:
            max_norm: the largest total norm.
            norm_type: any ``p > 0`` or ``inf``.
            error_if_nonfinite: raise if the total norm is nan or inf (costs one host sync).
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            torch.Tensor: the total norm before clipping, 0-d float32.

        Raises:
            KeyError: an unknown name in ``params``.
            ValueError: a bad ``norm_type``.
            RankDisagreementError: the ranks' calls differ (raised on every rank before data moves).
            StaleTensorsError: the values are no longer DeepSpeed's.
            RuntimeError: ``error_if_nonfinite`` and a non-finite norm (nothing is scaled).

        Communication:
            The agreement, then one ``all_reduce`` per process group; the scaling is local.

        Device and memory:
            One read for the norm, one read and write to scale, in place on the storage device; the norm on the
            communication device.

        Example:
            ```python
            total = grads.clip_grad_norm_(1.0)
            ```
        """
        sel = self._agreed_selection("clip_grad_norm_", params, norm_type=norm_type)
        return reductions.clip_grad_norm_(self._state, sel, max_norm, float(norm_type), error_if_nonfinite)

    @collective
    def clip_per_param_(
        self, max_norm: float, norm_type: float = 2.0, *, params: ParamSelection = None
    ) -> ParamValues:
        """Clip each selected tensor on its own to norm ``max_norm``.

        Args:
            max_norm: the largest norm of each parameter.
            norm_type: any ``p > 0`` or ``inf``.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ParamValues: ``{name: norm before clipping}``.

        Raises:
            KeyError: an unknown name in ``params``.
            ValueError: a bad ``norm_type``.
            RankDisagreementError: the ranks' calls differ (raised on every rank before data moves).
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            The agreement, then one ``all_reduce`` of a ``(k,)`` vector per process group.

        Device and memory:
            As ``clip_grad_norm_``.

        Example:
            ```python
            before = grads.clip_per_param_(0.1)
            ```
        """
        sel = self._agreed_selection("clip_per_param_", params, norm_type=norm_type)
        return reductions.clip_per_param_(self._state, sel, max_norm, float(norm_type))

