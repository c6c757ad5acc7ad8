"""Reductions over the local shards: norms, dot products, statistics, clipping, overflow. One collective each.

Local work (no communication): per flat group, :mod:`zero_dtensor.layout.segments` reduces every piece of this rank's
partition at once, parameters' fragments and padding gaps alike, with a fixed number of tensor operations whatever
the number of parameters: a row-wise reduction of its full rows (64 elements on the CPU, 2048 on accelerators:
:func:`~zero_dtensor.layout.segments.block_for`) accumulating in float32 inside the reduction (no upcast copy), one gather
of the rows holding the other elements and two float64 ``segment_reduce`` (so the partials are float64 sums of
float32 row sums: more precise than one long float32 reduction). One ``index_select`` then takes the selected
parameters' pieces, in selection order (padding never counts). A selection that covers under a quarter of a group's
local elements reduces the concatenation of its fragments instead, so picking one parameter of 10,000 does not pay
a pass over the partition.

Devices (:mod:`zero_dtensor.layout.devices`): partitions are reduced where they live (the storage device; the CPU under
offload) with index tensors cached there; the per-parameter (or per-group) vector moves once to the communication
device, where the collective runs and where every tensor result is returned (``stats`` and ``found_inf`` return
host values). No host sync apart from those documented per call.

Communication: the per-parameter partials are summed (or maxed) across ranks, **one all_reduce of a (k,) or (k, c)
vector per distinct process group** of the selected parameters (``k`` the number of selected parameters; DeepSpeed
models normally have one data-parallel group, so one collective in all; ``global_norm`` / ``clip_grad_norm_``
reduce one float64 per selected flat group instead, and a group selected whole whose parameters are one run of
the partition, as ZeRO-1/2 lay them out, is reduced locally by one row-wise ``vector_norm`` over that run); none
for replicated or single-rank groups, whose local values are already complete. ``stats()`` needs two (a sum and a
max). Results are in true (unscaled) units. On gloo below 4 ranks each travels as one all_gather and is reduced
locally (a small all_reduce there waits a scheduler tick far more often;
:func:`~zero_dtensor.comm.collectives.prefers_all_reduce`), and ``stats()`` then needs one. (``found_inf`` lives in
:mod:`zero_dtensor.ops.overflow`.)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from typing import Any

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_rows, sum_max_rows
from ..comm.agreement import distinct_groups
from ..layout.devices import to_comm, to_device, to_host, to_storage
from ..core.param_values import ParamStatsMap, ParamValues
from ..layout.segments import (SegmentPlan, block_for, param_index, piece_dots, piece_max_abs, piece_pow_sums,
                               piece_stats, piece_sums, segment_plan, sizes_plan)
from ..core.state import FlatState, Selection
from .transforms import PerParam, mul_

__all__ = [
    "GradStats",
    "clip_grad_norm_",
    "clip_per_param_",
    "dots",
    "global_norm",
    "norms",
    "stats",
]


@dataclass(frozen=True)
class GradStats:
    """Statistics of one parameter's true (unscaled) gradient, from ``ShardedGrads.stats``.

    ``norm`` is the 2-norm; ``max_abs`` the largest ``|g|`` (``nan`` if any element is nan); ``mean`` the mean over
    all elements; ``nan_count``/``inf_count`` count non-finite elements.
    """

    norm: float
    max_abs: float
    mean: float
    nan_count: int
    inf_count: int
    numel: int


def _grad_stats(names: list[str], norm: list[float], max_abs: list[float], mean: list[float], nan_count: list[int],
                inf_count: list[int], numel: list[int]) -> dict[str, GradStats]:
    """``{name: GradStats(...)}`` from columns, without the frozen ``__init__``'s six ``object.__setattr__`` calls
    per instance (``stats()`` builds one per parameter; this is about 2.5 times faster): each instance gets the same
    ``__dict__`` the constructor would give it, so users see ordinary frozen ``GradStats``."""
    objs = list(map(object.__new__, repeat(GradStats, len(names))))
    fields_ = [{"norm": a, "max_abs": b, "mean": c, "nan_count": d, "inf_count": e, "numel": f}
               for a, b, c, d, e, f in zip(norm, max_abs, mean, nan_count, inf_count, numel)]
    deque(map(object.__setattr__, objs, repeat("__dict__"), fields_), maxlen=0)
    return dict(zip(names, objs))


def _result_device(state: FlatState) -> torch.device:
    """Where every reduction's result lives: the communication device (the engine's; CUDA under NCCL, also when
    the partitions are offloaded to the CPU)."""
    return state.storage.devices.comm


# --- local partials: per group, every piece at once ----------------------------------------------------------------
SPARSE = 4  #: a selection covering under 1/SPARSE of a group's local elements reduces only its fragments


@dataclass(frozen=True)
class _Part:
    """One flat group's share of a selection: the buffer to reduce (one per state), its plan, and the pieces that
    are the selected parameters in selection order (``None``: piece ``j`` is the group's ``j``-th selected one)."""

    seg: SegmentPlan
    bufs: tuple[torch.Tensor, ...]
    take: torch.Tensor | None
    device: torch.device  # the storage device (index tensors are cached per device)


def _parts(states: Sequence[FlatState], sel: Selection) -> list[_Part]:
    """Per selected group (ascending index): :func:`_part`."""
    return [_part(states, sel, g) for g in sorted(sel.by_group)]


def _part(states: Sequence[FlatState], sel: Selection, g: int) -> _Part:
    """Group ``g``'s share of the selection: the whole partition of each state, or the concatenation of the
    selected fragments when they cover under ``1/SPARSE`` of it (states share one layout geometry)."""
    chosen, plan = sel.by_group[g], states[0].plan.groups[g]
    devices = states[0].storage.devices
    block = block_for(devices.storage)
    seg = segment_plan(plan.local, block)
    if len(chosen) == len(plan.params) or SPARSE * sum(map(plan.frag_len.__getitem__, chosen)) >= seg.numel:
        bufs = tuple(to_storage(s.storage.partitions[g], devices) for s in states)
        return _Part(seg, bufs, param_index(seg, chosen, devices.storage), devices.storage)
    bufs = tuple(to_storage(torch.cat(s.fragments_of(g, chosen)), devices) for s in states)
    return _Part(sizes_plan([plan.frag_len[k] for k in chosen], block), bufs, None, devices.storage)


def _per_param(state: FlatState, sel: Selection, parts: list[_Part], values: Callable[[_Part], torch.Tensor],
               dtype: torch.dtype, columns: tuple[int, ...] = ()) -> torch.Tensor:
    """``values(part)`` (per piece, float64) for the selected parameters: (k, *columns) ``dtype`` on the result
    device, rows in ``sel.params`` order."""
    devices = state.storage.devices
    out = []
    for part in parts:
        v = values(part)
        out.append((v if part.take is None else v.index_select(0, part.take)).to(dtype))
    if not out:
        return torch.zeros((0, *columns), dtype=dtype, device=devices.comm)
    if len(out) == 1:
        return to_comm(out[0], devices)
    # parts are in ascending group order; a stable sort of the selection by group says where each row goes
    order = _order(tuple(p.group for p in sel.params), devices.comm)
    stacked = to_comm(torch.cat(out), devices)
    return torch.empty_like(stacked).index_copy_(0, order, stacked)


@lru_cache(maxsize=32)
def _order(groups: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where each selected parameter's row goes among rows stacked group by group: a (k,) int64 index on
    ``device``, cached per (groups of the selection, device). Built once: a host-to-device copy on every call
    would be a host sync on CUDA (a blocking copy from pageable memory)."""
    return to_device(torch.argsort(torch.tensor(groups), stable=True), device)


def _reduce(state: FlatState, sel: Selection, local: torch.Tensor, op: Any,
            names: Sequence[str] | None = None) -> torch.Tensor:
    """All-reduce the rows of ``local`` (one per selected parameter) over each distinct process group of the
    multi-rank sharded groups (one collective per process group). Returns the reduced rows on the engine's
    device."""
    return _reduce_rows(state, sel, local, lambda rows, which, pg: all_reduce_rows(rows, which, pg, op))


def _reduce_rows(state: FlatState, sel: Selection, local: torch.Tensor,
                 reduce: Callable[[torch.Tensor, list[int], Any], None]) -> torch.Tensor:
    """``reduce(local, rows, process group)`` over each distinct process group of the multi-rank sharded groups,
    ``rows`` those of its selected parameters. Returns ``local``, moved to the communication device."""
    local = to_comm(local, state.storage.devices)  # where the process group communicates (and results live)
    for pg, members in _communicating_by_process_group(state):
        if len(members) == len(state.layout.groups):  # every row takes part (the usual case): no row lookup
            rows = list(range(len(sel.params)))
        else:
            rows = [i for i, p in enumerate(sel.params) if p.group in members]
        if rows:
            reduce(local, rows, pg)
    return local


def _communicating_by_process_group(state: FlatState) -> list[tuple[Any, set[int]]]:
    """``(process group, indices of its flat groups)`` for each distinct process group of the multi-rank sharded
    groups (the ones a reduction communicates on). No communication."""
    by_pg: dict[int, tuple[Any, set[int]]] = {}
    for i, g in enumerate(state.layout.groups):
        if g.placement.is_sharded and g.world_size > 1:
            pg = state.storage.process_groups[i]
            by_pg.setdefault(id(pg), (pg, set()))[1].add(i)
    return list(by_pg.values())


def _partials(state: FlatState, sel: Selection, norm_type: float) -> torch.Tensor:
    """Per selected parameter: local ``sum |x|^p`` (or ``max |x|`` for inf), float32, stored units."""
    is_inf = math.isinf(norm_type)

    def values(part: _Part) -> torch.Tensor:
        (buf,) = part.bufs
        return (piece_max_abs(buf, part.seg, part.device) if is_inf
                else piece_pow_sums(buf, part.seg, norm_type, part.device))

    return _per_param(state, sel, _parts((state,), sel), values, torch.float32)


def communicating_groups(state: FlatState) -> list[Any]:
    """The process groups a reduction communicates on: those of the multi-rank sharded groups, each once. No
    communication."""
    return distinct_groups(pg for g, pg in zip(state.layout.groups, state.storage.process_groups)
                           if g.placement.is_sharded)


def check_norm_type(norm_type: float) -> None:
    """``ValueError`` unless ``norm_type`` is a positive number or ``inf``."""
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")


def _reduced_partials(state: FlatState, sel: Selection, norm_type: float,
                      names: Sequence[str] | None = None) -> tuple[torch.Tensor, bool]:
    check_norm_type(norm_type)
    is_inf = math.isinf(norm_type)
    local = _partials(state, sel, norm_type)
    return _reduce(state, sel, local, dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, names), is_inf


def norm_values(state: FlatState, sel: Selection, norm_type: float,
                names: Sequence[str] | None = None) -> torch.Tensor:
    """Per-parameter true norms, (k,) float32: one collective per process group."""
    reduced, is_inf = _reduced_partials(state, sel, norm_type, names)
    values = reduced if is_inf else (reduced.sqrt() if norm_type == 2.0 else reduced.pow(1.0 / norm_type))
    return values / state.loss_scale


def norms(state: FlatState, sel: Selection, norm_type: float) -> ParamValues:
    """Per-parameter true norms, ``{name: 0-d float32}`` backed by one ``(k,)`` vector: one collective per process
    group."""
    names = sel.names
    return ParamValues(names, norm_values(state, sel, norm_type, names))


def global_norm(state: FlatState, sel: Selection, norm_type: float) -> torch.Tensor:
    """The true norm of all selected gradients together, a 0-d float32: one collective per process group, of one
    float64 per selected group (:func:`_group_partials`)."""
    check_norm_type(norm_type)
    reduced = _group_partials(state, sel, norm_type)
    if not reduced.numel():
        return torch.zeros((), dtype=torch.float32, device=reduced.device)
    if math.isinf(norm_type):
        total = reduced.max()
    else:
        total = reduced.sum()
        total = total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)
    return total.to(torch.float32) / state.loss_scale


#: partition dtypes reduced as one run (:func:`_run_partial`) on the CPU (elsewhere every dtype: the row-wise
#: ``vector_norm`` accumulates bf16/fp16 in float32 inside the reduction there; on the CPU it would copy them first)
_RUN_DTYPES = (torch.float32, torch.float64)


def _run_of(state: FlatState, sel: Selection, g: int) -> torch.Tensor | None:
    """Group ``g``'s parameter elements in this rank's partition as one view, where it is selected whole, holds
    them as one run (:attr:`~zero_dtensor.layout.plan.GroupPlan.param_run`) and stores float32 or float64; else
    ``None``. Other dtypes take the run too where the partitions are not on the CPU. Decided on each rank for
    itself (ZeRO-3 pads only the last rank's pieces): no collective depends on
    it."""
    plan, part = state.plan.groups[g], state.storage.partitions[g]
    if len(sel.by_group[g]) != len(plan.params) or plan.param_run is None:
        return None
    if part.dtype not in _RUN_DTYPES and state.storage.devices.storage.type == "cpu":
        return None
    start, length = plan.param_run
    return part.narrow(0, start, length)


def _run_partial(run: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum |x|^p`` (``max |x|`` for inf) of ``run``, a 0-d float64: as :mod:`zero_dtensor.layout.segments` reduces, the
    row norms of its full rows of :func:`~zero_dtensor.layout.segments.block_for` its device's width, accumulated in
    float32 inside the reduction (float64 for float64), summed in float64, plus its last partial row's (one
    ``vector_norm`` over a long float32 run loses digits: 4e-4 relative at 2.6M elements). One read, no copy."""
    if math.isinf(norm_type):
        return (torch.linalg.vector_norm(run, norm_type) if run.numel()
                else torch.zeros((), dtype=run.dtype, device=run.device)).to(torch.float64)
    block = block_for(run.device)
    acc = torch.float64 if run.dtype == torch.float64 else torch.float32
    rows = run.numel() // block * block
    parts = [run.narrow(0, 0, rows).view(-1, block), run.narrow(0, rows, run.numel() - rows).view(1, -1)]
    norms = torch.cat([torch.linalg.vector_norm(part, norm_type, dim=1, dtype=acc) for part in parts]
                      ).to(torch.float64)
    return (norms.square() if norm_type == 2.0 else norms.pow(norm_type)).sum()


def _group_partials(state: FlatState, sel: Selection, norm_type: float) -> torch.Tensor:
    """Per selected group (ascending index) the local ``sum |x|^p`` (``max |x|``) of its selected parameters,
    summed (maxed) across the ranks of each distinct process group of the multi-rank sharded groups: one
    collective per process group, a (groups,) float64 on the engine's device. Locally one ``vector_norm`` over
    the group's run where it has one (:func:`_run_of`), else its per-parameter partials (:func:`_part`)."""
    devices = state.storage.devices
    groups = sorted(sel.by_group)
    if not groups:
        return torch.zeros(0, dtype=torch.float64, device=devices.comm)
    is_inf = math.isinf(norm_type)
    values = []
    for g in groups:
        run = _run_of(state, sel, g)
        if run is not None:
            values.append(_run_partial(run, norm_type))
            continue
        part = _part((state,), sel, g)
        (buf,) = part.bufs
        pieces = (piece_max_abs(buf, part.seg, part.device) if is_inf
                  else piece_pow_sums(buf, part.seg, norm_type, part.device))
        pieces = pieces if part.take is None else pieces.index_select(0, part.take)
        values.append(pieces.to(torch.float64).max() if is_inf and pieces.numel() else pieces.to(torch.float64).sum())
    local = to_comm(torch.stack(values), devices)
    for pg, members in _communicating_by_process_group(state):
        rows = [i for i, g in enumerate(groups) if g in members]
        if rows:
            all_reduce_rows(local, rows, pg, dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM)
    return local


def dots(state: FlatState, other: FlatState, sel: Selection, with_norms: bool) -> Any:
    """Per-parameter ``<g, other_g>`` (and 2-norms): one collective of a (k, 1 or 3) float32 vector per process
    group. Locally: :func:`~zero_dtensor.layout.segments.piece_dots` (and two ``piece_pow_sums``) per group."""

    def values(part: _Part) -> torch.Tensor:
        a, b = part.bufs
        columns = [piece_dots(a, b, part.seg, part.device)]
        if with_norms:
            columns += [piece_pow_sums(a, part.seg, 2.0, part.device), piece_pow_sums(b, part.seg, 2.0, part.device)]
        return torch.stack(columns, dim=1)

    width = 3 if with_norms else 1
    local = _per_param(state, sel, _parts((state, other), sel), values, torch.float32, (width,))
    names = sel.names
    reduced = _reduce(state, sel, local, dist.ReduceOp.SUM, names)
    s, so = state.loss_scale, other.loss_scale
    result = ParamValues(names, reduced[:, 0] / (s * so))
    if not with_norms:
        return result
    return result, ParamValues(names, reduced[:, 1].sqrt() / s), ParamValues(names, reduced[:, 2].sqrt() / so)


def _moments(part: _Part) -> torch.Tensor:
    """(pieces, 6) float64: sum of squares, sum, max |x|, nan count, inf count, missed
    (:func:`~zero_dtensor.layout.segments.piece_stats` with ``counts``: three reads, counts decided on the device)."""
    (buf,) = part.bufs
    return piece_stats(buf, part.seg, part.device, counts=True)


def _counts(part: _Part) -> torch.Tensor:
    """(pieces, 2) float64: nan and inf counts, exactly (two more passes and two masks of the buffer's size: only
    taken when :func:`_moments` could not count every non-finite row)."""
    (buf,) = part.bufs
    return torch.stack([piece_sums(torch.isnan(buf), part.seg, part.device),
                        piece_sums(torch.isinf(buf), part.seg, part.device)], dim=1)


#: columns of :func:`_stat_rows`: summed across ranks (the first four), maxed (the last two)
_SUMMED = 4


def _stat_columns(part: _Part) -> torch.Tensor:
    """(pieces, 5) float64 of one part: sum of squares, sum, nan count, inf count, max |x| (with a host check of
    its own when the counts may be incomplete; :func:`stats` decides that from its one result copy instead)."""
    m = _moments(part)
    counts = m[:, 3:5] if not bool(m[:, 5].any()) else _counts(part)
    return torch.cat([m[:, :2], counts, m[:, 2:3]], dim=1)


def _stat_rows(state: FlatState, sel: Selection, parts: list[_Part]) -> torch.Tensor:
    """(k, 6) float64 on the communication device: sum of squares, sum, nan count, inf count, max |x|, missed
    (1.0 where some part's counts may be incomplete) per selected parameter. No host sync."""
    m = _per_param(state, sel, parts, _moments, torch.float64, (6,))
    return torch.cat([m[:, :2], m[:, 3:5], m[:, 2:3], m[:, 5:]], dim=1)


def stats(state: FlatState, sel: Selection) -> ParamStatsMap[GradStats]:
    """Per parameter 2-norm, max |g|, mean, nan and inf counts: a (k, 6) float64 matrix (sums of squares, sums,
    counts summed across ranks; max |x| and an incompleteness flag maxed; :func:`~zero_dtensor.comm.collectives.sum_max_rows`):
    per process group one all_gather of it (gloo below 4 ranks), else two all_reduces. Locally per group one
    :func:`~zero_dtensor.layout.segments.piece_stats` (sums of squares, sums, maxima: three reads; nan/inf counts of
    the bits and of up to max(16, rows/256) rows whose sum of squares is not finite, chosen on the device). One
    host sync: the copy of the results (``GradStats`` hold Python numbers). Only when more of some rank's rows of
    a group than that are not finite (the flag, the same on every rank after the reduction) are the counts taken
    again exactly (two more passes, one more collective, a second copy). The partials are reduced on the storage
    device and move to the communication device once."""
    parts = _parts((state,), sel)
    local = _stat_rows(state, sel, parts)
    names = sel.names
    scale = state.loss_scale
    reduced = _reduce_rows(state, sel, local, lambda rows, which, pg: sum_max_rows(rows, which, pg, _SUMMED))
    host = to_host(reduced)
    if bool(host[:, 5].any()):  # rare (a host value: no sync): count every element, agreed by the flag
        counts = _reduce(state, sel, _per_param(state, sel, parts, _counts, torch.float64, (2,)), dist.ReduceOp.SUM)
        host[:, 2:4] = to_host(counts)
    sumsq, total, nans, infs, top, _ = host.unbind(1)
    numels, counts_ = sel.numels()
    norm = list(map(math.sqrt, sumsq.tolist()))  # correctly rounded (torch's vectorized sqrt may be 1 ulp off)
    if scale != 1.0:
        norm = [x / scale for x in norm]
    max_abs = torch.where(nans != 0, math.nan, top / scale).tolist()
    mean = torch.where(counts_ > 0, total / counts_ / scale, 0.0).tolist()
    nan_count, inf_count = nans.to(torch.int64).tolist(), infs.to(torch.int64).tolist()
    columns = (norm, max_abs, mean, nan_count, inf_count, numels)

    def one(i: int) -> GradStats:
        return GradStats(*(c[i] for c in columns))

    return ParamStatsMap(names, one, lambda: list(_grad_stats(names, *columns).values()))


def clip_grad_norm_(state: FlatState, sel: Selection, max_norm: float, norm_type: float,
                    error_if_nonfinite: bool) -> torch.Tensor:
    """Clip like ``torch.nn.utils.clip_grad_norm_``: one collective, then one multiply per group (or one
    ``_foreach_mul_`` over the selected fragments)."""
    total = global_norm(state, sel, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients is non-finite, so it cannot be clipped. "
            "To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    mul_(state, sel, coef)
    return total


def clip_per_param_(state: FlatState, sel: Selection, max_norm: float, norm_type: float) -> dict[str, torch.Tensor]:
    values = norm_values(state, sel, norm_type)
    coefs = to_storage(torch.clamp(max_norm / (values + 1e-6), max=1.0), state.storage.devices)  # one move
    mul_(state, sel, PerParam(list(coefs.unbind(0))))
    return ParamValues(sel.names, values)
