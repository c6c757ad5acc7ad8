"""``BF16_Optimizer`` (ZeRO-1 with bf16 and ``grad_accum_dtype: fp32``): every rank holds the full gradient.

Facts used (``deepspeed/runtime/bf16_optimizer.py``, DeepSpeed 0.19.8): ``opt.fp32_groups_gradients_flat[i]`` is the
full averaged fp32 gradient of param group ``i`` after the boundary all-reduce, identical on every rank; parameters
of ``opt.bf16_groups[i]`` lie back to back (no padding between them), the tail padded to ``2 * ws``. ``step()``
reads exactly this buffer (DeepSpeed's own ``safe_set_full_grad`` writes ``p.grad`` instead, which it never reads)
and zeroes it afterwards (``clear_hp_grads``, which also resets ``opt.fp32_groups_has_gradients``). The norm is
taken over the full buffer, so every rank must write the same values.

When the buffer is *not* the averaged gradient, and how that is detected (no communication, identical on every
rank because both signals are):

- mid-accumulation it holds this rank's **local, unreduced** running sum (the engine all-reduces it only in the
  boundary ``backward()``): ``engine.is_gradient_accumulation_boundary()`` is False;
- after ``step()`` (or ``zero_grad()``) and before the next ``backward()`` it is zeroed: every
  ``fp32_groups_has_gradients`` flag is False (``backward()`` sets the flag of each parameter that got a gradient).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import GradientsNotReadyError, UnsupportedDeepSpeedError
from ..layout.flat import FlatLayout, GroupLayout, Packing, ParamLayout
from ..comm.process_groups import rank_in, world_size_of
from ..core.storage import FlatStorage
from ._common import WINDOW, cached_layout, kept_partition, micro_steps, model_layout, name_of, param_names


def _has_gradients(opt: Any) -> bool:
    flags = getattr(opt, "fp32_groups_has_gradients", None)
    if flags is None:  # an older/newer DeepSpeed without the flags: we cannot tell a zeroed buffer apart
        raise UnsupportedDeepSpeedError(
            "BF16_Optimizer without fp32_groups_has_gradients: zero_dtensor cannot tell whether its buffer holds "
            "this step's gradient; supported DeepSpeed versions are 0.18.9 and 0.19.x"
        )
    return any(any(group) for group in flags)


def _build_layout(engine: Any, opt: Any, partitions: tuple[torch.Tensor, ...]) -> FlatLayout:
    names = param_names(engine)
    groups, params = [], []
    for i, (group_params, flat) in enumerate(zip(opt.bf16_groups, partitions)):
        pg = opt.real_dp_process_group[i]
        groups.append(
            GroupLayout(i, world_size_of(pg), rank_in(pg), flat.numel(), Packing.CONTIGUOUS, replicated=True)
        )
        offset = 0
        for param in group_params:
            params.append(ParamLayout(name_of(names, param), torch.Size(param.shape), i, offset))
            offset += param.numel()
    return model_layout(engine, groups, params)


def layout_for(engine: Any, opt: Any, partitions: tuple[torch.Tensor, ...]) -> FlatLayout:
    """The (replicated) gradient layout of ``partitions``, one full flat fp32 buffer per param group; built once
    per optimizer and buffer sizes, and reused. No communication."""
    key = (tuple(p.numel() for p in partitions), tuple(len(g) for g in opt.bf16_groups))
    return cached_layout(opt, key, lambda: _build_layout(engine, opt, partitions))


def grad_storage(engine: Any, opt: Any) -> FlatStorage:
    if not engine.is_gradient_accumulation_boundary():
        raise GradientsNotReadyError(
            "BF16_Optimizer holds this rank's local, unreduced gradient sums mid-accumulation; " + WINDOW
        )
    if not _has_gradients(opt):
        raise GradientsNotReadyError(
            "BF16_Optimizer's gradient buffer was zeroed by engine.step()/zero_grad() and no backward() has run "
            "since; " + WINDOW
        )
    caches = tuple(kept_partition(opt, ("bf16", i), flat.view(-1))
                   for i, flat in enumerate(opt.fp32_groups_gradients_flat))
    partitions = tuple(c.buffer for c in caches)
    layout = layout_for(engine, opt, partitions)
    start_micro_step = micro_steps(engine)

    def is_current() -> bool:
        return micro_steps(engine) == start_micro_step and _has_gradients(opt)

    return FlatStorage(
        layout=layout,
        partitions=partitions,
        process_groups=tuple(opt.real_dp_process_group[i] for i in range(len(partitions))),
        loss_scale=1.0,
        device=engine.device,
        is_current=is_current,
        describe="BF16_Optimizer (ZeRO-1)",
        view_caches=caches,
    )
