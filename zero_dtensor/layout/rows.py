"""Many small copies between two 1-D buffers as one indexed copy of equal rows.

Reordering a ZeRO-3 all_gather into parameter order, or writing thousands of parameters' values into a partition,
is a list of *runs*: copy ``length`` elements from ``src_start`` of one buffer to ``dst_start`` of another. Done
run by run (``_foreach_copy_`` of narrow views, ``split_with_sizes_copy`` on the CPU) each run costs a dispatch, about
a microsecond: 10,000 runs cost more than the bytes. A :class:`RowMap` instead views both buffers as rows of ``width``
elements, ``width`` the greatest common divisor of every start, length and buffer size, and moves every run with
one ``index_select`` (and one ``index_copy_`` when the runs do not tile the destination; only the ``index_copy_``
when they read the whole source in its order, as a partition scattered into a parameter-order buffer does): a fixed
number of tensor operations whatever the number of runs, one kernel on a GPU.

Where the runs repeat with a period (a model of repeated layers: run ``i + P`` is run ``i`` moved by a fixed
step in both buffers), a :class:`RowMap` moves them instead with one strided ``copy_`` per :class:`RunFamily`
(:func:`run_families`: at most :data:`MAX_FAMILIES`, whatever the number of runs; a ZeRO-3 all_gather of a stack of
equal layers is one family per tensor of a layer): no index tensors, and on the CPU about twice as fast as
``index_copy_`` and 10-20% faster than ``index_select`` of narrow rows.

The row indices cost ``8 / width`` bytes per element moved; :func:`row_map` declines (returns ``None``) when they
would cost more than a quarter of the data they move (``width · element size <`` :data:`MIN_ROW_BYTES`), or when
the runs are long (:data:`LONG_RUN` elements on average: a dispatch per run is then cheap next to its bytes, and a
block copy beats an indexed one), and callers keep their per-run path. Index tensors are built once per device, with
a few tensor operations, and cached on the map.

:class:`PieceCopy` applies the same to a *list* of tensors (DeepSpeed's per-parameter gradient views) whose values,
concatenated, are a partition: where the pieces lie in one memory block (views of one flat buffer, in any order),
their concatenation is a set of runs of that block, copied with one :class:`RowMap` (or one block copy when they
lie in order) instead of a copy per piece. Nothing here communicates.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["FEW_COPIES", "LONG_RUN", "MAX_FAMILIES", "MIN_FAMILY_RUNS", "MIN_ROW_BYTES", "PieceCopy", "PieceKey",
           "RowMap", "RunFamily", "piece_copy", "piece_key", "row_map", "run_families"]

#: rows narrower than this many bytes are declined: their int64 indices would cost over a quarter of the data
MIN_ROW_BYTES = 32
#: runs this long on average (elements) are declined: one copy per run costs less than a dispatch's overhead then,
#: and beats an indexed copy of many rows
LONG_RUN = 4096
#: a :class:`RowMap` copies family by family when its runs make at most this many :class:`RunFamily`; else by index
MAX_FAMILIES = 16
#: the longest period :func:`run_families` looks for (runs per repeat, at each of its two levels)
MAX_PERIOD = 64
#: every family covers at least this many runs (repeats), else the runs keep the index path: so that a few runs of no
#: period (a small model, runs in reverse order) are not copied one by one, a copy per run
MIN_FAMILY_RUNS = 4


@dataclass(frozen=True)
class RunFamily:
    """Runs of ``length`` elements on a (up to) two-level grid, copied with one strided ``copy_``: for ``i <
    outer``, ``j < count`` the run ``src[s:s+length] -> dst[d:d+length]`` with ``s = src_start + i·src_outer +
    j·src_step`` and ``d = dst_start + i·dst_outer + j·dst_step`` (element offsets; steps are never negative)."""

    length: int
    count: int
    src_start: int
    src_step: int
    dst_start: int
    dst_step: int
    outer: int = 1
    src_outer: int = 0
    dst_outer: int = 0

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The family's runs from ``src`` into ``dst`` (1-D, contiguous; ``copy_`` casts)."""
        shape = (self.outer, self.count, self.length)
        dst.as_strided(shape, (self.dst_outer, self.dst_step, 1), dst.storage_offset() + self.dst_start).copy_(
            src.as_strided(shape, (self.src_outer, self.src_step, 1), src.storage_offset() + self.src_start))


