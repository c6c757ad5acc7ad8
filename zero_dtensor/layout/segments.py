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
them far more precise than one long float32 reduction.

**Several buffers at once** (the ``joint_*`` functions; issue 42): a selection spanning several flat groups (ZeRO-3's
sub-groups, several param groups) reduces each group's partition by its own plan, but only the kernels that read a
buffer are per buffer (its row-wise pass per quantity, the ``index_select`` of its bits); everything after them is
one set of operations for all buffers: the row values of every buffer and the bits of every buffer are
concatenated (in that order, buffer after buffer) into one vector, cast to float64 once, and one ``segment_reduce``
over joint offsets gives every piece's body and bits values (added or maxed once). The per-piece values are the same
float64 numbers as buffer by buffer: the same elements in the same segments. The ``piece_*`` functions are the
one-buffer case. Plans hold Python tuples only; the joint index tensors are built lazily per (plans, device) and
cached. In host memory (:func:`~.segment_plan.on_host`) the rows' and the bits' values are reduced apart, by
numpy's segment reductions (:func:`.cpu_rows.segment_reduce`), instead of concatenated for one ``segment_reduce``.
Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import cpu_rows, fused_rows
from .segment_plan import (BLOCK, COUNT_ROWS, COUNT_SHARE, DEVICE_BLOCK, JointPlan, SegmentPlan, acc_dtype, block_for,
                           count_budget, joint_plan, offsets_of, param_index, segment_plan, sizes_plan)

__all__ = [
    "BLOCK",
    "COUNT_ROWS",
    "COUNT_SHARE",
    "DEVICE_BLOCK",
    "block_for",
    "SegmentPlan",
    "param_index",
    "joint_dots",
    "joint_max_abs",
    "joint_pow_sums",
    "joint_stats",
    "joint_sums",
    "piece_dots",
    "piece_max_abs",
    "piece_pow_sums",
    "piece_stats",
    "piece_sums",
    "segment_plan",
    "sizes_plan",
]

def _check(buf: torch.Tensor, seg: SegmentPlan) -> None:
    if buf.dim() != 1 or buf.numel() != seg.numel:
        raise ValueError(f"expected a 1-D buffer of {seg.numel} elements, got shape {tuple(buf.shape)}")


def _prepare(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan], device: torch.device | None) -> JointPlan:
    """Check each buffer against its plan; the plans' joint index tensors on ``device`` (default: the first
    buffer's)."""
    if len(bufs) != len(segs) or not segs:
        raise ValueError(f"expected one buffer per plan, got {len(bufs)} buffers for {len(segs)} plans")
    for buf, seg in zip(bufs, segs):
        _check(buf, seg)
    return joint_plan(tuple(segs), bufs[0].device if device is None else torch.device(device))


def _rows(buf: torch.Tensor, seg: SegmentPlan) -> torch.Tensor:
    """The rows the plan covers, a (row_end, block) view."""
    return buf[: seg.row_end * seg.block].view(seg.row_end, seg.block)


def _row_views(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan]) -> list[torch.Tensor]:
    """The covered rows of each buffer whose plan has body rows (the others take no row-wise pass)."""
    return [_rows(buf, seg) for buf, seg in zip(bufs, segs) if seg.body_rows]


def _bit_parts(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan], j: JointPlan) -> list[torch.Tensor]:
    """The bits of every buffer, in buffer order, plan after plan, as pieces to concatenate: per buffer one
    ``index_select`` of the full rows outside every body (an index per row, not per element; the one operation
    per buffer) and a view of its last partial row."""
    parts: list[torch.Tensor] = []
    for buf, seg, bit_rows in zip(bufs, segs, j.bit_rows):
        full = seg.numel // seg.block
        parts += [buf[: full * seg.block].view(full, seg.block).index_select(0, bit_rows).view(-1),
                  buf[full * seg.block:]]
    return parts


