"""The buffers bulk materialization allocates: one allocator with observers, recycling, a kept workspace.

Every buffer ``full_tensors`` / ``iter_full`` allocates goes through :data:`BUFFERS` (a :class:`BufferPool`), so
that the tests and the benchmark account for memory the same way: ``with BUFFERS.observing(AllocationRecorder())``
sees every allocation (and can make one wait, e.g. for a backend thread to release the previous bucket).

Recycling: a ``full_tensors()`` call without ``out=`` takes the flat buffer of the previous call with the same
structure once nothing but the pool refers to its memory any more (every tensor of that result is gone), so a loop
that drops each step's result allocates only once; a live result is never overwritten. ``BUFFERS.recycle = False``
turns this off; :func:`release_workspace` frees what is kept.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch

__all__ = ["AllocationObserver", "AllocationRecorder", "BUFFERS", "BufferPool", "release_workspace"]


class AllocationObserver(Protocol):
    """Told about every buffer the pool allocates: ``before(nbytes)`` (may wait), then ``after(tensor)``."""

    def before(self, nbytes: int) -> None: ...

    def after(self, tensor: torch.Tensor) -> None: ...


def storage_refs(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (the pool's own reference included)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BufferPool:
    """The allocator of :mod:`zero_dtensor.materialize` (see the module docstring). No communication."""

    def __init__(self) -> None:
        self.recycle = True
        self._observers: list[AllocationObserver] = []
        self._recycled: dict[tuple[Any, ...], tuple[torch.Tensor, int]] = {}
        self.workspace: dict[tuple[Any, ...], torch.Tensor] = {}

    def alloc(self, numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
        nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
        for observer in self._observers:
            observer.before(nbytes)
        t = (torch.zeros if zero else torch.empty)(int(numel), dtype=dtype, device=device)
        for observer in self._observers:
            observer.after(t)
        return t

    @contextlib.contextmanager
    def observing(self, observer: AllocationObserver) -> Iterator[AllocationObserver]:
        """Report every allocation to ``observer`` inside the block."""
        self._observers.append(observer)
        try:
            yield observer
        finally:
            self._observers.remove(observer)

    def recycled_or_new(self, key: tuple[Any, ...], numel: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
        """The cached buffer for ``key`` if no result refers to its memory any more, else a new one (cached when the
        slot is empty). Returned as a view, so that a result pins the memory while it lives."""
        entry = self._recycled.get(key)
        if entry is not None:
            buf, idle_refs = entry
            if storage_refs(buf) == idle_refs:
                return buf.view(-1)
            return self.alloc(numel, dtype, device)  # still in use by a live result: do not cache a second one
        buf = self.alloc(numel, dtype, device)
        if self.recycle:
            self._recycled[key] = (buf, storage_refs(buf))
        return buf.view(-1)

    def idle(self) -> bool:
        """Whether every recycled buffer is free (no result holds it)."""
        return all(storage_refs(buf) == idle for buf, idle in self._recycled.values())

    def release(self) -> None:
        self.workspace.clear()
        self._recycled.clear()


BUFFERS = BufferPool()


def release_workspace() -> None:
    """Free the buffers kept between calls: the gather buffers of ``out=`` calls with user-made dicts and the
    recycled buffers of calls without ``out=``. Live results stay valid. No communication."""
    BUFFERS.release()


class AllocationRecorder:
    """Records every buffer the pool allocates and the peak of live bytes (a buffer is live until its storage is
    freed). With ``budget``, an allocation that would exceed it first waits up to 50 ms: a synchronous gloo
    collective returns once its work completed, but the backend's worker thread may hold the previous bucket's
    buffer a moment longer. Allocations made inside torch or the backend are *not* seen."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self.live = 0
        self.peak = 0
        self.sizes: list[int] = []

    def before(self, nbytes: int) -> None:
        deadline = time.monotonic() + 0.05
        while self.budget is not None and self.live + nbytes > self.budget and time.monotonic() < deadline:
            time.sleep(0.001)

    def after(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.sizes.append(nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def settled_live(self, timeout: float = 0.2) -> int:
        """Live bytes once the backend thread has let go of finished works."""
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.live
