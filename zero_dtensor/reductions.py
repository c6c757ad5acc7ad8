"""Reductions over the local shards: norms, dot products, statistics, clipping, overflow. One collective each.

Every call computes per-parameter partial results from this rank's fragments with a fixed number of tensor
operations (one ``torch._foreach_norm`` over the fragments, or one ``torch.segment_reduce`` over their
concatenation), then sums (or maxes) them across ranks: **one all_reduce of a (k,) or (k, c) vector per distinct
process group** of the selected parameters (``k`` the number of selected parameters; DeepSpeed models normally have
one data-parallel group, so one collective in all); none for replicated or single-rank groups, whose local values
are already complete. ``stats()`` needs two (a sum and a max). Results are in true (unscaled) units.
(``found_inf`` lives in :mod:`zero_dtensor.overflow`.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .collectives import all_reduce_rows
from .debug import check_grads_call
from .state import GradState, Selection
from .transforms import mul_

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


def _result_device(state: GradState) -> torch.device:
    return state.storage.device


def _selected_fragments(state: GradState, sel: Selection) -> list[torch.Tensor]:
    """The selected parameters' fragments (views, possibly empty), in ``sel.params`` order."""
    return [state.fragment(p) for p in sel.params]


def _reduce(state: GradState, sel: Selection, local: torch.Tensor, op: Any) -> torch.Tensor:
    """All-reduce the rows of ``local`` (one per selected parameter) over each distinct process group of the
    multi-rank sharded groups (one collective per process group). Returns the reduced rows on the engine's
    device."""
    check_grads_call(state.storage, "reduce", [p.name for p in sel.params], str(op), tuple(local.shape[1:]))
    storage = state.storage
    local = local.to(storage.device)  # where the process group communicates (offloaded partitions are host memory)
    communicating = [i for i, g in enumerate(state.layout.groups) if g.placement.is_sharded and g.world_size > 1]
    by_pg: dict[int, tuple[Any, set[int]]] = {}
    for i in communicating:
        pg = storage.process_groups[i]
        by_pg.setdefault(id(pg), (pg, set()))[1].add(i)
    for pg, members in by_pg.values():
        if len(members) == len(state.layout.groups):  # every row takes part (the usual case): no row lookup
            rows = list(range(len(sel.params)))
        else:
            rows = [i for i, p in enumerate(sel.params) if p.group in members]
        if rows:
            all_reduce_rows(local, rows, pg, op)
    return local


def _partials(state: GradState, sel: Selection, norm_type: float) -> torch.Tensor:
    """Per selected parameter: local ``sum |x|^p`` (or ``max |x|`` for inf), float32, stored units."""
    device = _result_device(state)
    frags = _selected_fragments(state, sel)
    rows = [i for i, f in enumerate(frags) if f.numel()]  # the inf-norm of an empty tensor is undefined in torch
    local = torch.zeros(len(frags), dtype=torch.float32, device=device)
    if not rows:
        return local
    norms_ = torch._foreach_norm([frags[i] for i in rows], norm_type, dtype=torch.float32)
    values = torch.stack(norms_).to(device)
    if not math.isinf(norm_type):
        values = values.pow(norm_type)
    if len(rows) == len(frags):
        return values
    return local.index_copy_(0, torch.tensor(rows, device=device), values)


def _reduced_partials(state: GradState, sel: Selection, norm_type: float) -> tuple[torch.Tensor, bool]:
    if not (norm_type > 0):
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    is_inf = math.isinf(norm_type)
    local = _partials(state, sel, norm_type)
    return _reduce(state, sel, local, dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM), is_inf


def norm_values(state: GradState, sel: Selection, norm_type: float) -> torch.Tensor:
    """Per-parameter true norms, (k,) float32: one collective per process group."""
    reduced, is_inf = _reduced_partials(state, sel, norm_type)
    values = reduced if is_inf else (reduced.sqrt() if norm_type == 2.0 else reduced.pow(1.0 / norm_type))
    return values / state.loss_scale


def norms(state: GradState, sel: Selection, norm_type: float) -> dict[str, torch.Tensor]:
    values = norm_values(state, sel, norm_type)
    return dict(zip((p.name for p in sel.params), values.unbind(0)))


def global_norm(state: GradState, sel: Selection, norm_type: float) -> torch.Tensor:
    """The true norm of all selected gradients together, a 0-d float32: one collective per process group."""
    reduced, is_inf = _reduced_partials(state, sel, norm_type)
    if not reduced.numel():
        return torch.zeros((), dtype=torch.float32, device=reduced.device)
    if is_inf:
        total = reduced.max()
    else:
        total = reduced.sum()
        total = total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)
    return total / state.loss_scale


