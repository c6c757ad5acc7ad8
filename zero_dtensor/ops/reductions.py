"""Reductions over the local shards: norms, dot products, statistics, clipping, overflow. One collective each.

Local work (no communication): every selected flat group at once, :mod:`zero_dtensor.layout.segments` reduces every
piece of this rank's partitions, parameters' fragments and padding gaps alike, with a fixed number of tensor
operations whatever the number of parameters: per group a row-wise reduction of its full rows per quantity (64
elements on the CPU, 2048 on accelerators: :func:`~zero_dtensor.layout.segments.block_for`) accumulating in float32
inside the reduction (no upcast copy) and one gather of the rows holding the other elements; then, once for all
groups, one cast to float64 and one ``segment_reduce`` per quantity (so the partials are float64 sums of float32 row
sums: more precise than one long float32 reduction). One ``index_select`` then takes the selected parameters'
pieces among all groups' pieces, in selection order (padding never counts). So a second flat group (ZeRO-3's
sub-groups) adds only the kernels that read it. A selection that covers under a quarter of a group's local elements
reduces the concatenation of its fragments instead, so picking one parameter of 10,000 does not pay a pass over the
partition.

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
:func:`~zero_dtensor.comm.collectives.prefers_all_reduce`); ``stats()`` gathers once on gloo at any size
(:func:`~zero_dtensor.comm.collectives.gathers_sum_max_rows`). (``found_inf`` lives in
:mod:`zero_dtensor.ops.overflow`.)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
import torch.distributed as dist

from ..comm.collectives import all_reduce_rows, sum_max_rows
from ..comm.agreement import distinct_groups
from ..layout import cpu_rows
from ..layout.devices import to_comm, to_host, to_storage
from ..core.param_values import ParamStatsMap, ParamValues
from ..layout.segments import block_for, joint_dots, joint_max_abs, joint_pow_sums, joint_stats, joint_sums
from ..core.state import FlatState, Selection
from .partials import (Parts, communicating_by_process_group, parts_of, per_param, reduce_across,
                       reduce_rows_across)
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


def _sqrt_list(values: torch.Tensor) -> list[float]:
    """The correctly rounded square roots of a float64 CPU tensor's values, as Python floats: numpy's (IEEE
    ``sqrt``, vectorized: 0.19 against 0.52 ms by ``math.sqrt`` for 10,000 values), else ``math.sqrt`` (torch's
    vectorized ``sqrt`` is not correctly rounded: 1.3% of 1M float64 values of every magnitude differed in the last
    bit)."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a DeepSpeed dependency
        return list(map(math.sqrt, values.tolist()))
    return numpy.sqrt(values.numpy()).tolist()


def _count_list(counts: torch.Tensor, any_counted: bool) -> list[int]:
    """A float64 CPU count column as Python ints; all zeros (``any_counted`` false) without converting it."""
    return counts.to(torch.int64).tolist() if any_counted else [0] * counts.numel()


def _partials(state: FlatState, sel: Selection, norm_type: float) -> torch.Tensor:
    """Per selected parameter: local ``sum |x|^p`` (or ``max |x|`` for inf), float32, stored units: every
    selected group at once (:func:`_piece_norms`)."""
    parts = parts_of((state,), sel)
    return per_param(state, parts, lambda p: _piece_norms(p, norm_type), torch.float32)


def _piece_norms(parts: Parts, norm_type: float) -> torch.Tensor:
    """Per piece of every group: ``sum |x|^p`` (``max |x|`` for inf), float64."""
    (bufs,) = parts.bufs
    if math.isinf(norm_type):
        return joint_max_abs(bufs, parts.segs, parts.device)
    return joint_pow_sums(bufs, parts.segs, norm_type, parts.device)


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
    return reduce_across(state, sel, local, dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, names), is_inf


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


#: partition dtypes reduced as one run (:func:`_run_norms`) on the CPU (elsewhere every dtype: the row-wise
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


def _run_norms(runs: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per run, one after the other: the row norms of its full rows of
    :func:`~zero_dtensor.layout.segments.block_for` its device's width, accumulated in float32 inside the reduction
    (float64 for float64), then its last partial row's (one ``vector_norm`` over a long float32 run loses digits:
    4e-4 relative at 2.6M elements), raised to ``p`` in float64: ``length // block + 1`` values per run, summed per
    run by the caller. Two reads' worth of kernels per run (the rows, the last row), one cast and one power for
    all. No copy."""
    block = block_for(runs[0].device)
    parts = []
    for run in runs:
        acc = torch.float64 if run.dtype == torch.float64 else torch.float32
        rows = run.numel() // block * block
        parts += [torch.linalg.vector_norm(run.narrow(0, 0, rows).view(-1, block), norm_type, dim=1, dtype=acc),
                  torch.linalg.vector_norm(run.narrow(0, rows, run.numel() - rows).view(1, -1), norm_type, dim=1,
                                           dtype=acc)]
    norms = torch.cat(parts).to(torch.float64)
    return norms.square() if norm_type == 2.0 else norms.pow(norm_type)


def _run_max(runs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per run ``max |x|``, a (runs,) float64 (0 for an empty run). On the CPU chunk by chunk
    (:func:`~zero_dtensor.layout.cpu_rows.max_abs`: its ``vector_norm(ord=inf)`` is unvectorized there)."""
    if runs and runs[0].device.type == "cpu":
        return torch.stack([cpu_rows.max_abs(run) for run in runs]).to(torch.float64)
    return torch.stack([torch.linalg.vector_norm(run, math.inf) if run.numel()
                        else torch.zeros((), dtype=run.dtype, device=run.device) for run in runs]).to(torch.float64)


