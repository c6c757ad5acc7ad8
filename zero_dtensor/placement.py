"""How a flat group's gradient is spread over the ranks of its process group, and what that costs to gather.

One placement kind per way DeepSpeed stores a group. Each answers, for a whole group at once, which elements each
rank holds, how the group's full buffer is assembled (which collective, how many bytes), and how an assembled
buffer is cut into parameters. Nothing outside this module branches on the kind of a group.

``N`` ranks, ``P`` elements per rank's partition, ``S`` the bytes of the group's padded flat buffer (``N·P``
elements, stored dtype; ``P`` elements for a replicated group):

===============  ===========================  =======================================  ===================================
placement        DeepSpeed                    rank ``r`` holds                         gathered with (bytes per rank)
===============  ===========================  =======================================  ===================================
``RaggedShard``  ZeRO-1/2                     ``[r·P, (r+1)·P)`` of the flat buffer:   ``all_gather`` of the partitions
                 (``DeepSpeedZeroOptimizer``) a parameter straddles ranks at any       ``(N-1)/N·S``; zero-padded
                                              offset (ragged pieces)                   ``all_reduce`` ``2(N-1)/N·S``;
                                                                                       ``gather`` to one rank ``S/N`` sent
``ChunkShard``   ZeRO-3                       chunk ``r`` of every parameter           as ``RaggedShard``; the gathered
                 (``..._Stage3``)             (``torch.chunk`` of the flattened        ``(N, P)`` rows are cut into
                                              parameter), back to back                 parameters by one
                                                                                       ``split_with_sizes_copy``
``Replicated``   ``BF16_Optimizer``,          the whole buffer                         nothing (one local copy for a
                 ``keep_full_grads``                                                   snapshot)
===============  ===========================  =======================================  ===================================

Cutting into parameters: ``RaggedShard`` and ``Replicated`` buffers are in parameter order already (one
``split_with_sizes`` gives every parameter as a view); ``ChunkShard`` buffers are rank-major, and parameter ``p``
is the row-major flattening of its ``(N, chunk_p)`` column block, so the whole group is reordered by one
``torch.split_with_sizes_copy`` along dimension 1 into a parameter-order buffer (as FSDP2 copies out its
all-gather) — or, for the zero-padded ``all_reduce``, each rank writes its chunks straight into parameter order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .collectives import all_gather_single, all_reduce_sum_work, on_comm_device

if TYPE_CHECKING:
    from .layout import GroupLayout, ParamLayout
    from .plan import GroupPlan

__all__ = ["ChunkShard", "GroupPlacement", "RaggedShard", "Replicated", "placement_of"]


@dataclass(frozen=True)
class GroupPlacement:
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

    @property
    def exact_param_shards(self) -> bool:
        """Whether one parameter's pieces form an exact per-parameter DTensor (``Shard(0)`` of the flattened
        parameter, or ``Replicate``)."""
        return True

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """One parameter's full flat values (stored dtype, still scaled), in memory the caller owns. **Collective**
        for sharded placements (see each kind)."""
        raise NotImplementedError

    def fill_for_reduce(self, region: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                        pieces: tuple[torch.Tensor, ...]) -> None:
        """Write this rank's values into ``region`` (``flat_numel`` elements) in parameter order, zeros elsewhere:
        the input of the zero-padded sum all_reduce. ``pieces`` is the partition cut by ``plan.local``."""
        raise NotImplementedError

    def to_param_order(self, gathered: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                       area: torch.Tensor | None) -> torch.Tensor:
        """An all_gather's result in parameter order: ``gathered`` itself, or reordered into ``area``."""
        return gathered

    def reorder_area(self, group: GroupLayout) -> int:
        """Elements of the extra buffer :meth:`to_param_order` needs after an all_gather (0: none)."""
        return 0


