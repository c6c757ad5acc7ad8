"""Bulk materialization: every requested full gradient with one collective per transfer.

A *transfer* is the set of sharded flat groups that share a process group, dtype and device: they travel in one
(coalesced) collective, or, gathered by ``all_to_all`` (no coalesced form), in one per flat group. Per group, the
assembled buffer is brought into parameter order (already so for ZeRO-1/2 and for the zero-padded all_reduce; one
row copy, :mod:`zero_dtensor.rows`, for a ZeRO-3 all_gather; one per side for a ZeRO-3 all_to_all), converted once
if the output dtype or loss scale asks for it, and cut into parameters with one ``split_with_sizes``: a fixed
number of tensor operations whatever the number of parameters. See ``ShardedGrads.full_tensors`` for the contract.

A large ZeRO-3 all_gather is *pipelined* (:func:`~zero_dtensor.materialize.strategy.pipelines`): two coalesced
all_gathers issued at once, of each group's columns up to and from its cut
(:attr:`~zero_dtensor.plan.GroupPlan.column_pieces`), each into its part of the group's region; once the first has
arrived its part is reordered, while the second travels where the group runs collectives in issue order (NCCL; gloo
runs the two at once, see :mod:`~zero_dtensor.materialize.strategy`). The steps (collectives, then what follows
each) run in order at the end of a synchronous call or in ``PendingFullTensors.wait()``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import (
    all_gather_by_all_to_all,
    all_gather_into,
    all_reduce_sum_work,
    comm_device,
    gather_to,
    global_rank,
    global_world_size,
    group_rank_of,
    peer_partitions_by_all_to_all,
    reduce_sum_to,
)
from ..layout import ParamLayout
from ..plan import ColumnPiece, GroupPlan
from ..state import FlatState
from ..views import ViewCache
from .buffers import BUFFERS
from .results import GatheredGrads, PendingFullTensors, run_steps
from .strategy import CALIBRATES, check_strategy, explicit, pipelines, planned, resolve

__all__ = ["check_request", "full_tensors", "plan_transfers"]

_NAME = operator.attrgetter("name")


@dataclass
class _Transfer:
    """Sharded flat groups that share a process group, dtype and device: they travel in one collective."""

    pg: dist.ProcessGroup
    dtype: torch.dtype
    device: torch.device
    groups: list[int] = field(default_factory=list)
    partitions: list[torch.Tensor] = field(default_factory=list)
    strategy: str = ""
    pipelined: bool = False  # gathered as two all_gathers, each part reordered once it has arrived
    reorder: bool = False  # gathered rank after rank, its groups need reordering into parameter order (ZeRO-3)
    pipelinable: bool = False  # an all_gather of it would be pipelined
    offsets: dict[int, int] = field(default_factory=dict)  # group index -> start in the transfer buffer
    numel: int = 0

    def key(self) -> tuple[Any, ...]:
        return ("transfer", self.pg, self.dtype, self.device, self.strategy, tuple(self.groups), self.numel)

    @property
    def nbytes(self) -> int:
        """Bytes of the assembled groups (stored dtype)."""
        return self.numel * self.partitions[0].element_size()


def plan_transfers(state: FlatState, params: list[ParamLayout], dst: int | None, strategy: str) -> list[_Transfer]:
    """The transfers a ``full_tensors`` call of ``params`` will make, each with the strategy it will use
    (:data:`~.strategy.CALIBRATES` where ``auto`` calibrates first): what the call's rank agreement compares (a pinned
    strategy, an environment variable or a calibration cache that differs between ranks shows here), then what
    :func:`full_tensors` runs. No communication."""
    transfers = _transfers(state, sorted(state.plan.by_group(params)))
    for t in transfers:
        if dst is not None:  # no calibration: it times the all-rank collectives, while dst= uses gather/reduce
            chosen = explicit(strategy)
            t.strategy = "all_reduce" if chosen == "all_reduce" else "all_gather"  # all_to_all: a gather too
            continue
        t.reorder = any(state.group(g).placement.reorder_area(state.group(g)) for g in t.groups)
        # the pieces (and their row copies) are planned only for transfers large enough to pipeline
        t.pipelinable = pipelines(t.nbytes, t.reorder) and any(len(_pieces(state, g)) > 1 for g in t.groups)
        t.strategy = planned(strategy, t.pg, t.device, t.dtype, t.nbytes, t.reorder, t.pipelinable,
                             one_group=len(t.groups) == 1)
    return transfers


def _transfers(state: FlatState, group_indices: Sequence[int]) -> list[_Transfer]:
    found: dict[tuple[Any, ...], _Transfer] = {}
    for i in group_indices:
        if not state.group(i).placement.is_sharded:
            continue
        part = state.comm_partition(i)
        pg = state.storage.process_groups[i]
        t = found.setdefault((pg, part.dtype, part.device), _Transfer(pg, part.dtype, part.device))
        t.offsets[i] = t.numel
        t.numel += state.group(i).flat_numel
        t.groups.append(i)
        t.partitions.append(part)
    return list(found.values())


# --- buffers -----------------------------------------------------------------------------------------------------
class _Buffers:
    """Where a call's buffers come from: the previous result's (``out=`` a :class:`GatheredGrads`), the kept
    workspace (``out=`` a user dict), or the recycling pool (no ``out=``). Every buffer handed out is recorded in
    the result's ``buffers``."""

    def __init__(self, out: MutableMapping[str, torch.Tensor] | None, result: MutableMapping[str, torch.Tensor]):
        self.reuse = out is not None
        self.own = result.buffers if isinstance(result, GatheredGrads) else BUFFERS.workspace
        self.result = result

    def get(self, key: tuple[Any, ...], numel: int, dtype: torch.dtype, device: torch.device,
            *, kept: bool = True) -> torch.Tensor:
        """A buffer for ``key``; ``kept=False`` for one whose views are handed to a user-made ``out=`` dict's
        missing entries (always fresh)."""
        if not kept:
            return BUFFERS.alloc(numel, dtype, device)
        key = (*key, numel, dtype, device)
        buf = self.own.get(key) if self.reuse else None
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = BUFFERS.alloc(numel, dtype, device) if self.reuse else BUFFERS.recycled_or_new(key, numel, dtype,
                                                                                                  device)
            self.own[key] = buf
        if isinstance(self.result, GatheredGrads):
            self.result.buffers[key] = buf
        return buf


