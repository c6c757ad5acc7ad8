"""The CPU recipe of the row passes of :mod:`zero_dtensor.layout.segments`: offloaded partitions
(``offload_optimizer: cpu``, where the reductions run on the host beside a GPU) and CPU-only runs.

On an accelerator a row-wise reduction reads the rows once and makes no temporary: CUDA casts bf16/fp16 to float32
in registers and ``vector_norm(ord=inf)`` is one vectorized read. On the CPU neither holds:

- a reduction of bf16/fp16 rows accumulating in float32 (``vector_norm(..., dtype=float32)``, ``sum(..., dtype=
  float32)``) first copies the whole input to float32 inside the kernel (``make_reduction``: 2x the data's bytes,
  invisible to a dispatch mode, seen by ``torch.profiler``'s memory events);
- ``vector_norm(ord=inf)`` takes a scalar, unvectorized kernel: about 25x slower than ``amax`` (12 ms against 0.46 ms
  for 2.6M float32 elements on one core);
- a dot product of rows multiplies into a product the size of the data before summing it (``linalg.vecdot``: ``mul``
  then ``sum``; bf16: a float32 copy first).

So here each buffer's rows are cut into chunks (:func:`chunk_counts`: a bounded number, whatever the number of
parameters; each at most :data:`MAX_ELEMENTS` elements so that its temporaries stay in cache) and every quantity is
computed chunk by chunk through one scratch tensor per dtype, allocated once per call at the largest chunk's size:
bf16/fp16 rows are copied to float32 once per chunk (one read of the data for every quantity of ``stats``), ``max
|x|`` is ``abs`` into the scratch then ``amax``, a dot product multiplies into the scratch then sums. Where a chunk
is cut, every quantity asked for is taken from it in turn while it is in the core's cache (``stats`` of float32
rows: the norm, the sum and the ``abs`` read each chunk from memory once, not the whole data three times), each
written into its slot of one result per kind (``out=``: the Python work per chunk is its kernels). The values are
bitwise those of the unchunked calls (the same per-row kernels on the same float32 values). Temporaries: the
scratch, at most 1/16 of the data's bytes (float32 rows: 1/32 of them in the usual one-buffer case). float32 and
float64 rows take ``vector_norm`` / ``sum`` whole (no temporary there). The per-piece segment reductions above the
rows go through numpy's ``reduceat`` here (:func:`segment_reduce`: about 3x faster than torch's CPU kernel; what it
derives from a plan's fixed offsets, :class:`HostSegments`, is derived once and kept with the plan). Nothing
here communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_ELEMENTS", "MIN_ROWS", "PARTS", "HostSegments", "chunk_counts", "dot_rows", "host_segments",
           "row_values", "segment_reduce"]

#: a buffer's rows are cut into about ``PARTS`` chunks (twice as many for bf16/fp16, whose float32 copy is twice
#: their bytes): at most 1/16 of the data's bytes per temporary (see :func:`chunk_counts`)
PARTS = 32
#: ... of at least this many rows each (a buffer shorter than that is one chunk: a few KB)
MIN_ROWS = 32
#: ... and of at most this many elements (1 MiB of float32: the temporaries stay in the core's cache)
MAX_ELEMENTS = 1 << 18

_LOW = (torch.bfloat16, torch.float16)


def _widen(dtype: torch.dtype) -> int:
    """How many times its bytes a chunk's float32 scratch takes (2 for bf16/fp16, else 1)."""
    return 2 if dtype in _LOW else 1


