"""Per-layout plans: everything a bulk call needs to run with a fixed number of tensor operations.

A :class:`FlatPlan` is built once per :class:`~zero_dtensor.layout.flat.FlatLayout` (and cached with it; adapters reuse
a layout across steps) from the placements' geometry. It holds only Python tuples — split sizes, offsets, which
piece is which parameter — so that executing a call is a handful of C++ calls whatever the number of parameters:
one ``split_with_sizes`` turns a partition (or an assembled flat buffer) into every parameter's view, one
``torch._foreach_*`` / ``segment_reduce`` / ``cat`` acts on all of them.

Vocabulary: a *fragment* is the part of one parameter a rank holds (1-D, possibly empty); *pieces* are the views
``split_with_sizes`` cuts a 1-D buffer into, parameters and padding gaps alike, tiling it exactly.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar


from .flat import FlatLayout, GroupLayout, ParamLayout
from .rows import RowMap, row_map
from .segment_plan import SegmentPlan, segment_plan
from .tiling import Tiling, tiling

__all__ = ["PIPELINE_FIRST_SHARE", "AllParams", "ColumnPiece", "FlatPlan", "GroupPlan", "Tiling", "plan_for", "tiling"]

#: A pipelined ZeRO-3 all_gather (:meth:`GroupPlan.column_pieces`) gathers the columns up to the parameter
#: boundary nearest this share of the partition and the rest as two collectives. Where a process group runs its
#: collectives in issue order (NCCL: one stream), the rest travels while the first part is reordered; reordering
#: costs about a third of gathering the same bytes on gloo (a memory-bound copy against a loopback transfer), so at
#: 3/4 the second part's transfer would last as long as the first part's reorder. (Gloo itself runs the two at once
#: on its worker threads: see :mod:`zero_dtensor.materialize.strategy`.)
PIPELINE_FIRST_SHARE = 0.75

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class ColumnPiece:
    """Columns ``[lo, hi)`` of a chunked group's ``(N, P)`` rows, gathered as ``(N, hi - lo)`` rows of their own
    and reordered into elements ``[N·lo, N·hi)`` of the parameter-order buffer (``lo`` and ``hi`` are parameter
    boundaries): ``sizes`` are the pieces of :attr:`GroupPlan.gathered` it covers, ``rows`` its row copy (``None``
    where rows do not pay: then one ``split_with_sizes_copy`` by ``sizes``). Compared by identity."""

    lo: int
    hi: int
    sizes: tuple[int, ...]
    rows: RowMap | None

    @property
    def width(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """One flat group: its parameters in buffer order and the tilings of its buffers on this rank. Compared (and
    hashed) by identity: a plan is built once per layout."""

    group: GroupLayout
    params: tuple[ParamLayout, ...]  # buffer order
    frag_start: tuple[int, ...]  # this rank's fragment of each parameter in the flattened parameter ...
    frag_len: tuple[int, ...]  # ... its length ...
    frag_offset: tuple[int, ...]  # ... and where it starts in this rank's partition
    local: Tiling  # this rank's partition: fragments and padding
    gathered: Tiling  # ragged / replicated: the assembled flat buffer; chunked: the columns of its (N, P) rows
    param_order: Tiling  # a parameter-order buffer: ragged/replicated as ``gathered``; chunked: N·chunk each
    _rows: dict[tuple[Any, ...], object] = field(default_factory=dict, init=False, repr=False)

    @property
    def index(self) -> int:
        return self.group.index

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(p.numel for p in self.params)

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Parameter names in buffer order."""
        return tuple(p.name for p in self.params)

    @cached_property
    def positions(self) -> dict[str, int]:
        """``name -> k``: a parameter's index in :attr:`params`."""
        return {p.name: k for k, p in enumerate(self.params)}

    def local_pieces_of(self, indices: Sequence[int]) -> tuple[int, ...]:
        """The pieces of :attr:`local` holding the parameters ``indices`` (buffer order); cached for
        :attr:`has_local`."""
        if indices is self.has_local:
            return self._has_local_pieces
        return tuple(self.local.piece[k] for k in indices)

    @cached_property
    def _has_local_pieces(self) -> tuple[int, ...]:
        return tuple(self.local.piece[k] for k in self.has_local)

    @cached_property
    def whole_local(self) -> tuple[int, ...]:
        """Indices (buffer order) of the non-empty parameters this rank holds whole."""
        return tuple(k for k, (n, p) in enumerate(zip(self.frag_len, self.params)) if n and n == p.numel)

    @cached_property
    def whole_position(self) -> dict[int, int]:
        """``k -> i``: parameter ``k`` is ``whole_local[i]``."""
        return {k: i for i, k in enumerate(self.whole_local)}

    @cached_property
    def has_local(self) -> tuple[int, ...]:
        """Indices (buffer order) of the parameters with a non-empty fragment on this rank."""
        return tuple(k for k, n in enumerate(self.frag_len) if n)

    # --- chunked groups' row copies: geometry, judged for elements of one size (the family's dtype) ---------------
    def column_rows(self, element_size: int) -> RowMap | None:
        """Chunked groups: the ``(N, P)`` rows of an all_gather (flattened) to parameter order, every piece of
        :attr:`gathered` (gaps too) as its ``(N, width)`` block, as one row copy (:mod:`zero_dtensor.layout.rows`);
        ``None`` for other groups or where rows do not pay for ``element_size``-byte elements
        (:func:`~zero_dtensor.layout.rows.row_map`). Cached per element size: families of any dtype share the plan."""
        return self._memo(("all", element_size), lambda: self._columns(range(self.group.world_size), element_size))

    def whole_columns(self, element_size: int) -> ColumnPiece:
        """Chunked groups: every column as one :class:`ColumnPiece` (the rows of :meth:`column_rows`)."""
        return self._memo(("whole", element_size), lambda: ColumnPiece(
            0, self.group.partition_numel, self.gathered.sizes, self.column_rows(element_size)))

    def column_pieces(self, element_size: int) -> tuple[ColumnPiece, ...]:
        """Chunked groups: the columns cut in two at the boundary of :attr:`gathered`'s pieces nearest
        :data:`PIPELINE_FIRST_SHARE` of ``P``, for an all_gather in two steps (:meth:`whole_columns` alone when no
        boundary lies inside)."""
        return self._memo(("pieces", element_size), lambda: self._column_pieces(element_size))

    def _column_pieces(self, element_size: int) -> tuple[ColumnPiece, ...]:
        P = self.group.partition_numel
        target = PIPELINE_FIRST_SHARE * P
        bounds = list(itertools.accumulate(self.gathered.sizes))[:-1]
        inside = [(abs(b - target), i + 1, b) for i, b in enumerate(bounds) if 0 < b < P]
        if not inside:
            return (self.whole_columns(element_size),)
        _, split, cut = min(inside)
        sizes = self.gathered.sizes
        every = range(self.group.world_size)
        return (ColumnPiece(0, cut, sizes[:split], self._columns(every, element_size, 0, cut)),
                ColumnPiece(cut, P, sizes[split:], self._columns(every, element_size, cut, P)))

    def column_windows(self, element_size: int, max_width: int) -> tuple[ColumnPiece, ...]:
        """Chunked groups: the columns cut at boundaries of :attr:`gathered`'s pieces into consecutive windows of at
        most ``max_width`` columns each (a piece wider than that alone), each with its row copy, for a gather in
        bounded windows, each reordered into its part of the parameter-order buffer once it has arrived."""
        return self._memo(("windows", element_size, max_width),
                          lambda: self._column_windows(element_size, max(1, max_width)))

    def _column_windows(self, element_size: int, max_width: int) -> tuple[ColumnPiece, ...]:
        sizes = self.gathered.sizes
        every = range(self.group.world_size)
        windows: list[ColumnPiece] = []
        lo = first = width = 0
        for i, size in enumerate(sizes + (None,)):
            if width and (size is None or width + size > max_width):
                windows.append(ColumnPiece(lo, lo + width, sizes[first:i],
                                           self._columns(every, element_size, lo, lo + width)))
                lo, first, width = lo + width, i, 0
            width += size or 0
        return tuple(windows) or (self.whole_columns(element_size),)

    def own_column_rows(self, element_size: int, piece: ColumnPiece | None = None) -> RowMap | None:
        """Chunked groups: this rank's partition (or its ``piece``'s columns) to its rows of the parameter-order
        blocks (of the piece's part: ``N·width`` elements; the rest of the destination untouched), as one row copy;
        ``None`` as for :meth:`column_rows`."""
        return self.rank_column_rows(self.group.rank, element_size, piece)

    def peer_column_rows(self, element_size: int, piece: ColumnPiece | None = None) -> RowMap | None:
        """Chunked groups: the other ranks' partitions (or their ``piece``'s columns), back to back in rank order
        (``(N-1)·P`` elements, what :func:`~zero_dtensor.comm.collectives.peer_partitions_by_all_to_all` receives), to
        their rows of the parameter-order blocks (this rank's rows untouched), as one row copy; ``None`` as for
        :meth:`column_rows`."""
        peers = tuple(r for r in range(self.group.world_size) if r != self.group.rank)
        return self._memo(("peers", element_size, *_bounds(piece)),
                          lambda: self._columns(peers, element_size, *_bounds(piece)))

    def rank_column_rows(self, rank: int, element_size: int, piece: ColumnPiece | None = None) -> RowMap | None:
        """Chunked groups: rank ``rank``'s partition (``P`` elements, or its ``piece``'s ``width`` columns) to its
        rows of the parameter-order blocks (the rest of the destination untouched), as one row copy; ``None`` as
        for :meth:`column_rows`."""
        return self._memo(("rank", rank, element_size, *_bounds(piece)),
                          lambda: self._columns((rank,), element_size, *_bounds(piece)))

    def _memo(self, key: tuple[Any, ...], build: Callable[[], T]) -> T:
        if key not in self._rows:
            self._rows[key] = build()
        return self._rows[key]

    def _columns(self, ranks: Sequence[int], element_size: int, lo: int = 0, hi: int | None = None
                 ) -> RowMap | None:
        """The row copy of columns ``[lo, hi)`` (parameter boundaries; default all) of the partitions of ``ranks``,
        held back to back in that order (``len(ranks)·(hi - lo)`` elements: every rank's for an all_gather, one
        rank's, the other ranks'), into their rows of the ``N·(hi - lo)`` parameter-order elements; ``None`` for
        groups gathered in parameter order."""
        if self.group.placement.param_order_gather:
            return None
        N = self.group.world_size
        hi = self.group.partition_numel if hi is None else hi
        W = hi - lo
        src, dst, lengths, padding = [], [], [], []
        gaps = set(self.gathered.gaps)
        start = 0
        for i, width in enumerate(self.gathered.sizes):
            if lo <= start < hi:
                at = start - lo
                for row, r in enumerate(ranks):
                    src.append(row * W + at)
                    dst.append(N * at + r * width)
                    lengths.append(width)
                    padding.append(i in gaps)
            start += width
        return row_map(src, dst, lengths, len(ranks) * W, N * W, element_size, padding)

    @cached_property
    def param_run(self) -> tuple[int, int] | None:
        """``(start, length)`` in this rank's partition of all its parameters' elements where they are one run (no
        padding between them: padding only before or after it, as ZeRO-1/2 pads a group's end), else ``None``."""
        sizes, gaps = self.local.sizes, set(self.local.gaps)
        kept = [k for k, n in enumerate(sizes) if n and k not in gaps]
        if not kept:
            return 0, 0
        if any(k in gaps and sizes[k] for k in range(kept[0], kept[-1] + 1)):
            return None
        start = sum(sizes[:kept[0]])
        return start, sum(sizes[kept[0]:kept[-1] + 1])

    @cached_property
    def local_segments(self) -> SegmentPlan:
        """Per-piece reductions of this rank's partition (:mod:`zero_dtensor.layout.segments`), built on first use."""
        return segment_plan(self.local)


