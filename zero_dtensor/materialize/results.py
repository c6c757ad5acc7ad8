"""What ``full_tensors`` returns: a dict that remembers its buffers, and the pending form of ``async_op=True``."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..layout.views import ViewCache

__all__ = ["FullGrads", "FullTensorsHandle", "GatheredGrads", "PendingFullTensors", "run_steps"]


_NAME = operator.attrgetter("name")


class GatheredGrads(dict):
    """``{name: full gradient}`` as returned by ``full_tensors``; pass it back as ``out=`` to reuse its memory.

    Besides the tensors it keeps the buffers they were assembled in (``buffers``), so a later call with ``out=``
    this dict gathers into the same memory: no allocation, and entries that are views of those buffers keep their
    addresses. Pickles as a plain dict (the buffers only serve reuse in this process).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._issued: tuple[tuple[str, ...], tuple[torch.Tensor, ...], Any] | None = None
        self._touched = False  # an entry was set, replaced or removed since the last call filled this dict
        self._caches: dict[int, ViewCache] = {}  # cut views of buffers the pool does not keep, per storage
        self._cut: tuple[torch.Tensor, ...] | None = None  # the cut views the last ``fill_cut`` took its entries from

    # every way of changing the entries marks the dict touched (the last call's record no longer describes it)
    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._touched = True
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._touched = True
        super().__delitem__(key)

    def __ior__(self, other: Any) -> GatheredGrads:  # type: ignore[override,misc]
        self._touched = True
        return super().__ior__(other)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self._touched = True
        super().update(*args, **kwargs)

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self._touched = True
        return super().setdefault(key, default)

    def pop(self, *args: Any) -> Any:  # type: ignore[override]
        self._touched = True
        return super().pop(*args)

    def popitem(self) -> tuple[str, torch.Tensor]:
        self._touched = True
        return super().popitem()

    def clear(self) -> None:
        self._touched = True
        super().clear()

    def in_order(self, names: tuple[str, ...]) -> bool:
        """Whether this dict's keys are exactly ``names``, in that order (O(1) when it holds what the last call
        issued for them)."""
        if self._issued is not None and not self._touched and (self._issued[0] is names or self._issued[0] == names):
            return True
        return len(self) == len(names) and all(map(operator.eq, self, names))

    def fill(self, names: tuple[str, ...], tensors: Sequence[torch.Tensor], dtype: Any) -> None:
        """Put ``tensors`` under ``names`` (request order) and remember them as what this call issued."""
        dict.update(self, zip(names, tensors))
        self._issued = (names, tuple(tensors), dtype)
        self._touched = False
        self._cut = None

    def fill_cut(self, names: tuple[str, ...], cut: tuple[torch.Tensor, ...],
                 take: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]] | None, dtype: Any) -> None:
        """:meth:`fill` with ``take(cut)`` (``cut`` itself when ``take`` is None): nothing to do when this dict
        still holds what the last call took from the same cut views (kept across calls with their buffer) for the
        same ``names`` and ``dtype`` (``out=`` the previous result, every step: no pass over 10,000 entries)."""
        issued = self._issued
        if (self._cut is cut and not self._touched and issued is not None and issued[0] is names
                and issued[2] == dtype):
            return
        self.fill(names, cut if take is None else take(cut), dtype)
        self._cut = cut

    def view_cache(self, t: torch.Tensor) -> ViewCache | None:
        """The view cache of the buffer in :attr:`buffers` that ``t`` is a view of (None if it is none of them, or
        empty)."""
        ptr = t.untyped_storage().data_ptr()
        if not ptr:  # empty: address 0, as every other empty buffer (of any dtype): cut anew
            return None
        for buf in self.buffers.values():
            if buf.untyped_storage().data_ptr() == ptr:
                cache = self._caches.get(ptr)
                if cache is None or cache.buffer.untyped_storage().data_ptr() != ptr:
                    cache = self._caches[ptr] = ViewCache(buf)
                return cache
        return None

    def record_issued(self, names: Sequence[str], dtype: Any) -> None:
        """Remember the tensors ``full_tensors`` just placed here (for the ``out=`` check of a later call)."""
        self._issued = (tuple(names), tuple(map(self.__getitem__, names)), dtype)
        self._touched = False
        self._cut = None

    def holds_issued(self, names: tuple[str, ...], dtype: Any) -> bool:
        """Whether this dict still holds exactly the tensors the last call made for the same ``names`` (request
        order) and ``dtype``: no entry set, replaced or removed since (O(1) then; after such a change, an identity
        pass over the entries). ``out=`` needs no per-tensor check then. The memory is the call's own buffers,
        written by collectives and copies that record no autograd history, so a tensor the caller made require
        grad is refilled as it is."""
        if self._issued is None:
            return False
        issued, tensors, issued_dtype = self._issued
        if issued_dtype != dtype or len(issued) != len(names) or len(self) != len(issued):
            return False
        if issued is not names and issued != names:
            return False
        return not self._touched or all(map(operator.is_, map(self.get, issued), tensors))

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


class PendingFullTensors:
    """Pending result of ``full_tensors(..., async_op=True)``. Every collective is issued by the call (a ZeRO-3
    transfer gathered in bounded windows too: every window at once, see
    :class:`~zero_dtensor.materialize.gathers.WindowedGather`), so :meth:`is_completed` turns true once they have
    finished, without :meth:`wait`, and ``wait()`` issues none (it is local). :meth:`wait` waits for them, puts
    the gathered values in parameter order, cuts the buffers into parameters and returns the dict (idempotent). The
    gradients must not change (no ``engine.step()``) before ``wait()``.

    ``steps``: pending collectives in issue order, each with what to do once they are done (a pipelined gather's
    or a window's reorder of the part that has arrived; ``None``: nothing); then ``finish``."""

    def __init__(self, steps: list[tuple[list[Any], Callable[[], None] | None]],
                 finish: Callable[[], dict[str, torch.Tensor]]) -> None:
        self._steps = steps
        self._finish: Callable[[], dict[str, torch.Tensor]] | None = finish
        self._result: dict[str, torch.Tensor] | None = None

    def is_completed(self) -> bool:
        """Whether every collective issued for this result has finished (non-blocking; no communication)."""
        if self._result is not None:
            return True
        return all(w.is_completed() for works, _ in self._steps for w in works)

    def wait(self) -> dict[str, torch.Tensor]:
        if self._result is None:
            run_steps(self._steps)
            assert self._finish is not None
            self._result, self._finish, self._steps = self._finish(), None, []
        return self._result


def run_steps(steps: list[tuple[list[Any], Callable[[], None] | None]]) -> None:
    """Wait for each step's collectives in order and run its follow-up (see :class:`PendingFullTensors`)."""
    for works, then in steps:
        for work in works:
            work.wait()
        if then is not None:
            then()


#: Former names, kept: they are part of the public API.
FullGrads = GatheredGrads
FullTensorsHandle = PendingFullTensors
