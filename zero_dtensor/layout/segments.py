"""Per-piece reductions of a 1-D buffer cut by a tiling, with a fixed number of tensor operations.

A rank's partition (or any 1-D buffer) is cut by a :class:`~zero_dtensor.layout.tiling.Tiling` into pieces: parameters'
fragments and padding gaps, thousands of them, most small. Reducing each piece on its own (``_foreach_norm`` over
per-piece views) costs about a microsecond per piece in dispatch alone, and long float32 reductions lose precision.
A :class:`SegmentPlan` instead splits the work in two, whatever the number of pieces:

- **rows**: the buffer's leading full rows of ``block`` (64) elements, ``buf[:rows·block].view(-1, block)``. A row
  lying entirely inside one piece belongs to that piece's *body*; rows straddling a piece boundary are unused. One
  row-wise reduction (``vector_norm`` / ``sum`` / ``amax``, ``amin`` over ``dim=1``, at least float32) gives a
  value per row; one float64 ``segment_reduce`` over the runs ``unused_0, body_0, unused_1, body_1, ...`` gives
  every piece's body value as the odd entries (a strided view);
- **bits**: every element of a piece not in its body (its head before its first full row, its tail after its last
  one, or the whole piece when it has none, everything in the last partial row included). One ``index_select``
  gathers them in buffer order, grouped by piece; one float64 ``segment_reduce`` (zero-length segments allowed)
  gives a value per piece.

The two are added (maxed) into one float64 value per piece. So every function here dispatches the same handful of
operations for 8 pieces or 10,000; row sums are over 64 elements and everything above them is float64, which makes
them far more precise than one long float32 reduction. Plans hold Python tuples only; their index tensors are built
lazily per device and cached on the plan. Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from .devices import to_device
from .tiling import Tiling

__all__ = [
    "BLOCK",
    "SegmentPlan",
    "param_index",
    "piece_dots",
    "piece_max_abs",
    "piece_pow_sums",
    "piece_stats",
    "piece_sums",
    "segment_plan",
    "sizes_plan",
]

BLOCK = 64  #: row width on the CPU: a row lying inside one piece is reduced by the row-wise pass
#: row width on accelerators: PyTorch's CUDA reduction vectorizes its loads only along rows over 128 elements; rows
#: of 2048 reach 1.09x a flat ``vector_norm`` on an H200 (64: 6.8x; 512: 1.5x; 8192: 1.55x; 1.03B bf16 elements)
DEVICE_BLOCK = 2048


def block_for(device: torch.device) -> int:
    """The row width of the plans reducing buffers on ``device``: :data:`BLOCK` on the CPU (its tuned recipe),
    :data:`DEVICE_BLOCK` elsewhere."""
    return BLOCK if torch.device(device).type == "cpu" else DEVICE_BLOCK
_PARAM_KEYS = 16  #: at most this many cached parameter selections per plan (then the cache starts over)


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """How to reduce every piece of a 1-D buffer of ``numel`` elements in a fixed number of operations.

    ``row_lengths`` (2 per piece): the runs of the first ``row_end`` rows of ``block`` elements, ``unused_i,
    body_i`` for piece ``i`` (a piece without full rows has ``0, 0``; unused rows straddle piece boundaries).
    ``bit_starts``/``bit_spans``: the other elements as maximal spans ``[start, start + span)`` in buffer order;
    ``bit_lengths[i]``: how many of them piece ``i`` holds (head and tail together). ``param_piece``: the tiling's
    piece of each parameter (buffer order), for :func:`param_index`. Compared by identity.
    """

    numel: int
    block: int
    row_end: int  # rows [0, row_end) are covered by row_lengths (the last body row's end)
    body_rows: int  # rows inside some piece's body (0: the row-wise pass is skipped)
    row_lengths: tuple[int, ...]
    bit_starts: tuple[int, ...]
    bit_spans: tuple[int, ...]
    bit_lengths: tuple[int, ...]
    param_piece: tuple[int, ...] = ()
    _by_device: dict[torch.device, _Tensors] = field(default_factory=dict, init=False, repr=False)
    _by_params: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def pieces(self) -> int:
        return len(self.bit_lengths)

    @property
    def bits(self) -> int:
        """How many elements the bits pass gathers."""
        return sum(self.bit_spans)


@dataclass(frozen=True)
class _Tensors:
    """A plan's index tensors on one device: per piece or per row, never per element."""

    row_offsets: torch.Tensor  # (2·pieces + 1,) int64: ``segment_reduce`` offsets of ``unused_0, body_0, ...``
    bit_rows: torch.Tensor  # (non-body full rows,) int64, ascending
    bit_offsets: torch.Tensor  # (pieces + 1,) int64: ``segment_reduce`` offsets of each piece's bits