def _bounds(piece: ColumnPiece | None) -> tuple[int, int | None]:
    """A :class:`ColumnPiece`'s ``(lo, hi)``; every column (``(0, None)``) for ``None``."""
    return (0, None) if piece is None else (piece.lo, piece.hi)


def _group_plan(group: GroupLayout, params: tuple[ParamLayout, ...]) -> GroupPlan:
    placement = group.placement
    ordered = tuple(sorted(params, key=lambda p: p.offset))
    ranges = [placement.rank_range(group, p, group.rank) for p in ordered]
    offsets = [placement.local_offset(group, p, group.rank) for p in ordered]
    lengths = [stop - start for start, stop in ranges]
    local = tiling(list(zip(offsets, lengths)), group.partition_numel)
    spans = [placement.span(p) for p in ordered]
    if placement.param_order_gather:
        gathered = tiling([(a, b - a) for a, b in spans], placement.gathered_numel(group))
        param_order = gathered
    else:  # columns of the (N, P) rows; parameter order holds each (N, chunk) block back to back
        gathered = tiling([(a, b - a) for a, b in spans], group.partition_numel)
        param_order = Tiling(tuple(group.world_size * s for s in gathered.sizes), gathered.piece, gathered.gaps)
    return GroupPlan(
        group=group,
        params=ordered,
        frag_start=tuple(start for start, _ in ranges),
        frag_len=tuple(lengths),
        frag_offset=tuple(offsets),
        local=local,
        gathered=gathered,
        param_order=param_order,
    )


