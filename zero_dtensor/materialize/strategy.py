"""How bulk materialization travels: ``all_gather`` of the partitions, the same gather by ``all_to_all`` or by
point-to-point ops (``send_recv``), or a zero-padded ``all_reduce``.

``"all_gather"``
    one ``all_gather`` of the equal-size partitions per (process group, dtype, device), coalesced over the flat
    groups that share them: ``(N-1)/N·S`` bytes per rank. The default on NCCL.
``"all_to_all"``
    the partitions by one ``all_to_all_single`` per flat group (it has no coalesced form), the same ``(N-1)/N·S``
    bytes per rank: ZeRO-1/2 rank after rank, as an all_gather leaves them
    (:func:`~zero_dtensor.comm.collectives.all_gather_by_all_to_all`); ZeRO-3 the other ranks' partitions received back
    to back (:func:`~zero_dtensor.comm.collectives.peer_partitions_by_all_to_all`) while this rank's is copied into its
    rows of parameter order, then theirs into the rest (one row copy each,
    :meth:`~zero_dtensor.materialize.assembly.GroupAssembly.peer_rows`; where rows do not pay, gathered as ZeRO-1/2 and
    reordered). Gloo's all_gather lands in a staging buffer of ``S`` it allocates per call and copies out of (the
    rank's own input too); its all_to_all receives in place and sends nothing to the rank itself. With more than 2
    ranks the input is the partition repeated (a local copy of up to ``S``). Measured on 2 gloo ranks sharing 2
    cores, 21 MiB: a bare all_to_all gather 0.63-0.72 of an ``all_gather_into_tensor``'s time.
``"send_recv"``
    the same gather by **one** batch of point-to-point ops per (process group, dtype, device) (``isend`` of each
    partition to every peer, ``irecv`` of every peer's, ``2(N-1)`` per flat group,
    :func:`~zero_dtensor.comm.point_to_point.send_recv`; coalesced on NCCL, posted one by one on gloo), the same
    ``(N-1)/N·S`` bytes per rank: every partition sent as it is (no copy of ``S``, unlike ``all_to_all`` with more
    than 2 ranks), every peer's received straight into its place (ZeRO-1/2: its rows of the output, this rank's
    own copied locally meanwhile; ZeRO-3: back to back, then reordered as ``all_to_all`` does). Measured on gloo
    (torchrun, 2/3/4 ranks sharing 2 cores, 80 MB): 0.32/0.38/0.41 of a bare ``all_gather_into_tensor``'s time.
    ``CommDebugMode`` does not see point-to-point ops: :func:`~zero_dtensor.comm.point_to_point.counting_p2p` counts them.
``"all_reduce"``
    each rank writes its partition into a zeroed full-size buffer, then one sum ``all_reduce`` of that buffer:
    ``2(N-1)/N·S`` bytes per rank, plus a memset of ``S``. Exact (every element has exactly one non-zero
    contributor; ``x + 0 == x`` in every float format). For ZeRO-3 it writes straight into parameter order, which
    skips the reordering copy.
``"auto"``
    the pinned strategy if one is set (:func:`set_gather_strategy` or ``ZERO_DTENSOR_GATHER_STRATEGY``), else
    ``all_gather`` on every backend but gloo; on gloo the candidates are measured once per (process group, device,
    dtype, power-of-two size class, ...) and the fastest is cached (:func:`calibrate`): all_gather, all_reduce and
    send_recv (one batch per transfer), and all_to_all where the transfer is one flat group (it has no coalesced
    form, and ``auto`` never issues more data collectives than one per transfer). Transfers under
    ``CALIBRATION_MIN_BYTES`` (1 MiB) are not measured and use all_gather.

A ZeRO-3 ``all_gather`` of ``PIPELINE_MIN_BYTES`` (16 MiB) or more is *pipelined* (:func:`pipelines`): it travels as
two all_gathers issued at once, of the columns up to a parameter boundary near 3/4 of every partition and of the
rest (:attr:`~zero_dtensor.layout.plan.GroupPlan.column_pieces`), and each part is reordered into parameter order once it
has arrived, in issue order. One collective more. Where the group runs collectives in issue order (NCCL: one
communication stream) the second part travels while the first is reordered. Gloo runs the two at once on its worker
threads: the smaller second part has then usually arrived before the first (25-27 of 30 calls, 2 ranks, 21 MiB) and
both reorders (a memory-bound copy of ``S``, 25-35% of the gather's time on gloo) follow the transfers; what the
pipelining gains there comes from the two concurrent transfers finishing sooner than one (2 gloo ranks sharing 2
cores, 21 MiB, 16 launches: 1.12-1.43 of a bare all_gather instead of 1.31-1.58). Smaller transfers are
latency-bound: one collective, reordered after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm.collectives import (all_gather_by_all_to_all, all_gather_single, all_reduce_op, max_across,
                                peer_partitions_by_all_to_all)
from ..layout.plan import PIPELINE_FIRST_SHARE
from ..comm.point_to_point import all_gather_by_send_recv, peer_partitions_by_send_recv
from ..comm.process_groups import (backend_of, comm_support_of, communicates, global_rank, group_rank_of,
                                   world_size_of)
from ..settings import ENV_STRATEGY, STRATEGIES, check_strategy, gather_strategy, pinned, set_gather_strategy

__all__ = [
    "CALIBRATION_ALL_TO_ALL_COLLECTIVES",
    "CALIBRATION_COLLECTIVES",
    "CALIBRATION_MAX_BYTES",
    "CALIBRATION_MIN_BYTES",
    "CALIBRATION_PIPELINED_COLLECTIVES",
    "CALIBRATION_SEND_RECV_BATCHES",
    "ENV_STRATEGY",
    "PIPELINE_MIN_BYTES",
    "STRATEGIES",
    "WINDOW_BYTES",
    "WINDOW_SHARE",
    "CALIBRATES",
    "calibrate",
    "check_strategy",
    "clear_calibration",
    "check_possible",
    "explicit",
    "gather_strategy",
    "pinned",
    "pipelines",
    "planned",
    "resolve",
    "set_gather_strategy",
    "strategy_decisions",
    "stream_strategy",
    "window_bytes",
    "windowed",
]

#: Collectives one calibration issues: 1 untimed + 3 timed all_gathers and as many all_reduces of the transfer's size
#: (capped at ``CALIBRATION_MAX_BYTES``) + 1 ``all_reduce(MAX)`` of the timings so that every rank takes the same
#: decision.
CALIBRATION_COLLECTIVES = 9
#: The same where the all_gather is pipelined (:func:`pipelines`): each of its 4 rounds is two all_gathers.
CALIBRATION_PIPELINED_COLLECTIVES = 13
#: Added to either where the all_to_all is a candidate too (a transfer of one flat group): its 4 rounds.
CALIBRATION_ALL_TO_ALL_COLLECTIVES = 4
#: Point-to-point batches (:func:`~zero_dtensor.comm.point_to_point.send_recv`) added to either on gloo, where send_recv is
#: a candidate: its 4 rounds.
CALIBRATION_SEND_RECV_BATCHES = 4
#: ZeRO-3 all_gathers of at least this many bytes (a power of two: a size class of calibration) are pipelined.
PIPELINE_MIN_BYTES = 16 * 2**20
CALIBRATION_MAX_BYTES = 128 * 2**20
#: ZeRO-3 gathers (every gather strategy) of more than this many bytes travel in column windows (:func:`windowed`)
#: through one staging buffer of :func:`window_bytes` (this, or 1/:data:`WINDOW_SHARE` of the transfer where that is
#: more; kept between calls): the staging memory beyond the result is one such buffer (or the widest parameter's
#: ``(N, chunk)`` block, where one is wider). It holds :data:`WINDOWS_IN_FLIGHT` windows at once where that keeps
#: the collective count (:func:`~zero_dtensor.materialize.transfers.window_cut`), else one window of all of it.
WINDOW_BYTES = 64 * 2**20
#: a windowed transfer of ``S`` bytes stages through ``max(WINDOW_BYTES, S / WINDOW_SHARE)``: at most
#: ``2·WINDOW_SHARE`` collectives plus one per flat group, not ``S / 64 MiB``
WINDOW_SHARE = 8
#: windows of a synchronous windowed gather in flight at once (each of at most 1/this of the staging buffer): the
#: next window's collective travels while the one before is reordered
WINDOWS_IN_FLIGHT = 2
#: Below this size ``auto`` does not calibrate and uses all_gather (fewer bytes): small transfers are latency-bound.
CALIBRATION_MIN_BYTES = 2**20

_DECISIONS: dict[tuple[Any, ...], str] = {}


def strategy_decisions() -> dict[tuple[Any, ...], str]:
    """Calibrated ``auto`` decisions so far: ``{(process group, device type, dtype, size class, all_to_all a
    candidate, pipelined, reorder): strategy}``. No communication."""
    return dict(_DECISIONS)


def clear_calibration() -> None:
    """Forget calibrated decisions (the next ``auto`` call on gloo measures again). Call it on every rank: a rank
    that forgot plans to calibrate where the others do not, and the next ``full_tensors`` raises
    ``RankDisagreementError`` on every rank. No communication."""
    _DECISIONS.clear()


def _size_class(nbytes: int) -> int:
    return max(int(nbytes), 1).bit_length()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def pipelines(nbytes: int, reorder: bool) -> bool:
    """Whether an all_gather of a bulk transfer of ``nbytes`` (the gathered bytes) travels in two pipelined steps:
    ZeRO-3 (``reorder``) transfers of at least ``PIPELINE_MIN_BYTES`` (where a parameter boundary lies inside the
    partitions to cut them at). No communication."""
    return reorder and nbytes >= PIPELINE_MIN_BYTES


def windowed(nbytes: int, reorder: bool) -> bool:
    """Whether a gather of a bulk transfer of ``nbytes`` (the gathered bytes) travels in bounded column windows:
    ZeRO-3 (``reorder``) transfers of more than :data:`WINDOW_BYTES`. Each window is one collective of the
    transfer's strategy into a staging buffer of :func:`window_bytes` (two windows of half of it in flight, or one of
    all of it: :func:`~zero_dtensor.materialize.transfers.window_cut`), then one reordering copy into its part of
    the result, while the next travels, so that no staging twin of the result is ever allocated. No
    communication."""
    return reorder and nbytes > WINDOW_BYTES


def window_bytes(nbytes: int) -> int:
    """The staging buffer of a windowed transfer of ``nbytes`` (gathered bytes): ``max(WINDOW_BYTES,
    ceil(nbytes / WINDOW_SHARE))`` (a 2 GiB transfer: 256 MiB, two windows of 128 MiB in flight, 16-17
    collectives; the staging memory beyond the result). No communication."""
    return max(WINDOW_BYTES, -(-int(nbytes) // WINDOW_SHARE))


def calibrate(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, nbytes: int,
              unpack: bool = False, pipelined: bool = False, all_to_all: bool = False,
              send_recv: bool = True) -> str:
    """Time the strategies at ``nbytes`` (capped at ``CALIBRATION_MAX_BYTES``) and return the fastest: all_gather,
    all_reduce, with ``send_recv`` send_recv and, with ``all_to_all``, all_to_all. **Collective**
    (``CALIBRATION_COLLECTIVES`` = 9 collectives; ``CALIBRATION_PIPELINED_COLLECTIVES`` = 13 with ``pipelined``,
    unless the scratch partition is a single element; ``CALIBRATION_ALL_TO_ALL_COLLECTIVES`` = 4 more with
    ``all_to_all``; ``CALIBRATION_SEND_RECV_BATCHES`` = 4 point-to-point batches with ``send_recv``).

    Each rank runs each once untimed (a first transfer of a size costs more on gloo: measured first, all_reduce won
    calibrations that all_gather won once warm), then times, 3 times and interleaved, what each strategy does on
    scratch buffers: all_gather is the collective, plus, with ``unpack`` (ZeRO-3, where only gathered results need
    a reordering copy into parameter order), one local copy of the gathered buffer right after it (where the gather
    has left the caches) — with ``pipelined``, two all_gathers issued at once (3/4 and 1/4 of the partition), each
    part copied once it has arrived, in issue order, as :mod:`~zero_dtensor.materialize.bulk` does; all_to_all is
    :func:`~zero_dtensor.comm.collectives.all_gather_by_all_to_all`, or, with ``unpack``, as bulk does it: the other
    ranks' partitions received (:func:`~zero_dtensor.comm.collectives.peer_partitions_by_all_to_all`) while this rank's
    is copied, then the received ones copied; send_recv the same by
    :func:`~zero_dtensor.comm.point_to_point.all_gather_by_send_recv` /
    :func:`~zero_dtensor.comm.point_to_point.peer_partitions_by_send_recv`; all_reduce is
    the zero fill of the full buffer, the copy of the rank's own part into it, then the collective. The per-rank
    minimum of each is then maximized over the group in one ``all_reduce(MAX)``, so every rank takes the same
    decision. Scratch memory: about ``2·nbytes`` (``3·nbytes`` with ``unpack``; capped), freed on return. Ties go
    to all_gather (fewer bytes than all_reduce; no scratch input, unlike all_to_all with more than 2 ranks).
    """
    world = world_size_of(group)
    esize = torch.empty((), dtype=dtype).element_size()
    per_rank = max(1, min(int(nbytes), CALIBRATION_MAX_BYTES) // esize // world)
    full = torch.zeros(per_rank * world, dtype=dtype, device=device)
    part = full.narrow(0, 0, per_rank).clone()
    own = full.narrow(0, group_rank_of(group, global_rank()) * per_rank, per_rank)
    reordered = torch.zeros_like(full) if unpack else None  # touched once here: no page faults in the timing
    first = min(max(1, round(PIPELINE_FIRST_SHARE * per_rank)), per_rank - 1) if pipelined and per_rank > 1 else 0

    def gather() -> None:
        if first:
            _pipelined_gather(full, part, reordered, first, group)
            return
        all_gather_single(full, part, group)
        if reordered is not None:
            reordered.copy_(full)

    def gather_from_peers(whole: Callable[..., Any], peers_only: Callable[..., Any]) -> Callable[[], None]:
        """The all_to_all or send_recv gather as full_tensors issues it: rank after rank (``whole``), or, where it
        reorders, the peers' partitions back to back (``peers_only``) while this rank's own is copied."""
        def run() -> None:
            if reordered is None:
                whole(full, part, group)
                return
            peers = full.narrow(0, 0, (world - 1) * per_rank)
            works = peers_only(peers, part, group, async_op=True)
            reordered.narrow(0, (world - 1) * per_rank, per_rank).copy_(part)
            for work in works:
                work.wait()
            reordered.narrow(0, 0, (world - 1) * per_rank).copy_(peers)
        return run

    gather_by_all_to_all = gather_from_peers(all_gather_by_all_to_all, peer_partitions_by_all_to_all)
    gather_by_send_recv = gather_from_peers(all_gather_by_send_recv, peer_partitions_by_send_recv)

    def reduce() -> None:
        full.zero_()
        own.copy_(part)
        all_reduce_op(full, group, dist.ReduceOp.SUM)

    runs = {"all_gather": gather, "all_to_all": gather_by_all_to_all, "all_reduce": reduce,
            "send_recv": gather_by_send_recv}
    if not all_to_all:
        del runs["all_to_all"]
    if not send_recv:
        del runs["send_recv"]
    timings = dict.fromkeys(runs, float("inf"))
    for attempt in range(4):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            _sync(device)
            if attempt:  # attempt 0 is the warm-up
                timings[name] = min(timings[name], time.perf_counter() - t0)
    reordered = None  # freed before the agreement (the closures above are done with it)
    slowest = dict(zip(runs, max_across(list(timings.values()), group, device)))
    return min(runs, key=lambda name: (slowest[name], name != "all_gather"))


def _pipelined_gather(full: torch.Tensor, part: torch.Tensor, reordered: torch.Tensor | None, first: int,
                      group: dist.ProcessGroup) -> None:
    """Two all_gathers issued at once (``part[:first]``, ``part[first:]``), each copied once it has arrived."""
    world = world_size_of(group)
    spans = ((0, first), (first, part.numel() - first))  # (start, length) in the partition
    works = [all_gather_single(full.narrow(0, world * start, world * length), part.narrow(0, start, length), group,
                               async_op=True) for start, length in spans]
    for work, (start, length) in zip(works, spans):
        assert work is not None
        work.wait()
        if reordered is not None:
            reordered.narrow(0, world * start, world * length).copy_(full.narrow(0, world * start, world * length))


def explicit(strategy: str) -> str:
    """``strategy`` itself unless it is ``"auto"``, else the pinned one (``"auto"`` when none is pinned)."""
    return gather_strategy() if strategy == "auto" else strategy


def check_possible(chosen: str, group: dist.ProcessGroup, device: torch.device) -> None:
    """Refuse ``send_recv`` (asked for, or pinned) where ``group``'s backend has no point-to-point ops for tensors
    on ``device`` (:func:`~zero_dtensor.comm.process_groups.comm_support`: gloo over CUDA tensors), before anything
    moves: ``ValueError``. No communication."""
    if chosen == "send_recv" and not comm_support_of(group, device).point_to_point:
        raise ValueError(f"strategy='send_recv' cannot run on {backend_of(group)} with {device.type} tensors (its "
                         f"isend/irecv cannot move them); use strategy='auto' or 'all_gather', or unpin it "
                         f"(set_gather_strategy(None) / unset ZERO_DTENSOR_GATHER_STRATEGY)")


def _decision_key(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, nbytes: int, unpack: bool,
                  pipelined: bool, one_group: bool) -> tuple[Any, ...]:
    return (group, device.type, dtype, _size_class(nbytes), one_group, pipelined, unpack)


#: what :func:`planned` answers where ``auto`` will calibrate first
CALIBRATES = "calibrate"


def planned(strategy: str, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, nbytes: int,
            unpack: bool = False, pipelined: bool = False, one_group: bool = False) -> str:
    """What :func:`resolve` will do, without doing it: the strategy, or :data:`CALIBRATES` where ``auto`` has no
    decision yet (the rank agreement compares this across ranks before any collective). No communication."""
    chosen = explicit(strategy)
    check_possible(chosen, group, device)
    if chosen != "auto":
        return chosen
    if backend_of(group) != "gloo" or nbytes < CALIBRATION_MIN_BYTES or not communicates(group):
        return "all_gather"  # (one rank: nothing travels, bulk copies the partition; nothing to time)
    decision = _DECISIONS.get(_decision_key(group, device, dtype, nbytes, unpack, pipelined, one_group))
    return CALIBRATES if decision is None else decision


def resolve(strategy: str, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, nbytes: int,
            unpack: bool = False, pipelined: bool = False, one_group: bool = False) -> str:
    """The strategy a bulk transfer of ``nbytes`` uses (may calibrate: see the module docstring). ``unpack``: an
    all_gather result needs reordering; ``pipelined``: an all_gather of this transfer would be pipelined
    (:func:`pipelines`, and a parameter boundary lies inside a partition to cut it at); ``one_group``: the transfer
    is one flat group (then all_to_all is a candidate). **Collective** where :func:`planned` answers
    :data:`CALIBRATES` (every rank must: the rank agreement checks it first)."""
    decision = planned(strategy, group, device, dtype, nbytes, unpack, pipelined, one_group)
    if decision != CALIBRATES:
        return decision
    key = _decision_key(group, device, dtype, nbytes, unpack, pipelined, one_group)
    decision = _DECISIONS[key] = calibrate(group, device, dtype, nbytes, unpack, pipelined, one_group,
                                           send_recv=comm_support_of(group, device).point_to_point)
    return decision


def stream_strategy(strategy: str, group: dist.ProcessGroup, param_order_gather: bool,
                    device: torch.device) -> str:
    """What ``iter_full`` uses per window of tensors on ``device``: the explicit or pinned strategy (``all_to_all``
    windows travel by all_gather: a window is small and gathered into scratch; ``send_recv`` where point-to-point
    ops cannot move them raises ``ValueError``, :func:`check_possible`), else ``send_recv`` on gloo over CPU
    tensors (every peer's share received in place: the fewest bytes, no padding, no zero fill, and gloo's
    cheapest gather), all_reduce for parameter-order (ZeRO-1/2) windows elsewhere (no stitching), all_gather for
    ZeRO-3 windows elsewhere. No communication."""
    chosen = explicit(strategy)
    check_possible(chosen, group, device)
    if chosen == "all_to_all":
        return "all_gather"
    if chosen != "auto":
        return chosen
    if comm_support_of(group, device).point_to_point and backend_of(group) == "gloo":
        return "send_recv"
    return "all_reduce" if param_order_gather else "all_gather"
