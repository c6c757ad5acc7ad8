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
from ..layout import GradLayout, GroupLayout, Packing, ParamLayout
from ..storage import GradStorage
from ._common import WINDOW, cached_layout, micro_steps, model_layout, name_of, param_names, wait_for_stream


def _process_group(opt: Any) -> dist.ProcessGroup:
    groups = {id(getattr(p, "ds_process_group", opt.dp_process_group)) for g in opt.fp16_groups for p in g}
    if len(groups) > 1:
        raise UnsupportedDeepSpeedError(
            "ZeRO-3 parameters are partitioned over more than one process group (e.g. MoE or hpZ); "
            "zero_dtensor supports ZeRO-3 with a single data-parallel partition group"
        )
    first = next((p for g in opt.fp16_groups for p in g), None)
    return getattr(first, "ds_process_group", opt.dp_process_group)


def _partitions(opt: Any) -> tuple[torch.Tensor, ...]:
    sizes = [sum(p.partition_numel() for p in group) for group in opt.fp16_groups]
    if opt.offload_optimizer:
        grads = [opt.fp32_partitioned_groups_flat[sg].grad for sg in range(len(sizes))]
        if any(g is None for g in grads):
            raise GradientsNotReadyError(f"ZeRO-3 offload has no gradient now: {WINDOW}")
        return tuple(g.view(-1).narrow(0, 0, size) for g, size in zip(grads, sizes))
    buffer = opt.grad_partitions_flat_buffer
    starts = itertools.accumulate(sizes, initial=0)  # one more than sizes; zip stops at the last group
    return tuple(buffer.narrow(0, start, size) for start, size in zip(starts, sizes))


def _build_layout(engine: Any, opt: Any, partitions: tuple[torch.Tensor, ...]
                  ) -> tuple[GradLayout, dict[str, Any], dist.ProcessGroup]:
    names = param_names(engine)
    pg = _process_group(opt)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    groups, params, by_name = [], [], {}
    for sg, (group_params, partition) in enumerate(zip(opt.fp16_groups, partitions)):
        groups.append(GroupLayout(sg, world, rank, partition.numel(), partition.dtype, Packing.CHUNKED))
        offset = 0
        for param in group_params:
            name = name_of(names, param)
            chunk = int(param.partition_numel())
            params.append(ParamLayout(name, torch.Size(param.ds_shape), sg, offset, chunk_numel=chunk))
            by_name[name] = param
            offset += chunk
    return model_layout(engine, groups, params), by_name, pg


def grad_storage(engine: Any, opt: Any) -> GradStorage:
    wait_for_stream(getattr(opt, "reduce_and_partition_stream", None))
    if opt.offload_optimizer and not engine.is_gradient_accumulation_boundary():
        raise GradientsNotReadyError(f"ZeRO-3 with offload_optimizer holds stale gradients mid-accumulation: {WINDOW}")
    if not getattr(opt, "_epilogue_ran_this_backward", True):  # reset by forward() and by step()
        raise GradientsNotReadyError(f"ZeRO-3 has not reduced gradients since the last forward()/step(): {WINDOW}")
    partitions = _partitions(opt)
    key = (tuple(p.numel() for p in partitions), tuple(p.dtype for p in partitions),
           tuple(len(g) for g in opt.fp16_groups))
    layout, by_name, pg = cached_layout(opt, key, lambda: _build_layout(engine, opt, partitions))
    start_micro_step = micro_steps(engine)

    def is_current() -> bool:
        return micro_steps(engine) == start_micro_step

    def after_write(written: Sequence[str]) -> None:
        if not opt.offload_optimizer:
            return
        for name in written:  # DeepSpeed's clip uses norms it precomputed from the chunk (stage3.py, offload)
            p = layout.by_name[name]
            chunk = partitions[p.group].narrow(0, p.offset, p.chunk_numel)
            opt.norm_for_param_grads[opt.get_param_id(by_name[name])] = opt._constant_buffered_norm2(chunk)

    return GradStorage(
        layout=layout,
        partitions=partitions,
        process_groups=(pg,) * len(partitions),
        loss_scale=float(opt.loss_scale),
        device=engine.device,
        is_current=is_current,
        after_write=after_write,
        describe="ZeRO-3",
    )
