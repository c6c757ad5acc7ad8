"""The partials every reduction shares: which pieces of which flat groups a selection reduces (the whole partition,
or its fragments when they are few), one cached index of where the selected parameters' values lie among them, the
per-parameter vector they give, and its reduction across the ranks of each process group.

No communication except :func:`reduce_across` / :func:`reduce_rows_across`: one collective per distinct process
group of the multi-rank sharded groups. Index tensors are built once per selection and device (one host-to-device
copy, cached), so a call copies nothing to the device on the host's behalf; the per-parameter vector moves once to
the communication device, where the collective runs and results live.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..comm.collectives import all_reduce_rows
from ..comm.process_groups import collective_path
from ..core.state import FlatState, Selection
from ..layout.devices import to_comm, to_device, to_storage
from ..layout.segment_plan import SegmentPlan, block_for, offsets_of, segment_plan, sizes_plan

__all__ = ["SPARSE", "Parts", "PieceIndex", "communicating_by_process_group", "parts_of", "per_param",
           "reduce_across", "reduce_rows_across"]


# --- local partials: per group, every piece at once ----------------------------------------------------------------
SPARSE = 4  #: a selection covering under 1/SPARSE of a group's local elements reduces only its fragments


@dataclass(frozen=True)
class PieceIndex:
    """Where a selection's values lie among all its groups' values, on the storage device (built once per
    selection and device, in one host-to-device copy: a copy on every call would be a host sync on CUDA)."""

    take: torch.Tensor | None  # (k,): each selected parameter's piece among all groups' pieces, selection order
    group_take: torch.Tensor | None  # (k,): the same, group by group (``None``: every piece, in order)
    group_offsets: torch.Tensor  # (groups + 1,): ``segment_reduce`` offsets of ``group_take``'s rows per group
    run_offsets: torch.Tensor | None  # (groups + 1,): of the run values (:mod:`.reductions`' runs), every group a run


@dataclass(frozen=True)
class Parts:
    """A selection's flat groups, reduced together: per group (ascending index) its plan and the buffer to reduce
    (one per state: the whole partition, or the concatenation of the selected fragments), and where the selected
    parameters' pieces lie among all groups' pieces (:class:`PieceIndex`)."""

    segs: tuple[SegmentPlan, ...]
    bufs: tuple[tuple[torch.Tensor, ...], ...]  # per state, one buffer per group
    index: PieceIndex
    device: torch.device  # the storage device (index tensors are cached per device)


def parts_of(states: Sequence[FlatState], sel: Selection) -> Parts | None:
    """The selected groups' buffers and plans (:func:`_part`) and their :class:`PieceIndex`. ``None`` when nothing is
    selected."""
    groups = sorted(sel.by_group)
    if not groups:
        return None
    devices = states[0].storage.devices
    parts = [_part(states, sel, g) for g in groups]
    segs = tuple(seg for seg, _, _ in parts)
    bufs = tuple(tuple(part[1][i] for part in parts) for i in range(len(states)))
    plans = states[0].plan.groups
    key = tuple((seg, tuple(sel.by_group[g]), whole,
                 plans[g].param_run[1] if whole and plans[g].param_run is not None else None)
                for (seg, _, whole), g in zip(parts, groups))
    order = None if len(groups) == 1 else tuple(p.group for p in sel.params)
    return Parts(segs, bufs, _index(key, order, devices.storage), devices.storage)


def _part(states: Sequence[FlatState], sel: Selection, g: int) -> tuple[SegmentPlan, tuple[torch.Tensor, ...], bool]:
    """Group ``g``'s share of the selection: its plan, the whole partition of each state (``True``), or the
    concatenation of the selected fragments when they cover under ``1/SPARSE`` of it (``False``; states share one
    layout geometry)."""
    chosen, plan = sel.by_group[g], states[0].plan.groups[g]
    devices = states[0].storage.devices
    block = block_for(devices.storage)
    seg = segment_plan(plan.local, block)
    if len(chosen) == len(plan.params) or SPARSE * sum(map(plan.frag_len.__getitem__, chosen)) >= seg.numel:
        return seg, tuple(to_storage(s.storage.partitions[g], devices) for s in states), True
    bufs = tuple(to_storage(torch.cat(s.fragments_of(g, chosen)), devices) for s in states)
    return sizes_plan([plan.frag_len[k] for k in chosen], block), bufs, False


@lru_cache(maxsize=32)
def _index(key: tuple[tuple[SegmentPlan, tuple[int, ...], bool, int | None], ...], order: tuple[int, ...] | None,
           device: torch.device) -> PieceIndex:
    """The :class:`PieceIndex` of a selection (``key``: per group its plan, its selected parameters, whether the plan
    is the whole partition's and the length of its parameters' run when it is selected whole and has one;
    ``order``: the group of each selected parameter, in selection order, ``None`` for one group) on ``device``."""
    stacked, base = [], 0
    for seg, chosen, whole, _ in key:
        stacked += [base + (seg.param_piece[k] if whole else i) for i, k in enumerate(chosen)]
        base += seg.pieces
    ordered = stacked
    if order is not None:  # rows stacked group by group go back to selection order (a stable sort by group)
        ordered = [0] * len(stacked)
        for i, at in enumerate(sorted(range(len(order)), key=order.__getitem__)):
            ordered[at] = stacked[i]
    block = block_for(device)
    runs = [n for *_, n in key]
    lists = [ordered, stacked, offsets_of([len(chosen) for _, chosen, _, _ in key]),
             offsets_of([n // block + 1 for n in runs]) if None not in runs else []]
    every = list(range(base))
    packed = torch.tensor([v for values in lists for v in values], dtype=torch.int64)
    take, group_take, group_offsets, run_offsets = to_device(packed, device).split(list(map(len, lists)))
    return PieceIndex(take=None if ordered == every else take, group_take=None if stacked == every else group_take,
                  group_offsets=group_offsets, run_offsets=run_offsets if lists[3] else None)


def per_param(state: FlatState, parts: Parts | None, values: Callable[[Parts], torch.Tensor],
               dtype: torch.dtype, columns: tuple[int, ...] = ()) -> torch.Tensor:
    """``values(parts)`` (per piece of all groups, float64) for the selected parameters: (k, *columns) ``dtype`` on
    the result device, rows in ``sel.params`` order: one ``index_select``, one cast and one move, whatever the
    number of groups."""
    devices = state.storage.devices
    if parts is None:
        return torch.zeros((0, *columns), dtype=dtype, device=devices.comm)
    v, take = values(parts), parts.index.take
    return to_comm((v if take is None else v.index_select(0, take)).to(dtype), devices)


def reduce_across(state: FlatState, sel: Selection, local: torch.Tensor, op: Any,
            names: Sequence[str] | None = None) -> torch.Tensor:
    """All-reduce the rows of ``local`` (one per selected parameter) over each distinct process group of the
    multi-rank sharded groups (one collective per process group). Returns the reduced rows on the engine's
    device."""
    return reduce_rows_across(state, sel, local, lambda rows, which, pg: all_reduce_rows(rows, which, pg, op))


def reduce_rows_across(state: FlatState, sel: Selection, local: torch.Tensor,
                 reduce: Callable[[torch.Tensor, Sequence[int], Any], None]) -> torch.Tensor:
    """``reduce(local, rows, process group)`` over each distinct process group of the multi-rank sharded groups,
    ``rows`` those of its selected parameters. Returns ``local``, moved to the communication device."""
    local = to_comm(local, state.storage.devices)  # where the process group communicates (and results live)
    for pg, members in communicating_by_process_group(state):
        if len(members) == len(state.layout.groups):  # every row takes part (the usual case): no row lookup
            rows = range(len(sel.params))  # (only its length is read then: no list of 10,000 ints per call)
        else:
            rows = [i for i, p in enumerate(sel.params) if p.group in members]
        if rows:
            reduce(local, rows, pg)
    return local


def communicating_by_process_group(state: FlatState) -> list[tuple[Any, set[int]]]:
    """``(process group, indices of its flat groups)`` for each distinct process group of the multi-rank sharded
    groups (the ones a reduction communicates on). No communication."""
    by_pg: dict[int, tuple[Any, set[int]]] = {}
    for i, g in enumerate(state.layout.groups):
        if g.placement.is_sharded and collective_path(g.world_size):
            pg = state.storage.process_groups[i]
            by_pg.setdefault(id(pg), (pg, set()))[1].add(i)
    return list(by_pg.values())