def _cat(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """``values`` concatenated (the one tensor itself when there is one)."""
    return values[0] if len(values) == 1 else torch.cat(list(values))


def _segments(values: torch.Tensor, offsets: torch.Tensor | cpu_rows.HostSegments, how: str) -> torch.Tensor:
    """One float64 ``segment_reduce`` by precomputed ``offsets`` (``lengths=`` would rebuild them on every call: a
    fill and a scan on CUDA); a host plan's :class:`~.cpu_rows.HostSegments`: host tensors, through
    :func:`.cpu_rows.segment_reduce` (the same values, about 3x faster there)."""
    if isinstance(offsets, cpu_rows.HostSegments):
        return cpu_rows.segment_reduce(values, offsets, how)
    return torch.segment_reduce(values, how, offsets=offsets, unsafe=True, initial=0.0 if how == "max" else None)


def _joined(values: torch.Tensor, j: JointPlan, how: str) -> torch.Tensor:
    """Per piece, from float64 ``values`` laid out as every plan's row values then every plan's bits (one value
    each): its body rows' and its bits' values reduced (``how``: "sum" or "max"), by one ``segment_reduce`` over
    both and one add (max)."""
    seg = _segments(values, j.host_all_runs or j.all_offsets, how)
    body, bits = seg[: 2 * j.pieces][1::2], seg[2 * j.pieces:]
    return bits + body if how == "sum" else torch.maximum(bits, body)


def _host_joined(row_values: Sequence[torch.Tensor], bits: torch.Tensor, j: JointPlan, how: str) -> torch.Tensor:
    """:func:`_joined` in host memory, from float64 row values (one tensor per buffer with rows) and float64 bits
    kept apart: one segment reduction over the rows' runs and one over the bits (:func:`.cpu_rows.segment_reduce`),
    added (maxed). No concatenation of the rows and the bits (on the CPU each one copies every value; an
    accelerator takes :func:`_joined`: one kernel)."""
    out = _segments(bits, j.host_bit_runs or j.bit_offsets, how)
    if not row_values:
        return out
    body = _segments(_cat(row_values), j.host_row_runs or j.row_offsets, how)[1::2]
    return out.add_(body) if how == "sum" else torch.maximum(out, body)


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Per row the 2-norm, accumulated inside the reduction in float32 (float64 for float64 rows): no upcast copy
    of the rows. Squared in float64 by the caller."""
    return torch.linalg.vector_norm(rows, 2, dim=1, dtype=acc_dtype(rows.dtype))


def _row_max_abs(rows: torch.Tensor) -> torch.Tensor:
    """Per row ``max |x|`` (nan where the row holds one), in the rows' dtype: one ``vector_norm(ord=inf)`` pass
    (one read at the 2-norm's speed, no ``abs`` copy; ``aminmax`` read the rows 1.27x slower on an H200). Exact:
    the maximum of ``|x|`` is one of the stored values."""
    return torch.linalg.vector_norm(rows, math.inf, dim=1)


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Per row ``sum x`` in float32 (float64 for float64 rows; bool rows count)."""
    return rows.sum(1, dtype=acc_dtype(rows.dtype))


def _row_passes(rows: Sequence[torch.Tensor], kinds: Sequence[str | float]) -> list[list[torch.Tensor]]:
    """Per kind (``"norm"``, ``"sum"``, ``"max"``, or ``p`` for ``sum |x|^p``) the per-row values of every
    buffer's rows, to concatenate. Accelerators: one row-wise reduction per buffer and kind (:func:`_row_norms`,
    :func:`_row_sums`, :func:`_row_max_abs`, ``linalg._powsum``); the CPU: :func:`.cpu_rows.row_values` (chunks
    through one scratch: no float32 copy of bf16/fp16 data, no ``vector_norm(ord=inf)``), the same values."""
    if rows and rows[0].device.type == "cpu":
        return cpu_rows.row_values(rows, kinds)
    return [[_ROW_PASS[kind](r) if isinstance(kind, str) else
             torch.linalg._powsum(r, kind, dim=1, dtype=acc_dtype(r.dtype)) for r in rows] for kind in kinds]


_ROW_PASS = {"norm": _row_norms, "sum": _row_sums, "max": _row_max_abs}


# --- the reductions ------------------------------------------------------------------------------------------------
def joint_pow_sums(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan], p: float = 2.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """(pieces of all plans,) float64, plan after plan: ``sum |x|^p`` of each piece of each buffer (0 for an empty
    one), ``p > 0`` finite.

    Rows by one row-wise reduction per buffer accumulating inside (``vector_norm`` squared in float64 for p = 2,
    ``linalg._powsum`` else: float32, float64 for float64 buffers; no upcast copy); bits in float64; everything
    above the row-wise pass and the bits' gather is one set of operations for all buffers. ``device``: where the
    buffers live (the index tensors are cached per device; default the first buffer's)."""
    j = _prepare(bufs, segs, device)
    rows = _row_views(bufs, segs)
    if p == 2.0:  # row norms and raw bits squared together
        (norms,) = _row_passes(rows, ("norm",))
        if j.host:
            bits = _cat(_bit_parts(bufs, segs, j)).to(torch.float64).square_()
            return _host_joined([n.to(torch.float64).square_() for n in norms], bits, j, "sum")
        values = torch.cat([*norms, *_bit_parts(bufs, segs, j)]).to(torch.float64).square_()
        return _joined(values, j, "sum")
    (acc,) = _row_passes(rows, (p,))
    bits = torch.cat(_bit_parts(bufs, segs, j)).to(torch.float64).abs_().pow_(p)
    values = torch.cat([_cat(acc).to(torch.float64), bits]) if acc else bits
    return _joined(values, j, "sum")


def joint_max_abs(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan],
                  device: torch.device | None = None) -> torch.Tensor:
    """(pieces of all plans,) float64: ``max |x|`` of each piece, 0 for an empty one, ``nan`` where the piece holds
    a nan. Rows by one ``vector_norm(ord=inf)`` per buffer (one read, no full-size temporary)."""
    j = _prepare(bufs, segs, device)
    (maxima,) = _row_passes(_row_views(bufs, segs), ("max",))
    if j.host:
        bits = _cat(_bit_parts(bufs, segs, j)).to(torch.float64).abs_()
        return _host_joined([m.to(torch.float64) for m in maxima], bits, j, "max")
    values = torch.cat([*maxima, *_bit_parts(bufs, segs, j)])
    return _joined(values.to(torch.float64).abs_(), j, "max")


def joint_sums(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan],
               device: torch.device | None = None) -> torch.Tensor:
    """(pieces of all plans,) float64: ``sum x`` of each piece (0 for an empty one); buffers may be bool (counts).
    Rows summed in float32 (float64 for float64 buffers), everything above them in float64."""
    j = _prepare(bufs, segs, device)
    (sums,) = _row_passes(_row_views(bufs, segs), ("sum",))
    values = torch.cat([*sums, *_bit_parts(bufs, segs, j)])
    return _joined(values.to(torch.float64), j, "sum")


