"""The neutral layout of every family (gradients, fp32 masters, optimizer state): flat groups, per-parameter ranges and placements.

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

Where a group's elements lie is its *placement* (:attr:`GroupLayout.placement`), one frozen kind per way DeepSpeed
stores a group; :func:`placement_of` is the one place that reads a group's packing and replication flags.

``N`` ranks, ``P`` elements per rank's partition:

========================  ============================  ===========================================================
kind                      DeepSpeed                     rank ``r`` holds
========================  ============================  ===========================================================
``RaggedShard``           ZeRO-1/2                      ``[r·P, (r+1)·P)`` of the zero-padded flat buffer of
                          (``DeepSpeedZeroOptimizer``)  ``N·P`` elements: a parameter straddles ranks at any offset
``ChunkShard``            ZeRO-3 (``..._Stage3``)       chunk ``r`` of every parameter (``torch.chunk`` of the
                                                        flattened parameter), at the same offset in every partition
``Replicated``            ``BF16_Optimizer``,           the whole buffer (``P`` elements)
                          ``keep_full_grads``
========================  ============================  ===========================================================

How each kind's buffer is assembled from the ranks (which collective, how many bytes) is
:mod:`zero_dtensor.materialize.placements`'s, one layer up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["ChunkShard", "FlatLayout", "GroupLayout", "GroupPlacement", "Packing", "ParamLayout", "RaggedShard",
           "Replicated", "placement_of"]


class Packing(enum.Enum):
    CONTIGUOUS = "contiguous"
    CHUNKED = "chunked"


@dataclass(frozen=True)
class GroupLayout:
    """One flat buffer (of any family), as seen from every rank of its process group: geometry only. The dtype is
    the family's (its storage's partitions): families of the same geometry (gradients, masters, every optimizer-state
    key, clones in another dtype) share one layout and therefore one cached plan."""

    index: int
    world_size: int
    rank: int
    partition_numel: int
    packing: Packing
    replicated: bool = False

    def __post_init__(self) -> None:
        if self.replicated and self.packing is not Packing.CONTIGUOUS:
            raise ValueError("a replicated group holds the whole buffer in parameter order: use Packing.CONTIGUOUS")
        if not 0 <= self.rank < self.world_size or self.partition_numel < 0:
            raise ValueError(f"bad group geometry: rank {self.rank} of {self.world_size}, {self.partition_numel} "
                             "elements per partition")

    @cached_property
    def placement(self) -> GroupPlacement:
        """Where this group's elements lie on its ranks (:func:`placement_of`): geometry only; how its buffer is
        assembled is :func:`zero_dtensor.materialize.placements.assembly_of`'s."""
        return placement_of(self)

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
    """Where one trainable parameter's slice (gradient, master weight or optimizer state) lives inside its group.

    ``offset`` is the start in the global flat buffer for contiguous packing, and the start inside *every* rank's
    partition for chunked packing (where each rank holds ``chunk_numel`` elements of the parameter).
    """

    name: str
    shape: torch.Size
    group: int
    offset: int
    chunk_numel: int = 0

    @cached_property
    def numel(self) -> int:
        return self.shape.numel()

    def rank_range(self, group: GroupLayout, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the elements of the flattened parameter that ``rank`` holds."""
        return group.placement.rank_range(group, self, rank)

    def local_offset(self, group: GroupLayout, rank: int) -> int:
        """Where the fragment of :meth:`rank_range` starts inside ``rank``'s partition."""
        return group.placement.local_offset(group, self, rank)


@dataclass(frozen=True, eq=False)
class FlatLayout:
    """All groups and all trainable parameters (model order) of one engine.

    Compared by identity (a layout is built once per optimizer and reused across steps; its plan is cached on it).
    """

    groups: tuple[GroupLayout, ...]
    params: tuple[ParamLayout, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in layout: {names}")

    @cached_property
    def by_name(self) -> dict[str, ParamLayout]:
        return {p.name: p for p in self.params}

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Every parameter's name, model order (one tuple per layout)."""
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


@dataclass(frozen=True)
class GroupPlacement:
    """Where one kind of flat group's elements lie on its ranks (see the module docstring): pure geometry, no dtype, no
    family, no communication. How a kind's buffer is assembled is :mod:`zero_dtensor.materialize.placements`'s."""

    #: a short name for messages and benchmarks
    kind: str = ""

    @property
    def is_sharded(self) -> bool:
        """Whether assembling the full buffer needs a collective."""
        return True

    @property
    def param_order_gather(self) -> bool:
        """Whether an all_gather of the partitions lands in parameter order (else rows must be reordered)."""
        return True

    @property
    def exact_param_shards(self) -> bool:
        """Whether one parameter's pieces form an exact per-parameter DTensor (``Shard(0)`` of the flattened
        parameter, or ``Replicate``)."""
        return True

    def dtensor_placement(self) -> Placement:
        """The placement of the group's flat ``DTensor``."""
        return Shard(0)

    def rank_range(self, group: GroupLayout, param: ParamLayout, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of the elements of the flattened ``param`` that ``rank`` holds."""
        raise NotImplementedError

    def local_offset(self, group: GroupLayout, param: ParamLayout, rank: int) -> int:
        """Where the fragment of :meth:`rank_range` starts inside ``rank``'s partition."""
        raise NotImplementedError

    def span(self, param: ParamLayout) -> tuple[int, int]:
        """``[start, stop)`` ``param`` occupies in the axis the group is laid out along: the global flat buffer
        (ragged, replicated) or every rank's partition (chunked)."""
        return param.offset, param.offset + param.numel

    def gathered_numel(self, group: GroupLayout) -> int:
        """Elements of the group's assembled buffer."""
        return group.flat_numel


@dataclass(frozen=True)
class RaggedShard(GroupPlacement):
    """ZeRO-1/2: parameters back to back in a zero-padded flat buffer of ``N·P`` elements; rank ``r`` owns
    ``[r·P, (r+1)·P)``. A parameter's pieces are ragged: never describe one as a per-parameter ``Shard(0)``."""

    kind: str = "ragged"

    @property
    def exact_param_shards(self) -> bool:
        return False

    def rank_range(self, group: GroupLayout, param: ParamLayout, rank: int) -> tuple[int, int]:
        lo, hi = rank * group.partition_numel, (rank + 1) * group.partition_numel
        start = min(max(lo - param.offset, 0), param.numel)
        return start, max(min(hi - param.offset, param.numel), start)

    def local_offset(self, group: GroupLayout, param: ParamLayout, rank: int) -> int:
        start, stop = self.rank_range(group, param, rank)
        return 0 if start == stop else param.offset + start - rank * group.partition_numel


@dataclass(frozen=True)
class ChunkShard(GroupPlacement):
    """ZeRO-3: each parameter split like ``torch.chunk(flat_param, N)`` into chunks of ``chunk_numel`` elements,
    each stored at the same ``offset`` in every rank's partition (zero-padded at the end of the parameter)."""

    kind: str = "chunked"

    @property
    def param_order_gather(self) -> bool:
        return False

    def rank_range(self, group: GroupLayout, param: ParamLayout, rank: int) -> tuple[int, int]:
        start = min(rank * param.chunk_numel, param.numel)
        return start, min(start + param.chunk_numel, param.numel)

    def local_offset(self, group: GroupLayout, param: ParamLayout, rank: int) -> int:
        return param.offset

    def span(self, param: ParamLayout) -> tuple[int, int]:
        return param.offset, param.offset + param.chunk_numel


@dataclass(frozen=True)
class Replicated(GroupPlacement):
    """Every rank holds the whole flat buffer: ``BF16_Optimizer``'s gradient and ``keep_full_grads``."""

    kind: str = "replicated"

    @property
    def is_sharded(self) -> bool:
        return False

    def dtensor_placement(self) -> Placement:
        return Replicate()

    def rank_range(self, group: GroupLayout, param: ParamLayout, rank: int) -> tuple[int, int]:
        return 0, param.numel

    def local_offset(self, group: GroupLayout, param: ParamLayout, rank: int) -> int:
        return param.offset

    def gathered_numel(self, group: GroupLayout) -> int:
        return group.partition_numel


_RAGGED, _CHUNKED, _REPLICATED = RaggedShard(), ChunkShard(), Replicated()


def placement_of(group: GroupLayout) -> GroupPlacement:
    """The placement of ``group`` (the one place that reads its packing and replication flags): replicated, else
    chunked (ZeRO-3) or ragged (ZeRO-1/2) by its packing. No communication."""
    if group.replicated:
        return _REPLICATED
    return _CHUNKED if group.packing is Packing.CHUNKED else _RAGGED


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's contiguous strides of ``shape`` (zero-size dims count as 1), computed without creating a tensor."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