def _build(sizes: Sequence[int], param_piece: tuple[int, ...], block: int) -> SegmentPlan:
    """One pass over the pieces (Python ints only)."""
    row_lengths: list[int] = []
    bit_starts: list[int] = []
    bit_spans: list[int] = []
    bit_lengths: list[int] = []
    row_pos = body_rows = start = 0

    def bit(at: int, length: int) -> None:
        if not length:
            return
        if bit_starts and bit_starts[-1] + bit_spans[-1] == at:  # adjacent to the previous span: extend it
            bit_spans[-1] += length
        else:
            bit_starts.append(at)
            bit_spans.append(length)

    for size in sizes:
        end = start + size
        first, last = -(-start // block), end // block  # the piece's full rows are [first, last)
        if last > first:
            row_lengths += (first - row_pos, last - first)
            row_pos, body_rows = last, body_rows + last - first
            bit(start, first * block - start)
            bit(last * block, end - last * block)
            bit_lengths.append(size - (last - first) * block)
        else:
            row_lengths += (0, 0)
            bit(start, size)
            bit_lengths.append(size)
        start = end
    return SegmentPlan(numel=start, block=block, row_end=row_pos, body_rows=body_rows,
                       row_lengths=tuple(row_lengths), bit_starts=tuple(bit_starts), bit_spans=tuple(bit_spans),
                       bit_lengths=tuple(bit_lengths), param_piece=param_piece)


@lru_cache(maxsize=64)
def segment_plan(tiling: Tiling, block: int = BLOCK) -> SegmentPlan:
    """The plan of a :class:`~zero_dtensor.layout.tiling.Tiling` (cached per tiling value: one Python pass on first use).
    Its :func:`param_index` maps the tiling's parameters to their pieces."""
    return _build(tiling.sizes, tiling.piece, block)


def sizes_plan(sizes: Sequence[int], block: int = BLOCK) -> SegmentPlan:
    """The plan of a buffer made of pieces of ``sizes`` back to back, piece ``k`` being parameter ``k`` (for a
    concatenation of selected fragments; cached per ``sizes``)."""
    return _sizes_plan(tuple(sizes), block)


@lru_cache(maxsize=64)
def _sizes_plan(sizes: tuple[int, ...], block: int) -> SegmentPlan:
    return _build(sizes, tuple(range(len(sizes))), block)


def _tensors(seg: SegmentPlan, device: torch.device) -> _Tensors:
    """The plan's index tensors on ``device`` (built on first use, then cached on the plan)."""
    found = seg._by_device.get(device)
    if found is None:  # two threads may both build it: the same values, one is kept
        found = seg._by_device.setdefault(device, _make_tensors(seg, device))
    return found


def _offsets(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _make_tensors(seg: SegmentPlan, device: torch.device) -> _Tensors:
    """Per piece and per row only: the body runs' offsets, the full rows outside every body (they and the last
    partial row hold every bit, in buffer order), the bits' per-piece offsets. One copy to ``device``."""
    full = seg.numel // seg.block
    body = bytearray(full)
    row = 0
    for i in range(0, len(seg.row_lengths), 2):
        row += seg.row_lengths[i]
        body[row:row + seg.row_lengths[i + 1]] = b"\x01" * seg.row_lengths[i + 1]
        row += seg.row_lengths[i + 1]
    bit_rows = [r for r in range(full) if not body[r]]
    row_offsets, bit_offsets = _offsets(seg.row_lengths), _offsets(seg.bit_lengths)
    packed = torch.tensor(row_offsets + bit_rows + bit_offsets, dtype=torch.int64)
    moved = to_device(packed, device).split([len(row_offsets), len(bit_rows), len(bit_offsets)])
    return _Tensors(row_offsets=moved[0], bit_rows=moved[1], bit_offsets=moved[2])


def param_index(seg: SegmentPlan, params: Sequence[int], device: torch.device) -> torch.Tensor:
    """(len(params),) int64 on ``device``: the piece of each of the given parameters (indices into the tiling's
    parameters, buffer order). Cached per (device, params) on the plan (a few selections at a time)."""
    key = (device, tuple(params))
    found = seg._by_params.get(key)
    if found is None:
        found = to_device(torch.tensor([seg.param_piece[k] for k in key[1]], dtype=torch.int64), device)
        if len(seg._by_params) >= _PARAM_KEYS:
            seg._by_params.clear()
        seg._by_params[key] = found
    return found


# --- the two passes ------------------------------------------------------------------------------------------------
def _acc(*dtypes: torch.dtype) -> torch.dtype:
    """Row accumulation dtype: float64 for float64 input, else float32 (bf16/fp16/fp32, bool)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _check(buf: torch.Tensor, seg: SegmentPlan) -> None:
    if buf.dim() != 1 or buf.numel() != seg.numel:
        raise ValueError(f"expected a 1-D buffer of {seg.numel} elements, got shape {tuple(buf.shape)}")


def _rows(buf: torch.Tensor, seg: SegmentPlan) -> torch.Tensor:
    """The rows the plan covers, a (row_end, block) view."""
    return buf[: seg.row_end * seg.block].view(seg.row_end, seg.block)


def _bits(buf: torch.Tensor, seg: SegmentPlan, t: _Tensors) -> torch.Tensor:
    """The bits in buffer order, float64: one ``index_select`` of the full rows outside every body (an index per
    row, not per element) and the last partial row, concatenated (a copy of the bits only)."""
    full = seg.numel // seg.block
    picked = buf[: full * seg.block].view(full, seg.block).index_select(0, t.bit_rows).view(-1)
    return torch.cat([picked, buf[full * seg.block:]]).to(torch.float64)  # the same ops with or without a tail


def _per_piece(bit_values: torch.Tensor, row_values: torch.Tensor | None, t: _Tensors, how: str) -> torch.Tensor:
    """Combine per-bit and per-row float64 values into per-piece values (``how``: "sum" or "max")."""
    out = _segments(bit_values, t.bit_offsets, how)
    if row_values is None:
        return out
    body = _body(row_values, t, how)
    return out.add_(body) if how == "sum" else torch.maximum(out, body)


def _segments(values: torch.Tensor, offsets: torch.Tensor, how: str) -> torch.Tensor:
    """One float64 ``segment_reduce`` by precomputed ``offsets`` (``lengths=`` would rebuild them on every call: a
    fill and a scan on CUDA)."""
    return torch.segment_reduce(values, how, offsets=offsets, unsafe=True, initial=0.0 if how == "max" else None)


def _body(row_values: torch.Tensor, t: _Tensors, how: str) -> torch.Tensor:
    """Per piece, its body rows reduced: the odd runs of ``unused_0, body_0, unused_1, ...`` (a strided view)."""
    return _segments(row_values, t.row_offsets, how)[1::2]


def _row_pow_sums(rows: torch.Tensor, p: float) -> torch.Tensor:
    """Per row ``sum |x|^p``, float64, accumulated inside the reduction (float32, float64 for float64 rows): no
    upcast copy of the rows."""
    acc = _acc(rows.dtype)
    if p == 2.0:
        return torch.linalg.vector_norm(rows, 2, dim=1, dtype=acc).to(torch.float64).square_()
    return torch.linalg._powsum(rows, p, dim=1, dtype=acc).to(torch.float64)


def _row_max_abs(rows: torch.Tensor) -> torch.Tensor:
    """Per row ``max |x|`` (nan where the row holds one), float64: one ``vector_norm(ord=inf)`` pass (one read at
    the 2-norm's speed, no ``abs`` copy; ``aminmax`` read the rows 1.27x slower on an H200). Exact: the maximum
    of ``|x|`` is one of the stored values."""
    return torch.linalg.vector_norm(rows, math.inf, dim=1).to(torch.float64)


# --- the reductions ------------------------------------------------------------------------------------------------
def piece_pow_sums(buf: torch.Tensor, seg: SegmentPlan, p: float = 2.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """(pieces,) float64 on ``buf.device``: ``sum |x|^p`` of each piece (0 for an empty one), ``p > 0`` finite.

    Rows by one row-wise reduction accumulating inside (``vector_norm`` squared for p = 2, ``linalg._powsum``
    else: float32, float64 for float64 buffers; no upcast copy); bits in float64. ``device``: where ``buf`` lives
    (the index tensors are cached per device; default ``buf.device``)."""
    _check(buf, seg)
    t = _tensors(seg, buf.device if device is None else device)
    bits = _bits(buf, seg, t)
    bits = bits.square_() if p == 2.0 else bits.abs_().pow_(p)
    row_values = _row_pow_sums(_rows(buf, seg), p) if seg.body_rows else None
    return _per_piece(bits, row_values, t, "sum")


def piece_max_abs(buf: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None) -> torch.Tensor:
    """(pieces,) float64: ``max |x|`` of each piece, 0 for an empty one, ``nan`` where the piece holds a nan (as
    ``aminmax`` propagates it). Rows by one ``aminmax`` over ``dim=1`` (one read, no full-size temporary)."""
    _check(buf, seg)
    t = _tensors(seg, buf.device if device is None else device)
    row_values = _row_max_abs(_rows(buf, seg)) if seg.body_rows else None
    return _per_piece(_bits(buf, seg, t).abs_(), row_values, t, "max")


def piece_sums(buf: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None) -> torch.Tensor:
    """(pieces,) float64: ``sum x`` of each piece (0 for an empty one); ``buf`` may be bool (counts). Rows summed in
    float32 (float64 for float64 buffers), everything above them in float64."""
    _check(buf, seg)
    t = _tensors(seg, buf.device if device is None else device)
    row_values = None
    if seg.body_rows:
        row_values = _rows(buf, seg).sum(1, dtype=_acc(buf.dtype)).to(torch.float64)
    return _per_piece(_bits(buf, seg, t), row_values, t, "sum")


#: :func:`piece_stats` with ``counts=True`` counts the non-finite elements of at most ``rows // COUNT_SHARE`` rows
#: (those whose sum of squares is not finite: the only ones holding a nan or an inf), chosen on the device
COUNT_SHARE = 256
COUNT_ROWS = 16  #: ... or at most this many rows, whichever is more (a few bad rows of a small buffer)


def piece_stats(buf: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None, *,
                counts: bool = False) -> torch.Tensor:
    """(pieces, 3) float64: per piece the sum of squares, the sum and the max ``|x|``, exactly as
    :func:`piece_pow_sums`, :func:`piece_sums` and :func:`piece_max_abs` give them, sharing one gather of the bits:
    three reads of the rows (``vector_norm``, ``sum``, ``vector_norm(ord=inf)``).

    ``counts``: (pieces, 6), three more columns: nan count, inf count, and ``missed`` (1.0 on every piece when
    the counts may be incomplete, else 0.0), decided on the device without a host sync: the bits are counted
    directly; of the rows, only those whose sum of squares is not finite can hold a nan or an inf, and up to
    ``max(COUNT_ROWS, row_end // COUNT_SHARE)`` of them (chosen by one ``topk`` of the row flags) are gathered and counted (a
    temporary of at most 1/:data:`COUNT_SHARE` of the rows, or 16 rows: about 8 MB of 2 GB on the H200 layout). ``missed`` is set when more rows than that are not
    finite (then count with :func:`piece_sums` of ``isnan``/``isinf``)."""
    _check(buf, seg)
    t = _tensors(seg, buf.device if device is None else device)
    bits = _bits(buf, seg, t)
    offsets = t.bit_offsets
    columns = [_segments(bits * bits, offsets, "sum"), _segments(bits, offsets, "sum"), None]
    if counts:
        columns += [_segments(torch.isnan(bits).to(torch.float64), offsets, "sum"),
                    _segments(torch.isinf(bits).to(torch.float64), offsets, "sum")]
    columns[2] = _segments(bits.abs_(), offsets, "max")
    missed = None
    if seg.body_rows:
        rows, acc = _rows(buf, seg), _acc(buf.dtype)
        row_sq = _row_pow_sums(rows, 2.0)
        columns[0].add_(_body(row_sq, t, "sum"))
        columns[1].add_(_body(rows.sum(1, dtype=acc).to(torch.float64), t, "sum"))
        columns[2] = torch.maximum(columns[2], _body(_row_max_abs(rows), t, "max"))
        if counts:
            missed = _count_bad_rows(rows, row_sq, t, columns[3], columns[4])
    if not counts:
        return torch.stack(columns, dim=1)
    flag = torch.zeros_like(columns[0]) if missed is None else missed.to(torch.float64).expand(seg.pieces)
    return torch.stack([*columns, flag], dim=1)


def _count_bad_rows(rows: torch.Tensor, row_sq: torch.Tensor, t: _Tensors, nans: torch.Tensor,
                    infs: torch.Tensor) -> torch.Tensor:
    """Add the nan and inf counts of the body rows whose sum of squares is not finite to ``nans``/``infs`` (per
    piece, in place): the first ``max(COUNT_ROWS, rows // COUNT_SHARE)`` such rows found by one ``topk`` (a fixed-size
    gather, no host sync). Returns a 0-d bool: whether more rows than that are not finite (counts incomplete)."""
    bad = ~torch.isfinite(row_sq)
    budget = min(rows.shape[0], max(COUNT_ROWS, rows.shape[0] // COUNT_SHARE))
    pick = torch.topk(bad.to(torch.uint8), budget, sorted=False).indices
    picked = rows.index_select(0, pick)
    run = torch.searchsorted(t.row_offsets, pick, right=True) - 1  # the run of each picked row
    body = (run % 2 == 1) & bad.index_select(0, pick)  # rows straddling pieces are bits (counted there)
    piece = torch.div(run, 2, rounding_mode="floor").clamp_(max=nans.shape[0] - 1)
    nans.index_add_(0, piece, torch.isnan(picked).sum(1).to(torch.float64) * body)
    infs.index_add_(0, piece, torch.isinf(picked).sum(1).to(torch.float64) * body)
    return bad.sum() > budget


#: :func:`piece_dots` reduces its rows in at most about :data:`DOT_PARTS` chunks, each at least this many elements
#: (one chunk for buffers up to it)
DOT_CHUNK = 1 << 22
#: ... and at most ``rows // DOT_PARTS`` rows (plus a last, shorter one): a bounded number of chunks (about 3
#: kernels each), temporaries of at most 1/DOT_PARTS of the rows' float32 size
DOT_PARTS = 16


def _dot_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per row ``sum x·y``, float64. Lower-precision rows: one float32 copy of ``x``, multiplied in place by ``y``
    (exact products: a bf16 or fp16 product fits float32), summed in float32 per row; float32/float64 rows:
    ``linalg.vecdot`` (float64 if either is)."""
    acc = _acc(x.dtype, y.dtype)
    if x.dtype == acc and y.dtype == acc:
        return torch.linalg.vecdot(x, y).to(torch.float64)
    if x.dtype != acc:
        return x.to(acc).mul_(y).sum(1).to(torch.float64)
    return y.to(acc).mul_(x).sum(1).to(torch.float64)


def piece_dots(a: torch.Tensor, b: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None
               ) -> torch.Tensor:
    """(pieces,) float64 on ``a.device``: ``sum a·b`` of each piece (``a`` and ``b`` on the same device). Rows
    chunk by chunk (:func:`_dot_rows`; at most :data:`DOT_PARTS` + 1 chunks of at least :data:`DOT_CHUNK`
    elements): accumulation in float32 (float64 if either is float64) of exact products for lower-precision data,
    no temporary over 1/DOT_PARTS of the rows' float32 size, a number of operations bounded whatever the size."""
    _check(a, seg)
    _check(b, seg)
    t = _tensors(seg, a.device if device is None else device)
    row_values = None
    if seg.body_rows:
        step = max(1, DOT_CHUNK // seg.block, seg.row_end // DOT_PARTS)
        chunks = [_dot_rows(x, y) for x, y in zip(_rows(a, seg).split(step), _rows(b, seg).split(step))]
        row_values = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return _per_piece(_bits(a, seg, t).mul_(_bits(b, seg, t)), row_values, t, "sum")
