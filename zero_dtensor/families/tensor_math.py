"""The transforms (no communication) of every :class:`~zero_dtensor.families.tensors.ShardedTensors` family, as a
mixin: elementwise ``mul_`` … ``add_noise_``, and ``clone``. The reductions are in :mod:`.tensor_reductions`.

The mixin uses the host's ``_state`` (:class:`~zero_dtensor.core.state.FlatState`), ``_agreed_selection`` and
``_check_same_layout``; the work is done by :mod:`zero_dtensor.ops.transforms`. A
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

from ..ops import transforms
from ..core.state import FlatState, ParamSelection, Selection
from ..ops.transforms import Scalar

__all__ = ["TensorMath"]

#: per source family, the numbers of its clones (made in the same order on every rank, as every call is)
_CLONES: dict[str, itertools.count] = {}


def _clone_family(source: str) -> str:
    """A new clone's family fingerprint: numbered per source family in the order this process makes clones of it,
    so two clones (an EMA and a snapshot) never share one, and the k-th clone of a family is the same one on every
    rank that made its clones in the same order."""
    return f"clone #{next(_CLONES.setdefault(source, itertools.count(1)))} of {source}"


class TensorMath:
    """Transforms of a sharded family (see the module docstring)."""

    _state: FlatState

    if TYPE_CHECKING:
        def _agreed_selection(self, what: str, params: ParamSelection, *, norm_type: Any = None) -> Selection: ...

        def _check_same_layout(self, other: Any) -> None: ...

        def _check_current(self) -> None: ...

    def mul_(self, factor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Multiply the selected values by ``factor``, in place.

        Args:
            factor: a number, a 0-d tensor, or a mapping ``name -> factor`` covering every selected parameter.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values.

        Example:
            ```python
            grads.mul_(0.5, params=lambda n: "embed" in n)
            ```
        """
        sel = self._state.pick(params)
        transforms.mul_(self._state, sel, transforms.per_param(self._state, factor, sel, "factor"))
        return self

    def div_(self, divisor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Divide the selected values by ``divisor``, in place.

        Args:
            divisor: a number, a 0-d tensor, or a mapping ``name -> divisor``.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values.

        Example:
            ```python
            grads.div_(world_size)
            ```
        """
        sel = self._state.pick(params)
        transforms.div_(self._state, sel, transforms.per_param(self._state, divisor, sel, "divisor"))
        return self

    def zero_(self, *, params: ParamSelection = None):
        """Set the selected values to zero.

        Args:
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values.

        Example:
            ```python
            grads.zero_(params=lambda n: n.endswith("bias"))
            ```
        """
        transforms.zero_(self._state, self._state.pick(params))
        return self

    def add_(self, other: Any, *, alpha: Scalar | Mapping[str, Scalar] = 1.0, params: ParamSelection = None):
        """``g += alpha * other`` in true (unscaled) units, in place.

        Args:
            other: a number or 0-d tensor, or another family or clone with the same layout (e.g. the masters).
            alpha: a number, 0-d tensor, or a mapping ``name -> alpha`` (per parameter, e.g. PCGrad coefficients).
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values. With another family, ``alpha * other`` is formed in float32.

        Example:
            ```python
            master.add_(grads, alpha=-lr)
            ```
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
        """Clamp the selected true values to ``[min, max]``, in place.

        Args:
            min: lower bound (a number, a 0-d tensor, or ``None``).
            max: upper bound (a number, a 0-d tensor, or ``None``).
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values.

        Example:
            ```python
            grads.clamp_(-1.0, 1.0)
            ```
        """
        if min is None and max is None:
            raise ValueError("clamp_: give at least one of min, max")
        lo = None if min is None else transforms.scalar(min, "min")
        hi = None if max is None else transforms.scalar(max, "max")
        transforms.clamp_(self._state, self._state.pick(params), lo, hi)
        return self

    def lerp_(self, end: Any, weight: Scalar, *, params: ParamSelection = None):
        """``g += weight * (end - g)`` in true units, in place (``torch.lerp``), e.g. an EMA.

        Args:
            end: another family or clone with the same layout, or a number / 0-d tensor.
            weight: a number or 0-d tensor.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values.

        Example:
            ```python
            ema = zd.sharded_master_params(engine).clone()
            ema.lerp_(zd.sharded_master_params(engine), 1 - 0.999)      # after each step
            ```
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
        """Overwrite the selected values with those of ``other`` (another family or clone with the same layout).

        Args:
            other: the source, e.g. a snapshot from ``clone()``; loss scales are converted.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values.

        Example:
            ```python
            saved = grads.clone()
            grads.copy_(saved)
            ```
        """
        if not isinstance(other, TensorMath):
            raise TypeError(
                f"copy_ takes another ShardedTensors or a clone with the same layout, got {type(other).__name__} "
                "(to write full tensors use set_full_)"
            )
        self._check_same_layout(other)
        transforms.copy_(self._state, other._state, self._state.pick(params))
        return self

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor | None], *, params: ParamSelection = None):
        """Apply an elementwise function to the selected values, in place, once per flat group.

        ``fn(x)`` gets a 1-D tensor of this rank's elements of one flat group (true units) and must be elementwise and
        shape-preserving; it may change ``x`` in place and return ``None``, or return new values of ``x``'s shape.

        Args:
            fn: ``fn(x) -> Tensor | None``, elementwise.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params``.
            ValueError: ``fn`` returned another shape. Groups already processed stay changed (one group: nothing).
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None; ``fn`` must not communicate.

        Device and memory:
            On the storage device; a view of the partition when a whole group is selected, else one copy of the
            selected fragments (and float32 under fp16).

        Example:
            ```python
            grads.apply_(lambda x: x.sign_())
            ```
        """
        if not callable(fn):
            raise TypeError(f"apply_ takes a callable, got {type(fn).__name__}")
        transforms.apply_(self._state, self._state.pick(params), fn)
        return self

    def add_noise_(self, std: Scalar, seed: int, *, params: ParamSelection = None):
        """Add Gaussian noise ``std · N(0, 1)`` that depends only on ``(seed, name, element)``, not on the sharding.

        Results are identical at every world size and ZeRO stage (``zd.counter_normal`` is the reference). Use a new
        ``seed`` per step.

        Args:
            std: standard deviation, in true units.
            seed: an int.
            params: the parameters to touch: names, a predicate ``name -> bool``, or ``None`` for all.

        Returns:
            ShardedTensors: ``self``, for chaining.

        Raises:
            KeyError: an unknown name in ``params`` (or in a per-parameter mapping).
            TypeError: an operand of the wrong kind.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place, on the storage device (the CPU under offload): one read and write of the selected values.

        Example:
            ```python
            grads.add_noise_(1e-3, seed=engine.global_steps)
            ```
        """
        std_v = transforms.scalar(std, "std")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"add_noise_: seed must be an int, got {type(seed).__name__}")
        transforms.add_noise_(self._state, self._state.pick(params), std_v, int(seed))
        return self

    def clone(self, *, dtype: torch.dtype | None = None):
        """A sharded copy in memory of its own, valid across steps (an EMA, the previous gradient).

        The clone has the same layout and every operation of the family, serves as ``other`` of ``add_``, ``lerp_``,
        ``copy_`` and ``dots``, is never stale and is not seen by the optimizer.

        Args:
            dtype: store the copy in another floating dtype (e.g. float32 for an EMA of bf16 values).

        Returns:
            ShardedTensors: the copy.

        Raises:
            TypeError: a non-floating ``dtype``.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            This rank's partitions once more, in ``dtype``, on the storage device.

        Example:
            ```python
            previous = grads.clone()
            ```
        """
        self._check_current()
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"clone: dtype must be floating, got {dtype}")
        storage = transforms.clone_storage(self._state, dtype)
        return type(self)(replace(storage, family=_clone_family(self._state.storage.family)))

