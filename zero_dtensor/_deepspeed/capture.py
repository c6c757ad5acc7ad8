"""Keep the full reduced gradient that ZeRO-1/2 computes during backward anyway (opt-in, zero extra collectives).

``DeepSpeedZeroOptimizer`` all-reduces whole IPG buckets in ``average_tensor`` and then keeps only the slices this
rank owns. :class:`BucketReductionCapture` wraps four of the optimizer's methods (instance attributes; removed by
:meth:`remove`) and copies the reduced values of every bucket into one full flat buffer per param group, laid out
exactly like DeepSpeed's global flat buffer (``round_robin_bit16_offsets``; padding zero). Two paths:

- ``reduce_scatter: false``: ``average_tensor`` all-reduces the whole bucket in place; after it returns the bucket
  *is* the averaged gradient (notes §8 mode A).
- ``reduce_scatter: true`` (default) with ``use_multi_rank_bucket_allreduce: true`` (default): the bucket is divided,
  cut into per-owner slices and each small bucket of slices goes through ``allreduce_bucket``; its *return value* is
  the all-reduced flat of those slices on every rank, of which DeepSpeed copies back only its own. The wrapper of
  ``allreduce_bucket`` copies all of it (mode B, without changing what DeepSpeed itself does).

Accumulation: stage 2 reduces on every micro-step, so each reduction is added (in the dtype DeepSpeed accumulates
in) to the buffer, which is zeroed at the first reduction of an accumulation window; stage 1 reduces once at the
boundary. Values are in DeepSpeed's stored units (× loss scale under fp16).

Requires ``contiguous_gradients: true`` (otherwise reduction goes through ``buffered_reduce_fallback``, which this
does not see) and, with ``reduce_scatter: true``, ``use_multi_rank_bucket_allreduce: true`` (otherwise DeepSpeed
uses ``dist.reduce`` to each owner and no rank ever holds the full values). Configuration is never changed here:
an unsuitable one raises :class:`~zero_dtensor.errors.UnsupportedDeepSpeedError` naming the key to set.

Cost: memory, one full flat gradient per param group per rank (``S``, the unsharded size in the accumulation dtype);
time, one copy (stage 1) or add (stage 2) of each reduced bucket during backward. No communication.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedDeepSpeedError
from ._common import param_offsets, wait_for_stream
from .version import check_deepspeed_version


def _sum_dtype(opt: Any, group: int) -> torch.dtype:
    """The dtype DeepSpeed sums micro-step reductions in, so that the kept values are bit-identical to its own."""
    if opt.cpu_offload and opt.partition_gradients and not getattr(opt, "low_precision_master_weights_and_grads", False):
        return opt.bit16_groups_flat[group].dtype  # stage-2 offload sums in accumulated_grads_in_cpu (param dtype)
    return _accum_dtype(opt, group)


def _accum_dtype(opt: Any, group: int) -> torch.dtype:
    """The dtype of the partition DeepSpeed's step reads (the kept buffer's dtype)."""
    if opt.cpu_offload:
        return opt.single_partition_of_fp32_groups[group].dtype
    compact = getattr(opt, "_use_compact_grad_partition_buffer", None)
    if compact is not None and compact(group):
        return torch.float32
    return opt.bit16_groups_flat[group].dtype


def check_config(engine: Any, opt: Any) -> None:
    """Raise UnsupportedDeepSpeedError unless DeepSpeed reduces whole buckets through ``average_tensor``."""
    stage = 2 if opt.partition_gradients else 1
    if not opt.contiguous_gradients:
        raise UnsupportedDeepSpeedError(
            f"keep_full_grads needs DeepSpeed's contiguous bucket reduction; this ZeRO-{stage} engine has "
            '"zero_optimization": {"contiguous_gradients": false}. Set "contiguous_gradients": true (the default) '
            "in the DeepSpeed config, or use sharded_grads(engine).full_tensors() (one all_gather per group)"
        )
    if opt.reduce_scatter and not getattr(opt, "use_multi_rank_bucket_allreduce", True):
        raise UnsupportedDeepSpeedError(
            f"keep_full_grads: with \"use_multi_rank_bucket_allreduce\": false this ZeRO-{stage} engine reduces each "
            "slice only to its owner, so no rank ever holds the full gradient. Set "
            '"zero_optimization": {"use_multi_rank_bucket_allreduce": true} (the default) or '
            '{"reduce_scatter": false} in the DeepSpeed config'
        )
    for name in ("average_tensor", "allreduce_bucket", "ipg_buckets", "bit16_groups", "round_robin_bit16_groups"):
        if not hasattr(opt, name):
            raise UnsupportedDeepSpeedError(
                f"keep_full_grads relies on DeepSpeedZeroOptimizer.{name}, which this DeepSpeed lacks; "
                "supported: DeepSpeed 0.18.9 and 0.19.x"
            )


class BucketReductionCapture:
    """The wrappers and buffers for one ``DeepSpeedZeroOptimizer``. Create through :func:`install`."""

    def __init__(self, engine: Any, opt: Any, offsets: dict[int, tuple[int, int, int]]) -> None:
        self.engine = engine
        self.opt = opt
        self._offsets = offsets  # id(param) -> (group, flat offset, numel)
        self.buffers: list[torch.Tensor | None] = [None] * len(opt.round_robin_bit16_groups)
        self.flat_numels = [int(opt.bit16_groups_flat[i].numel()) for i in range(len(self.buffers))]
        self.window: int | None = None
        self.first_micro_step: int | None = None
        self.captures = 0
        self._seen: set[int] = set()  # id(param) reduced at least once in this window
        self._current: tuple[torch.Tensor, list[tuple[int, int, int]], torch.Tensor | None] | None = None
        #: set while a replicated view of this window is handed out: copies raw writes into DeepSpeed's partition
        self.before_step: Callable[[], None] | None = None
        self._wrapped = {"average_tensor": self._average_tensor, "allreduce_bucket": self._allreduce_bucket,
                         "step": self._step, "zero_grad": self._zero_grad}
        self._originals = {name: getattr(opt, name) for name in self._wrapped}
        for name, wrapper in self._wrapped.items():
            setattr(opt, name, wrapper)
        self._orig_average = self._originals["average_tensor"]
        self._orig_allreduce_bucket = self._originals["allreduce_bucket"]
        self.active = True

    # --- window bookkeeping --------------------------------------------------------------------------------------
    def _window_of(self, micro_steps: int) -> int:
        return micro_steps // max(int(self.engine.gradient_accumulation_steps()), 1)

    def _begin(self) -> None:
        micro = int(self.engine.micro_steps)
        window = self._window_of(micro)
        if window != self.window:  # a new accumulation window: the first reduction of each param copies
            self.window, self.first_micro_step, self.captures = window, micro, 0
            self._seen = set()

    def complete(self) -> bool:
        """Whether the buffers hold every reduction of the current accumulation window (else use the shards)."""
        micro = int(self.engine.micro_steps)
        if not self.active or self.window != self._window_of(micro) or self.captures == 0:
            return False
        if self.opt.partition_gradients:  # stage 2 reduces every micro-step: the first one must have been seen
            gas = max(int(self.engine.gradient_accumulation_steps()), 1)
            return self.first_micro_step == self.window * gas
        return True  # stage 1 reduces only at the boundary

    def finalize(self) -> None:
        """Zero the ranges of parameters that got no gradient in this window (DeepSpeed's partition holds zeros)."""
        for pid, (g, offset, numel) in self._offsets.items():
            if pid not in self._seen and self.buffers[g] is not None:
                self.buffers[g].narrow(0, offset, numel).zero_()

    def _buffer(self, group: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers[group]
        if buf is None:
            buf = self.buffers[group] = torch.zeros(
                self.flat_numels[group], dtype=_accum_dtype(self.opt, group), device=like.device
            )
        return buf

    # --- wrappers --------------------------------------------------------------------------------------------------
    def _average_tensor(self, tensor: torch.Tensor, communication_data_type: torch.dtype, *args: Any, **kwargs: Any):
        self._begin()
        bucket = self.opt.ipg_buckets[communication_data_type]
        # (start in the bucket, numel, target view in the full buffer, add instead of copy), in bucket order
        spans, start, reduced_params = [], 0, []
        for group, index, _param_id in bucket.params:
            param = self.opt.bit16_groups[group][index]
            g, offset, numel = self._offsets[id(param)]
            add = _sum_dtype(self.opt, g) if id(param) in self._seen else None
            spans.append((start, numel, self._buffer(g, tensor).narrow(0, offset, numel), add))
            reduced_params.append(id(param))
            start += numel
        self._current = (tensor, spans) if self.opt.reduce_scatter else None
        try:
            result = self._orig_average(tensor, communication_data_type, *args, **kwargs)
        finally:
            self._current = None
        if not self.opt.reduce_scatter:  # mode A: the bucket itself now holds the averaged gradient
            wait_for_stream(getattr(self.opt, "reduction_stream", None) if self.opt.overlap_comm else None)
            for begin, numel, target, add in spans:
                _put(target, tensor.narrow(0, begin, numel), add)
        self._seen.update(reduced_params)
        self.captures += 1
        return result

    def _allreduce_bucket(self, bucket: Any, *args: Any, **kwargs: Any):
        """Mode B: copy every all-reduced slice (DeepSpeed keeps only its own) straight into the full buffer."""
        allreduced = self._orig_allreduce_bucket(bucket, *args, **kwargs)
        current = self._current
        rank_arg = kwargs.get("rank", args[1] if len(args) > 1 else None)
        if current is None or rank_arg is not None:
            return allreduced
        base, spans = current
        element = base.element_size()
        starts = [s[0] for s in spans]
        pos = 0
        for piece in bucket:
            n = piece.numel()
            a = (piece.data_ptr() - base.data_ptr()) // element  # the piece is a narrow() of the bucket
            if 0 <= a and a + n <= base.numel():
                k = max(bisect.bisect_right(starts, a) - 1, 0)
                while k < len(spans) and spans[k][0] < a + n:
                    begin, numel, target, add = spans[k]
                    lo, hi = max(a, begin), min(a + n, begin + numel)
                    if hi > lo:
                        _put(target.narrow(0, lo - begin, hi - lo), allreduced.narrow(0, pos + lo - a, hi - lo), add)
                    k += 1
            pos += n
        return allreduced

    def _step(self, *args: Any, **kwargs: Any):
        """DeepSpeed's step, after raw writes into the kept buffers (views handed out by ``sharded_grads``) have
        been copied into the partitions the step reads."""
        sync, self.before_step = self.before_step, None
        if sync is not None and self.active:
            sync()
        return self._originals["step"](*args, **kwargs)

    def _zero_grad(self, *args: Any, **kwargs: Any):
        """DeepSpeed's zero_grad; the kept buffers no longer describe a window (the next reduction starts anew)."""
        self.window, self.before_step = None, None
        return self._originals["zero_grad"](*args, **kwargs)

    def remove(self) -> None:
        """Restore DeepSpeed's methods and free the buffers."""
        if not self.active:
            return
        for name, wrapper in self._wrapped.items():
            if self.opt.__dict__.get(name) != wrapper:
                continue  # wrapped again after us: that wrapper still calls ours, which now only passes through
            if getattr(self._originals[name], "__self__", None) is self.opt:
                del self.opt.__dict__[name]  # the class's method shows through again
            else:  # an instance attribute set before us (another wrapper): put it back
                self.opt.__dict__[name] = self._originals[name]
        self.before_step = None
        self.buffers = [None] * len(self.buffers)
        self.active = False
        _CAPTURES.pop(id(self.opt), None)


def _put(target: torch.Tensor, source: torch.Tensor, add: torch.dtype | None) -> None:
    """Copy (first reduction of a parameter in this window) or accumulate in dtype ``add`` (later micro-steps)."""
    if add is None:
        target.copy_(source)
    elif add == target.dtype:
        target.add_(source.to(add))
    else:  # DeepSpeed sums in a narrower dtype than it stores: round the same way
        target.copy_(target.to(add).add_(source.to(add)))


_CAPTURES: dict[int, BucketReductionCapture] = {}


def active_capture(opt: Any) -> BucketReductionCapture | None:
    capture = _CAPTURES.get(id(opt))
    return capture if capture is not None and capture.opt is opt and capture.active else None


def install(engine: Any) -> BucketReductionCapture | None:
    """Start capturing on ``engine``'s ZeRO-1/2 optimizer; None for BF16_Optimizer (already replicated)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer


    check_deepspeed_version()
    opt = engine.optimizer
    if type(opt) is BF16_Optimizer:
        return None
    if type(opt) is not DeepSpeedZeroOptimizer:
        kind = type(opt)
        raise UnsupportedDeepSpeedError(
            f"keep_full_grads supports ZeRO stages 1 and 2 (DeepSpeedZeroOptimizer) and BF16_Optimizer (already "
            f"replicated); engine.optimizer is {kind.__module__}.{kind.__qualname__}. ZeRO-3 never holds a full "
            "gradient without extra traffic: use sharded_grads(engine).full_tensors() (one all_gather)"
        )
    existing = active_capture(opt)
    if existing is not None:
        return existing
    check_config(engine, opt)
    offsets = {}
    for i, params in enumerate(opt.round_robin_bit16_groups):
        for param, offset in zip(params, param_offsets(opt, i)):
            offsets[id(param)] = (i, offset, param.numel())
    capture = BucketReductionCapture(engine, opt, offsets)
    _CAPTURES[id(opt)] = capture
    return capture
