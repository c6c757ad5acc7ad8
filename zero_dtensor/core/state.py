"""The one internal state under a :class:`~zero_dtensor.families.tensors.ShardedTensors` (gradients, masters, optimizer
state): storage, plan, selection, staleness.

Every internal module (materialization, transforms, reductions) takes a :class:`FlatState` as an argument instead
of reaching into the public object above it. Nothing here communicates.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from functools import cached_property
from typing import Any, Union

import torch

from ..comm.collectives import on_comm_device
from ..errors import StaleGradientsError
from ..layout.flat import FlatLayout, GroupLayout, ParamLayout
from ..layout.plan import AllParams, FlatPlan, GroupPlan, plan_for
from .storage import FlatStorage
from ..layout.views import ViewCache

__all__ = ["FlatState", "GradsLike", "ParamSelection", "Selection", "STALE", "check_dtype", "short_names",
           "state_of"]

ParamSelection = Union[None, Collection[str], Callable[[str], bool]]

STALE = (
    "these gradients were consumed by engine.step() (or a later micro-step began); call "
    "zero_dtensor.sharded_grads(engine) again after the next engine.backward() at an accumulation boundary"
)


def short_names(names: tuple[str, ...] | list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', …' if len(names) > limit else ''}] ({len(names)} in all)"


_NAME = operator.attrgetter("name")
_NUMEL = operator.attrgetter("numel")


class Selection:
    """Selected parameters, grouped: per flat group, the indices (buffer order) into its :class:`GroupPlan`."""

    __slots__ = ("params", "by_group", "_names", "_numels")

    def __init__(self, params: list[ParamLayout], by_group: dict[int, list[int]]) -> None:
        self.params = params  # in the order results are returned
        self.by_group = by_group
        self._names: tuple[str, ...] | None = None
        self._numels: tuple[list[int], torch.Tensor] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The selected parameters' names, in result order (made once per selection)."""
        if self._names is None:
            self._names = tuple(map(_NAME, self.params))
        return self._names

    def numels(self) -> tuple[list[int], torch.Tensor]:
        """The selected parameters' element counts, in result order, as a list and as a float64 CPU tensor (made
        once per selection; the selection of every parameter is kept across steps). Callers must not modify
        them."""
        if self._numels is None:
            counts = list(map(_NUMEL, self.params))
            self._numels = counts, torch.tensor(counts, dtype=torch.float64)
        return self._numels

    def whole(self, plan: GroupPlan) -> bool:
        """Whether every parameter of the group is selected."""
        return len(self.by_group.get(plan.index, ())) == len(plan.params)