# --- filling and cutting -------------------------------------------------------------------------------------------
def _fill_for_reduce(state: FlatState, t: _Transfer, buf: torch.Tensor) -> None:
    """Every group's all_reduce input: this rank's values in parameter order, zeros elsewhere (the placement's)."""
    for g, part in zip(t.groups, t.partitions):
        group, plan = state.group(g), state.plan.groups[g]
        pieces = state.pieces[g] if part is state.storage.partitions[g] else None  # moved: cut on use
        region = buf.narrow(0, t.offsets[g], group.flat_numel)
        group.placement.fill_for_reduce(region, group, plan, part, pieces, BUFFERS.view_cache(region))


def _converted(state: FlatState, g: int, order: torch.Tensor, want: torch.dtype, buffers: _Buffers,
               copy: bool, kept: bool = True) -> torch.Tensor:
    """``order`` in true units and dtype ``want``: itself when nothing changes and no copy is needed, else one
    converted buffer (bit-identical to unscaling each parameter on its own)."""
    scale = state.loss_scale
    if scale == 1.0 and want == order.dtype and not copy:
        return order
    out = buffers.get(("converted", g, want), order.numel(), want, order.device, kept=kept)
    if scale == 1.0:
        out.copy_(order)
    elif want == torch.float32:
        out.copy_(order)
        out.div_(scale)
    else:
        out.copy_(order.to(torch.float32).div_(scale))
    return out


