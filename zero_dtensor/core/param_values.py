"""Per-parameter results of reductions: read-only mappings backed by one vector, entries made on use.

``norms()`` of a model with 10,000 tensors needs one ``(k,)`` vector; a dict of 10,000 0-d tensors costs 10,000
tensor objects on top (about 0.5 µs each, one ``unbind``), and 10,000 ``GradStats`` cost more. These mappings hold
the vector (or the columns) and the names, and make entries only when they are read: a few entries one by one, all
of them at once (one ``unbind``, one bulk build) as soon as more are read, iterated or compared. They behave as a
read-only ``dict`` (``Mapping``: ``[]``, ``get``, ``in``, ``len``, iteration in result order, ``items``,
``values``, ``==`` with a dict); ``dict(result)`` makes a plain dict and pickling gives one. Nothing here
communicates.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, Mapping, Sequence, ValuesView
from typing import Any, Generic, TypeVar

import torch

__all__ = ["ParamStatsMap", "ParamValues"]

V = TypeVar("V")

#: entries read one by one before a result makes all of them at once
FEW = 16


class _LazyParamMap(Mapping[str, V], Generic[V]):
    """Names in result order; entry ``i`` made by :meth:`_one`, all of them by :meth:`_every`."""

    __slots__ = ("_names", "_index", "_entries", "_reads")

    def __init__(self, names: Sequence[str]) -> None:
        self._names = names
        self._index: dict[str, int] | None = None
        self._entries: dict[str, V] | None = None
        self._reads = 0

    # --- what subclasses provide -----------------------------------------------------------------------------------
    def _one(self, i: int) -> V:
        raise NotImplementedError

    def _every(self) -> list[V]:
        raise NotImplementedError

    # --- the mapping -------------------------------------------------------------------------------------------------
    @property
    def names(self) -> Sequence[str]:
        """Parameter names, in result order (entry ``i`` of the backing vector is ``names[i]``)."""
        return self._names

    def _all(self) -> dict[str, V]:
        if self._entries is None:
            self._entries = dict(zip(self._names, self._every()))
        return self._entries

    def _position(self, name: str) -> int:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self._names)}
        return self._index[name]

    def __getitem__(self, name: str) -> V:
        if self._entries is not None:
            return self._entries[name]
        self._reads += 1
        if self._reads > FEW:
            return self._all()[name]
        return self._one(self._position(name))

    def __contains__(self, name: object) -> bool:
        if self._entries is not None:
            return name in self._entries
        try:
            self._position(name)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def items(self) -> ItemsView[str, V]:  # type: ignore[override]
        return self._all().items()

    def values(self) -> ValuesView[V]:  # type: ignore[override]
        return self._all().values()

    def copy(self) -> dict[str, V]:
        """A plain dict of every entry."""
        return dict(self._all())

    def __or__(self, other: Mapping[str, Any]) -> dict[str, Any]:
        return {**self._all(), **other}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _LazyParamMap):
            other = other._all()
        return self._all() == other if isinstance(other, Mapping) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (self._all(),))


class ParamValues(_LazyParamMap[torch.Tensor]):
    """``{name: 0-d tensor}``, entry ``i`` a view of ``vector[i]`` (see the module docstring). ``vector`` is a
    snapshot the caller owns: the whole result as one tensor, without any per-parameter object."""

    __slots__ = ("vector",)

    def __init__(self, names: Sequence[str], vector: torch.Tensor) -> None:
        super().__init__(names)
        self.vector = vector

    def _one(self, i: int) -> torch.Tensor:
        return self.vector[i]

    def _every(self) -> list[torch.Tensor]:
        return list(self.vector.unbind(0))


class ParamStatsMap(_LazyParamMap[V]):
    """``{name: GradStats}`` from per-parameter columns (Python lists), built by ``make_one(i)`` for a single entry
    and ``make_all()`` for every entry at once."""

    __slots__ = ("_make_one", "_make_all")

    def __init__(self, names: Sequence[str], make_one: Callable[[int], V], make_all: Callable[[], list[V]]) -> None:
        super().__init__(names)
        self._make_one, self._make_all = make_one, make_all

    def _one(self, i: int) -> V:
        return self._make_one(i)

    def _every(self) -> list[V]:
        return self._make_all()
