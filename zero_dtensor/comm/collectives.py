"""The few collectives zero_dtensor issues, each over one DeepSpeed data-parallel process group.

Every function here must be called on every rank of the group, in the same order, with the same arguments (apart
from the local data): that is what a collective is. Point-to-point exchanges are in
:mod:`zero_dtensor.comm.point_to_point`, queries of a process group (ranks, sizes, backends) in
:mod:`zero_dtensor.comm.process_groups`.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..layout.devices import to_device
from .process_groups import backend_of, collective_path, comm_support_of, world_size_of

__all__ = [
    "comm_device",
    "comm_device_types",
    "all_gather_into",
    "all_gather_single",
    "all_gather_by_all_to_all",
    "peer_partitions_by_all_to_all",
    "all_gather_objects",
    "gather_int_rows_within",
    "gathers_sum_max_rows",
    "max_int_values_within",
    "prefers_all_reduce",
    "all_reduce_small",
    "sum_max_rows",
    "GLOO_REDUCE_FROM",
    "all_reduce_op",
    "all_reduce_rows",
    "all_reduce_sum_work",
    "gather_to",
    "max_across",
    "mesh_for",
    "on_comm_device",
    "reduce_sum_to",
    # zero_dtensor.redistribute
    "all_to_all_into",
    "sum_ints",
]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_MESHES: dict[tuple[dist.ProcessGroup, str], DeviceMesh] = {}


_DEVICE_TYPES: dict[dist.ProcessGroup, frozenset[str]] = {}


def comm_device_types(group: dist.ProcessGroup) -> frozenset[str]:
    """Device types ``group``'s backends communicate on, from ``dist.get_backend_config`` (``"cpu:gloo,cuda:nccl"``
    → ``{"cpu", "cuda"}``; a DeepSpeed NCCL group → ``{"cuda"}``). Empty when the backend does not say."""
    types = _DEVICE_TYPES.get(group)
    if types is None:
        config = dist.get_backend_config(group)
        types = _DEVICE_TYPES[group] = frozenset(item.split(":")[0] for item in config.split(",") if ":" in item)
    return types


def comm_device(tensor: torch.Tensor, group: dist.ProcessGroup, fallback: torch.device) -> torch.device:
    """``tensor.device`` where ``group`` can communicate on it, else ``fallback`` (the engine's device)."""
    types = comm_device_types(group)
    return tensor.device if not types or tensor.device.type in types else torch.device(fallback)


def on_comm_device(tensor: torch.Tensor, group: dist.ProcessGroup, fallback: torch.device) -> torch.Tensor:
    """``tensor`` itself where ``group`` can communicate on its device, else a copy on ``fallback``.

    CPU-offloaded gradients in a CUDA job sit on the CPU while DeepSpeed's data-parallel group is NCCL (CUDA only):
    they travel through the engine's device (one host-to-device copy of the local partition).
    """
    return to_device(tensor, comm_device(tensor, group, fallback))


def mesh_for(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over an existing process group (creates no communicator). Cached per group."""
    key = (group, device_type)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return mesh


def _coalescing_device(group: dist.ProcessGroup, device: torch.device) -> torch.device | None:
    """``device`` for ``_coalescing_manager``: gloo raises "does not implement startCoalescing" when given one (its
    coalesced all_gather/all_reduce fast paths need none); other backends get it."""
    return None if dist.get_backend(group) == "gloo" else device


# --- building blocks of zero_dtensor.materialize (each returns the pending ``Work`` objects when async) ---------------


def all_gather_into(
    outs: Sequence[torch.Tensor],
    partitions: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> list[dist.Work]:
    """Gather each equal-per-rank 1-D ``partitions[i]`` into the preallocated ``outs[i]`` (``N×`` its length).

    **One** collective for all of them (coalesced when there are several; they must share dtype and device), or,
    where the backend cannot coalesce on their device (:func:`~zero_dtensor.comm.process_groups.comm_support`: gloo over
    CUDA tensors), one ``all_gather_into_tensor`` per partition. Bytes received per rank: ``(N-1)/N`` of the summed
    output sizes. Returns the pending works (empty when sync).
    """
    if len(outs) != len(partitions):
        raise ValueError(f"{len(outs)} outputs for {len(partitions)} partitions")
    if len(partitions) == 1 or not comm_support_of(group, partitions[0].device).coalescing:
        works = [_all_gather_single(out, part, group=group, async_op=async_op) for out, part in zip(outs, partitions)]
        return [w for w in works if w is not None] if async_op else []
    with dist._coalescing_manager(group=group, device=_coalescing_device(group, partitions[0].device),
                                  async_ops=async_op) as cm:
        for out, part in zip(outs, partitions):
            _all_gather_single(out, part, group=group)
    return list(cm.works) if async_op else []


def all_reduce_sum_work(tensor: torch.Tensor, group: dist.ProcessGroup, *, async_op: bool = False) -> list[dist.Work]:
    """One in-place sum ``all_reduce`` (``2(N-1)/N·S`` bytes per rank); returns the pending work when async."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return [work] if async_op and work is not None else []


def reduce_sum_to(
    tensor: torch.Tensor, group_dst: int, group: dist.ProcessGroup, *, async_op: bool = False
) -> list[dist.Work]:
    """One in-place sum ``reduce`` to group rank ``group_dst`` (only its ``tensor`` holds the sum afterwards)."""
    work = dist.reduce(tensor, group_dst=group_dst, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return [work] if async_op and work is not None else []


def gather_to(
    local: torch.Tensor,
    gather_list: list[torch.Tensor] | None,
    group_dst: int,
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> list[dist.Work]:
    """One ``gather`` of equal-size ``local`` tensors into ``gather_list`` on group rank ``group_dst`` (``None``
    elsewhere). Bytes: each rank sends ``S/N``; the destination receives ``(N-1)/N·S``. Has no coalesced form."""
    work = dist.gather(local, gather_list=gather_list, group_dst=group_dst, group=group, async_op=async_op)
    return [work] if async_op and work is not None else []


def max_across(values: Sequence[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    """Element-wise maximum of a few floats over the group: one ``all_reduce(MAX)`` of ``len(values)`` float64."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.cpu()]


def all_reduce_op(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp) -> torch.Tensor:
    """One in-place ``all_reduce`` with reduce op ``op``."""
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _stacked_by_rank(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``tensor`` (contiguous, the same shape everywhere), stacked in rank order, ``(N, *shape)``: one
    ``all_gather_into_tensor``."""
    n = dist.get_world_size(group)
    gathered = torch.empty(n * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(gathered, tensor.reshape(-1), group=group)
    return gathered.view(n, *tensor.shape)


def all_reduce_small(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp) -> None:
    """Reduce a small contiguous ``tensor`` (``SUM`` or ``MAX``) over ``group`` in place, by the cheaper of two ways
    (:func:`prefers_all_reduce`): one ``all_reduce``, or one ``all_gather_into_tensor`` (``N`` times its bytes
    received, ``N`` times its size held briefly) and a local reduction over the ranks in rank order (``sum`` /
    ``amax``: the same value on every rank; at 2 ranks bit-identical to the all_reduce's ``a + b``; ``amax``
    propagates nan, as torch's reductions do; so does the all_reduce's ``MAX`` of floating values,
    :func:`_all_reduce_max_keeping_nan`). One collective either way."""
    if prefers_all_reduce(group) or op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        if op == dist.ReduceOp.MAX and tensor.is_floating_point():
            _all_reduce_max_keeping_nan(tensor, group)
        else:
            dist.all_reduce(tensor, op=op, group=group)
        return
    by_rank = _stacked_by_rank(tensor, group)
    if op == dist.ReduceOp.SUM:
        torch.sum(by_rank, 0, out=tensor)
    else:
        torch.amax(by_rank, 0, out=tensor)


def _all_reduce_max_keeping_nan(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The element-wise maximum of a small contiguous floating ``tensor`` over ``group``, in place, ``nan`` where
    any rank holds one: one ``all_reduce(MAX)`` of the values and a flag per value (``isnan``, 0 or 1) side by side
    (2x the bytes). A backend's ``MAX`` need not propagate a nan: gloo's (``std::max``) drops one that arrives as
    its second operand, so at 4 ranks a nan on rank 1 or 2 was lost. No host sync."""
    flat = tensor.view(-1)
    packed = torch.cat([flat, torch.isnan(flat).to(flat.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    n = flat.numel()
    flat.copy_(packed[:n]).masked_fill_(packed[n:] > 0, float("nan"))


@functools.lru_cache(maxsize=64)
def row_index(which: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``which`` as an int64 index on ``device``, made once per (rows, device) and cached: a host-to-device copy
    per call would be a small blocking copy (a host sync) on CUDA. The caller must not write to it."""
    return to_device(torch.tensor(which, dtype=torch.int64), device)


def all_reduce_rows(rows: torch.Tensor, which: list[int], group: dist.ProcessGroup, op: dist.ReduceOp) -> None:
    """Reduce rows ``which`` of the contiguous ``rows`` in place (:func:`all_reduce_small`): **one** collective (the
    whole tensor when every row takes part, else one ``index_select`` / ``index_copy_`` around it)."""
    if len(which) == rows.shape[0]:
        all_reduce_small(rows, group, op)
        return
    index = row_index(tuple(which), rows.device)
    part = rows.index_select(0, index)
    all_reduce_small(part, group, op)
    rows.index_copy_(0, index, part)


def sum_max_rows(rows: torch.Tensor, which: list[int], group: dist.ProcessGroup, sum_columns: int) -> None:
    """Reduce rows ``which`` of the contiguous 2-D ``rows`` over ``group`` in place: their first ``sum_columns``
    columns summed, the others maxed. Where :func:`gathers_sum_max_rows`, **one** ``all_gather_into_tensor`` of the
    rows (``N`` times their bytes received) and both reductions locally, over the ranks in rank order (as
    :func:`all_reduce_small`); else two collectives (one all_reduce each)."""
    if not gathers_sum_max_rows(group):
        sums, maxes = rows[:, :sum_columns].contiguous(), rows[:, sum_columns:].contiguous()
        all_reduce_rows(sums, which, group, dist.ReduceOp.SUM)
        all_reduce_rows(maxes, which, group, dist.ReduceOp.MAX)
        rows[:, :sum_columns], rows[:, sum_columns:] = sums, maxes
        return
    index = None if len(which) == rows.shape[0] else row_index(tuple(which), rows.device)
    part = rows if index is None else rows.index_select(0, index)
    by_rank = _stacked_by_rank(part, group)
    # both reductions over whole rows (contiguous: 5x faster than over the column slices at 10,000 rows, the same
    # values), the maxima's columns spliced into the sums
    reduced = by_rank.sum(0)
    reduced[:, sum_columns:] = by_rank.amax(0)[:, sum_columns:]
    if index is None:
        rows.copy_(reduced)
    else:
        rows.index_copy_(0, index, reduced)


def gather_int_rows_within(values: Sequence[int], group: dist.ProcessGroup, device: torch.device,
                           timeout: datetime.timedelta) -> list[list[int]] | None:
    """Every rank's ``values`` (the same length on every rank), as one row per group rank: one ``all_gather`` of
    ``len(values)`` int64 per rank (``N·8·len`` bytes received), or ``None`` when not every rank joined within
    ``timeout`` (the group is then unusable: a collective is left pending)."""
    local = torch.tensor(list(values), dtype=torch.int64, device=device)
    gathered = torch.empty(dist.get_world_size(group) * local.numel(), dtype=torch.int64, device=device)
    work = _all_gather_single(gathered, local, group=group, async_op=True)
    try:
        work.wait(timeout=timeout)
    except RuntimeError:
        return None
    return gathered.view(-1, local.numel()).tolist()


GLOO_REDUCE_FROM = 4  #: gloo groups of at least this many ranks reduce small values by all_reduce, smaller ones gather


def prefers_all_reduce(group: dist.ProcessGroup) -> bool:
    """Whether a small collective whose combined values every rank needs (an agreement's few int64, a reduction of
    per-parameter partials) is cheapest as one ``all_reduce`` on ``group`` rather than one ``all_gather`` and a local
    reduction: on every backend but gloo (NCCL's small all_reduce runs on a tree, about log N steps; its all_gather
    on a ring, N-1), and on gloo from :data:`GLOO_REDUCE_FROM` ranks on. Measured on gloo (2 CPU cores, after a
    barrier, slowest rank): at 4 ranks an all_reduce of 4 int64 takes 0.84-1.08 ms (median of 400) against
    3.6-3.8 ms for an all_gather of 2; at 2 ranks the medians are alike (0.2-0.4 ms from 64 B to 320 KB) but 23-36%
    of small all_reduces wait a scheduler tick (about 3.5 ms) against 3-13% of all_gathers; at 3 ranks the
    all_gather is faster too. No communication."""
    return backend_of(group) != "gloo" or world_size_of(group) >= GLOO_REDUCE_FROM


def gathers_sum_max_rows(group: dist.ProcessGroup) -> bool:
    """Whether :func:`sum_max_rows` reduces by one ``all_gather`` (and both reductions locally) rather than two
    ``all_reduce``\ s: on gloo, at every world size, where one collective beats two. Measured on gloo (2 CPU
    cores, after a barrier, slowest rank, median of 95): at 4 ranks a (10000, 6) float64 row matrix takes 6.2-7.8
    ms gathered and reduced locally against 14.0-14.7 ms for the two all_reduces (its four and two columns), a
    (198, 6) one 5.0 against 14.6 ms; at 3 ranks 5.4 against 8.4 ms. NCCL keeps the two all_reduces (a small one
    runs on a tree; the gather grows with ``N``). No communication."""
    return backend_of(group) == "gloo"


def max_int_values_within(values: Sequence[int], group: dist.ProcessGroup, device: torch.device,
                          timeout: datetime.timedelta) -> list[int] | None:
    """The element-wise maximum of every rank's ``values`` (the same length on every rank): one ``all_reduce``
    (MAX) of ``len(values)`` int64, or ``None`` when not every rank joined within ``timeout`` (the group is then
    unusable: a collective is left pending). Cheaper than :func:`gather_int_rows_within` where the rows themselves
    are not needed (at 4 gloo ranks a few int64 reduce in a third of an all_gather's time)."""
    local = torch.tensor(list(values), dtype=torch.int64, device=device)
    work = dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        work.wait(timeout=timeout)
    except RuntimeError:
        return None
    return local.tolist()


def all_gather_objects(obj: object, group: dist.ProcessGroup) -> list[object]:
    """Every rank's picklable ``obj`` (``all_gather_object``; for error messages, not for data)."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *,
                      async_op: bool = False) -> dist.Work | None:
    """One ``all_gather`` of an equal-size 1-D ``inp`` into ``out`` (``N×`` its length)."""
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def all_gather_by_all_to_all(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *,
                             async_op: bool = False) -> list[dist.Work]:
    """What ``all_gather_single(out, inp)`` leaves in ``out`` (``N×`` the equal-size 1-D ``inp``, rank after rank),
    by **one** ``all_to_all_single``: bytes per rank sent and received ``(N-1)·S`` (``S`` = ``inp``'s bytes), as an
    all_gather's.

    Gloo's all_gather lands in a staging buffer of ``N·S`` it allocates per call and then copies out (and copies
    the rank's own input into it); its all_to_all receives straight into the output. With 2 ranks the other rank's
    half is received in place (:func:`peer_partitions_by_all_to_all`) and ``inp`` copied locally into this rank's
    half: measured on 2 gloo ranks sharing 2 cores, 21 MiB gathered, about half the time of
    ``all_gather_into_tensor``. With ``N > 2`` ranks the input is ``inp`` repeated ``N`` times (one local copy of
    ``N·S`` into a scratch buffer, held by the pending work), since an all_to_all sends each peer its own
    contiguous piece of one input, and every piece lands in place; with 1 rank, one local copy and no collective.
    Returns the pending work when async."""
    world = dist.get_world_size(group)
    n = inp.numel()
    if out.numel() != world * n:
        raise ValueError(f"out has {out.numel()} elements, expected {world} x {n}")
    if not collective_path(world):
        out.copy_(inp)
        return []
    if world == 2:
        rank = dist.get_rank(group)
        out.narrow(0, rank * n, n).copy_(inp)
        return peer_partitions_by_all_to_all(out.narrow(0, (1 - rank) * n, n), inp, group, async_op=async_op)
    splits = [n] * world
    return all_to_all_into(out, inp.repeat(world), splits, splits, group, async_op=async_op)


def peer_partitions_by_all_to_all(peers: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *,
                                  async_op: bool = False) -> list[dist.Work]:
    """Every other rank's equal-size 1-D ``inp``, back to back in rank order (this rank's skipped), into ``peers``
    (``(N-1)×`` its length), by **one** ``all_to_all_single`` that sends nothing to this rank itself: ``(N-1)·S``
    bytes sent and received per rank. The input is ``inp`` itself with 2 ranks, else ``inp`` repeated ``N-1`` times
    (one local copy of ``(N-1)·S`` into a scratch buffer, held by the pending work); nothing with 1 rank. Returns the
    pending work when async."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = inp.numel()
    if peers.numel() != (world - 1) * n:
        raise ValueError(f"peers has {peers.numel()} elements, expected {world - 1} x {n}")
    if not collective_path(world):
        return []  # no peers
    splits = [0 if r == rank else n for r in range(world)]
    return all_to_all_into(peers, inp if world == 2 else inp.repeat(world - 1), splits, splits, group,
                           async_op=async_op)


# --- building blocks of zero_dtensor.redistribute -------------------------------------------------------------------


def all_to_all_into(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> list[dist.Work]:
    """One ``all_to_all_single`` with uneven splits: the first ``in_splits[0]`` elements of the 1-D ``inp`` go to
    group rank 0, the next ``in_splits[1]`` to rank 1, ...; ``out`` receives ``out_splits[s]`` elements from each
    rank ``s``, in rank order (every rank's splits must match its peers'). Bytes per rank: sent
    ``sum(in_splits) - in_splits[self]``, received ``sum(out_splits) - out_splits[self]`` (times the element size).
    gloo (pairwise), NCCL and MPI implement it. Returns the pending work when async."""
    work = dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group, async_op=async_op)
    return [work] if async_op and work is not None else []


def sum_ints(values: Sequence[int], group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Element-wise sum of a few ints over the group: one ``all_reduce(SUM)`` of ``len(values)`` int64
    (``2(N-1)/N · 8·len`` bytes per rank). For error flags and small bookkeeping, not for data."""
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()