def piece_pow_sums(buf: torch.Tensor, seg: SegmentPlan, p: float = 2.0,
                   device: torch.device | None = None) -> torch.Tensor:
    """(pieces,) float64 on ``buf.device``: ``sum |x|^p`` of each piece of one buffer (:func:`joint_pow_sums`)."""
    return joint_pow_sums((buf,), (seg,), p, device)


def piece_max_abs(buf: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None) -> torch.Tensor:
    """(pieces,) float64: ``max |x|`` of each piece of one buffer (:func:`joint_max_abs`)."""
    return joint_max_abs((buf,), (seg,), device)


def piece_sums(buf: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None) -> torch.Tensor:
    """(pieces,) float64: ``sum x`` of each piece of one buffer (:func:`joint_sums`)."""
    return joint_sums((buf,), (seg,), device)


def joint_stats(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan], device: torch.device | None = None, *,
                counts: bool = False, order: Sequence[int] | None = None) -> torch.Tensor:
    """(pieces of all plans, 3) float64: per piece the sum of squares, the sum and the max ``|x|``, exactly as
    :func:`joint_pow_sums`, :func:`joint_sums` and :func:`joint_max_abs` give them, sharing one gather of the bits:
    three reads of the rows per buffer (``vector_norm``, ``sum``, ``vector_norm(ord=inf)``).

    ``counts``: (pieces, 6), three more columns: nan count, inf count, and ``missed`` (1.0 on every piece when
    the counts may be incomplete, else 0.0), decided on the device without a host sync: the bits are counted
    directly; of the rows, only those whose sum of squares is not finite can hold a nan or an inf, and up to
    ``max(COUNT_ROWS, row_end // COUNT_SHARE)`` of each buffer's (chosen by one ``topk`` of its row flags) are
    gathered and counted (a temporary of at most 1/:data:`COUNT_SHARE` of the rows, or 16 rows: about 8 MB of 2 GB
    on the H200 layout). ``missed`` is set when more of some buffer's rows than that are not finite (then count
    with :func:`joint_sums` of ``isnan``/``isinf``). In host memory (the CPU, offloaded partitions: a branch
    costs no device sync there) the counts are zeros unless some piece's sum of squares is not finite, then exact
    (:func:`_host_counts`), and ``missed`` is 0. ``order``: the columns in this order instead (indices into the
    above; one concatenation either way)."""
    j = _prepare(bufs, segs, device)
    rows = _row_views(bufs, segs)
    bits = _bit_parts(bufs, segs, j)
    if fused_rows.applies(rows):  # one read of the rows, exact counts (settings.set_fused_reductions)
        return _fused_stats(rows, bits, j, counts=counts, order=order)
    norms, sums, maxima = _row_passes(rows, ("norm", "sum", "max"))
    if j.host:
        return _host_stats(bufs, segs, device, (norms, sums, maxima), bits, j, counts=counts, order=order)
    squares = torch.cat([*norms, *bits]).to(torch.float64).square_()
    columns = [_joined(squares, j, "sum"),
               _joined(torch.cat([*sums, *bits]).to(torch.float64), j, "sum"),
               _joined(torch.cat([*maxima, *bits]).to(torch.float64).abs_(), j, "max")]
    columns = [c.unsqueeze(1) for c in columns]
    if counts:
        raw = torch.cat(bits)
        found = _segments(torch.stack([torch.isnan(raw), torch.isinf(raw)], dim=1).to(torch.float64), j.bit_offsets,
                          "sum")  # (pieces, 2): exact small integers, whatever the order of the sum
        if rows:
            missed = _count_bad_rows(rows, squares[: j.rows], j, found).to(torch.float64).expand(j.pieces, 1)
        else:
            missed = torch.zeros((j.pieces, 1), dtype=torch.float64, device=squares.device)
        columns += [found[:, :1], found[:, 1:], missed]
    return torch.cat(columns if order is None else [columns[i] for i in order], dim=1)


