"""Full (unsharded) gradients from ZeRO partitions: bulk (``full_tensors``) and streaming (``iter_full``).

Both are reached through ``ShardedGrads.full_tensors`` / ``ShardedGrads.iter_full``. Everything here is
**collective**: every rank of a group's data-parallel process group must make the same calls with the same arguments,
in the same order.

Notation: ``N`` ranks in a group's process group, ``S`` the bytes of the padded flat buffers being materialized, in
the dtype DeepSpeed stores them. "Bytes per rank" follows the ring model (nccl-tests ``PERFORMANCE.md``): all_gather
and reduce-scatter move ``(N-1)/N·S``, all_reduce ``2(N-1)/N·S``; a gather sends ``S/N`` from every rank and
delivers ``(N-1)/N·S`` to the root.

Modules, one concept each: :mod:`.assembly` and :mod:`.placements` (how each placement kind's buffer is assembled
from its ranks: per-parameter gathers, reorders, streaming windows), :mod:`.strategy` (all_gather, all_to_all, send_recv or all_reduce, calibration on gloo),
:mod:`.buffers` (the allocator with its observers, recycling, the kept workspace), :mod:`.results` (the result dict
and the pending handle), :mod:`.bulk` (``full_tensors``: validation and the call), :mod:`.transfers` (what a call
moves and the buffers it lands in), :mod:`.gathers` (each strategy's transfer issued), :mod:`.emit` (the result
cut into parameters), :mod:`.stream` (``iter_full``).
"""

from __future__ import annotations

from typing import Any

from ..core.state import GradsLike, state_of
from . import buffers, bulk, results, stream, strategy
from .buffers import BUFFERS, AllocationRecorder, BufferPool, release_workspace
from .results import FullGrads, FullTensorsHandle, GatheredGrads, PendingFullTensors
from .strategy import (
    CALIBRATION_ALL_TO_ALL_COLLECTIVES,
    CALIBRATION_COLLECTIVES,
    CALIBRATION_MAX_BYTES,
    CALIBRATION_PIPELINED_COLLECTIVES,
    CALIBRATION_SEND_RECV_BATCHES,
    ENV_STRATEGY,
    PIPELINE_MIN_BYTES,
    STRATEGIES,
    calibrate,
    clear_calibration,
    gather_strategy,
    set_gather_strategy,
    strategy_decisions,
)
from .stream import DEFAULT_BUCKET_BYTES

__all__ = [
    "AllocationRecorder",
    "BUFFERS",
    "BufferPool",
    "CALIBRATION_ALL_TO_ALL_COLLECTIVES",
    "CALIBRATION_COLLECTIVES",
    "CALIBRATION_MAX_BYTES",
    "CALIBRATION_PIPELINED_COLLECTIVES",
    "CALIBRATION_SEND_RECV_BATCHES",
    "DEFAULT_BUCKET_BYTES",
    "ENV_STRATEGY",
    "FullGrads",
    "FullTensorsHandle",
    "GatheredGrads",
    "PIPELINE_MIN_BYTES",
    "PendingFullTensors",
    "STRATEGIES",
    "calibrate",
    "clear_calibration",
    "gather_strategy",
    "plan_windows",
    "release_workspace",
    "set_gather_strategy",
    "strategy_decisions",
]


def plan_windows(grads: GradsLike, names: list[str] | None = None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 strategy: str = "auto") -> list[dict[str, Any]]:
    """The windows ``iter_full`` would use (for tests and the benchmark). No communication."""
    state = state_of(grads)
    return stream.plan_windows(state, state.select(names), bucket_bytes=bucket_bytes, strategy=strategy)