class FlatState:
    """One family's memory of one engine (for one step, for gradients), with its cached plan and this step's partition pieces."""

    def __init__(self, storage: FlatStorage, stale: Callable[[], Exception] | None = None) -> None:
        self.storage = storage
        self.plan: FlatPlan = plan_for(storage.layout)
        #: makes the error a use after the storage went stale raises (default: the gradients' one)
        self.stale = stale

    # --- description ---------------------------------------------------------------------------------------------
    @property
    def layout(self) -> FlatLayout:
        return self.storage.layout

    @property
    def loss_scale(self) -> float:
        return self.storage.loss_scale

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def group(self, index: int) -> GroupLayout:
        return self.storage.layout.groups[index]

    def is_current(self) -> bool:
        return self.storage.is_current()

    def check_current(self) -> None:
        if not self.storage.is_current():
            raise StaleGradientsError(STALE) if self.stale is None else self.stale()

    # --- memory ----------------------------------------------------------------------------------------------------
    @cached_property
    def view_caches(self) -> tuple[ViewCache, ...]:
        """Per group, the cache of views of its partition: the adapter's (kept across steps) or this step's own."""
        caches = self.storage.view_caches
        if caches and all(c.buffer is part for c, part in zip(caches, self.storage.partitions)):
            return caches
        return tuple(ViewCache(part) for part in self.storage.partitions)

    @cached_property
    def pieces(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per group, its partition cut by the plan's local tiling (one ``split_with_sizes`` per group, views; made
        once per partition the adapter keeps across steps)."""
        return tuple(cache.split(g.local.sizes) for cache, g in zip(self.view_caches, self.plan.groups))

    def fragments_of(self, group: int, indices: Iterable[int]) -> list[torch.Tensor]:
        """The fragments (views of the partition) of the given parameters of ``group``."""
        plan, pieces = self.plan.groups[group], self.pieces[group]
        return [pieces[plan.local.piece[k]] for k in indices]

    def padding_of(self, group: int) -> list[torch.Tensor]:
        plan, pieces = self.plan.groups[group], self.pieces[group]
        return [pieces[i] for i in plan.local.gaps if plan.local.sizes[i]]

    def fragment(self, param: ParamLayout) -> torch.Tensor:
        g, k = self.plan.where[param.name]
        return self.pieces[g][self.plan.groups[g].local.piece[k]]

    def comm_partition(self, group: int) -> torch.Tensor:
        """This rank's partition on a device its process group communicates on (a copy only for CPU-offloaded
        gradients whose group cannot take CPU tensors, e.g. NCCL)."""
        storage = self.storage
        return on_comm_device(storage.partitions[group], storage.process_groups[group], storage.device)

    # --- units -----------------------------------------------------------------------------------------------------
    def to_true(self, stored: torch.Tensor) -> torch.Tensor:
        return self.storage.to_true(stored)

    def finish(self, full: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        full = self.storage.to_true(full)
        return full if dtype is None or full.dtype == dtype else full.to(dtype)

    # --- selection -------------------------------------------------------------------------------------------------
    def select(self, names: Any) -> list[ParamLayout]:
        """Requested parameters in request order (all, in model order, for ``None``; those a predicate
        ``name -> bool`` accepts, in model order); refuses a single string, non-string entries, duplicates and
        unknown names before anything communicates."""
        layout = self.layout
        if names is None:
            return AllParams(layout.params)
        if callable(names) and not isinstance(names, (Collection, Mapping)):
            return [p for p in layout.params if names(p.name)]
        if isinstance(names, (str, bytes)):
            raise TypeError(f"names must be a list of parameter names, not a single string: pass [{names!r}]")
        if isinstance(names, Mapping) or not isinstance(names, Iterable):
            raise TypeError(f"names must be a list of parameter names, a predicate name -> bool or None, got "
                            f"{type(names).__name__}")
        names = list(names)
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"names must be parameter names (str); got {[type(b).__name__ for b in bad[:4]]}")
        seen: set[str] = set()
        duplicates = sorted({n for n in names if n in seen or seen.add(n)})
        if duplicates:
            raise ValueError(f"names lists {duplicates} more than once; give each parameter once")
        unknown = [n for n in names if n not in layout.by_name]
        if unknown:
            raise KeyError(f"not trainable parameters of this engine: {unknown}; known: {short_names(layout.names)}")
        return [layout.by_name[n] for n in names]

    def pick(self, params: ParamSelection) -> Selection:
        """A transform's ``params=`` (names, a predicate or ``None``), validated, in model order. Raises
        ``StaleGradientsError`` first: every transform calls it before touching the gradients."""
        self.check_current()
        layout = self.layout
        if params is None:
            everything = _ALL_SELECTED.get(self.plan)
            if everything is None:
                everything = _ALL_SELECTED[self.plan] = self.selection(list(layout.params))
            return everything
        elif isinstance(params, str):
            raise TypeError(f"params must be a collection of names or a predicate, not a single string ({params!r})")
        elif callable(params) and not isinstance(params, Collection):
            chosen = [p for p in layout.params if params(p.name)]
        else:
            try:
                wanted = set(params)
            except TypeError:
                raise TypeError(
                    f"params must be None, a collection of names or a predicate name -> bool, got "
                    f"{type(params).__name__}"
                ) from None
            unknown = sorted(str(n) for n in wanted if n not in layout.by_name)
            if unknown:
                raise KeyError(f"not trainable parameters of this engine: {unknown}")
            chosen = [p for p in layout.params if p.name in wanted]
        return self.selection(chosen)

    def selection(self, params: list[ParamLayout]) -> Selection:
        where = self.plan.where
        by_group: dict[int, list[int]] = {}
        for p in params:
            g, k = where[p.name]
            by_group.setdefault(g, []).append(k)
        return Selection(params, by_group)


#: per plan, the selection of every parameter (``params=None``, the usual case), built once; never modified
_ALL_SELECTED: weakref.WeakKeyDictionary[FlatPlan, Selection] = weakref.WeakKeyDictionary()

GradsLike = Any  # a ShardedGrads (anything with ``__zero_dtensor_state__``) or a FlatState


def state_of(grads: GradsLike) -> FlatState:
    """The :class:`FlatState` of a ``ShardedGrads`` (through its ``__zero_dtensor_state__``), or ``grads`` itself."""
    if isinstance(grads, FlatState):
        return grads
    getter = getattr(grads, "__zero_dtensor_state__", None)
    if getter is None:
        raise TypeError(f"expected a zero_dtensor ShardedGrads, got {type(grads).__name__}")
    return getter()


def check_dtype(dtype: Any, what: str) -> None:
    """``dtype=`` of a read: ``None`` or a floating ``torch.dtype`` (an integer or bool cast would truncate)."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what}: dtype must be a torch.dtype or None, got {type(dtype).__name__} ({dtype!r})")
    if not dtype.is_floating_point:
        raise TypeError(f"{what}: dtype must be a floating dtype (e.g. torch.float32), got {dtype}: a cast of a "
                        "tensor to it would silently truncate")