def _flat(frags: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fragments concatenated as float32 on ``device`` and their lengths (for ``segment_reduce``)."""
    lengths = torch.tensor([f.numel() for f in frags], dtype=torch.int64, device=device)
    if not frags:
        return torch.zeros(0, dtype=torch.float32, device=device), lengths
    dtypes = {f.dtype for f in frags}
    flat = torch.cat(frags) if len(dtypes) == 1 else torch.cat([f.to(torch.float32) for f in frags])
    return flat.to(device=device, dtype=torch.float32), lengths


def _segment_sum(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.segment_reduce(values, "sum", lengths=lengths, unsafe=True)


def dots(state: GradState, other: GradState, sel: Selection, with_norms: bool) -> Any:
    """Per-parameter ``<g, other_g>`` (and 2-norms): one collective of a (k, 1 or 3) float32 vector."""
    device = _result_device(state)
    a, lengths = _flat(_selected_fragments(state, sel), device)
    b, _ = _flat(_selected_fragments(other, sel), device)
    columns = [_segment_sum(a * b, lengths)]
    if with_norms:
        columns += [_segment_sum(a * a, lengths), _segment_sum(b * b, lengths)]
    local = torch.stack(columns, dim=1)
    reduced = _reduce(state, sel, local, dist.ReduceOp.SUM)
    s, so = state.loss_scale, other.loss_scale
    names = [p.name for p in sel.params]
    result = dict(zip(names, (reduced[:, 0] / (s * so)).unbind(0)))
    if not with_norms:
        return result
    mine = dict(zip(names, (reduced[:, 1].sqrt() / s).unbind(0)))
    theirs = dict(zip(names, (reduced[:, 2].sqrt() / so).unbind(0)))
    return result, mine, theirs


def stats(state: GradState, sel: Selection) -> dict[str, GradStats]:
    """Per parameter 2-norm, max |g|, mean, nan and inf counts: a (k, 4) float64 sum and a (k,) float32 max, each
    one collective per process group; one host sync. Local work: one ``_foreach_norm`` each for the sum of squares
    and the max, one ``segment_reduce`` for the sums; nan/inf counts only when some value is not finite."""
    device = _result_device(state)
    frags = _selected_fragments(state, sel)
    rows = [i for i, f in enumerate(frags) if f.numel()]
    k = len(frags)
    sums = torch.zeros(k, 4, dtype=torch.float64, device=device)
    maxes = torch.zeros(k, dtype=torch.float32, device=device)
    if rows:
        present = [frags[i] for i in rows]
        flat, lengths = _flat(present, device)
        index = torch.tensor(rows, device=device) if len(rows) != k else None
        sq = torch.stack(torch._foreach_norm(present, 2, dtype=torch.float32)).to(device=device, dtype=torch.float64)
        columns = [sq * sq, _segment_sum(flat.to(torch.float64), lengths)]
        if bool(torch.isfinite(flat).all()):
            columns += [torch.zeros_like(sq), torch.zeros_like(sq)]
            top = torch.stack(torch._foreach_norm(present, float("inf"), dtype=torch.float32)).to(device)
        else:  # count them (rare): the 2-norm and the max are nan/inf then, as before
            nan, inf = torch.isnan(flat), torch.isinf(flat)
            columns += [_segment_sum(nan.to(torch.float64), lengths), _segment_sum(inf.to(torch.float64), lengths)]
            top = torch.segment_reduce(flat.abs().masked_fill_(nan, 0), "max", lengths=lengths, unsafe=True,
                                       initial=0.0)
        local = torch.stack(columns, dim=1)
        if index is None:
            sums, maxes = local, top
        else:
            sums.index_copy_(0, index, local)
            maxes.index_copy_(0, index, top)
    sums = _reduce(state, sel, sums, dist.ReduceOp.SUM)
    maxes = _reduce(state, sel, maxes, dist.ReduceOp.MAX)
    scale = state.loss_scale
    out = {}
    for param, (sumsq, total, nans, infs), m in zip(sel.params, sums.tolist(), maxes.tolist()):
        n = param.numel
        out[param.name] = GradStats(
            norm=math.sqrt(sumsq) / scale if not math.isnan(sumsq) else math.nan,
            max_abs=math.nan if nans else m / scale,
            mean=total / n / scale if n else 0.0,
            nan_count=int(nans),
            inf_count=int(infs),
            numel=n,
        )
    return out


def clip_grad_norm_(state: GradState, sel: Selection, max_norm: float, norm_type: float,
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


def clip_per_param_(state: GradState, sel: Selection, max_norm: float, norm_type: float) -> dict[str, torch.Tensor]:
    from .transforms import PerParam

    values = norm_values(state, sel, norm_type)
    coefs = torch.clamp(max_norm / (values + 1e-6), max=1.0)
    mul_(state, sel, PerParam(list(coefs.unbind(0))))
    return dict(zip((p.name for p in sel.params), values.unbind(0)))
