"""What a ``full_tensors`` call moves and where it lands: its *transfers* (the sharded flat groups that share a
process group, dtype and device, and travel in one collective or one batch of point-to-point ops), the strategy
each uses (:mod:`.strategy`), and the buffers they are assembled in (the previous result's, the kept workspace or
the recycling pool: :mod:`.buffers`). Planning only: no communication.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..layout.flat import ParamLayout
from .placements import assembly_of
from ..layout.plan import ColumnPiece
from ..comm.process_groups import communicates
from ..core.state import FlatState
from ..layout.views import ViewCache
from .buffers import BUFFERS
from .results import GatheredGrads
from . import strategy as _strategy
from .strategy import explicit, pipelines, planned, windowed

__all__ = ["Buffers", "Transfer", "narrower", "pipeline_pieces", "plan_transfers", "view_cache", "window_cut",
           "window_pieces"]


@dataclass
class Transfer:
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
    windowed: bool = False  # a gather of it travels in bounded column windows (ZeRO-3, large: strategy.windowed)
    single: bool = False  # its process group has one rank: the partitions are the whole, nothing travels
    offsets: dict[int, int] = field(default_factory=dict)  # group index -> start in the transfer buffer
    numel: int = 0

    def key(self) -> tuple[Any, ...]:
        return ("transfer", self.pg, self.dtype, self.device, self.strategy, tuple(self.groups), self.numel)

    @property
    def nbytes(self) -> int:
        """Bytes of the assembled groups (stored dtype)."""
        return self.numel * self.partitions[0].element_size()


def plan_transfers(state: FlatState, params: list[ParamLayout], dst: int | None, strategy: str) -> list[Transfer]:
    """The transfers a ``full_tensors`` call of ``params`` will make, each with the strategy it will use
    (:data:`~.strategy.CALIBRATES` where ``auto`` calibrates first): what the call's rank agreement compares (a pinned
    strategy, an environment variable or a calibration cache that differs between ranks shows here), then what
    :func:`full_tensors` runs. No communication."""
    transfers = _transfers(state, sorted(state.plan.by_group(params)))
    for t in transfers:
        t.single = not communicates(t.pg)
        if dst is not None:  # no calibration: it times the all-rank collectives, while dst= uses gather/reduce
            chosen = explicit(strategy)
            t.strategy = "all_reduce" if chosen == "all_reduce" else "all_gather"  # all_to_all: a gather too
            continue
        t.reorder = any(assembly_of(state.group(g)).reorder_area(state.group(g)) for g in t.groups)
        # the pieces (and their row copies) are planned only for transfers large enough to pipeline
        t.windowed = windowed(t.nbytes, t.reorder)
        t.pipelinable = (not t.windowed and pipelines(t.nbytes, t.reorder)
                         and any(len(pipeline_pieces(state, g)) > 1 for g in t.groups))
        t.strategy = planned(strategy, t.pg, t.device, t.dtype, t.nbytes, t.reorder, t.pipelinable,
                             one_group=len(t.groups) == 1)
    return transfers


def _transfers(state: FlatState, group_indices: Sequence[int]) -> list[Transfer]:
    found: dict[tuple[Any, ...], Transfer] = {}
    for i in group_indices:
        if not state.group(i).placement.is_sharded:
            continue
        part = state.comm_partition(i)
        pg = state.storage.process_groups[i]
        t = found.setdefault((pg, part.dtype, part.device), Transfer(pg, part.dtype, part.device))
        t.offsets[i] = t.numel
        t.numel += state.group(i).flat_numel
        t.groups.append(i)
        t.partitions.append(part)
    return list(found.values())


def window_pieces(state: FlatState, g: int, window_bytes: int) -> tuple[ColumnPiece, ...]:
    """Group ``g``'s column windows whose gathered ``(N, width)`` rows hold at most ``window_bytes`` (one wider
    parameter alone): :meth:`~zero_dtensor.materialize.assembly.GroupAssembly.window_pieces`."""
    group = state.group(g)
    element_size = state.storage.partitions[g].element_size()
    max_width = window_bytes // (element_size * group.world_size)
    return assembly_of(group).window_pieces(state.plan.groups[g], element_size, max_width)


def window_cut(state: FlatState, groups: Sequence[int], window_bytes: int) -> tuple[list[tuple[ColumnPiece, ...]], int]:
    """How a windowed transfer of ``groups`` with a staging buffer of ``window_bytes`` travels: each group's windows
    and how many are in flight at once. Two windows of at most half the buffer each (the next one's collective
    overlaps the reorder of the one before, :class:`~.gathers.WindowedGather`) where that keeps the transfer of
    ``S`` bytes within ``2·S/window_bytes`` windows plus one per group (the count :func:`~.strategy.window_bytes`
    promises; parameters as wide as half the buffer would double it), else one window of the whole buffer at a
    time. No communication."""
    halves = [window_pieces(state, g, window_bytes // _strategy.WINDOWS_IN_FLIGHT) for g in groups]
    nbytes = sum(state.group(g).flat_numel * state.storage.partitions[g].element_size() for g in groups)
    if sum(map(len, halves)) <= 2 * nbytes // window_bytes + len(groups):
        return halves, _strategy.WINDOWS_IN_FLIGHT
    return [window_pieces(state, g, window_bytes) for g in groups], 1


def pipeline_pieces(state: FlatState, g: int) -> tuple[ColumnPiece, ...]:
    element_size = state.storage.partitions[g].element_size()
    return assembly_of(state.group(g)).pipeline_pieces(state.plan.groups[g], element_size)


# --- buffers -----------------------------------------------------------------------------------------------------
class Buffers:
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


def narrower(buf: torch.Tensor, cache: Any) -> Any:
    """``narrow(start, length)`` of ``buf``: views kept in the buffer's cache when it is kept. The collectives get
    these kept views, so a backend thread that holds its inputs a moment after ``wait()`` holds no extra view of
    the memory, and the buffer is found free (and reused, with its cut views) by the next call."""
    if cache is None:
        return lambda start, length: buf.narrow(0, start, length)
    base = buf.storage_offset()
    return lambda start, length: cache.get(("narrow", base + start, length),
                                           lambda _: [buf.narrow(0, start, length)])[0]


def view_cache(result: Any, t: torch.Tensor) -> ViewCache | None:
    """The cache of the kept buffer ``t`` is a view of: the pool's, else that of a :class:`GatheredGrads`
    ``result`` holding it; None for memory nobody keeps (cut anew)."""
    cache = BUFFERS.view_cache(t)
    if cache is None and isinstance(result, GatheredGrads):
        cache = result.view_cache(t)
    return cache