def run_families(runs: Sequence[Sequence[int]], limit: int | None = None,
                 min_runs: int = MIN_FAMILY_RUNS) -> tuple[RunFamily, ...] | None:
    """``runs`` (``(src, dst, length)``, in destination order) as at most ``limit`` (default :data:`MAX_FAMILIES`)
    :class:`RunFamily` of at least ``min_runs`` runs each, or ``None``.

    Level one, per run length: the smallest period ``P`` (at most :data:`MAX_PERIOD`) such that the runs of that
    length ``j, j + P, j + 2P, ...`` (destination order) move by one step in each buffer, for every ``j < P``: ``P``
    families (a run of a length of its own is one). Level two does the same over the families of equal length,
    count and steps (their starts): e.g. the same tensor of every layer, once per rank of a ZeRO-3 all_gather, is one
    family. A plan-time pass over the runs per candidate period."""
    if not runs:
        return None
    limit = MAX_FAMILIES if limit is None else limit
    by_length: dict[int, list[tuple[int, int]]] = {}
    for s, d, n in runs:
        by_length.setdefault(n, []).append((s, d))
    if len(by_length) > MAX_PERIOD:
        return None
    alike: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for length, starts in by_length.items():
        found = _periodic(starts)
        if found is None:
            return None
        for count, s0, s_step, d0, d_step in found:
            alike.setdefault((length, count, s_step, d_step), []).append((s0, d0))
    families = []
    for (length, count, s_step, d_step), starts in alike.items():
        # in destination order, then in source order (the same tensor of each rank, when a layer has several
        # tensors of one length): the fewer families
        tried = [_periodic(sorted(starts, key=operator.itemgetter(1))), _periodic(sorted(starts))]
        outer = min((t for t in tried if t is not None), key=len, default=None)
        if outer is None:
            return None
        if any(n * count < min_runs for n, *_ in outer):
            return None
        families += [RunFamily(length, count, s0, s_step, d0, d_step, n, s_outer, d_outer)
                     for n, s0, s_outer, d0, d_outer in outer]
        if len(families) > limit:
            return None
    return tuple(families)


def _periodic(starts: list[tuple[int, int]]) -> list[tuple[int, int, int, int, int]] | None:
    """For points ``(a, b)``: the smallest period ``P <= MAX_PERIOD`` such that the points ``j, j + P, ...`` move
    by one non-negative step in each coordinate; per ``j``, ``(count, a0, a_step, b0, b_step)``. ``None`` when
    there is none."""
    n = len(starts)
    a = [v for v, _ in starts]
    b = [v for _, v in starts]
    for period in range(1, min(n, MAX_PERIOD) + 1):
        a_steps = list(map(operator.sub, a[period:], a))
        b_steps = list(map(operator.sub, b[period:], b))
        if (a_steps[period:] != a_steps[:-period] or b_steps[period:] != b_steps[:-period]
                or any(v < 0 for v in a_steps[:period]) or any(v < 0 for v in b_steps[:period])):
            continue
        out = []
        for j in range(period):
            several = j + period < n
            out.append((len(range(j, n, period)), a[j], a_steps[j] if several else 0, b[j],
                        b_steps[j] if several else 0))
        return out
    return None


@dataclass(frozen=True, eq=False)
class RowMap:
    """Copy runs ``src[s:s+n] -> dst[d:d+n]`` as rows of ``width`` elements (see the module docstring).

    ``src_rows``/``dst_rows``/``row_counts``: per run, its first row in each buffer and its length, in rows.
    Runs are in destination order, adjacent ones merged. ``tiles_dst``: they cover the destination exactly (then one ``index_select`` writes it).
    Compared by identity.
    """

    width: int
    src_numel: int
    dst_numel: int
    src_rows: tuple[int, ...]
    dst_rows: tuple[int, ...]
    row_counts: tuple[int, ...]
    tiles_dst: bool
    reads_src_in_order: bool = False  # the runs, in destination order, are the whole source in its order
    families: tuple[RunFamily, ...] | None = None  # the runs as a few strided copies (:func:`run_families`)
    _index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False,
                                                                          repr=False)

    @property
    def rows(self) -> int:
        """Rows moved."""
        return sum(self.row_counts)

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(source rows, destination rows)``, int64 on ``device``, one entry per row moved (cached)."""
        found = self._index.get(device)
        if found is None:
            counts = torch.tensor(self.row_counts, dtype=torch.int64)
            firsts = torch.cumsum(counts, 0) - counts  # where each run starts among the rows moved
            step = torch.arange(self.rows, dtype=torch.int64)
            src = step + torch.repeat_interleave(torch.tensor(self.src_rows, dtype=torch.int64) - firsts, counts)
            dst = step + torch.repeat_interleave(torch.tensor(self.dst_rows, dtype=torch.int64) - firsts, counts)
            found = self._index[device] = (src.to(device), dst.to(device))
        return found

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every run of ``src`` into ``dst`` (1-D, ``src_numel`` and ``dst_numel`` elements, contiguous): one
        ``index_select`` into ``dst`` itself when the runs tile it, else one ``index_copy_`` of ``src`` itself when
        they read it whole and in order, else an ``index_select`` then an ``index_copy_``; a dtype conversion adds
        one copy. With :attr:`families`: one strided ``copy_`` (casting) per family instead. Nothing else in
        ``dst`` changes."""
        if src.device != dst.device:
            src = src.to(dst.device)
        if self.families is not None:
            for family in self.families:
                family.copy(src, dst)
            return
        src_idx, dst_idx = self.indices(dst.device)
        rows = src.view(-1, self.width)
        if self.tiles_dst and src.dtype == dst.dtype:
            torch.index_select(rows, 0, src_idx, out=dst.view(-1, self.width))
            return
        if self.reads_src_in_order:  # the source is already the picked rows
            dst.view(-1, self.width).index_copy_(0, dst_idx, rows if rows.dtype == dst.dtype else rows.to(dst.dtype))
            return
        picked = rows.index_select(0, src_idx)
        if picked.dtype != dst.dtype:
            picked = picked.to(dst.dtype)
        if self.tiles_dst:
            dst.view(-1, self.width).copy_(picked)
        else:
            dst.view(-1, self.width).index_copy_(0, dst_idx, picked)


