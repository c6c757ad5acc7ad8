"""Opt-in ``Replicate`` gradients for ZeRO-1/2 at zero extra communication: :func:`keep_full_grads`.

During ``engine.backward()`` ZeRO-1/2 all-reduces whole gradient buckets and then throws away everything but the
slice each rank owns. ``keep_full_grads(engine)`` keeps a copy of the reduced values, so that afterwards
``sharded_grads(engine)`` describes every flat group as ``Replicate()``: ``full_tensors()`` and
``ParamGrad.full_tensor()`` issue **no collective**, norms need none either, and writes go to the full buffer and
then into DeepSpeed's own partition (every rank must write the same values, which ``set_full_`` requires anyway).

- Supported: ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``) with ``contiguous_gradients: true`` (the default) and
  either ``reduce_scatter: false`` or ``use_multi_rank_bucket_allreduce: true`` (the default), with or without
  ``offload_optimizer``. ``BF16_Optimizer`` is already replicated (the handle does nothing). ZeRO-3 is refused:
  its reduce-scatter never materializes the full gradient. The DeepSpeed configuration is never changed: an
  unsuitable one raises :class:`~zero_dtensor.errors.UnsupportedDeepSpeedError` naming the key to set.
- Call it before the ``backward()`` whose gradients you want (e.g. once after ``deepspeed.initialize``); an
  accumulation window that started before it falls back to the sharded view for that step.
- Cost: one extra full-size flat gradient per rank (the unsharded size in the gradient-accumulation dtype) and one
  copy/add of each reduced bucket during backward; no communication.
- It wraps two private methods of the optimizer instance (``average_tensor``, ``allreduce_bucket``);
  ``handle.remove()`` restores them and frees the buffer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FullGradsHandle", "KeepFullGradsHandle", "keep_full_grads"]


class KeepFullGradsHandle:
    """Returned by :func:`keep_full_grads`; ``remove()`` (or leaving a ``with`` block) stops capturing."""

    def __init__(self, engine: Any, capture: Any) -> None:
        self._engine = engine
        self._capture = capture

    @property
    def active(self) -> bool:
        """True while gradients are being kept (always False for BF16_Optimizer, which needs no capture)."""
        return self._capture is not None and self._capture.active

    @property
    def nbytes(self) -> int:
        """Bytes of the kept full buffers on this rank (0 before the first backward)."""
        if self._capture is None:
            return 0
        return sum(b.numel() * b.element_size() for b in self._capture.buffers if b is not None)

    def remove(self) -> None:
        """Stop keeping full gradients: restore the optimizer's methods and free the kept buffers (idempotent).

        Returns:
            None.

        Raises nothing.

        Communication:
            None.

        Device and memory:
            Frees ``nbytes`` on this rank.

        Example:
            ```python
            handle = zd.keep_full_grads(engine)
            handle.remove()
            ```
        """
        if self._capture is not None:
            self._capture.remove()

    def __enter__(self) -> KeepFullGradsHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"KeepFullGradsHandle(active={self.active}, nbytes={self.nbytes})"


def keep_full_grads(engine: Any) -> KeepFullGradsHandle:
    """Keep the full reduced gradient that ZeRO-1/2 computes in backward, so reads need no collective.

    Opt-in ``Replicate`` for ZeRO-1/2: DeepSpeed's bucket all-reduce already produces the full gradient on every
    rank; kept, ``full_tensors()`` and the norms need no data collective. Idempotent per engine. Details and costs:
    ``docs/configurations.md``.

    Args:
        engine: a DeepSpeed ZeRO-1/2 engine (``BF16_Optimizer`` is replicated already: the handle is inactive).

    Returns:
        KeepFullGradsHandle: ``remove()`` (or leaving a ``with`` block) stops keeping.

    Raises:
        UnsupportedDeepSpeedError: ZeRO-3, an unknown optimizer, or ``contiguous_gradients: false``.

    Communication:
        None, ever.

    Device and memory:
        The full gradient, ``S`` bytes per rank, kept from the first backward on.

    Example:
        ```python
        with zd.keep_full_grads(engine):
            ...                                         # train; full_tensors() moves no data
        ```
    """
    from .._deepspeed.capture import install

    return KeepFullGradsHandle(engine, install(engine))


#: The former name, kept: it is part of the public API.
FullGradsHandle = KeepFullGradsHandle
