"""The buffers bulk materialization allocates: one allocator with observers, recycling, a kept workspace.

Every buffer ``full_tensors`` / ``iter_full`` allocates goes through :data:`BUFFERS` (a :class:`BufferPool`), so
that the tests and the benchmark account for memory the same way: ``with BUFFERS.observing(AllocationRecorder())``
sees every allocation (and can make one wait, e.g. for a backend thread to release the previous bucket).

Recycling: a ``full_tensors()`` call without ``out=`` takes a kept flat buffer of an earlier call with the same
structure once nothing but the pool refers to its memory any more (every tensor of that result, every view of it and
every storage object of it the caller took, ``t.untyped_storage()``, is gone), the most recently handed out first;
up to two are kept per structure (:attr:`BufferPool.slots`), so a loop that keeps the previous step's result until
the next call allocates only twice; a live result is never overwritten. A recycled buffer keeps the
per-parameter views cut from it (:class:`~zero_dtensor.layout.views.ViewCache`), so a later result hands out the same
view objects (made once, not every call): the buffer counts as free only when no result, no view of it and none
of those view objects is referred to from outside the pool. ``BUFFERS.recycle = False``
turns this off; :func:`release_workspace` frees what is kept. ``set_full_`` stages small values in one kept
scratch buffer per flat group, device and dtype (:meth:`BufferPool.scratch`), and an exchange its send and receive
buffers (:meth:`BufferPool.transient`), freed the same way.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ..layout.views import ViewCache

__all__ = ["AllocationObserver", "AllocationRecorder", "BUFFERS", "BufferPool", "release_workspace"]


class AllocationObserver(Protocol):
    """Told about every buffer the pool allocates: ``before(nbytes)`` (may wait), then ``after(tensor)``."""

    def before(self, nbytes: int) -> None: ...

    def after(self, tensor: torch.Tensor) -> None: ...


#: how long a new recycled buffer waits for a kept one that only a backend thread still holds (seconds)
SETTLE_S = 0.05


class BufferPool:
    """The allocator of :mod:`zero_dtensor.materialize` (see the module docstring). No communication."""

    def __init__(self) -> None:
        self.recycle = True
        self._observers: list[AllocationObserver] = []
        self._recycled: dict[tuple[Any, ...], list[ViewCache]] = {}
        #: buffers kept per structure: two, so that a loop holding the previous result (or a backend thread that
        #: lets go of a finished collective's views a moment late) still finds a free one
        self.slots = 2
        self._by_storage: dict[int, ViewCache] = {}
        #: kept buffers (``id`` of their cache) that did not settle within :data:`SETTLE_S` once
        self._stuck: set[int] = set()
        self.workspace: dict[tuple[Any, ...], torch.Tensor] = {}
        self._scratch: dict[tuple[Any, ...], ViewCache] = {}
        self._transient: dict[tuple[Any, ...], torch.Tensor] = {}
        self._lent: set[tuple[Any, ...]] = set()

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
        """A kept buffer for ``key`` that no result refers to any more (the most recently handed out of those:
        the one a loop just dropped, also when an older result was freed late), else a new one (kept while fewer
        than :attr:`slots` are). Returned as a view, so that a result pins the memory while it lives."""
        kept = self._recycled.setdefault(key, [])
        for cache in reversed(kept):  # the most recently handed out first: the result the caller just dropped
            if cache.is_idle(check_objects=True):
                self._stuck.discard(id(cache))
                kept.remove(cache)
                kept.append(cache)
                return cache.buffer.view(-1)
        settled = self._settled(kept) if self.recycle else None
        if settled is not None:
            kept.remove(settled)
            kept.append(settled)
            return settled.buffer.view(-1)
        buf = self.alloc(numel, dtype, device)
        if self.recycle and len(kept) < self.slots:
            cache = ViewCache(buf)
            kept.append(cache)
            if buf.untyped_storage().data_ptr():  # an empty buffer has address 0, as every other empty one
                self._by_storage[buf.untyped_storage().data_ptr()] = cache
        return buf.view(-1)

    def _settled(self, kept: list[ViewCache]) -> ViewCache | None:
        """Before a new buffer is allocated for a structure: a kept one whose views nobody holds, once the
        backend's worker thread has let go of the storage (a synchronous gloo collective returns when its work
        completed; the thread drops its reference a moment later, later still on a busy machine). Waits up to
        :data:`SETTLE_S` (only when such a buffer exists: a result the caller holds is never waited for);
        ``None`` if none settles."""
        waiting = [cache for cache in kept if id(cache) not in self._stuck and cache.views_free()]
        deadline = time.monotonic() + SETTLE_S
        while waiting and time.monotonic() < deadline:
            time.sleep(0.0005)
            for cache in waiting:
                if cache.is_idle(check_objects=True):
                    return cache
        # something other than a backend thread holds these (a caller's own view of a result): not waited for
        # again until they are seen free
        self._stuck.update(map(id, waiting))
        return None

    def scratch(self, key: tuple[Any, ...], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A kept 1-D buffer of ``numel`` elements for use within one call (``set_full_``'s staging): the buffer
        kept under ``key`` when nothing else refers to it and it is large enough, else a new one, kept instead. On
        the CPU a new buffer of tens of MiB costs more in page faults than the copy into it. Kept with the
        workspace: :func:`release_workspace` frees it."""
        kept = self._scratch.get(key)
        if kept is not None and kept.buffer.numel() >= numel and kept.buffer.dtype == dtype and kept.is_idle():
            return kept.buffer.narrow(0, 0, numel)
        buf = self.alloc(numel, dtype, device)
        if self.recycle:
            self._scratch[key] = ViewCache(buf)
        return buf.view(-1)  # a view: while the caller holds it, the kept buffer is not idle

    def transient(self, key: tuple[Any, ...], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A kept 1-D buffer of ``numel`` elements that only the calling function uses, for synchronous
        collectives and local copies, and lets go of before it returns (an exchange's packed send and its receive
        buffer): the one kept under ``key`` whenever it is large enough, whatever else still refers to its memory.
        A synchronous collective is done with its buffers when it returns (gloo's worker thread drops its
        reference a moment later, NCCL orders any later use on its stream), so waiting for that reference would
        only allocate anew on a busy machine. Never hand it out, nor give it to an asynchronous collective. Kept
        with the workspace: :func:`release_workspace` frees it."""
        kept = self._transient.get(key)
        if kept is None or kept.numel() < numel or kept.dtype != dtype or kept.device != device:
            kept = self.alloc(numel, dtype, device)
            if self.recycle:
                self._transient[key] = kept
        return kept.narrow(0, 0, numel)

    def lend(self, key: tuple[Any, ...], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A kept 1-D buffer of ``numel`` elements lent to one call until it hands it back (:meth:`give_back`),
        asynchronous collectives included: the one kept under ``key`` (:meth:`transient`, grown where too small)
        unless it is lent (then a new one, not kept: two pending calls never share it). For a call's staging
        buffer, which a fresh allocation would page in anew every call on the CPU. Kept with the workspace:
        :func:`release_workspace` frees it."""
        if key in self._lent or not self.recycle:
            return self.alloc(numel, dtype, device)
        self._lent.add(key)
        return self.transient(key, numel, dtype, device)

    def give_back(self, key: tuple[Any, ...]) -> None:
        """The buffer :meth:`lend` lent under ``key`` is no longer used (every collective into it waited for)."""
        self._lent.discard(key)

    def view_cache(self, t: torch.Tensor) -> ViewCache | None:
        """The view cache of the recycled buffer ``t`` is a view of (its per-parameter cuts are made once), or None
        for memory the pool does not keep and for an empty ``t`` (cutting it anew is the only safe choice: every
        empty storage has address 0, so one empty buffer would pass for another, of another dtype)."""
        ptr = t.untyped_storage().data_ptr()
        if not ptr or not self._by_storage:  # address 0: an empty buffer, not told apart from other empty ones
            return None
        cache = self._by_storage.get(ptr)
        return cache if cache is not None and cache.buffer.untyped_storage().data_ptr() == ptr else None

    def idle(self) -> bool:
        """Whether every recycled buffer is free (no result holds it)."""
        return all(cache.is_idle(check_objects=True) for kept in self._recycled.values() for cache in kept)

    def release(self) -> None:
        self.workspace.clear()
        self._scratch.clear()
        self._transient.clear()
        self._lent.clear()
        self._recycled.clear()
        self._by_storage.clear()
        self._stuck.clear()


BUFFERS = BufferPool()


def release_workspace() -> None:
    """Free the buffers kept between calls: the gather buffers of ``out=`` calls with user-made dicts, the
    recycled buffers of calls without ``out=`` and ``set_full_``'s staging buffers. Live results stay valid. No
    communication."""
    BUFFERS.release()


class AllocationRecorder:
    """Records every buffer the pool allocates and the peak of live bytes (a buffer is live until its storage is
    freed). With ``budget``, an allocation that would exceed it first waits up to ``wait_s`` (50 ms) for live
    bytes to drop: a synchronous gloo collective returns once its work completed, but the backend's worker thread
    may hold the previous bucket's buffer a moment longer (longer still on a busy machine). Allocations made inside
    torch or the backend are *not* seen."""

    def __init__(self, budget: int | None = None, wait_s: float = 0.05) -> None:
        self.budget = budget
        self.wait_s = wait_s
        self.live = 0
        self.peak = 0
        self.sizes: list[int] = []

    def before(self, nbytes: int) -> None:
        deadline = time.monotonic() + self.wait_s
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