def chunk_counts(rows: Sequence[torch.Tensor], parts: int = PARTS, widen: bool = True) -> list[int]:
    """How many chunks each buffer's ``(R_i, W)`` rows are cut into: ``floor(parts · widen · R_i / R)`` (``R`` all
    buffers' rows), at least one, at most one per :data:`MIN_ROWS` rows, at least one per :data:`MAX_ELEMENTS`
    elements. The floor keeps the total at most ``parts · widen`` for two buffers (a second flat group adds no
    chunk), and a chunk at most ``2 R / (parts · widen)`` rows: with ``parts`` 32, a scratch of at most 1/16 of the
    data's bytes (1/32 for one buffer). Python ints only."""
    total = sum(r.shape[0] for r in rows)
    counts = []
    for r in rows:
        n, width = r.shape
        k = min(parts * (_widen(r.dtype) if widen else 1) * n // total, n // MIN_ROWS) if total else 0
        counts.append(max(1, min(max(k, -(-n * width // MAX_ELEMENTS)), n)))
    return counts


def _scratch(rows: Sequence[torch.Tensor], counts: Sequence[int], dtype_of: Callable[[torch.dtype], torch.dtype]
             ) -> dict[torch.dtype, torch.Tensor]:
    """One uninitialized scratch per scratch dtype, of the largest chunk's ``(rows, W)`` (``W`` the widest). Made
    with ``new_empty`` of an empty view of the data: on the data's device, reading none of it."""
    need: dict[torch.dtype, tuple[int, int]] = {}
    for r, k in zip(rows, counts):
        dtype = dtype_of(r.dtype)
        chunk = -(-r.shape[0] // k)
        have = need.get(dtype, (0, 0))
        need[dtype] = (max(have[0], chunk), max(have[1], r.shape[1]))
    return {dtype: rows[0][:0].new_empty(shape, dtype=dtype) for dtype, shape in need.items()}


def _view(scratch: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The scratch's first ``like.numel()`` elements shaped like ``like``."""
    return scratch.view(-1)[: like.numel()].view(like.shape)


def row_values(rows: Sequence[torch.Tensor], kinds: Sequence[str | float]) -> list[list[torch.Tensor]]:
    """Per kind, the per-row values of every buffer's rows (one 1-D tensor per buffer, to concatenate), float32
    (float64 for float64 rows): ``"norm"`` the 2-norm, ``"sum"`` the sum, ``"max"`` ``max |x|`` (nan where a row
    holds one), a number ``p`` the sum of ``|x|^p``. Bitwise the values of ``vector_norm(rows, 2, dim=1,
    dtype=acc)``, ``rows.sum(1, dtype=acc)``, ``vector_norm(rows, inf, dim=1)`` and ``linalg._powsum(rows, p,
    dim=1, dtype=acc)``. Bool rows are summed whole (counts). A chunked buffer's values are written chunk by chunk
    into one result per kind (``out=``): no per-chunk result to convert or concatenate."""
    out: list[list[torch.Tensor]] = [[] for _ in kinds]
    has_max = "max" in kinds
    chunked = [r for r in rows if r.dtype in _LOW or (has_max and r.dtype != torch.bool)]
    counts = dict(zip(map(id, chunked), chunk_counts(chunked))) if chunked else {}
    scratch = _scratch(chunked, list(counts.values()), _scratch_dtype) if chunked else {}
    for r in rows:
        if id(r) not in counts:  # float32/float64 without max (or bool): whole, no temporary
            for values, kind in zip(out, kinds):
                if kind != "max":
                    values.append(_whole(r, kind))
            continue
        found = _chunked_values(r, counts[id(r)], scratch[_scratch_dtype(r.dtype)], kinds)
        for values, value in zip(out, found):
            values.append(value)
    return out


def _chunked_values(rows: torch.Tensor, parts: int, scratch: torch.Tensor, kinds: Sequence[str | float]
                    ) -> list[torch.Tensor]:
    """Per kind the per-row values of one buffer's rows cut into ``parts`` chunks, every quantity of a chunk taken
    while it is in the core's cache (bf16/fp16 chunks copied into ``scratch`` as float32 first; ``max`` last:
    ``abs`` into the scratch (in place on the float32 copy), then ``amax``). Each value is written into its slot of
    one result per kind."""
    low = rows.dtype in _LOW
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    like = rows[:0]  # new_empty of an empty view: on the rows' device, reading none of them
    results = [like.new_empty(rows.shape[0], dtype=acc if kind != "max" or low else rows.dtype) for kind in kinds]
    slots = [result.tensor_split(parts) for result in results]
    max_slots = slots[list(kinds).index("max")] if "max" in kinds else None
    chunks = rows.tensor_split(parts)
    buf = scratch.view(-1)[: chunks[0].numel()].view(chunks[0].shape)  # the first chunk is the largest
    for i, c in enumerate(chunks):
        into = buf[: c.shape[0]]
        x = into.copy_(c) if low else c
        for kind, slot in zip(kinds, slots):
            if kind != "max":
                _whole_into(x, kind, slot[i])
        if max_slots is not None:
            torch.amax(x.abs_() if low else torch.abs(c, out=into), 1, out=max_slots[i])
    return results


def _whole_into(rows: torch.Tensor, kind: str | float, out: torch.Tensor) -> None:
    """:func:`_whole` of ``rows`` written into ``out`` (``"norm"`` or ``"sum"`` directly, ``p`` copied)."""
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    if kind == "norm":
        torch.linalg.vector_norm(rows, 2, dim=1, dtype=acc, out=out)
    elif kind == "sum":
        torch.sum(rows, 1, dtype=acc, out=out)
    else:
        out.copy_(_whole(rows, kind))


def _scratch_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW else dtype


def _whole(rows: torch.Tensor, kind: str | float) -> torch.Tensor:
    """One kind's per-row values of ``rows`` in one reduction (float32, float64 for float64 rows)."""
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    if kind == "norm":
        return torch.linalg.vector_norm(rows, 2, dim=1, dtype=acc)
    if kind == "sum":
        return rows.sum(1, dtype=acc)
    if kind == "max":
        return rows.abs().amax(1)
    return torch.linalg._powsum(rows, float(kind), dim=1, dtype=acc)


def dot_rows(rows_a: Sequence[torch.Tensor], rows_b: Sequence[torch.Tensor], norms: bool = False
             ) -> list[list[torch.Tensor]]:
    """Per row ``sum a·b`` of every pair of buffers' rows (and with ``norms`` each operand's row 2-norms): ``[sums]``
    or ``[sums, norms of a, norms of b]``, lists of 1-D float32 tensors (float64 if either operand is) to
    concatenate. Chunk by chunk (:func:`chunk_counts` of the pair): float32/float64 pairs ``mul`` into the scratch
    then ``sum`` (bitwise ``linalg.vecdot``), their norms taken whole; a pair with a bf16/fp16 operand first copies
    each operand's chunk to float32 (one scratch each) and takes everything from the copies (bitwise the recipe of
    :func:`~zero_dtensor.layout.segments._dot_rows`: exact float32 products; the norms those of ``vector_norm(...,
    dtype=float32)``). Each operand read once (twice for float32 norms); no temporary over 1/16 of the data (both
    operands)."""
    pairs = list(zip(rows_a, rows_b))
    wide = [a if _widen(a.dtype) >= _widen(b.dtype) else b for a, b in pairs]
    counts = chunk_counts(wide, widen=False)  # the data is both operands: a float32 chunk of R/16 rows is 1/16 of it
    acc = [torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32 for a, b in pairs]
    low = [a.dtype in _LOW or b.dtype in _LOW for a, b in pairs]
    need: dict[torch.dtype, int] = {}
    for (a, _), k, dtype in zip(pairs, counts, acc):
        need[dtype] = max(need.get(dtype, 0), -(-a.shape[0] // k) * a.shape[1])
    like = pairs[0][0][:0]
    scratch = {dtype: like.new_empty(n, dtype=dtype) for dtype, n in need.items()}
    other = ({torch.float32: like.new_empty(need[torch.float32], dtype=torch.float32)}
             if norms and any(low) else {})
    out: list[list[torch.Tensor]] = [[], [], []] if norms else [[]]
    for (a, b), k, dtype, is_low in zip(pairs, counts, acc, low):
        buf = scratch[dtype]
        if norms and not is_low:
            out[1].append(_whole(a, "norm"))
            out[2].append(_whole(b, "norm"))
        for x, y in zip(a.tensor_split(k), b.tensor_split(k)):
            into = _view(buf, x)
            if norms and is_low:
                xa, xb = into.copy_(x), _view(other[torch.float32], y).copy_(y)
                out[1].append(_whole(xa, "norm"))
                out[2].append(_whole(xb, "norm"))
                prod = xa.mul_(xb)
            elif x.dtype == dtype and y.dtype == dtype:
                prod = torch.mul(x, y, out=into)
            elif x.dtype != dtype:
                prod = into.copy_(x).mul_(y)
            else:
                prod = into.copy_(y).mul_(x)
            out[0].append(prod.sum(1))
    return out


def max_abs(flat: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of a 1-D tensor (``nan`` if it holds one; 0 if empty), a 0-d tensor, float32 for bf16/fp16:
    chunk by chunk through one scratch (``abs`` then ``amax``; bf16/fp16 copied to float32 first), as
    :func:`row_values`' ``"max"``. One read, a scratch of at most 1/16 of the data."""
    n = flat.numel()
    dtype = _scratch_dtype(flat.dtype)
    if not n:
        return flat[:0].new_zeros((), dtype=dtype)
    k = max(1, min(PARTS * _widen(flat.dtype), n // (MIN_ROWS * 64)), -(-n // MAX_ELEMENTS))
    buf = flat[:0].new_empty(-(-n // k), dtype=dtype)
    low = flat.dtype in _LOW
    maxima = [(buf[: c.numel()].copy_(c).abs_() if low else torch.abs(c, out=buf[: c.numel()])).amax()
              for c in flat.tensor_split(k)]
    return maxima[0] if k == 1 else torch.stack(maxima).amax()


@dataclass(frozen=True, eq=False)
class HostSegments:
    """What :func:`segment_reduce` derives from a plan's fixed offsets, derived once (:func:`host_segments`) and
    kept with the plan: per call only the reduction and its result remain."""

    count: int  # segments
    end: int  # values the segments cover (the offsets' last)
    starts: Any  # numpy int64: the starts of the segments beginning before ``end`` (those after are empty)
    empty: torch.Tensor | None  # (count,) bool: the empty segments (their result 0), None when none is


def host_segments(offsets: torch.Tensor) -> HostSegments:
    """The :class:`HostSegments` of host ``offsets`` (ascending, ``count + 1`` of them). Reads them once."""
    count = offsets.numel() - 1
    end = int(offsets[-1]) if count >= 0 else 0
    if count <= 0 or end <= 0:
        return HostSegments(max(count, 0), 0, None, None)
    starts, stops = offsets[:-1], offsets[1:]
    empty = stops == starts
    inside = int((starts < end).sum())
    return HostSegments(count, end, starts[:inside].numpy().copy(), empty if bool(empty.any()) else None)


def segment_reduce(values: torch.Tensor, offsets: torch.Tensor | HostSegments, how: str) -> torch.Tensor:
    """``torch.segment_reduce(values, how, offsets=offsets, unsafe=True, initial=...)`` of host tensors (``how``:
    ``"sum"``, or ``"max"`` with an initial 0): per segment ``[offsets[i], offsets[i + 1])`` of ``values``' first
    dimension its sum (its maximum and 0; nan where it holds a nan), 0 for an empty segment. ``offsets`` may be
    given as their :func:`host_segments`, derived once for a fixed plan. Through numpy's ``reduceat`` where numpy
    is installed (a DeepSpeed dependency): about 3x faster than torch's CPU ``segment_reduce`` on 10,000 segments
    of 280,000 values (0.27 against 0.85 ms; pairwise sums within each segment, so possibly another last float64
    bit than torch's sequential ones). No copy of ``values`` (views of the same memory); the result is new."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - DeepSpeed requires numpy
        assert isinstance(offsets, torch.Tensor), "HostSegments are built where numpy is"
        return torch.segment_reduce(values, how, offsets=offsets, unsafe=True, initial=0.0 if how == "max" else None)
    plan = offsets if isinstance(offsets, HostSegments) else host_segments(offsets)
    if not plan.end:
        return values.new_zeros((plan.count, *values.shape[1:]))
    ufunc = numpy.add if how == "sum" else numpy.maximum
    with numpy.errstate(invalid="ignore", over="ignore"):  # inf - inf, nan: the values torch gives, no warning
        reduced = torch.from_numpy(ufunc.reduceat(values[: plan.end].numpy(), plan.starts, axis=0))
    if len(plan.starts) == plan.count:
        found = reduced
    else:  # the segments after the values' end are empty
        found = values.new_zeros((plan.count, *values.shape[1:]))
        found[: len(plan.starts)] = reduced
    if how == "max":
        found.clamp_min_(0.0)  # the initial 0 (nan stays nan)
    if plan.empty is not None:
        found.masked_fill_(plan.empty.view(-1, *([1] * (values.dim() - 1))), 0.0)
    return found