def _host_stats(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan], device: torch.device | None,
                passes: tuple[list[torch.Tensor], ...], bits: Sequence[torch.Tensor], j: JointPlan, *,
                counts: bool, order: Sequence[int] | None) -> torch.Tensor:
    """:func:`joint_stats` in host memory from its row passes (``passes``: per-row norms, sums, maxima) and the
    gathered bits: the bits cast to float64 once, each column by :func:`_host_joined` (no concatenation of rows and
    bits), the counts by :func:`_host_counts`."""
    raw = _cat(bits).to(torch.float64)
    wide = [[v.to(torch.float64) for v in values] for values in passes]
    columns = [_host_joined([n.square_() for n in wide[0]], raw.square(), j, "sum"),
               _host_joined(wide[1], raw, j, "sum"),
               _host_joined(wide[2], raw.abs(), j, "max")]
    columns = [c.unsqueeze(1) for c in columns]
    if counts:
        columns += _host_counts(bufs, segs, device, columns[0])
    return torch.cat(columns if order is None else [columns[i] for i in order], dim=1)


def _host_counts(bufs: Sequence[torch.Tensor], segs: Sequence[SegmentPlan], device: torch.device | None,
                 squares: torch.Tensor) -> list[torch.Tensor]:
    """:func:`joint_stats`' count columns (nan count, inf count, ``missed``) in host memory, where reading a value
    back costs no device synchronization: a piece holds a nan or an inf only where its sum of squares is not
    finite, so they are zeros unless some piece's is (one check of the (pieces, 1) sums of squares); then exact
    counts (:func:`joint_sums` of ``isnan`` and ``isinf``: two more passes and two masks). ``missed`` is 0: every
    count is exact."""
    zeros = torch.zeros_like(squares)
    if bool(torch.isfinite(squares).all()):
        return [zeros, zeros, zeros]
    found = [joint_sums([torch.isnan(b) for b in bufs], segs, device),
             joint_sums([torch.isinf(b) for b in bufs], segs, device)]
    return [f.unsqueeze(1) for f in found] + [zeros]


def _fused_stats(rows: Sequence[torch.Tensor], bits: Sequence[torch.Tensor], j: JointPlan, *, counts: bool,
                 order: Sequence[int] | None) -> torch.Tensor:
    """:func:`joint_stats` through the fused row pass (:func:`~.fused_rows.row_moments`: one read of each buffer's
    rows) and the raw bits in float64: (pieces, 3), or (pieces, 6) with ``counts`` (nan count, inf count, and
    ``missed``, always 0: every count is exact), columns in ``order`` if given. The rows' and bits' values go column
    by column into one (5, rows + bits) float64 tensor (one concatenation), then one 1-D ``segment_reduce`` per
    column wanted (:func:`_joined`; CUDA reduces 1-D data with CUB's segmented reduction, a 2-D ``segment_reduce``
    with one thread per output looping over its segment)."""
    raw = _cat(bits).to(torch.float64)
    per_bit = torch.stack([raw.square(), raw, raw.abs(), torch.isnan(raw).to(raw.dtype),
                           torch.isinf(raw).to(raw.dtype)])
    values = torch.cat([*(fused_rows.row_moments(r).t() for r in rows), per_bit], dim=1)  # float64 columns
    columns = [_joined(values[c], j, "max" if c == 2 else "sum") for c in range(5 if counts else 3)]
    if counts:
        columns.append(torch.zeros_like(columns[0]))
    return torch.stack(columns if order is None else [columns[i] for i in order], dim=1)


