"""Bulk materialization: every requested full gradient with one collective per transfer.

A *transfer* is the set of sharded flat groups that share a process group, dtype and device: they travel in one
(coalesced) collective, or, gathered by ``all_to_all`` (no coalesced form), in one per flat group. Per group, the
assembled buffer is brought into parameter order (already so for ZeRO-1/2 and for the zero-padded all_reduce; one
row copy, :mod:`zero_dtensor.layout.rows`, for a ZeRO-3 all_gather; one per side for a ZeRO-3 all_to_all), converted once
if the output dtype or loss scale asks for it, and cut into parameters with one ``split_with_sizes``: a fixed
number of tensor operations whatever the number of parameters. See ``ShardedGrads.full_tensors`` for the contract.

A large ZeRO-3 all_gather is *pipelined* (:func:`~zero_dtensor.materialize.strategy.pipelines`): two coalesced
all_gathers issued at once, of each group's columns up to and from its cut
(:attr:`~zero_dtensor.layout.plan.GroupPlan.column_pieces`), each into its part of the group's region; once the first has
arrived its part is reordered, while the second travels where the group runs collectives in issue order (NCCL; gloo
runs the two at once, see :mod:`~zero_dtensor.materialize.strategy`). The steps (collectives, then what follows
each) run in order at the end of a synchronous call or in ``PendingFullTensors.wait()``.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from ..comm.collectives import all_gather_into, all_reduce_sum_work, comm_device, gather_to, reduce_sum_to
from ..layout.flat import ParamLayout
from .placements import assembly_of
from ..comm.process_groups import global_rank, global_world_size, group_rank_of
from ..core.state import FlatState
from .emit import emit, request_names, target_dtype
from .gathers import copy_whole, fill_for_reduce, gather_by_peers, pipelined_gather, send_only, windowed_gather
from .results import GatheredGrads, PendingFullTensors, run_steps
from .strategy import CALIBRATES, check_strategy, resolve
from .transfers import Buffers, Transfer, narrower, plan_transfers, view_cache

__all__ = ["check_request", "full_tensors", "plan_transfers"]

GATHERS = ("all_gather", "all_to_all", "send_recv")  #: strategies that gather rank after rank (ZeRO-3 reorders)


# --- validation ------------------------------------------------------------------------------------------------------
def _validate_out(state: FlatState, params: list[ParamLayout], out: Any, dtype: torch.dtype | None) -> None:
    if not isinstance(out, MutableMapping):
        raise TypeError(f"out= must be a dict name -> tensor (e.g. a previous full_tensors result), got "
                        f"{type(out).__name__}")
    if isinstance(out, GatheredGrads) and out.holds_issued(request_names(state, params), dtype):
        return  # exactly the tensors an earlier call of the same request made: shapes, dtype, device known
    storage = state.storage
    wants: dict[int, tuple[torch.dtype, torch.device]] = {}
    for p in params:
        t = out.get(p.name)
        if t is None:
            continue
        spec = wants.get(p.group)
        if spec is None:
            spec = wants[p.group] = (target_dtype(state, p, dtype), comm_device(
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
    transfers: list[Transfer] | None = None,
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
        t.windowed = t.windowed and t.strategy in GATHERS

    result: MutableMapping[str, torch.Tensor] = out if out is not None else GatheredGrads()
    buffers = Buffers(out, result)
    regions: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # group -> (assembled, reorder area)
    steps: list[tuple[list[Any], Callable[[], None] | None]] = []  # what async or pipelined collectives await
    for t in transfers:
        if not (is_dst or t.strategy == "all_reduce"):
            steps.append((send_only(t, dst, async_op), None))
            continue
        if t.single:  # one rank: each partition is its whole group, copied (ZeRO-3: reordered) into the result
            buf = buffers.get(t.key(), t.numel, t.dtype, t.device)
            narrow = narrower(buf, view_cache(result, buf))
            for g, part in zip(t.groups, t.partitions):
                regions[g] = (narrow(t.offsets[g], state.group(g).flat_numel), None)
                copy_whole(state, g, part, regions[g][0], view_cache(result, buf))
            continue
        if t.windowed:  # the result alone, in parameter order; each window staged and reordered into it
            buf = buffers.get(t.key(), t.numel, t.dtype, t.device)
            narrow = narrower(buf, view_cache(result, buf))
            for g in t.groups:
                regions[g] = (narrow(t.offsets[g], state.group(g).flat_numel), None)
            windowed_gather(state, t, regions, result, steps, async_op)
            continue
        # smaller ZeRO-3 gathered results are reordered into a second area of the same buffer (at most
        # WINDOW_BYTES), so that a kept result pins (and a recycled one frees) all of the call's memory at once
        gathered = t.strategy in GATHERS  # rank after rank: ZeRO-3 reorders
        areas = {g: assembly_of(state.group(g)).reorder_area(state.group(g)) if gathered else 0 for g in t.groups}
        buf = buffers.get(t.key(), t.numel + sum(areas.values()), t.dtype, t.device)
        narrow = narrower(buf, view_cache(result, buf))
        at = t.numel
        for g in t.groups:
            area = narrow(at, areas[g]) if areas[g] else None
            at += areas[g]
            regions[g] = (narrow(t.offsets[g], state.group(g).flat_numel), area)
        buf = narrow(0, t.numel)
        if t.strategy == "all_reduce":
            fill_for_reduce(state, t, buf)
            steps.append((all_reduce_sum_work(buf, t.pg, async_op=async_op) if dst is None
                          else reduce_sum_to(buf, group_rank_of(t.pg, dst), t.pg, async_op=async_op), None))
        elif t.pipelined:
            steps += pipelined_gather(state, t, regions, narrow, result)
        elif dst is None and t.strategy in ("all_to_all", "send_recv"):
            steps += gather_by_peers(state, t, regions, result, async_op, t.strategy == "send_recv")
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
        return emit(state, params, regions, result, dtype, buffers, out is not None)

    if async_op:
        return PendingFullTensors(steps, finish)
    run_steps(steps)
    return finish()