@dataclass(frozen=True)
class RaggedShard(GroupPlacement):
    """ZeRO-1/2: parameters back to back in a zero-padded flat buffer of ``N·P`` elements; rank ``r`` owns
    ``[r·P, (r+1)·P)``. A parameter's pieces are ragged: never describe one as a per-parameter ``Shard(0)``."""

    kind: str = "ragged"

    def rank_range(self, group: GroupLayout, param: ParamLayout, rank: int) -> tuple[int, int]:
        lo, hi = rank * group.partition_numel, (rank + 1) * group.partition_numel
        start = min(max(lo - param.offset, 0), param.numel)
        return start, max(min(hi - param.offset, param.numel), start)

    def local_offset(self, group: GroupLayout, param: ParamLayout, rank: int) -> int:
        start, stop = self.rank_range(group, param, rank)
        return 0 if start == stop else param.offset + start - rank * group.partition_numel

    @property
    def exact_param_shards(self) -> bool:
        return False

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """One sum ``all_reduce`` of a zero-padded ``numel`` buffer (exact: one non-zero contributor per element),
        ``2(N-1)/N·numel`` elements per rank."""
        start, stop = self.rank_range(group, param, group.rank)
        local = partition.narrow(0, self.local_offset(group, param, group.rank), stop - start)
        local = on_comm_device(local, pg, device)
        full = torch.zeros(param.numel, dtype=local.dtype, device=local.device)
        full.narrow(0, start, stop - start).copy_(local)
        all_reduce_sum_work(full, pg)
        return full

    def fill_for_reduce(self, region: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                        pieces: tuple[torch.Tensor, ...]) -> None:
        P, r = group.partition_numel, group.rank
        region.narrow(0, 0, r * P).zero_()
        region.narrow(0, (r + 1) * P, group.flat_numel - (r + 1) * P).zero_()
        mine = region.narrow(0, r * P, P)
        if pieces:
            torch.cat(pieces, out=mine)


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

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """One ``all_gather`` of the ``chunk_numel``-long (padded) chunks, ``(N-1)/N·numel`` elements per rank."""
        chunk = on_comm_device(partition.narrow(0, param.offset, param.chunk_numel), pg, device)
        gathered = torch.empty(group.world_size * param.chunk_numel, dtype=chunk.dtype, device=chunk.device)
        all_gather_single(gathered, chunk, pg)
        return gathered.narrow(0, 0, param.numel)

    def fill_for_reduce(self, region: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                        pieces: tuple[torch.Tensor, ...]) -> None:
        """Rank ``r``'s chunk of parameter ``p`` goes to row ``r`` of ``p``'s ``(N, chunk)`` block: one zero fill,
        one ``_foreach_copy_``."""
        region.zero_()
        keep = plan.has_local
        if keep:
            blocks = region.split_with_sizes(list(plan.param_order.sizes))
            targets = [blocks[plan.param_order.piece[k]].view(group.world_size, -1)[group.rank]
                       .narrow(0, 0, plan.frag_len[k]) for k in keep]
            torch._foreach_copy_(targets, [pieces[plan.local.piece[k]] for k in keep])

    def to_param_order(self, gathered: torch.Tensor, group: GroupLayout, plan: GroupPlan,
                       area: torch.Tensor | None) -> torch.Tensor:
        """The ``(N, P)`` rows cut into column blocks by one ``split_with_sizes_copy`` into ``area``."""
        assert area is not None
        blocks = area.split_with_sizes(list(plan.param_order.sizes))
        N = group.world_size
        torch.split_with_sizes_copy(gathered.view(N, group.partition_numel), list(plan.gathered.sizes), dim=1,
                                    out=[b.view(N, -1) for b in blocks])
        return area

    def reorder_area(self, group: GroupLayout) -> int:
        return group.flat_numel


@dataclass(frozen=True)
class Replicated(GroupPlacement):
    """Every rank holds the whole (averaged) flat buffer: ``BF16_Optimizer`` and ``keep_full_grads``."""

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

    def gather_param(self, group: GroupLayout, param: ParamLayout, partition: torch.Tensor,
                     pg: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
        """No communication: one local copy (a snapshot, never a view of the live gradient)."""
        return partition.narrow(0, param.offset, param.numel).clone()


_RAGGED, _CHUNKED, _REPLICATED = RaggedShard(), ChunkShard(), Replicated()


def placement_of(group: GroupLayout) -> GroupPlacement:
    """The placement of ``group`` (the one place that reads its packing and replication flags)."""
    from .layout import Packing

    if group.replicated:
        return _REPLICATED
    return _CHUNKED if group.packing is Packing.CHUNKED else _RAGGED