def _per_group(values: torch.Tensor, offsets: torch.Tensor | None, is_inf: bool) -> torch.Tensor:
    """(groups,) float64: ``values`` laid out group by group (``offsets``; ``None``: one group) summed (maxed) per
    group. One group: one ``sum`` (``max``) as before; several: one ``segment_reduce`` for all (the same values per
    group, summed in sequence: possibly another last float64 bit than one ``sum`` each)."""
    if offsets is None or offsets.numel() == 2:
        one = values.max() if is_inf and values.numel() else values.sum()
        return one.unsqueeze(0)
    return torch.segment_reduce(values, "max" if is_inf else "sum", offsets=offsets, unsafe=True,
                                initial=0.0 if is_inf else None)


def _group_partials(state: FlatState, sel: Selection, norm_type: float) -> torch.Tensor:
    """Per selected group (ascending index) the local ``sum |x|^p`` (``max |x|``) of its selected parameters,
    summed (maxed) across the ranks of each distinct process group of the multi-rank sharded groups: one
    collective per process group, a (groups,) float64 on the engine's device. Locally, where every selected group
    is a run (:func:`_run_of`), row-wise ``vector_norm`` calls over each run (:func:`_run_norms`); else every group's
    per-parameter partials (:func:`_piece_norms`); then one reduction per group for all groups
    (:func:`_per_group`)."""
    devices = state.storage.devices
    groups = sorted(sel.by_group)
    if not groups:
        return torch.zeros(0, dtype=torch.float64, device=devices.comm)
    is_inf = math.isinf(norm_type)
    runs = [_run_of(state, sel, g) for g in groups]
    if all(run is not None for run in runs):
        if is_inf:
            local = _run_max(runs)
        else:  # one run is one sum: no index needed (a selection's index costs a lookup keyed by every parameter)
            offsets = parts_of((state,), sel).index.run_offsets if len(runs) > 1 else None
            local = _per_group(_run_norms(runs, norm_type), offsets, False)
    elif all(run is None for run in runs):
        local = _piece_group_partials(parts_of((state,), sel), norm_type)
    else:  # some groups are runs, some not (a selection whole in some groups only): group by group
        local = torch.cat([(_run_max([run]) if is_inf else _run_norms([run], norm_type).sum().unsqueeze(0))
                           if run is not None else _piece_group_partials(parts_of((state,), _subset(sel, [g])),
                                                                          norm_type)
                           for g, run in zip(groups, runs)])
    local = to_comm(local, devices)
    for pg, members in communicating_by_process_group(state):
        rows = [i for i, g in enumerate(groups) if g in members]
        if rows:
            all_reduce_rows(local, rows, pg, dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM)
    return local


def _piece_group_partials(parts: Parts, norm_type: float) -> torch.Tensor:
    """(groups,) float64: per group of ``parts``, the sum (max) of its selected parameters' partials."""
    pieces = _piece_norms(parts, norm_type)
    take = parts.index.group_take
    return _per_group(pieces if take is None else pieces.index_select(0, take), parts.index.group_offsets,
                      math.isinf(norm_type))


def _subset(sel: Selection, groups: list[int]) -> Selection:
    """``sel`` restricted to ``groups``."""
    keep = set(groups)
    return Selection([p for p in sel.params if p.group in keep], {g: sel.by_group[g] for g in groups})


def dots(state: FlatState, other: FlatState, sel: Selection, with_norms: bool) -> Any:
    """Per-parameter ``<g, other_g>`` (and 2-norms): one collective of a (k, 1 or 3) float32 vector per process
    group. Locally: :func:`~zero_dtensor.layout.segments.joint_dots` (and two ``joint_pow_sums``) over every group."""

    def values(parts: Parts) -> torch.Tensor:
        a, b = parts.bufs
        found = joint_dots(a, b, parts.segs, parts.device, with_norms=with_norms)
        return found if with_norms else found.unsqueeze(1)

    width = 3 if with_norms else 1
    local = per_param(state, parts_of((state, other), sel), values, torch.float32, (width,))
    names = sel.names
    reduced = reduce_across(state, sel, local, dist.ReduceOp.SUM, names)
    s, so = state.loss_scale, other.loss_scale
    result = ParamValues(names, reduced[:, 0] / (s * so))
    if not with_norms:
        return result
    return result, ParamValues(names, reduced[:, 1].sqrt() / s), ParamValues(names, reduced[:, 2].sqrt() / so)


