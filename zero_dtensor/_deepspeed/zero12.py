"""``DeepSpeedZeroOptimizer`` (ZeRO stages 1 and 2): default list-of-views, compact fp32 buffer, CPU offload.

Facts used (``deepspeed/runtime/zero/stage_1_and_2.py``, DeepSpeed 0.19.8; 0.18.9 differs where noted):

- Flat order of param group ``i`` is ``opt.round_robin_bit16_groups[i]``; the k-th parameter starts at
  ``opt.round_robin_bit16_offsets[i][k]`` (0.18.9 lacks that list: cumulative numels plus
  ``round_robin_bit16_padding``). ``_hp_mapping`` is wrong under ``round_robin_gradients`` and is never used.
- ``opt.partition_size[i]`` is equal on every rank of ``opt.real_dp_process_group[i]``; rank r owns
  ``[r*P, (r+1)*P)`` of the zero-padded flat buffer.
- At a boundary, after backward: ``opt.averaged_gradients[i]`` is either a ``GradPartitionBufferGroup`` with one
  contiguous ``flat_partition`` (fp32 accumulation of a 16-bit model), or a plain list of views (+ zero padding)
  whose concatenation is the partition. With CPU offload it is ``opt.single_partition_of_fp32_groups[i].grad``.
- ``engine.step()`` sets ``averaged_gradients[i] = None``. Stored values are multiplied by ``opt.loss_scale``.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GradientsNotReadyError
from ..layout.flat import FlatLayout, GroupLayout, Packing, ParamLayout
from ..layout.plan import plan_for
from ..comm.process_groups import rank_in, world_size_of
from ..layout.rows import PieceCopy, PieceKey, piece_copy, piece_key
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
    param_offsets,
    wait_for_stream,
)
from .capture import active_capture
from .grad_order import order_gradient_buffer, placed


class _FlatViews(list):
    """DeepSpeed versions without ``GradPartitionBufferGroup``: the same list of views, with the flat tensor."""

    flat_partition: torch.Tensor


@dataclass(eq=False)
class _FlatSlot:
    """A flat partition this adapter keeps across steps, with the per-parameter views DeepSpeed reads from it.

    ``views`` cut the flat tensor like DeepSpeed's own list of pieces (``numels``), as 1-D views: DeepSpeed reads
    them flat (the step's norm, overflow check and flattening, ``safe_get_full_grad``'s fragment), and comparing
    numels costs one pass where comparing shapes makes a ``torch.Size`` per piece. ``rebound`` holds the views and
    ``flat_partition`` that ``averaged_gradients[group]`` is rebound to, each step by a new list that copies it
    (:func:`_for_this_step`). The slot is reused
    only when nothing outside its view cache refers to its memory (no user view of the previous step is alive).
    """

    cache: ViewCache
    views: tuple[torch.Tensor, ...]
    numels: tuple[int, ...]
    rebound: Any  # a GradPartitionBufferGroup or _FlatViews
    data_ptr: int
    #: how the last pieces lay in memory (their key and plan; ``None``: piece by piece), reused while they lie
    #: the same way
    copy_plan: tuple[PieceKey, PieceCopy | None] | None = None

    @property
    def flat(self) -> torch.Tensor:
        return self.cache.buffer

    def fits(self, first: torch.Tensor, numels: tuple[int, ...]) -> bool:
        return (self.flat.dtype == first.dtype and self.flat.device == first.device
                and self.flat.data_ptr() == self.data_ptr and self.rebound.flat_partition is self.flat
                and numels == self.numels)


def _new_slot(pieces: Sequence[torch.Tensor], numels: tuple[int, ...], numel: int) -> _FlatSlot:
    first = pieces[0]
    cache = ViewCache(torch.empty(numel, dtype=first.dtype, device=first.device))
    sizes = [*numels, numel - sum(numels)] if sum(numels) < numel else list(numels)
    views = cache.get("deepspeed", lambda flat: flat.split_with_sizes(sizes)[: len(numels)])
    for view, piece in zip(views, pieces):
        if getattr(piece, "_zero_padding", False):
            view._zero_padding = True
    from deepspeed.runtime.zero import stage_1_and_2

    buffer_group = getattr(stage_1_and_2, "GradPartitionBufferGroup", None)
    if buffer_group is not None:
        rebound = buffer_group(list(views), cache.buffer)
    else:
        rebound = _FlatViews(views)
        rebound.flat_partition = cache.buffer
    return _FlatSlot(cache, views, numels, rebound, cache.buffer.data_ptr())


_SHAPE = operator.attrgetter("shape")
_SLOTS: weakref.WeakKeyDictionary[Any, dict[int, list[_FlatSlot]]] = weakref.WeakKeyDictionary()
_MAX_SLOTS = 2  # a loop that keeps last step's views until the next call alternates between two


def _slot_for(opt: Any, group: int, pieces: Sequence[torch.Tensor], numels: tuple[int, ...]) -> _FlatSlot:
    """A kept slot that fits ``pieces`` (of ``numels`` elements) and is idle, else a new one (kept if there is
    room)."""
    first = pieces[0]
    slots = _SLOTS.setdefault(opt, {}).setdefault(group, [])
    slots[:] = [s for s in slots if s.fits(first, numels)]  # a changed structure (or moved memory) drops a slot
    for slot in slots:
        if slot.cache.is_idle():
            return slot
    slot = _new_slot(pieces, numels, int(opt.partition_size[group]))
    if len(slots) < _MAX_SLOTS:
        slots.append(slot)
    return slot


def _contiguous_partition(opt: Any, group: int) -> ViewCache:
    """This rank's partition of group ``group`` as one tensor that the optimizer step reads, with its view cache.

    The compact buffer and the offload buffer already are one tensor. The default list of views is used in place
    where its pieces lie one after the other in one buffer and fill the partition, a last rank's zero padding
    included (``grads_in_partition``: ZeRO-1's, and from the backward after the first call ZeRO-2's and the
    padding too, laid out by :mod:`.grad_order`; :func:`~.grad_order.placed`; no allocation, no copy). Otherwise
    (the first step's ZeRO-2 pieces, in the order gradients arrived; separate gradient tensors; alignment padding
    between parameters) it is copied (:func:`_copy_pieces`) into a flat tensor of
    ``partition_size`` elements allocated once and kept across steps (:class:`_FlatSlot`; a second one only while a
    caller still holds views of the first). ``averaged_gradients[group]`` is rebound either way to a
    ``GradPartitionBufferGroup`` over the partition where DeepSpeed has that class, so its step reads the flat
    tensor without flattening again (the copy here replaces the step's own).
    """
    if opt.cpu_offload:
        grad = opt.single_partition_of_fp32_groups[group].grad
        if grad is None:
            raise GradientsNotReadyError(f"ZeRO-1/2 offload has no gradient for param group {group} now: {WINDOW}")
        return kept_partition(opt, ("offload", group), grad.view(-1))
    pieces = opt.averaged_gradients.get(group)
    if pieces is None:
        raise GradientsNotReadyError(f"ZeRO-1/2 has no reduced gradient for param group {group} now: {WINDOW}")
    flat = getattr(pieces, "flat_partition", None)
    if flat is not None:
        borrowed = getattr(pieces, "_zero_dtensor_cache", None)
        if borrowed is not None and borrowed.buffer is flat:  # rebound by an earlier call of this step (in place)
            return borrowed
        for slot in _SLOTS.get(opt, {}).get(group, ()):
            if slot.flat is flat:  # rebound by an earlier call of this step
                return slot.cache
        return ViewCache(flat.view(-1))  # DeepSpeed's compact buffer: new memory every step
    key = piece_key(pieces)
    numels = key[0] if key is not None else tuple(map(torch.Tensor.numel, pieces))
    partition_numel = int(opt.partition_size[group])
    in_place = placed(pieces, key, partition_numel) if key is not None else None
    if in_place is not None:
        start, key = in_place
        # through a detached alias: a view's ``_base`` would keep DeepSpeed's first piece alive past the step
        cache = ViewCache(pieces[0].detach().as_strided((partition_numel,), (1,), start))
        opt.averaged_gradients[group] = _in_place(pieces, key, cache)
        _SLOTS.get(opt, {}).pop(group, None)  # a flat copy of an earlier step (ZeRO-2's first) is not kept for nothing
        return cache
    slot = _slot_for(opt, group, pieces, numels)
    _copy_pieces(slot, pieces, key)
    opt.averaged_gradients[group] = _for_this_step(slot.rebound, pieces)
    return slot.cache


def _in_place(pieces: Sequence[torch.Tensor], key: PieceKey, cache: ViewCache) -> list:
    """DeepSpeed's own ``pieces`` (lying as :func:`~.grad_order.placed` found) in a new list over the partition
    ``cache.buffer``, a 1-D view of their buffer: no allocation, no copy and no new view per piece. A
    ``GradPartitionBufferGroup`` where DeepSpeed has that class (its step then reads the partition without
    flattening it again), else a :class:`_FlatViews` (DeepSpeed 0.18.9 flattens the list as it does without
    zero_dtensor). Where ``key`` leaves out a trailing zero-padding tensor (:func:`~.grad_order.placed`), the list
    holds a view of the zeroed memory after the pieces in its place (one view). DeepSpeed's step drops the list;
    it also holds ``cache``, so that a second call of this step finds it, and nothing of zero_dtensor's keeps it
    (:func:`grad_storage` refers to it weakly) or DeepSpeed's buffer (a new one every backward) past the step."""
    buffer_group = _lazy_buffer_group()
    flat = cache.buffer
    rebound = _FlatViews() if buffer_group is None else buffer_group.__new__(buffer_group)
    list.extend(rebound, pieces)
    rebound.flat_partition = flat
    padded = len(key[0]) < len(pieces)
    if padded:
        numel = pieces[-1].numel()
        padding = flat.narrow(0, flat.numel() - numel, numel)
        padding._zero_padding = True
        rebound[-1] = padding
    rebound._zero_dtensor_cache = cache
    rebound._zero_dtensor_start = flat.storage_offset()  # where the partition started when the pieces were taken
    return rebound


@functools.cache
def _lazy_buffer_group() -> type | None:
    """DeepSpeed's ``GradPartitionBufferGroup`` (``None`` where it lacks it), subclassed so that its
    ``_view_specs`` (each piece's offset in the partition, shape and padding flag, which only its
    ``move_flat_partition`` reads: offloading the optimizer's states) is computed on first read, as its
    ``__init__`` computes it, instead of by a pass over thousands of pieces in every first call of a step."""
    from deepspeed.runtime.zero import stage_1_and_2

    base = getattr(stage_1_and_2, "GradPartitionBufferGroup", None)
    if base is None:
        return None

    def specs(self: Any) -> list:
        found = self.__dict__.get("_zero_dtensor_specs")
        if found is None:
            # relative to the partition as it lay when built (move_flat_partition reads this after moving it)
            start = self.__dict__.get("_zero_dtensor_start", 0)
            found = self.__dict__["_zero_dtensor_specs"] = [
                (b.storage_offset() - start, b.shape, getattr(b, "_zero_padding", False)) for b in self]
        return found

    def set_specs(self: Any, value: list) -> None:
        self.__dict__["_zero_dtensor_specs"] = value

    return type(base.__name__, (base,), {"_view_specs": property(specs, set_specs), "__module__": __name__,
                                         "__qualname__": base.__qualname__})


def _for_this_step(rebound: list, replaced: Any) -> list:
    """A new list like ``rebound`` (the same view objects and attributes, no new view) that also holds the
    DeepSpeed list ``replaced``. DeepSpeed's step drops it (``averaged_gradients[i] = None``) and ``replaced`` with
    it: thousands of DeepSpeed's views are freed in the step, as they are without zero_dtensor, not in this call
    (1-2 ms at 5,000 pieces). The slot keeps ``rebound`` itself; nothing of zero_dtensor's holds the new list
    (:func:`grad_storage` refers to it weakly)."""
    step = type(rebound).__new__(type(rebound))
    list.extend(step, rebound)
    step.__dict__.update(rebound.__dict__)
    step._zero_dtensor_replaced = replaced
    return step


def _is_live(current: Any, ref: Callable[[], Any]) -> bool:
    held = ref()
    return held is not None and current is held


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` where it takes one (DeepSpeed's and zero_dtensor's lists of views do), else a
    strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _copy_pieces(slot: _FlatSlot, pieces: Sequence[torch.Tensor], key: PieceKey | None) -> None:
    """DeepSpeed's pieces into the slot's flat tensor. DeepSpeed's views of one reduced buffer (ZeRO-1: in order;
    ZeRO-2: in the order gradients arrived) are copied as runs of that buffer, a fixed number of copies whatever the
    number of pieces (:class:`~zero_dtensor.layout.rows.PieceCopy`, its plan kept while the pieces lie the same way);
    anything else (separate tensors: ``contiguous_gradients: false``) with one ``_foreach_copy_`` into views shaped
    like the pieces (cut once per structure)."""
    plan = None
    if key is not None:
        if slot.copy_plan is None or slot.copy_plan[0] != key:
            slot.copy_plan = (key, piece_copy(key, slot.flat.element_size(), slot.flat.numel()))
        plan = slot.copy_plan[1]
    if plan is not None:
        plan.copy(pieces, slot.flat)
        return
    shapes = tuple(map(_SHAPE, pieces))
    shaped = slot.cache.get(("shaped", shapes),
                            lambda flat: torch._C._nn.unflatten_dense_tensors(flat, list(pieces)))
    torch._foreach_copy_(list(shaped), list(pieces))


def _offload_consumed(opt: Any, partitions: tuple[torch.Tensor, ...]) -> bool:
    """Offload keeps ``.grad`` after ``step()``; the per-parameter norms that backward records are then reset.

    ``norm_for_param_grads`` is filled by the boundary backward for every parameter with a fragment on this rank and
    emptied by ``step()`` (``reset_cpu_buffers``). A rank whose partitions hold only padding cannot tell (its values
    are zeros either way) and answers False.
    """
    norms = getattr(opt, "norm_for_param_grads", None)
    if norms is None:
        return False
    return len(norms) == 0 and any(
        len(opt.params_in_partition[i]) > 0 for i in range(len(partitions))
    )


def _group_layout(opt: Any, group: int) -> GroupLayout:
    pg = opt.real_dp_process_group[group]
    return GroupLayout(
        index=group,
        world_size=world_size_of(pg),
        rank=rank_in(pg),
        partition_numel=int(opt.partition_size[group]),
        packing=Packing.CONTIGUOUS,
    )


def _build_layout(engine: Any, opt: Any, partitions: tuple[torch.Tensor, ...]) -> tuple[FlatLayout, dict[str, Any]]:
    names = param_names(engine)
    groups, params, by_name = [], [], {}
    for i in range(len(partitions)):
        groups.append(_group_layout(opt, i))
        for param, offset in zip(opt.round_robin_bit16_groups[i], param_offsets(opt, i)):
            name = name_of(names, param)
            params.append(ParamLayout(name=name, shape=torch.Size(param.shape), group=i, offset=offset))
            by_name[name] = param
    return model_layout(engine, groups, params), by_name


def layout_for(engine: Any, opt: Any, partitions: tuple[torch.Tensor, ...]) -> tuple[FlatLayout, dict[str, Any]]:
    """The layout of flat groups holding ``partitions`` (one 1-D tensor per param group, ``opt.partition_size[i]``
    elements: the gradient, or the fp32 masters and optimizer state, which share its geometry), and the parameters
    by name; built once per optimizer and partition sizes (geometry only: every family of any dtype shares it, and
    so its plan), and reused. No communication."""
    key = (tuple(p.numel() for p in partitions), tuple(len(g) for g in opt.round_robin_bit16_groups))
    return cached_layout(opt, key, lambda: _build_layout(engine, opt, partitions))


def grad_storage(engine: Any, opt: Any) -> FlatStorage:
    wait_for_stream(getattr(opt, "reduction_stream", None))
    stage = 2 if opt.partition_gradients else 1
    if not engine.is_gradient_accumulation_boundary():
        what = "local, unreduced gradients" if stage == 1 else "partial sums only in per-parameter buffers"
        if opt.cpu_offload:
            what = "a stale offload buffer"
        raise GradientsNotReadyError(f"ZeRO-{stage} holds {what} mid-accumulation; {WINDOW}")
    order_gradient_buffer(opt)  # from the next backward on, the pieces lie in place (no copy here)
    caches = tuple(_contiguous_partition(opt, i) for i in range(len(opt.round_robin_bit16_groups)))
    partitions = tuple(c.buffer for c in caches)
    if opt.cpu_offload and _offload_consumed(opt, partitions):
        raise GradientsNotReadyError(
            f"ZeRO-{stage} offload: engine.step() already consumed these gradients (its fp32 buffer still holds the "
            f"clipped, unscaled values of the last step); {WINDOW}"
        )
    layout, by_name = layout_for(engine, opt, partitions)

    start_micro_step = micro_steps(engine)
    # weakly: the list DeepSpeed's step drops must not outlive the step here (:func:`_for_this_step`)
    live = [_weak(opt.averaged_gradients.get(i)) for i in range(len(partitions))] if not opt.cpu_offload else []

    def is_current() -> bool:
        if micro_steps(engine) != start_micro_step:
            return False
        if opt.cpu_offload:
            return all(opt.single_partition_of_fp32_groups[i].grad is not None for i in range(len(partitions)))
        return all(_is_live(opt.averaged_gradients.get(i), live[i]) for i in range(len(partitions)))

    def after_write(written: Sequence[str]) -> None:
        if not opt.cpu_offload:
            return
        try:
            from deepspeed.runtime.zero.utils import get_norm_dtype
        except ImportError:  # DeepSpeed 0.18.9 computes these norms in float64
            def get_norm_dtype() -> torch.dtype:
                return torch.float64

        plan = plan_for(layout)
        ids, fragments = [], []
        for name in written:
            g, k = plan.where[name]
            local = plan.groups[g].local
            if plan.groups[g].frag_len[k]:  # DeepSpeed records a norm only for parameters with a local fragment
                ids.append(opt.get_param_id(by_name[name]))
                fragments.append(caches[g].split(local.sizes)[local.piece[k]])
        if fragments:  # as DeepSpeed computes them (fragment.to(norm dtype).norm(2)), one _foreach_norm for all
            opt.norm_for_param_grads.update(zip(ids, torch._foreach_norm(fragments, 2, dtype=get_norm_dtype())))

    sharded = FlatStorage(
        layout=layout,
        partitions=partitions,
        process_groups=tuple(opt.real_dp_process_group[i] for i in range(len(partitions))),
        loss_scale=float(opt.loss_scale),
        device=engine.device,
        is_current=is_current,
        after_write=after_write,
        describe=f"ZeRO-{stage}",
        view_caches=caches,
    )
    capture = active_capture(opt)
    if capture is not None and capture.complete():
        capture.finalize()
        return _replicated(sharded, capture)
    return sharded


def _replicated(sharded: FlatStorage, capture: Any) -> FlatStorage:
    """The same gradients as ``sharded``, but every group is the full flat buffer kept by ``keep_full_grads``.

    Writes (``set_full_`` and in-place transforms, which call ``after_write``) go to the full buffer; ``after_write``
    then copies this rank's slice of every touched group into DeepSpeed's partition (the memory ``step()`` reads,
    converting device/dtype where needed, e.g. a CPU offload buffer) and refreshes DeepSpeed's bookkeeping. Raw
    writes into views of the full buffer (``to_local()``, ``grads.groups``, ``local_partitions``) are found by the
    buffers' version counters and copied the same way at the start of the optimizer step (the capture wraps it).
    Every rank must therefore apply the same change (as with ``BF16_Optimizer``).
    """
    layout = sharded.layout
    fulls = []
    for g, part in zip(layout.groups, sharded.partitions):
        full = capture.buffers[g.index]
        if full is None:  # no parameter of this group received a gradient: DeepSpeed's partition is zeros too
            full = capture.buffers[g.index] = torch.zeros(g.flat_numel, dtype=part.dtype, device=sharded.device)
        fulls.append(full)
    caches = tuple(kept_partition(capture.opt, ("keep_full_grads", i), full) for i, full in enumerate(fulls))
    fulls = [c.buffer for c in caches]

    def build() -> FlatLayout:
        groups = tuple(GroupLayout(g.index, g.world_size, g.rank, g.flat_numel, Packing.CONTIGUOUS, replicated=True)
                       for g in layout.groups)
        return FlatLayout(groups=groups, params=layout.params)

    new_layout = cached_layout(capture.opt, ("keep_full_grads", layout), build)

    versions = [full._version for full in fulls]  # bumped by any in-place write through any view of a buffer

    def copy_to_partitions(groups: Sequence[int]) -> None:
        for i in groups:
            g = layout.groups[i]
            sharded.partitions[i].copy_(fulls[i].narrow(0, g.local_start, g.partition_numel))
            versions[i] = fulls[i]._version

    def after_write(written: Sequence[str]) -> None:
        copy_to_partitions(sorted({new_layout.by_name[n].group for n in written}))
        sharded.after_write(written)

    def before_step() -> None:
        """Raw writes (``to_local()``, ``grads.groups``, ``local_partitions``) reach the step too."""
        dirty = [i for i, full in enumerate(fulls) if full._version != versions[i]]
        if dirty:
            copy_to_partitions(dirty)
            sharded.after_write([p.name for p in layout.params if p.group in dirty])

    capture.before_step = before_step

    return FlatStorage(
        layout=new_layout,
        partitions=tuple(fulls),
        process_groups=sharded.process_groups,
        loss_scale=sharded.loss_scale,
        device=sharded.device,
        is_current=sharded.is_current,
        after_write=after_write,
        describe=f"{sharded.describe} + keep_full_grads (Replicate)",
        view_caches=caches,
    )