@dataclass(frozen=True, eq=False)
class FlatPlan:
    """Every group's :class:`GroupPlan` and the lookups bulk calls need, for one layout on one rank."""

    layout: FlatLayout
    groups: tuple[GroupPlan, ...]

    @cached_property
    def where(self) -> dict[str, tuple[int, int]]:
        """``name -> (group index, index in that group's plan)``."""
        return {p.name: (g.index, k) for g in self.groups for k, p in enumerate(g.params)}

    @cached_property
    def _all_by_group(self) -> dict[int, list[ParamLayout]]:
        return _grouped(self.layout.params)

    def by_group(self, params: Sequence[ParamLayout]) -> dict[int, list[ParamLayout]]:
        """``params`` grouped by flat group (each list in ``params`` order); cached for every parameter in model
        order. Callers must not modify the lists."""
        if self.is_everything(params):
            return self._all_by_group
        return _grouped(params)

    def is_everything(self, params: Sequence[ParamLayout]) -> bool:
        """Whether ``params`` is every parameter in model order (an :class:`AllParams` list is known to be: O(1))."""
        everything = self.layout.params
        if len(params) != len(everything):
            return False
        if type(params) is AllParams and params._of is everything:
            return True
        return all(map(operator.is_, params, everything))

    @cached_property
    def model_order_take(self) -> Callable[[Sequence[object]], tuple[object, ...]] | None:
        """For every parameter in model order: picks, from the concatenation of each group's per-parameter values
        (groups in :meth:`by_group` order of every parameter, buffer order within), the values in model order;
        ``None`` when that concatenation already is model order (or there are fewer than two parameters)."""
        at: dict[str, int] = {}
        for g in self._all_by_group:
            base = len(at)
            at.update((name, base + k) for k, name in enumerate(self.groups[g].names))
        take = [at[p.name] for p in self.layout.params]
        if len(take) < 2 or take == list(range(len(take))):
            return None
        return operator.itemgetter(*take)

    @cached_property
    def fragments(self) -> dict[str, tuple[int, int, int]]:
        """``name -> (start, stop, offset in this rank's partition)`` of this rank's fragment."""
        out = {}
        for g in self.groups:
            for k, p in enumerate(g.params):
                out[p.name] = (g.frag_start[k], g.frag_start[k] + g.frag_len[k], g.frag_offset[k])
        return out