def _cut(plan: GroupPlan, values: torch.Tensor, result: Any = None) -> tuple[torch.Tensor, ...]:
    """Every parameter of the group (buffer order) as a view of a parameter-order buffer: one ``split_with_sizes``,
    made once per recycled buffer (:meth:`~zero_dtensor.materialize.buffers.BufferPool.view_cache`) or per buffer
    of a :class:`GatheredGrads` ``result`` (reused when it comes back as ``out=``)."""
    cache = _view_cache(result, values)
    if cache is None:
        return _make_cut(plan, values)
    key = ("cut", plan, values.storage_offset(), values.numel(), values.dtype)
    return cache.get(key, lambda _: _make_cut(plan, values))


def _narrower(buf: torch.Tensor, cache: Any) -> Any:
    """``narrow(start, length)`` of ``buf``: views kept in the buffer's cache when it is kept. The collectives get
    these kept views, so a backend thread that holds its inputs a moment after ``wait()`` holds no extra view of
    the memory, and the buffer is found free (and reused, with its cut views) by the next call."""
    if cache is None:
        return lambda start, length: buf.narrow(0, start, length)
    base = buf.storage_offset()
    return lambda start, length: cache.get(("narrow", base + start, length),
                                           lambda _: [buf.narrow(0, start, length)])[0]


def _view_cache(result: Any, t: torch.Tensor) -> ViewCache | None:
    """The cache of the kept buffer ``t`` is a view of: the pool's, else that of a :class:`GatheredGrads`
    ``result`` holding it; None for memory nobody keeps (cut anew)."""
    cache = BUFFERS.view_cache(t)
    if cache is None and isinstance(result, GatheredGrads):
        cache = result.view_cache(t)
    return cache


