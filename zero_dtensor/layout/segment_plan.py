"""How a 1-D buffer cut by a tiling is reduced with a fixed number of operations: the :class:`SegmentPlan` of its
rows and bits (the scheme is described in :mod:`zero_dtensor.layout.segments`, which runs it), the row width per
device, and the joint index of several plans reduced together (:class:`JointPlan`). Plans hold Python tuples only;
index tensors are built lazily per (plans, device) and cached. No communication, no data is read here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from .cpu_rows import HostSegments, host_segments
from .devices import to_device
from .tiling import Tiling

__all__ = ["BLOCK", "COUNT_ROWS", "COUNT_SHARE", "DEVICE_BLOCK", "JointPlan", "SegmentPlan", "acc_dtype", "block_for",
           "count_budget", "joint_plan", "offsets_of", "on_host", "param_index", "segment_plan", "sizes_plan"]


BLOCK = 64  #: row width on the CPU: a row lying inside one piece is reduced by the row-wise pass
#: row width on accelerators: PyTorch's CUDA reduction vectorizes its loads only along rows over 128 elements; rows
#: of 2048 reach 1.09x a flat ``vector_norm`` on an H200 (64: 6.8x; 512: 1.5x; 8192: 1.55x; 1.03B bf16 elements)
DEVICE_BLOCK = 2048


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype row reductions accumulate in: float64 if any input is float64, else float32 (bf16/fp16/fp32,
    bool)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


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

    _by_params: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def pieces(self) -> int:
        return len(self.bit_lengths)

    @property
    def bits(self) -> int:
        """How many elements the bits pass gathers."""
        return sum(self.bit_spans)


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


def offsets_of(lengths: Sequence[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: where each of ``lengths`` starts, and the total last."""
    return list(itertools.accumulate(lengths, initial=0))


@dataclass(frozen=True)
class JointPlan:
    """Index tensors of one or more plans reduced together, on one device: per piece or per row, never per element.
    Their values are laid out plan after plan: every plan's row values (its first ``row_end`` rows), then every
    plan's bits."""

    pieces: int  # all plans' pieces
    rows: int  # all plans' covered rows (sum of ``row_end``)
    row_offsets: torch.Tensor  # (2·pieces + 1,): ``segment_reduce`` offsets of every plan's ``unused_0, body_0, ...``
    all_offsets: torch.Tensor  # (3·pieces + 1,): the same runs, then each piece's bits, over rows then bits
    bit_offsets: torch.Tensor  # (pieces + 1,): each piece's bits among the bits alone
    bit_rows: tuple[torch.Tensor, ...]  # per plan: its full rows outside every body, ascending
    row_starts: torch.Tensor  # (plans with rows + 1,): where each plan's rows start among all rows (then the end)
    budgets: torch.Tensor  # (plans with rows,): how many of its rows :func:`joint_stats` counts at most
    pick_starts: torch.Tensor  # (sum of budgets,): the row start of the plan of each counted row
    #: in host memory (:func:`on_host`), what the host segment reduction derives from ``row_offsets``,
    #: ``all_offsets`` and ``bit_offsets`` (:func:`.cpu_rows.host_segments`), derived once with the plan; None
    #: elsewhere
    host_row_runs: HostSegments | None = None
    host_all_runs: HostSegments | None = None
    host_bit_runs: HostSegments | None = None

    @property
    def host(self) -> bool:
        """The plans reduce buffers in host memory (:func:`on_host`): the host recipe applies."""
        return self.host_all_runs is not None


def _bit_rows(seg: SegmentPlan) -> list[int]:
    """The full rows of ``seg`` outside every body (they and the last partial row hold every bit, in buffer
    order)."""
    full = seg.numel // seg.block
    body = bytearray(full)
    row = 0
    for i in range(0, len(seg.row_lengths), 2):
        row += seg.row_lengths[i]
        body[row:row + seg.row_lengths[i + 1]] = b"\x01" * seg.row_lengths[i + 1]
        row += seg.row_lengths[i + 1]
    return [r for r in range(full) if not body[r]]


@lru_cache(maxsize=64)
def joint_plan(segs: tuple[SegmentPlan, ...], device: torch.device) -> JointPlan:
    """The joint index tensors of ``segs`` on ``device`` (plans compare by identity; one Python pass and one copy to
    ``device`` on first use, then cached)."""
    row_lengths = [n for seg in segs for n in seg.row_lengths]
    bit_lengths = [n for seg in segs for n in seg.bit_lengths]
    rows = sum(seg.row_end for seg in segs)
    row_offsets, bit_offsets = offsets_of(row_lengths), offsets_of(bit_lengths)
    all_offsets = row_offsets + [rows + o for o in bit_offsets[1:]]
    bit_rows = [_bit_rows(seg) for seg in segs]
    ends = [seg.row_end for seg in segs if seg.row_end]
    row_starts, budgets = offsets_of(ends), [count_budget(n) for n in ends]
    pick_starts = [start for start, b in zip(row_starts, budgets) for _ in range(b)]
    lists = [row_offsets, all_offsets, bit_offsets, row_starts, budgets, pick_starts, *bit_rows]
    packed = torch.tensor([v for values in lists for v in values], dtype=torch.int64)
    moved = to_device(packed, device).split(list(map(len, lists)))
    runs = [host_segments(offsets) if on_host(device) else None for offsets in moved[:3]]
    return JointPlan(pieces=len(bit_lengths), rows=rows, row_offsets=moved[0], all_offsets=moved[1],
                     bit_offsets=moved[2], row_starts=moved[3], budgets=moved[4], pick_starts=moved[5],
                     bit_rows=tuple(moved[6:]), host_row_runs=runs[0], host_all_runs=runs[1], host_bit_runs=runs[2])


def on_host(device: torch.device) -> bool:
    """Whether buffers on ``device`` are in host memory (the CPU; offloaded partitions), where a read of a value
    back to Python costs no device synchronization. (A ``cpu:1`` device stands for an accelerator in the tests'
    simulation of one: not the host.)"""
    device = torch.device(device)
    return device.type == "cpu" and not device.index


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


# --- the two passes, over one plan or several at once ----------------------------------------------------------------


#: :func:`~zero_dtensor.layout.segments.joint_stats` with ``counts=True`` counts the non-finite elements of at most ``rows // COUNT_SHARE`` rows
#: of each buffer (those whose sum of squares is not finite: the only ones holding a nan or an inf), chosen on the
#: device
COUNT_SHARE = 256
COUNT_ROWS = 16  #: ... or at most this many rows, whichever is more (a few bad rows of a small buffer)


def count_budget(rows: int) -> int:
    """How many of a buffer's ``rows`` covered rows :func:`~zero_dtensor.layout.segments.joint_stats` counts at most."""
    return min(rows, max(COUNT_ROWS, rows // COUNT_SHARE))