class AllParams(list):
    """Every parameter of a layout in model order (what a selection of ``None`` is), marked so that
    :meth:`FlatPlan.is_everything` need not compare 10,000 entries. A copy is a plain list."""

    __slots__ = ("_of",)

    def __init__(self, params: tuple[ParamLayout, ...]) -> None:
        super().__init__(params)
        self._of = params

    def _changed(self, *args: object, **kwargs: object) -> None:
        raise TypeError("AllParams is read-only: copy it with list(...) first")

    append = extend = insert = remove = pop = clear = sort = reverse = _changed  # type: ignore[assignment]
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _changed  # type: ignore[assignment]


def _grouped(params: Sequence[ParamLayout]) -> dict[int, list[ParamLayout]]:
    out: dict[int, list[ParamLayout]] = {}
    for p in params:
        out.setdefault(p.group, []).append(p)
    return out


_PLANS: weakref.WeakKeyDictionary[FlatLayout, FlatPlan] = weakref.WeakKeyDictionary()


def plan_for(layout: FlatLayout) -> FlatPlan:
    """The cached plan of ``layout`` (built on first use: one pass over the parameters). No communication."""
    plan = _PLANS.get(layout)
    if plan is None:
        groups = tuple(_group_plan(g, layout.params_of(g.index)) for g in layout.groups)
        plan = _PLANS[layout] = FlatPlan(layout, groups)
    return plan
