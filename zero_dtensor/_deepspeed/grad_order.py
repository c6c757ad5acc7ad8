"""ZeRO-1/2 without offload: DeepSpeed's contiguous gradient buffer laid out in flat order, so it is used in place.

Facts used (``deepspeed/runtime/zero/stage_1_and_2.py``, 0.19.8 and 0.18.9 alike):

- With ``contiguous_gradients`` (the default), ``copy_grads_in_partition(param[, group_idx])`` copies the reduced
  gradient of each parameter of this rank's partitions (``params_in_partition[g]``, whole parameters, boundary
  ones included) into ``grads_in_partition`` at ``grads_in_partition_offset``, advances the offset by the
  parameter's numel and rebinds the gradient to that memory. The buffer is ``torch.empty`` of the sum of those
  numels (``opt.dtype``, the current device), allocated by the first copy after ``_release_ipg_buffers`` set it to
  ``None`` (every backward). No other code reads the offset.
- The pieces of a step's partition (``averaged_gradients[g]``, from ``get_flat_partition``) are views of those
  gradients, the first and last narrowed to the partition, plus a zero tensor of their own where the partition
  ends in padding (``_zero_padding``).
- ZeRO-1 copies at the boundary in flat order; ZeRO-2 copies during backward in the order gradients arrive (about
  the reverse), so its pieces lie out of order and :mod:`.zero12` had to copy them into a flat partition once per
  step (2 GB of bf16 gradients: about 0.9 ms of an H200's bandwidth).

:func:`order_gradient_buffer` wraps that method (an instance attribute, as :mod:`.capture` wraps others) so that
each gradient goes where flat order puts it: group after group, each group's parameters in ``params_in_partition``
order, and after each group its partition's zero padding (zeroed once per buffer; at most ``2 x world size - 1``
elements). The values, when the buffer is allocated, its dtype and device are DeepSpeed's; the buffer grows by the
padding only. A rank's pieces then lie one after the other and fill its partition, and :mod:`.zero12` uses them in
place: the first ``sharded_grads`` of a step copies and allocates nothing, and DeepSpeed's step reads the same
memory (a ``GradPartitionBufferGroup``) without flattening it. Only where a parameter has alignment padding
(``parameter_alignment``), or got no gradient this step (DeepSpeed gives it a zero tensor of its own), do the
pieces still need the copy. No communication; no tensor operation besides DeepSpeed's own (and the padding's
fill).
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..layout.rows import PieceKey

__all__ = ["FlatOrder", "order_gradient_buffer", "padding_after", "placed"]


@dataclass(frozen=True)
class FlatOrder:
    """Where each parameter's gradient goes in ``grads_in_partition`` (flat order) and the buffer's size.

    ``place``: DeepSpeed's parameter id -> element offset; ``padding``: (element offset, numel) of each group's
    trailing zero padding in the buffer; ``numel``: the buffer's elements (DeepSpeed's size plus the paddings)."""

    place: dict[int, int]
    padding: tuple[tuple[int, int], ...]
    numel: int


def _flat_order(opt: Any) -> FlatOrder:
    """Flat order over every group (the buffer's size is DeepSpeed's, plus the paddings); ``place`` only for the
    parameters of groups whose gradients go through the buffer (not 0.19.x's compact fp32 buffer)."""
    compact = getattr(opt, "_use_compact_grad_partition_buffer", None)
    place: dict[int, int] = {}
    padding: list[tuple[int, int]] = []
    at = 0
    for group, params in enumerate(opt.params_in_partition):
        start, buffered = at, compact is None or not compact(group)
        for param in params:
            if buffered:
                place[opt.get_param_id(param)] = at
            at += param.numel()
        # the partition starts first_offset into the group's first parameter; what it lacks at its end is padding
        tail = int(opt.partition_size[group]) - (at - start - int(opt.first_offset[group])) if params else 0
        if tail > 0:
            padding.append((at, tail))
            at += tail
    return FlatOrder(place, tuple(padding), at)


_ORDERS: weakref.WeakKeyDictionary[Any, FlatOrder] = weakref.WeakKeyDictionary()
#: ``grads_in_partition`` buffers this module allocated (by storage address) -> their order, while their memory
#: lives (DeepSpeed drops the buffer tensor in backward; the gradients it holds keep the storage)
_BUFFERS: dict[int, tuple[weakref.ref, FlatOrder]] = {}


def order_gradient_buffer(opt: Any) -> None:
    """From the next backward on, ZeRO-1/2 (contiguous gradients, no offload) lays its reduced gradients in flat
    order (module docstring). Idempotent; a no-op where DeepSpeed does not use ``grads_in_partition``. No
    communication, no tensor operation now."""
    if opt in _ORDERS or opt.cpu_offload or not getattr(opt, "contiguous_gradients", False):
        return
    if "copy_grads_in_partition" in vars(opt):  # wrapped by someone else: leave their wrapper alone
        return
    order = _ORDERS[opt] = _flat_order(opt)
    if not order.place:  # every group accumulates in the compact fp32 buffer
        return
    original = opt.copy_grads_in_partition
    opt_ref = weakref.ref(opt)
    ours: list[Callable[[], Any]] = [lambda: None]  # a weak reference to the buffer allocated here last

    def copy_grads_in_partition(param: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        o = opt_ref()
        at = order.place.get(o.get_param_id(param))
        if at is not None:
            if o.grads_in_partition is None:
                o.grads_in_partition = _allocate(order, o.dtype)
                ours[0] = weakref.ref(o.grads_in_partition)
            if o.grads_in_partition is ours[0]():  # not a buffer DeepSpeed began in its own order
                o.grads_in_partition_offset = at
        return original(param, *args, **kwargs)

    opt.copy_grads_in_partition = copy_grads_in_partition


def _allocate(order: FlatOrder, dtype: torch.dtype) -> torch.Tensor:
    from deepspeed.accelerator import get_accelerator

    buffer = torch.empty(order.numel, dtype=dtype, device=get_accelerator().current_device_name())
    for at, numel in order.padding:
        buffer.narrow(0, at, numel).zero_()
    storage = buffer.untyped_storage()
    address = storage.data_ptr()
    _BUFFERS[address] = (weakref.ref(storage, functools.partial(_forget, address)), order)
    return buffer


def _forget(address: int, ref: weakref.ref) -> None:
    if _BUFFERS.get(address, (None,))[0] is ref:
        del _BUFFERS[address]


def padding_after(piece: torch.Tensor, numel: int) -> bool:
    """Whether the ``numel`` elements right after ``piece`` are a group's zero padding in a ``grads_in_partition``
    buffer this module allocated (zeroed there, and never written by DeepSpeed)."""
    storage = piece.untyped_storage()
    entry = _BUFFERS.get(storage.data_ptr())
    if entry is None or entry[0]() is not storage:
        return False
    end = piece.storage_offset() + piece.numel()
    return (end, numel) in entry[1].padding


def placed(pieces: Sequence[torch.Tensor], key: PieceKey, partition_numel: int) -> tuple[int, PieceKey] | None:
    """Where the partition starts (:func:`_in_place_start`) and the key of the pieces that lie in place, when
    DeepSpeed's ``pieces`` (of :func:`~zero_dtensor.layout.rows.piece_key` ``key``) can be used in place: they fill
    the partition, or all but the last do and the buffer holds the group's zero padding, zeroed, of the last one's
    size right after them (a ``grads_in_partition`` laid out by :func:`order_gradient_buffer`: the last piece is
    then the zero tensor DeepSpeed appends where a partition ends in padding, ``_zero_padding`` or not). Else
    ``None``."""
    element_size = pieces[0].element_size()
    start = _in_place_start(key, element_size, partition_numel)
    if start is not None:
        return start, key
    padding = pieces[-1]
    if len(pieces) < 2:
        return None
    key = (key[0][:-1], key[1][:-1], key[2])
    start = _in_place_start(key, element_size, partition_numel - padding.numel())
    if start is None or not padding_after(pieces[-2], padding.numel()):
        return None
    return start, key


#: the last answer of :func:`_in_place_start` per (element size, partition size): DeepSpeed lays the pieces out the
#: same way every step (a new buffer, the same offsets in it), so the key repeats and one comparison of it (C-level)
#: replaces the pass over the pieces
_LAST_START: dict[tuple[int, int], tuple[PieceKey, int | None]] = {}


def _in_place_start(key: PieceKey, element_size: int, partition_numel: int) -> int | None:
    """:func:`_find_in_place_start`, remembered for the last key of each (element size, partition size)."""
    last = _LAST_START.get((element_size, partition_numel))
    if last is not None and last[0] == key:
        return last[1]
    found = _find_in_place_start(key, element_size, partition_numel)
    if len(_LAST_START) > 64:
        _LAST_START.clear()
    _LAST_START[(element_size, partition_numel)] = (key, found)
    return found


def _find_in_place_start(key: PieceKey, element_size: int, partition_numel: int) -> int | None:
    """Where (in elements of the first piece's storage) the partition starts when DeepSpeed's ``pieces`` (of
    :func:`piece_key` ``key``) already lie one after the other in one buffer and fill the partition (ZeRO-1's
    ``grads_in_partition``, in flat order; no zero-padding tensor of its own), else ``None``. A few C-level passes
    over the key, no tensor operation."""
    numels, offsets, nbytes = key
    first = offsets[0]
    if first % element_size or sum(numels) != partition_numel or first + partition_numel * element_size > nbytes:
        return None
    ends = itertools.accumulate(numels[:-1], lambda at, n: at + n * element_size, initial=first)
    return first // element_size if all(map(operator.eq, ends, offsets)) else None
