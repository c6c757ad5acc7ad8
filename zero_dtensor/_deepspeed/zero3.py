"""``DeepSpeedZeroOptimizer_Stage3`` (ZeRO-3), with and without CPU offload.

Facts used (``deepspeed/runtime/zero/stage3.py``, DeepSpeed 0.19.8):

- Each parameter is split like ``torch.chunk``: ``pn = p.partition_numel() = ceil(numel / ws)`` elements per rank,
  zero-padded; its full shape is ``p.ds_shape``; its partition group ``getattr(p, "ds_process_group",
  opt.dp_process_group)``.
- Without offload, reduced gradients live in ``opt.grad_partitions_flat_buffer``: the chunks of
  ``itertools.chain(*opt.fp16_groups)`` back to back, so sub-group ``sg`` is one contiguous slice. They are valid at
  every micro-step (reduced partial sums mid-accumulation) and are *not* cleared by ``step()``.
- With ``offload_optimizer``, the boundary copies them into ``opt.fp32_partitioned_groups_flat[sg].grad`` at
  ``opt.grad_position[param_id][1]`` (the same running sums); mid-accumulation that copy is stale.
- Reduction runs on ``opt.reduce_and_partition_stream``. Stored values are multiplied by ``opt.loss_scale``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import GradientsNotReadyError, UnsupportedDeepSpeedError
from ..layout.flat import FlatLayout, GroupLayout, Packing, ParamLayout
from ..layout.plan import plan_for
from ..comm.process_groups import rank_in, world_size_of
from ..core.storage import FlatStorage
from ..layout.views import ViewCache
from ._common import (
    WINDOW,
    cached_layout,
    kept_partition,
    micro_steps,
    model_layout,
    name_of,
    param_names,
    wait_for_stream,
)


def buffered_norms(opt: Any, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """``opt._constant_buffered_norm2(c)`` for every chunk: ``(‖c‖₂²)^½`` in DeepSpeed's norm dtype, one
    ``_foreach_norm`` for all chunks below its 250M-element buffer (DeepSpeed's own call for larger ones)."""
    try:
        from deepspeed.runtime.zero.utils import get_norm_dtype

        dtype = get_norm_dtype()
    except ImportError:  # DeepSpeed 0.18.9 computes these norms in float64
        dtype = torch.float64
    small = [i for i, c in enumerate(chunks) if c.numel() <= 250_000_000]
    out: list[torch.Tensor] = [None] * len(chunks)  # type: ignore[list-item]
    if small:
        norms = torch._foreach_norm([chunks[i] for i in small], 2, dtype=dtype)
        norms = torch._foreach_pow(torch._foreach_pow(norms, 2.0), 0.5)
        for i, n in zip(small, norms):
            out[i] = n
    for i, c in enumerate(chunks):
        if out[i] is None:
            out[i] = opt._constant_buffered_norm2(c)
    return out


def _process_group(opt: Any) -> dist.ProcessGroup:
    groups = {id(getattr(p, "ds_process_group", opt.dp_process_group)) for g in opt.fp16_groups for p in g}
    if len(groups) > 1:
        raise UnsupportedDeepSpeedError(
            "ZeRO-3 parameters are partitioned over more than one process group (e.g. MoE or hpZ); "
            "zero_dtensor supports ZeRO-3 with a single data-parallel partition group"
        )
    first = next((p for g in opt.fp16_groups for p in g), None)
    return getattr(first, "ds_process_group", opt.dp_process_group)


def _partition_sizes(opt: Any) -> list[int]:
    """Elements of this rank's partition of each sub-group (computed once per optimizer and group structure)."""
    key = ("partition sizes", tuple(len(g) for g in opt.fp16_groups))
    return cached_layout(opt, key, lambda: [sum(p.partition_numel() for p in group) for group in opt.fp16_groups])


def _partitions(opt: Any) -> tuple[ViewCache, ...]:
    """Per sub-group, this rank's partition (a view of DeepSpeed's persistent flat buffer, kept across steps)."""
    return tuple(kept_partition(opt, ("zero3", sg), part) for sg, part in enumerate(_partition_views(opt)))


def _partition_views(opt: Any) -> tuple[torch.Tensor, ...]:
    sizes = _partition_sizes(opt)
    if opt.offload_optimizer:
        grads = [opt.fp32_partitioned_groups_flat[sg].grad for sg in range(len(sizes))]
        if any(g is None for g in grads):
            raise GradientsNotReadyError(f"ZeRO-3 offload has no gradient now: {WINDOW}")
        return tuple(g.view(-1).narrow(0, 0, size) for g, size in zip(grads, sizes))
    buffer = opt.grad_partitions_flat_buffer
    starts = itertools.accumulate(sizes, initial=0)  # one more than sizes; zip stops at the last group
    return tuple(buffer.narrow(0, start, size) for start, size in zip(starts, sizes))


def _build_layout(engine: Any, opt: Any, partitions: tuple[torch.Tensor, ...]
                  ) -> tuple[FlatLayout, dict[str, Any], dist.ProcessGroup]:
    names = param_names(engine)
    pg = _process_group(opt)
    world, rank = world_size_of(pg), rank_in(pg)
    groups, params, by_name = [], [], {}
    for sg, (group_params, partition) in enumerate(zip(opt.fp16_groups, partitions)):
        groups.append(GroupLayout(sg, world, rank, partition.numel(), Packing.CHUNKED))
        offset = 0
        for param in group_params:
            name = name_of(names, param)
            chunk = int(param.partition_numel())
            params.append(ParamLayout(name, torch.Size(param.ds_shape), sg, offset, chunk_numel=chunk))
            by_name[name] = param
            offset += chunk
    return model_layout(engine, groups, params), by_name, pg


def layout_for(engine: Any, opt: Any, partitions: tuple[torch.Tensor, ...]
               ) -> tuple[FlatLayout, dict[str, Any], dist.ProcessGroup]:
    """The layout of sub-groups holding ``partitions`` (one 1-D tensor per sub-group, its chunks back to back: the
    gradient, or the fp32 masters and optimizer state, which share its geometry), the parameters by name and the
    partition group; built once per optimizer and partition sizes (geometry only: every family of any dtype shares
    it, and so its plan), and reused. No communication."""
    key = (tuple(p.numel() for p in partitions), tuple(len(g) for g in opt.fp16_groups))
    return cached_layout(opt, key, lambda: _build_layout(engine, opt, partitions))


def grad_storage(engine: Any, opt: Any) -> FlatStorage:
    wait_for_stream(getattr(opt, "reduce_and_partition_stream", None))
    if opt.offload_optimizer and not engine.is_gradient_accumulation_boundary():
        raise GradientsNotReadyError(f"ZeRO-3 with offload_optimizer holds stale gradients mid-accumulation: {WINDOW}")
    if not getattr(opt, "_epilogue_ran_this_backward", True):  # reset by forward() and by step()
        raise GradientsNotReadyError(f"ZeRO-3 has not reduced gradients since the last forward()/step(): {WINDOW}")
    caches = _partitions(opt)
    partitions = tuple(c.buffer for c in caches)
    layout, by_name, pg = layout_for(engine, opt, partitions)
    start_micro_step = micro_steps(engine)

    def is_current() -> bool:
        return micro_steps(engine) == start_micro_step

    def after_write(written: Sequence[str]) -> None:
        if not opt.offload_optimizer:
            return
        # DeepSpeed's clip uses norms it precomputed from each padded chunk (stage3.py, offload): the same values,
        # as its _constant_buffered_norm2 computes them, with one _foreach_norm for all written parameters
        plan = plan_for(layout)
        ids, chunks = [], []
        for name in written:
            g, k = plan.where[name]
            columns = plan.groups[g].gathered  # the chunks (and padding) tiling this rank's partition
            ids.append(opt.get_param_id(by_name[name]))
            chunks.append(caches[g].split(columns.sizes)[columns.piece[k]])
        opt.norm_for_param_grads.update(zip(ids, buffered_norms(opt, chunks)))

    return FlatStorage(
        layout=layout,
        partitions=partitions,
        process_groups=(pg,) * len(partitions),
        loss_scale=float(opt.loss_scale),
        device=engine.device,
        is_current=is_current,
        after_write=after_write,
        describe="ZeRO-3",
        view_caches=caches,
    )