def _count_bad_rows(rows: list[torch.Tensor], row_sq: torch.Tensor, j: JointPlan, found: torch.Tensor) -> torch.Tensor:
    """Add the nan and inf counts of the body rows whose sum of squares is not finite to ``found`` ((pieces, 2), in
    place): per buffer the first ``max(COUNT_ROWS, rows // COUNT_SHARE)`` such rows, found by one ``topk`` and
    gathered by one ``index_select`` (fixed sizes, no host sync); everything else once for all buffers. Returns a
    0-d bool: whether some buffer has more rows than that not finite (counts incomplete)."""
    bad = (~torch.isfinite(row_sq)).to(torch.float64)  # (all rows,) 0/1
    picks, picked = [], []
    for r, start in zip(rows, offsets_of([r.shape[0] for r in rows])):
        pick = torch.topk(bad[start: start + r.shape[0]], count_budget(r.shape[0]), sorted=False).indices
        picks.append(pick)
        picked.append(r.index_select(0, pick))
    pick = _cat(picks).add_(j.pick_starts)  # among all rows
    block = _cat(picked)
    run = torch.searchsorted(j.row_offsets, pick, right=True) - 1  # the run of each picked row
    weight = (run.remainder(2) == 1) * bad.index_select(0, pick)  # rows straddling pieces are bits (counted there)
    piece = torch.div(run, 2, rounding_mode="floor").clamp_(max=j.pieces - 1)
    per_row = torch.stack([torch.isnan(block), torch.isinf(block)], dim=1).sum(2).to(torch.float64)
    found.index_add_(0, piece, per_row.mul_(weight.unsqueeze(1)))
    return (_segments(bad, j.row_starts, "sum") > j.budgets).any()


#: :func:`joint_dots` reduces its rows in at most about :data:`DOT_PARTS` chunks (plus one per further buffer), each
#: at least this many elements (one chunk per buffer up to it)
DOT_CHUNK = 1 << 22
#: ... and at most ``rows // DOT_PARTS`` rows of all buffers (plus a last, shorter one per buffer): a bounded number
#: of chunks (about 3 kernels each), temporaries of at most 1/DOT_PARTS of the rows' float32 size
DOT_PARTS = 16


def _dot_rows(x: torch.Tensor, y: torch.Tensor, *, in_kernel_cast: bool | None = None) -> torch.Tensor:
    """Per row ``sum x·y``, float32 (float64 if either is). Products of lower-precision rows are exact in float32
    (a bf16 or fp16 product fits), summed in float32 per row; float32/float64 rows: ``linalg.vecdot``.

    Lower-precision rows, two recipes (``in_kernel_cast``; default: on every device but the CPU):

    - on an accelerator, one ``addcmul`` into a float32 zero expanded to the rows' shape (stride 0, nothing read):
      its kernel loads both operands in their own dtype and casts in registers (TensorIterator's dynamic cast), so
      it reads each operand once and writes the products once, then ``sum``: 12 bytes of traffic per bf16 element
      pair (the float32 copy, then the in-place multiply, made 20);
    - on the CPU, TensorIterator would make float32 copies of both operands for that ``addcmul`` behind the
      dispatcher, so the CPU keeps one visible float32 copy of ``x`` multiplied in place by ``y``.

    Both give bitwise the same float32 products and sums."""
    acc = acc_dtype(x.dtype, y.dtype)
    if x.dtype == acc and y.dtype == acc:
        return torch.linalg.vecdot(x, y)
    if x.device.type != "cpu" if in_kernel_cast is None else in_kernel_cast:
        zero = torch.zeros((1, 1), dtype=acc, device=x.device).expand(x.shape)
        return torch.addcmul(zero, x, y).sum(1)
    if x.dtype != acc:
        return x.to(acc).mul_(y).sum(1)
    return y.to(acc).mul_(x).sum(1)