def _moments(parts: Parts, order: Sequence[int] | None = None) -> torch.Tensor:
    """(pieces, 6) float64: sum of squares, sum, max |x|, nan count, inf count, missed (or these columns in
    ``order``; :func:`~zero_dtensor.layout.segments.joint_stats` with ``counts``: three reads, counts decided on
    the device), every group at once."""
    (bufs,) = parts.bufs
    return joint_stats(bufs, parts.segs, parts.device, counts=True, order=order)


def _counts(parts: Parts) -> torch.Tensor:
    """(pieces, 2) float64: nan and inf counts, exactly (two more passes and two masks of each buffer's size: only
    taken when :func:`_moments` could not count every non-finite row)."""
    (bufs,) = parts.bufs
    return torch.stack([joint_sums([torch.isnan(b) for b in bufs], parts.segs, parts.device),
                        joint_sums([torch.isinf(b) for b in bufs], parts.segs, parts.device)], dim=1)


#: columns of :func:`_stat_rows`: summed across ranks (the first four), maxed (the last two)
_SUMMED = 4
_ROW_ORDER = (0, 1, 3, 4, 2, 5)  #: :func:`_moments`' columns in :func:`_stat_rows`' order


def _stat_columns(parts: Parts) -> torch.Tensor:
    """(pieces, 5) float64 of every group: sum of squares, sum, nan count, inf count, max |x| (with a host check of
    its own when the counts may be incomplete; :func:`stats` decides that from its one result copy instead)."""
    m = _moments(parts)
    counts = m[:, 3:5] if not bool(m[:, 5].any()) else _counts(parts)
    return torch.cat([m[:, :2], counts, m[:, 2:3]], dim=1)


def _stat_rows(state: FlatState, parts: Parts | None) -> torch.Tensor:
    """(k, 6) float64 on the communication device: sum of squares, sum, nan count, inf count, max |x|, missed
    (1.0 where some group's counts may be incomplete) per selected parameter. No host sync."""
    return per_param(state, parts, lambda p: _moments(p, _ROW_ORDER), torch.float64, (6,))


def stats(state: FlatState, sel: Selection) -> ParamStatsMap[GradStats]:
    """Per parameter 2-norm, max |g|, mean, nan and inf counts: a (k, 6) float64 matrix (sums of squares, sums,
    counts summed across ranks; max |x| and an incompleteness flag maxed; :func:`~zero_dtensor.comm.collectives.sum_max_rows`):
    per process group one all_gather of it (gloo), else two all_reduces. Locally one
    :func:`~zero_dtensor.layout.segments.joint_stats` over every group (sums of squares, sums, maxima: three reads;
    nan/inf counts of the bits and of up to max(16, rows/256) rows per group whose sum of squares is not finite,
    chosen on the device). One
    host sync: the copy of the results (``GradStats`` hold Python numbers). Only when more of some rank's rows of
    a group than that are not finite (the flag, the same on every rank after the reduction) are the counts taken
    again exactly (two more passes, one more collective, a second copy). The partials are reduced on the storage
    device and move to the communication device once."""
    parts = parts_of((state,), sel)
    local = _stat_rows(state, parts)
    names = sel.names
    scale = state.loss_scale
    reduced = reduce_rows_across(state, sel, local, lambda rows, which, pg: sum_max_rows(rows, which, pg, _SUMMED))
    host = to_host(reduced)
    if bool(host[:, 5].any()):  # rare (a host value: no sync): count every element, agreed by the flag
        counts = reduce_across(state, sel, per_param(state, parts, _counts, torch.float64, (2,)), dist.ReduceOp.SUM)
        host[:, 2:4] = to_host(counts)
    sumsq, total, nans, infs, top, _ = host.unbind(1)
    numels, counts_ = sel.numels()
    norm = _sqrt_list(sumsq)
    if scale != 1.0:
        norm = [x / scale for x in norm]
    any_nan = bool(nans.any())  # host values: no sync; all-zero counts (the usual case) skip their conversions
    top = top / scale if scale != 1.0 else top
    max_abs = (torch.where(nans != 0, math.nan, top) if any_nan else top).tolist()
    mean = torch.where(counts_ > 0, total / counts_ / scale, 0.0).tolist()
    nan_count, inf_count = _count_list(nans, any_nan), _count_list(infs, bool(infs.any()))
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