def _make_cut(plan: GroupPlan, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    pieces = values.split_with_sizes(list(plan.param_order.sizes))
    out = []
    for k, p in enumerate(plan.params):
        piece = pieces[plan.param_order.piece[k]]
        if piece.numel() != p.numel:  # ZeRO-3: the (N, chunk) block is padded past the parameter
            piece = piece.narrow(0, 0, p.numel)
        out.append(piece if len(p.shape) == 1 else piece.view(p.shape))
    return tuple(out)


# --- validation ------------------------------------------------------------------------------------------------------
def _request_names(state: FlatState, params: list[ParamLayout]) -> tuple[str, ...]:
    """The requested names in request order (the layout's own tuple for every parameter in model order)."""
    return state.layout.names if state.plan.is_everything(params) else tuple(map(_NAME, params))


def _target_dtype(state: FlatState, p: ParamLayout, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if state.loss_scale != 1.0 else state.storage.partitions[p.group].dtype


def _validate_out(state: FlatState, params: list[ParamLayout], out: Any, dtype: torch.dtype | None) -> None:
    if not isinstance(out, MutableMapping):
        raise TypeError(f"out= must be a dict name -> tensor (e.g. a previous full_tensors result), got "
                        f"{type(out).__name__}")
    if isinstance(out, GatheredGrads) and out.holds_issued(_request_names(state, params), dtype):
        return  # exactly the tensors an earlier call of the same request made: shapes, dtype, device known
    storage = state.storage
    wants: dict[int, tuple[torch.dtype, torch.device]] = {}
    for p in params:
        t = out.get(p.name)
        if t is None:
            continue
        spec = wants.get(p.group)
        if spec is None:
            spec = wants[p.group] = (_target_dtype(state, p, dtype), comm_device(
                storage.partitions[p.group], storage.process_groups[p.group], storage.device))
        want, device = spec
        if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != want or t.device != device:
            got = f"{type(t).__name__}" if not isinstance(t, torch.Tensor) else f"{tuple(t.shape)} {t.dtype} {t.device}"
            raise ValueError(f"out[{p.name!r}] must be a tensor of shape {tuple(p.shape)}, dtype {want} on {device}; "
                             f"got {got}")
        if not t.is_contiguous():
            raise ValueError(f"out[{p.name!r}] must be contiguous")
        if t.requires_grad:
            raise ValueError(f"out[{p.name!r}] requires grad; pass tensors that do not (e.g. t.detach())")


def _check_dst(state: FlatState, dst: Any, wanted: list[int]) -> None:
    world = global_world_size()
    if not isinstance(dst, int) or isinstance(dst, bool) or not 0 <= dst < world:
        raise ValueError(f"dst must be a global rank in [0, {world}), got {dst!r}")
    for i in wanted:
        try:
            group_rank_of(state.storage.process_groups[i], dst)
        except ValueError:
            raise ValueError(f"dst={dst} is not a member of the process group of flat group {i}") from None


def check_request(state: FlatState, params: list[ParamLayout], *, dtype: torch.dtype | None,
                  out: MutableMapping[str, torch.Tensor] | None, dst: int | None, strategy: str) -> None:
    """Refuse a ``full_tensors`` request this rank cannot make (``strategy``, ``out=`` entries, ``dst``), before any
    communication: ``TypeError`` / ``ValueError``. No communication."""
    check_strategy(strategy)
    if out is not None:
        _validate_out(state, params, out, dtype)
    if dst is not None:
        _check_dst(state, dst, sorted(state.plan.by_group(params)))


# --- the call --------------------------------------------------------------------------------------------------------
def full_tensors(
    state: FlatState,
    params: list[ParamLayout],
    *,
    dtype: torch.dtype | None = None,
    out: MutableMapping[str, torch.Tensor] | None = None,
    dst: int | None = None,
    async_op: bool = False,
    strategy: str = "auto",
    transfers: list[_Transfer] | None = None,
) -> dict[str, torch.Tensor] | PendingFullTensors:
    """See ``ShardedGrads.full_tensors`` (the documented entry point); ``params`` and the arguments are already
    validated (:func:`check_request`, before the rank-agreement check); ``transfers``: :func:`plan_transfers` of
    the same arguments, as the agreement compared them (planned here when not given)."""
    state.check_current()
    is_dst = dst is None or global_rank() == dst

    if transfers is None:
        transfers = plan_transfers(state, params, dst, strategy)
    for t in transfers:
        if t.strategy == CALIBRATES:  # every rank agreed on it (the agreement compared the plans)
            t.strategy = resolve(strategy, t.pg, t.device, t.dtype, t.nbytes, t.reorder, t.pipelinable,
                                 one_group=len(t.groups) == 1)
        t.pipelined = t.pipelinable and t.strategy == "all_gather"

    result: MutableMapping[str, torch.Tensor] = out if out is not None else GatheredGrads()
    buffers = _Buffers(out, result)
    regions: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # group -> (assembled, reorder area)
    steps: list[tuple[list[Any], Callable[[], None] | None]] = []  # what async or pipelined collectives await
    for t in transfers:
        if not (is_dst or t.strategy == "all_reduce"):
            steps.append((_send_only(t, dst, async_op), None))
            continue
        # ZeRO-3 all_gather results are reordered into a second area of the same buffer, so that a kept result
        # pins (and a recycled one frees) all of the call's memory at once
        gathered = t.strategy in ("all_gather", "all_to_all")  # rank after rank: ZeRO-3 needs reordering
        areas = {g: state.group(g).placement.reorder_area(state.group(g)) if gathered else 0 for g in t.groups}
        buf = buffers.get(t.key(), t.numel + sum(areas.values()), t.dtype, t.device)
        narrow = _narrower(buf, _view_cache(result, buf))
        at = t.numel
        for g in t.groups:
            area = narrow(at, areas[g]) if areas[g] else None
            at += areas[g]
            regions[g] = (narrow(t.offsets[g], state.group(g).flat_numel), area)
        buf = narrow(0, t.numel)
        if t.strategy == "all_reduce":
            _fill_for_reduce(state, t, buf)
            steps.append((all_reduce_sum_work(buf, t.pg, async_op=async_op) if dst is None
                          else reduce_sum_to(buf, group_rank_of(t.pg, dst), t.pg, async_op=async_op), None))
        elif t.pipelined:
            steps += _pipelined_gather(state, t, regions, narrow, result)
        elif dst is None and t.strategy == "all_to_all":
            steps.append(_gather_by_all_to_all(state, t, regions, async_op))
        elif dst is None:
            outs = [regions[g][0] for g in t.groups]
            steps.append((all_gather_into(outs, t.partitions, t.pg, async_op=async_op), None))
        else:
            works = []
            for g, part in zip(t.groups, t.partitions):  # gather has no coalesced form: one per flat group
                rows = list(regions[g][0].view(state.group(g).world_size, -1).unbind(0))
                works += gather_to(part, rows, group_rank_of(t.pg, dst), t.pg, async_op=async_op)
            steps.append((works, None))

    def finish() -> dict[str, torch.Tensor]:
        if not is_dst:
            empty = GatheredGrads()
            if isinstance(result, GatheredGrads):
                empty.buffers = result.buffers
            return empty
        return _emit(state, params, regions, result, dtype, buffers, out is not None)

    if async_op:
        return PendingFullTensors(steps, finish)
    run_steps(steps)
    return finish()


def _pieces(state: FlatState, g: int) -> tuple[ColumnPiece, ...]:
    return state.group(g).placement.pipeline_pieces(state.plan.groups[g], state.storage.partitions[g].element_size())


def _pipelined_gather(state: FlatState, t: _Transfer, regions: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
                      narrow: Callable[[int, int], torch.Tensor],
                      result: MutableMapping[str, torch.Tensor]) -> list[tuple[list[Any], Callable[[], None]]]:
    """Issue a pipelined transfer's two all_gathers at once (each coalesced over its groups: every group's
    columns of that step, gathered as ``(N, width)`` rows into its part of the group's region), and return the
    steps that reorder each part into the group's area once it has arrived. The regions then hold the areas: in
    parameter order once the steps have run."""
    per_step: list[list[tuple[int, torch.Tensor, torch.Tensor, ColumnPiece]]] = [[], []]
    for g, part in zip(t.groups, t.partitions):
        area = regions[g][1]
        assert area is not None
        N = state.group(g).world_size
        for k, piece in enumerate(_pieces(state, g)):
            rows = narrow(t.offsets[g] + N * piece.lo, N * piece.width)
            per_step[k].append((g, rows, part.narrow(0, piece.lo, piece.width), piece))
        regions[g] = (area, None)
    steps: list[tuple[list[Any], Callable[[], None]]] = []
    for members in per_step:
        if not members:
            continue
        works = all_gather_into([rows for _, rows, _, _ in members], [inp for _, _, inp, _ in members], t.pg,
                                async_op=True)
        steps.append((works, _reorder_step(state, members, regions, result)))
    return steps


def _gather_by_all_to_all(state: FlatState, t: _Transfer,
                          regions: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
                          async_op: bool) -> tuple[list[Any], Callable[[], None] | None]:
    """One ``all_to_all_single`` per flat group (it has no coalesced form), and the step that follows them. Where the
    placement reorders through rows (:meth:`~zero_dtensor.placement.GroupPlacement.peer_rows`: ZeRO-3), the other
    ranks' partitions are received back to back into the group's region (the collective issued asynchronously even
    for a synchronous call: the step awaits it) while this rank's partition is copied into its rows of parameter
    order, and copied into theirs once they have arrived: ``S`` copied in all, not ``S/N`` into the gathered rows
    and then ``S``. Elsewhere the group is gathered rank after rank
    (:func:`~zero_dtensor.collectives.all_gather_by_all_to_all`) and reordered as an all_gather is. The regions of
    the first kind then hold their areas."""
    works: list[Any] = []
    after: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (peer row copy, received, area)
    for g, part in zip(t.groups, t.partitions):
        group = state.group(g)
        region, area = regions[g]
        rows = group.placement.peer_rows(state.plan.groups[g], part.element_size()) if area is not None else None
        if rows is None or area is None:
            works += all_gather_by_all_to_all(region, part, t.pg, async_op=async_op)
            continue
        own, peers = rows
        received = region.narrow(0, 0, (group.world_size - 1) * group.partition_numel)
        works += peer_partitions_by_all_to_all(received, part, t.pg, async_op=True)  # awaited by the step
        own.copy(part, area)  # while it travels (both only read the partition)
        after.append((peers, received, area))
        regions[g] = (area, None)
    if not after:
        return works, None

    def reorder() -> None:
        for peers, received, area in after:
            peers.copy(received, area)
    return works, reorder


def _reorder_step(state: FlatState, members: list[tuple[int, torch.Tensor, torch.Tensor, ColumnPiece]],
                  regions: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
                  result: MutableMapping[str, torch.Tensor]) -> Callable[[], None]:
    def reorder() -> None:
        for g, rows, _, piece in members:
            group, area = state.group(g), regions[g][0]
            target = area.narrow(0, group.world_size * piece.lo, group.world_size * piece.width)
            group.placement.to_param_order(rows, group, state.plan.groups[g], target, _view_cache(result, area),
                                           piece)
    return reorder


def _send_only(t: _Transfer, dst: int | None, async_op: bool) -> list[Any]:
    """A non-destination rank of ``dst=`` with all_gather: send this rank's partitions (one gather per group)."""
    works: list[Any] = []
    for part in t.partitions:
        works += gather_to(part, None, group_rank_of(t.pg, dst), t.pg, async_op=async_op)
    return works


def _emit(state: FlatState, params: list[ParamLayout], regions: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
          result: MutableMapping[str, torch.Tensor], dtype: torch.dtype | None, buffers: _Buffers,
          reuse: bool) -> dict[str, torch.Tensor]:
    """Fill ``result`` in request order: per group one parameter-order buffer (converted once if needed), cut into
    views; entries of a user-made ``out=`` dict are filled with one ``_foreach_copy_`` per group."""
    user_dict = reuse and not isinstance(result, GatheredGrads)
    everything = state.plan.is_everything(params) and len(params) > 1 and not user_dict
    views: dict[str, torch.Tensor] = {}
    cuts: list[tuple[torch.Tensor, ...]] = []  # every parameter's view, per group (the fast path below)
    for g, members in state.plan.by_group(params).items():
        group, plan = state.group(g), state.plan.groups[g]
        want = _target_dtype(state, members[0], dtype)
        if group.placement.is_sharded:
            region, area = regions[g]
            order = region if area is None else group.placement.to_param_order(
                region, group, plan, area, _view_cache(result, area))
            live = False
        else:
            order, live = state.storage.partitions[g], True  # a snapshot needs one local copy
        if user_dict:
            existing = [p for p in members if result.get(p.name) is not None]
            if existing:
                cut = dict(zip(plan.names, _cut(plan, _converted(state, g, order, want, buffers, copy=False))))
                torch._foreach_copy_([result[p.name] for p in existing], [cut[p.name] for p in existing])
            missing = [p for p in members if result.get(p.name) is None] if existing else members
            if not missing:
                continue
            values = _converted(state, g, order, want, buffers, copy=True, kept=False)
            cut = dict(zip(plan.names, _cut(plan, values)))
            views.update((p.name, cut[p.name]) for p in missing)
        else:
            values = _converted(state, g, order, want, buffers, copy=live)
            if everything:
                cuts.append(_cut(plan, values, result))
            else:
                views.update(zip(plan.names, _cut(plan, values, result)))
    if everything:  # every parameter in model order into our own dict: one cached pick, no per-name lookups
        assert isinstance(result, GatheredGrads)
        flat = cuts[0] if len(cuts) == 1 else tuple(chain.from_iterable(cuts))
        take = state.plan.model_order_take
        names = state.layout.names
        if reuse and not result.in_order(names):  # a dict of other names: start over, in request order
            dict.clear(result)
        result.fill_cut(names, flat, take, dtype)
        return result  # type: ignore[return-value]
    names = list(map(_NAME, params))
    if user_dict:
        result.update((n, views[n]) for n in names if n in views)
    else:
        result.update(zip(names, map(views.__getitem__, names)))
    if reuse and list(result) != names:  # keep the caller's key order: request order
        ordered = {n: result.pop(n) for n in names}
        result.update(ordered)
    if isinstance(result, GatheredGrads):
        result.record_issued(names, dtype)
    return result  # type: ignore[return-value]