def joint_dots(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], segs: Sequence[SegmentPlan],
               device: torch.device | None = None, *, with_norms: bool = False) -> torch.Tensor:
    """(pieces of all plans,) float64: ``sum a·b`` of each piece (``a[i]`` and ``b[i]`` on one device, cut by
    ``segs[i]``). Rows chunk by chunk (:func:`_dot_rows`; chunks of ``max(DOT_CHUNK elements, all buffers' rows /
    DOT_PARTS)`` rows, each buffer's last one shorter: at most :data:`DOT_PARTS` plus one per buffer in all):
    accumulation in float32 (float64 if either is float64) of exact products for lower-precision data, no
    temporary over 1/DOT_PARTS of the rows' float32 size, a number of operations bounded whatever the size.

    On the CPU the rows go through :func:`.cpu_rows.dot_rows` instead (chunks bounded by the data: each operand read
    once, no temporary over 1/16 of both). ``with_norms``: (pieces, 3), the dot products then each operand's sums of
    squares (:func:`joint_pow_sums`; on the CPU from the same chunks: bf16/fp16 operands read once for all three)."""
    if with_norms and not (a and a[0].device.type == "cpu"):
        return torch.stack([joint_dots(a, b, segs, device), joint_pow_sums(a, segs, 2.0, device),
                            joint_pow_sums(b, segs, 2.0, device)], dim=1)
    j = _prepare(a, segs, device)
    _prepare(b, segs, device)
    rows_a, rows_b = _row_views(a, segs), _row_views(b, segs)
    if fused_rows.applies(rows_a + rows_b):  # each operand read once (settings.set_fused_reductions)
        dots = _fused_dots(rows_a, rows_b, _bit_parts(a, segs, j), _bit_parts(b, segs, j), j)
        return dots if not with_norms else torch.stack(
            [dots, joint_pow_sums(a, segs, 2.0, device), joint_pow_sums(b, segs, 2.0, device)], dim=1)
    if a[0].device.type == "cpu":  # chunks bounded by the data, through one scratch
        found = cpu_rows.dot_rows(rows_a, rows_b, with_norms) if rows_a else [[], [], []]
        bits_a, bits_b = (torch.cat(_bit_parts(x, segs, j)).to(torch.float64) for x in (a, b))
        columns = [torch.cat([*found[0], bits_a * bits_b]).to(torch.float64)]
        if with_norms:
            columns += [torch.cat([*found[1], bits_a]).to(torch.float64).square_(),
                        torch.cat([*found[2], bits_b]).to(torch.float64).square_()]
        joined = [_joined(c, j, "sum") for c in columns]
        return joined[0] if not with_norms else torch.stack(joined, dim=1)
    step = max(1, DOT_CHUNK // segs[0].block, j.rows // DOT_PARTS)
    sums = [_dot_rows(x, y) for ra, rb in zip(rows_a, rows_b) for x, y in zip(ra.split(step), rb.split(step))]
    bits = torch.cat(_bit_parts(a, segs, j)).to(torch.float64)
    bits.mul_(torch.cat(_bit_parts(b, segs, j)).to(torch.float64))
    values = torch.cat([_cat(sums).to(torch.float64), bits]) if sums else bits
    return _joined(values, j, "sum")


def _fused_dots(rows_a: Sequence[torch.Tensor], rows_b: Sequence[torch.Tensor], bits_a: Sequence[torch.Tensor],
                bits_b: Sequence[torch.Tensor], j: JointPlan) -> torch.Tensor:
    """:func:`joint_dots` through the fused row pass (:func:`~.fused_rows.row_dots`: each operand's rows read once)
    and the bits multiplied in float64: (pieces,) float64 on the rows' device."""
    bits = _cat(bits_a).to(torch.float64).mul_(_cat(bits_b).to(torch.float64))
    sums = _cat([fused_rows.row_dots(x, y) for x, y in zip(rows_a, rows_b)]).to(torch.float64)
    return _joined(torch.cat([sums, bits]), j, "sum")


def piece_stats(buf: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None, *,
                counts: bool = False) -> torch.Tensor:
    """(pieces, 3 or 6) float64: :func:`joint_stats` of one buffer."""
    return joint_stats((buf,), (seg,), device, counts=counts)


def piece_dots(a: torch.Tensor, b: torch.Tensor, seg: SegmentPlan, device: torch.device | None = None
               ) -> torch.Tensor:
    """(pieces,) float64 on ``a.device``: :func:`joint_dots` of one pair of buffers."""
    return joint_dots((a,), (b,), (seg,), device)
