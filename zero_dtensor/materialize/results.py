"""What ``full_tensors`` returns: a dict that remembers its buffers, and the pending form of ``async_op=True``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FullGrads", "FullTensorsHandle", "GatheredGrads", "PendingFullTensors"]


class GatheredGrads(dict):
    """``{name: full gradient}`` as returned by ``full_tensors``; pass it back as ``out=`` to reuse its memory.

    Besides the tensors it keeps the buffers they were assembled in (``buffers``), so a later call with ``out=``
    this dict gathers into the same memory: no allocation, and entries that are views of those buffers keep their
    addresses. Pickles as a plain dict (the buffers only serve reuse in this process).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


class PendingFullTensors:
    """Pending result of ``full_tensors(..., async_op=True)``. :meth:`wait` completes the collectives already
    issued (no new ones), cuts the buffers into parameters and returns the dict (idempotent). The gradients must not
    change (no ``engine.step()``) before ``wait()``."""

    def __init__(self, works: list[Any], finish: Callable[[], dict[str, torch.Tensor]]) -> None:
        self._works = works
        self._finish: Callable[[], dict[str, torch.Tensor]] | None = finish
        self._result: dict[str, torch.Tensor] | None = None

    def is_completed(self) -> bool:
        """Whether every collective issued for this result has finished (non-blocking; no communication)."""
        return self._result is not None or all(w.is_completed() for w in self._works)

    def wait(self) -> dict[str, torch.Tensor]:
        if self._result is None:
            for work in self._works:
                work.wait()
            assert self._finish is not None
            self._result, self._finish, self._works = self._finish(), None, []
        return self._result


#: Former names, kept: they are part of the public API.
FullGrads = GatheredGrads
FullTensorsHandle = PendingFullTensors