def row_map(src_starts: Sequence[int], dst_starts: Sequence[int], lengths: Sequence[int], src_numel: int,
            dst_numel: int, element_size: int, padding: Sequence[bool] | None = None) -> RowMap | None:
    """A :class:`RowMap` for runs ``(src_starts[i], dst_starts[i], lengths[i])`` (empty runs skipped; adjacent
    ones merged), or ``None`` when the common row width is too narrow for ``element_size``-byte elements, the runs
    are long (see the module docstring), or there is nothing to copy. Runs marked ``padding`` (a partition's
    padding) make run families of their own (:func:`run_families`)."""
    runs = _merged_runs(src_starts, dst_starts, lengths)
    if not runs:
        return None
    width = math.gcd(src_numel, dst_numel, *(v for run in runs for v in run))
    if width * element_size < MIN_ROW_BYTES or sum(r[2] for r in runs) >= LONG_RUN * len(runs):
        return None
    ends = [d + n for _, d, n in runs]
    tiles = runs[0][1] == 0 and ends[-1] == dst_numel and all(e == r[1] for e, r in zip(ends, runs[1:]))
    src_ends = [s + n for s, _, n in runs]
    in_order = (runs[0][0] == 0 and src_ends[-1] == src_numel
                and all(e == r[0] for e, r in zip(src_ends, runs[1:])))
    return RowMap(width, src_numel, dst_numel, tuple(r[0] // width for r in runs), tuple(r[1] // width for r in runs),
                  tuple(r[2] // width for r in runs), tiles, in_order,
                  run_families(runs) if padding is None else _families_apart(src_starts, dst_starts, lengths, padding))


def _families_apart(src_starts: Sequence[int], dst_starts: Sequence[int], lengths: Sequence[int],
                    padding: Sequence[bool]) -> tuple[RunFamily, ...] | None:
    """The run families of the runs not marked ``padding``, then those of the padding runs (found apart, so that
    a partition's padding, as long as some parameter's chunk, does not break the parameters' period; they may be
    of fewer runs)."""
    found: list[RunFamily] = []
    for pad in (False, True):
        keep = [i for i, p in enumerate(padding) if bool(p) == pad]
        if not keep:
            continue
        runs = _merged_runs([src_starts[i] for i in keep], [dst_starts[i] for i in keep], [lengths[i] for i in keep])
        families = run_families(runs, min_runs=1 if pad else MIN_FAMILY_RUNS) if runs else ()
        if families is None:
            return None
        found += families
    return tuple(found) if len(found) <= MAX_FAMILIES else None


def _merged_runs(src_starts: Sequence[int], dst_starts: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """``[src, dst, length]`` runs in destination order, empty ones skipped, adjacent ones merged."""
    runs: list[list[int]] = []
    for s, d, n in sorted(zip(src_starts, dst_starts, lengths), key=lambda run: run[1]):
        if not n:
            continue
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += n
        else:
            runs.append([s, d, n])
    return runs


#: ``(numels, byte offsets from the first piece's storage start, that storage's bytes)`` of a list of pieces
PieceKey = tuple[tuple[int, ...], tuple[int, ...], int]

_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_IS_CPU = operator.attrgetter("is_cpu")


#: a :class:`PieceCopy` takes at most this many extra copies (runs copied one by one, pieces outside the block);
#: beyond it the caller copies piece by piece
FEW_COPIES = 16


@dataclass(frozen=True, eq=False)
class PieceCopy:
    """How to write the concatenation of a list of pieces into a flat buffer with a fixed number of copies.

    Built by :func:`piece_copy` for one structure of pieces (``key``, from :func:`piece_key`: their numels and where
    each lies relative to the first piece's storage); a later list whose :func:`piece_key` equals ``key`` lies the
    same way and reuses it. Pieces inside the first piece's storage are read as runs of the block
    ``[block_start, block_start + block_numel)`` of that storage: with ``rows`` (one ``index_select``, see
    :class:`RowMap`) or, when they make at most :data:`FEW_COPIES` runs, one copy per run (``runs``: ``(block start,
    flat start, length)``; one run when the pieces lie in order). At most :data:`FEW_COPIES` pieces elsewhere
    (``outside``, e.g. a zero-padding tensor of its own) are copied with one ``_foreach_copy_``.
    """

    key: PieceKey
    block_start: int
    block_numel: int
    rows: RowMap | None
    runs: tuple[tuple[int, int, int], ...]
    outside: tuple[tuple[int, int], ...]  # (piece index, flat start)

    def copy(self, pieces: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """Write ``pieces`` (whose :func:`piece_key` is ``key``) into ``flat``, in order."""
        first = pieces[0]
        block = first.as_strided((self.block_numel,), (1,), self.block_start) if self.block_numel else None
        if self.rows is not None:
            self.rows.copy(block, flat)
        elif self.runs:
            torch._foreach_copy_([flat.narrow(0, d, n) for _, d, n in self.runs],
                                 [block.narrow(0, s, n) for s, _, n in self.runs])
        if self.outside:
            torch._foreach_copy_([flat.narrow(0, at, pieces[i].numel()) for i, at in self.outside],
                                 [pieces[i].reshape(-1) for i, _ in self.outside])


def piece_key(pieces: Sequence[torch.Tensor]) -> PieceKey | None:
    """``(numels, byte offsets from the first piece's storage start, storage bytes)`` of ``pieces``, or ``None``
    when they cannot be read as runs of memory (a piece not contiguous, or of another dtype or device than the
    first). A few C-level passes over the list: no tensor operation."""
    first = pieces[0]
    if not all(map(torch.Tensor.is_contiguous, pieces)):
        return None
    dtype, device = first.dtype, first.device
    if set(map(_DTYPE, pieces)) != {dtype}:
        return None
    # on the CPU a bool per piece (``is_cpu``) instead of a new ``torch.device`` object per piece
    same_device = (all(map(_IS_CPU, pieces)) if first.is_cpu
                   else not any(map(device.__ne__, map(_DEVICE, pieces))))
    if not same_device:
        return None
    storage = first.untyped_storage()
    base = storage.data_ptr()
    offsets = tuple(map(base.__rsub__, map(torch.Tensor.data_ptr, pieces)))
    return tuple(map(torch.Tensor.numel, pieces)), offsets, storage.nbytes()


def piece_copy(key: PieceKey, element_size: int, flat_numel: int) -> PieceCopy | None:
    """The :class:`PieceCopy` for pieces of ``key`` (from :func:`piece_key`) into a flat buffer of ``flat_numel``
    elements (their concatenation, zero-padded or not), or ``None`` when it would take more than
    :data:`FEW_COPIES` extra copies (pieces of their own, short runs of a block too narrow for rows): the caller
    copies piece by piece then."""
    numels, offsets, nbytes = key
    flat_starts = list(itertools.accumulate(numels, initial=0))
    inside, outside = [], []
    for i, (n, off) in enumerate(zip(numels, offsets)):
        if not n:
            continue
        if off >= 0 and off % element_size == 0 and off + n * element_size <= nbytes:
            inside.append(i)
        else:
            outside.append((i, flat_starts[i]))
    if len(outside) > FEW_COPIES:
        return None
    if not inside:
        return PieceCopy(key, 0, 0, None, (), tuple(outside))
    starts = [offsets[i] // element_size for i in inside]
    lo = min(starts)
    hi = max(s + numels[i] for s, i in zip(starts, inside))
    src = [s - lo for s in starts]
    dst = [flat_starts[i] for i in inside]
    lengths = [numels[i] for i in inside]
    rows = row_map(src, dst, lengths, hi - lo, flat_numel, element_size)
    runs = () if rows is not None else tuple(tuple(r) for r in _merged_runs(src, dst, lengths))
    if len(runs) > FEW_COPIES:
        return None
    return PieceCopy(key, lo, hi - lo, rows, runs, tuple(outside))
