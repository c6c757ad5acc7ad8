"""Where a flat group's elements lie on the ranks of its process group: pure geometry, one kind per way DeepSpeed
stores a group. No dtype, no family, no communication: a kind answers, for one parameter of one group, which
elements each rank holds and where they start in its partition. :mod:`zero_dtensor.placement` adds to each kind how
its buffer is assembled (the collectives); :mod:`zero_dtensor.layout` picks the kind of a group.

``N`` ranks, ``P`` elements per rank's partition:

========================  ============================  ===========================================================
kind                      DeepSpeed                     rank ``r`` holds
========================  ============================  ===========================================================
``RaggedGeometry``        ZeRO-1/2                      ``[r·P, (r+1)·P)`` of the zero-padded flat buffer of
                          (``DeepSpeedZeroOptimizer``)  ``N·P`` elements: a parameter straddles ranks at any offset
``ChunkGeometry``         ZeRO-3 (``..._Stage3``)       chunk ``r`` of every parameter (``torch.chunk`` of the
                                                        flattened parameter), at the same offset in every partition
``ReplicatedGeometry``    ``BF16_Optimizer``,           the whole buffer (``P`` elements)
                          ``keep_full_grads``
========================  ============================  ===========================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

if TYPE_CHECKING:
    from .layout import GroupLayout, ParamLayout

__all__ = ["ChunkGeometry", "GroupGeometry", "RaggedGeometry", "ReplicatedGeometry"]


@dataclass(frozen=True)
class GroupGeometry:
    """The geometry of one kind of flat group (see the module docstring)."""

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
class RaggedGeometry(GroupGeometry):
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
class ChunkGeometry(GroupGeometry):
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
class ReplicatedGeometry(GroupGeometry):
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
