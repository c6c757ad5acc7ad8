"""Views kept across steps: per-parameter views cost ~1 µs each to make, so buffers that live across steps keep
theirs.

A :class:`ViewCache` belongs to one 1-D buffer (a partition an adapter keeps stable across steps, or a recycled
gather buffer) and holds views of it keyed by how they were cut (e.g. a tiling's sizes). Every view it holds is a
distinct tensor sharing the buffer's storage, so :meth:`ViewCache.is_idle` can tell, from the storage's use count
alone, whether anything *outside* the cache (a user's view, a live result) still refers to the memory. Nothing here
communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import operator
import sys
from itertools import repeat

import torch

__all__ = ["ViewCache", "storage_object_held", "storage_refs"]


def storage_refs(t: torch.Tensor) -> int:
    """How many holders share ``t``'s storage (``t`` included, and the storage object this call makes: compare
    counts taken by this function only). A Python storage object (``t.untyped_storage()``) held by a caller does
    not count here: see :func:`storage_object_held`."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


#: ``sys.getrefcount`` of a storage object nobody holds: the temporary and the call's own argument
_STORAGE_OBJECT_FREE = 2


def storage_object_held(t: torch.Tensor) -> bool:
    """Whether anything holds the Python storage object of ``t``'s memory (``x.untyped_storage()`` of any tensor
    sharing it: torch keeps one such object per storage while it is referenced). Its C++ use count does not
    rise with those references, so :func:`storage_refs` alone cannot see them."""
    return sys.getrefcount(t.untyped_storage()) > _STORAGE_OBJECT_FREE


#: ``sys.getrefcount`` of a view only the cache's tuple refers to (the tuple, and the call's own argument)
_CACHE_ONLY = 2


class ViewCache:
    """Views of ``buffer``, built once per key (see the module docstring)."""

    __slots__ = ("buffer", "_views", "_held", "_base_refs")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._base_refs = storage_refs(buffer)  # the buffer and whoever else held the memory when it was cached
        self._views: dict[object, tuple[torch.Tensor, ...]] = {}
        self._held = 0  # tensors the cache holds that share the storage (the buffer itself aside)

    def get(self, key: object, build: Callable[[torch.Tensor], Sequence[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """The views cached under ``key``, or ``build(buffer)`` (which must return *new* views of the buffer)."""
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = tuple(build(self.buffer))
            self._held += len(views)
        return views

    @property
    def entries(self) -> int:
        """How many keys the cache holds views for."""
        return len(self._views)

    def holds(self, key: object) -> bool:
        """Whether views are cached under ``key``."""
        return key in self._views

    def split(self, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """``buffer.split_with_sizes(sizes)``, cached."""
        return self.get(("split", sizes), lambda b: b.split_with_sizes(list(sizes)))

    def is_idle(self, *, check_objects: bool = False) -> bool:
        """Whether only what held the memory when the cache was made and the cached views refer to the storage,
        and nobody holds its Python storage object.
        ``check_objects``: also whether no cached view *object* is referred to from outside
        the cache (views handed out as results)."""
        if storage_refs(self.buffer) != self._base_refs + self._held or storage_object_held(self.buffer):
            return False
        return not check_objects or self.views_free()

    def views_free(self) -> bool:
        """Whether no cached view object is referred to from outside the cache (the storage may still be held: see
        :meth:`is_idle`). One C-level pass over the objects' reference counts (a view's attributes are not read:
        touching 10,000 cold tensor objects costs milliseconds). A view the caller made require grad and then
        dropped is handed out again as it is."""
        for views in self._views.values():
            if any(map(operator.ne, map(sys.getrefcount, views), repeat(_CACHE_ONLY))):
                return False
        return True
