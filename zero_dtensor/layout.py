"""The neutral gradient layout: flat groups, per-parameter ranges and placements.

Nothing here knows DeepSpeed. An adapter in :mod:`zero_dtensor._deepspeed` reads the optimizer's private state once
and describes it with these frozen dataclasses; everything else (views, collectives, transforms) works on them.

Two packings cover every ZeRO stage:

``Packing.CONTIGUOUS`` (ZeRO-1/2, ``BF16_Optimizer``)
    Parameters lie back to back in one global flat buffer of ``world_size * partition_numel`` elements (padded with
    zeros); rank ``r`` owns ``[r * P, (r + 1) * P)``. A parameter straddles ranks at arbitrary offsets, so its pieces
    are *ragged* and must never be described as a per-parameter ``Shard(0)`` DTensor.

``Packing.CHUNKED`` (ZeRO-3)
    Every parameter is split like ``torch.chunk(flat_param, world_size)``: chunks of ``ceil(numel / world_size)``
    elements, each stored at the same ``offset`` in every rank's partition (zero-padded at the end). A parameter is
    therefore an exact (possibly uneven) ``Shard(0)`` DTensor.

A group is either sharded (every rank holds ``partition_numel`` elements of a ``world_size * partition_numel`` buffer)
or replicated (every rank holds the whole buffer; ``partition_numel`` is then the full length).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["GradLayout", "GroupLayout", "Packing", "ParamLayout"]


class Packing(enum.Enum):
    CONTIGUOUS = "contiguous"
    CHUNKED = "chunked"


@dataclass(frozen=True)
class GroupLayout:
    """One flat gradient buffer, as seen from every rank of its process group."""

    index: int
    world_size: int
    rank: int
    partition_numel: int
    dtype: torch.dtype
    packing: Packing
    replicated: bool = False

    @property
    def flat_numel(self) -> int:
        """Global length of the (padded) flat buffer."""
        return self.partition_numel if self.replicated else self.partition_numel * self.world_size

    @property
    def local_start(self) -> int:
        """Where this rank's partition starts in the global flat buffer (contiguous packing)."""
        return 0 if self.replicated else self.rank * self.partition_numel


@dataclass(frozen=True)
class ParamLayout:
    """Where one trainable parameter's gradient lives inside its group.

    ``offset`` is the start in the global flat buffer for contiguous packing, and the start inside *every* rank's
    partition for chunked packing (where each rank holds ``chunk_numel`` elements of the parameter).
    """

    name: str
    shape: torch.Size
    group: int
    offset: int
    chunk_numel: int = 0

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def rank_range(self, group: GroupLayout, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the elements of the flattened parameter that ``rank`` holds."""
        if group.replicated:
            return 0, self.numel
        if group.packing is Packing.CHUNKED:
            start = min(rank * self.chunk_numel, self.numel)
            return start, min(start + self.chunk_numel, self.numel)
        lo, hi = rank * group.partition_numel, (rank + 1) * group.partition_numel
        start = min(max(lo - self.offset, 0), self.numel)
        stop = max(min(hi - self.offset, self.numel), start)
        return start, stop

    def local_offset(self, group: GroupLayout, rank: int) -> int:
        """Where the fragment of :meth:`rank_range` starts inside ``rank``'s partition."""
        if group.packing is Packing.CHUNKED and not group.replicated:
            return self.offset
        start, stop = self.rank_range(group, rank)
        if start == stop:
            return 0  # an empty fragment: any in-range offset
        base = 0 if group.replicated else rank * group.partition_numel
        return self.offset + start - base


@dataclass(frozen=True)
class GradLayout:
    """All groups and all trainable parameters (model order) of one engine."""

    groups: tuple[GroupLayout, ...]
    params: tuple[ParamLayout, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in layout: {names}")

    @cached_property
    def by_name(self) -> dict[str, ParamLayout]:
        return {p.name: p for p in self.params}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @cached_property
    def _by_group(self) -> dict[int, tuple[ParamLayout, ...]]:
        grouped: dict[int, list[ParamLayout]] = {}
        for p in self.params:
            grouped.setdefault(p.group, []).append(p)
        return {g: tuple(ps) for g, ps in grouped.items()}

    def params_of(self, group: int) -> tuple[ParamLayout, ...]:
        """The parameters of flat group ``group``, in model order (computed once per layout)."""
        return self._by_group.get(group, ())
