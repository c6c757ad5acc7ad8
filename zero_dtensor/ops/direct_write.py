"""``set_full_``'s per-parameter path: each value copied straight into its fragment, planned once per request and
flat group, so that a call makes no Python pass over the parameters. On an accelerator (a device type not in
:data:`FOREACH_DEVICES`), where the fragments form one run of the partition (padding gaps aside) and every value is
contiguous and on the partition's device, one ``torch.cat(..., out=)`` writes the run (one
vectorized kernel per 128 inputs on CUDA; ``_foreach_copy_`` launches once per 320 chunks of 64Ki elements);
otherwise one ``_foreach_copy_`` into cached views of the fragments. **No communication**; writes DeepSpeed's
partition in place (no allocation beyond a zero filler of the largest padding gap, made once per request, dtype and
device; a value that lies in the partition's own memory, a view of it at any offset, is copied first,
:func:`~zero_dtensor.core.storage.shares_memory`, as the redistribution writes do) and never records autograd
history (the caller runs it under ``torch.no_grad``)."""

from __future__ import annotations

import operator
import weakref
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch

from ..core.state import FlatState
from ..core.storage import shares_memory
from ..layout.plan import GroupPlan

__all__ = ["write_direct"]

_DEVICE = operator.attrgetter("device")
#: the device types whose partitions keep ``_foreach_copy_`` where one ``cat`` could write the run
#: (:func:`write_direct`): the CPU, where ``_foreach_copy_`` is a loop of vectorized copies with no launches and
#: ``cat`` made the per-parameter path 20-30% slower in CPU time on 198 bf16 tensors
#: (``benchmarks/host_time_ab.py``; offloaded partitions live there). Tests empty it to run the ``cat`` path.
FOREACH_DEVICES: frozenset[str] = frozenset({"cpu"})


@dataclass(frozen=True, eq=False)
class _DirectWrite:
    """How one request's values of one flat group are written value by value (planned once per request and group):
    ``whole_pick`` picks the values of the parameters this rank holds whole (``None``: all of them, in order), each
    copied into a cached view of its fragment in the parameter's shape; ``partial`` holds, per parameter this rank
    holds only part of, its value's index, its index ``k`` in the group, and the part's start and length in the
    value."""

    whole_pick: Callable[[list[torch.Tensor]], Any] | None
    whole: tuple[int, ...]  # the parameters (indices ``k`` in the group) held whole, in request order
    partial: tuple[tuple[int, int, int, int], ...]
    whole_offsets: tuple[int, ...]  # where their fragments start in the partition
    whole_shapes: tuple[torch.Size, ...]  # their shapes
    whole_strides: tuple[tuple[int, ...], ...]  # and contiguous strides
    run: _Run | None  # where the fragments written form one run of the partition (padding aside)


@dataclass(frozen=True, eq=False)
class _Run:
    """The fragments a request writes, where they cover ``length`` elements of the partition from ``start`` with
    nothing in between but padding (ZeRO-3 pads each parameter's chunk on the last ranks): ``pick`` takes the
    sources (whole values, then partial parts) followed by one zero filler per padding gap (``gaps``: their
    lengths, in partition order) and returns them in partition order."""

    start: int
    length: int
    pick: Callable[[list[torch.Tensor]], Any]
    gaps: tuple[int, ...]


_DIRECT: weakref.WeakKeyDictionary[GroupPlan, dict[tuple[str, ...], _DirectWrite]] = weakref.WeakKeyDictionary()
_DIRECT_KEPT = 16


def _direct_write(plan: GroupPlan, names: tuple[str, ...]) -> _DirectWrite:
    """The cached :class:`_DirectWrite` of ``names`` (request order) in ``plan``'s group (a pass over the
    parameters the first time a request is seen, none after)."""
    per_plan = _DIRECT.setdefault(plan, {})
    found = per_plan.get(names)
    if found is None:
        if len(per_plan) >= _DIRECT_KEPT:
            per_plan.clear()
        whole_at, positions = plan.whole_position, plan.positions
        ks = [positions[n] for n in names]
        held = [i for i, k in enumerate(ks) if k in whole_at]
        partial = tuple((i, k, plan.frag_start[k], plan.frag_len[k]) for i, k in enumerate(ks)
                        if k not in whole_at and plan.frag_len[k])
        pick = None if held == list(range(len(ks))) else _picker(held)
        whole = tuple(ks[i] for i in held)
        shapes = tuple(plan.params[k].shape for k in whole)
        found = per_plan[names] = _DirectWrite(pick, whole, partial, tuple(plan.frag_offset[k] for k in whole),
                                               shapes, tuple(_contiguous_strides(shape) for shape in shapes),
                                               _run(plan, [*whole, *(k for _, k, _, _ in partial)]))
    return found


def _run(plan: GroupPlan, ks: list[int]) -> _Run | None:
    """The :class:`_Run` of the fragments of parameters ``ks`` (in source order), or ``None`` where something other
    than padding (a fragment the request does not name) lies between two of them, or there is no fragment."""
    order = sorted((i for i, k in enumerate(ks) if plan.frag_len[k]), key=lambda i: plan.frag_offset[ks[i]])
    if not order:
        return None
    held = sorted(plan.frag_offset[k] for k in range(len(plan.params)) if plan.frag_len[k])
    start = end = plan.frag_offset[ks[order[0]]]
    picks: list[int] = []
    gaps: list[int] = []
    for i in order:
        at = plan.frag_offset[ks[i]]
        if at != end:  # a gap: padding only if no fragment of the group starts inside it
            if bisect_left(held, end) != bisect_left(held, at):
                return None
            picks.append(len(ks) + len(gaps))
            gaps.append(at - end)
        picks.append(i)
        end = at + plan.frag_len[ks[i]]
    return _Run(start, end - start, _picker(picks), tuple(gaps))


_FILLERS: weakref.WeakKeyDictionary[_Run, dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]] = \
    weakref.WeakKeyDictionary()


def _fillers(run: _Run, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Zero views for ``run``'s padding gaps, of ``buffer``'s dtype and device (one zero tensor of the largest gap,
    made once per run, dtype and device)."""
    if not run.gaps:
        return []
    per_run = _FILLERS.setdefault(run, {})
    key = (buffer.dtype, buffer.device)
    found = per_run.get(key)
    if found is None:
        zeros = buffer.new_zeros(max(run.gaps))
        found = per_run[key] = [zeros[:n] for n in run.gaps]
    return found


def _picker(indices: list[int]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """``values -> [values[i] for i in indices]`` with one C-level call."""
    if not indices:
        return lambda values: []
    get = operator.itemgetter(*indices)
    return (lambda values: [get(values)]) if len(indices) == 1 else (lambda values: list(get(values)))


def write_direct(state: FlatState, plan: GroupPlan, names: tuple[str, ...], values: list[torch.Tensor]) -> None:
    """The values straight into this rank's fragments, planned once per request (:class:`_DirectWrite`): a call
    makes no pass over the parameters in Python, only one view per partly held parameter (ZeRO-1/2: at most two per
    rank and group; ZeRO-3 over several ranks: every one). Where the fragments form one run (:class:`_Run`) and
    the values allow it (:func:`_concatenable`), one ``cat`` into the run and no view of the partition at all (a
    buffer DeepSpeed allocates anew every step, ZeRO-1's, costs no view per parameter and step); otherwise, and
    under fp16 loss scaling, one ``_foreach_copy_`` into cached views of the fragments (whole local parameters in
    their shape)."""
    direct = _direct_write(plan, names)
    sources = values if direct.whole_pick is None else direct.whole_pick(values)
    if direct.partial:
        sources = [*sources, *(values[i].reshape(-1).narrow(0, start, length)
                               for i, _, start, length in direct.partial)]
    if not sources:
        return
    cache = state.view_caches[plan.index]
    scale = state.loss_scale
    if (scale == 1.0 and direct.run is not None and cache.buffer.device.type not in FOREACH_DEVICES
            and _concatenable(sources, cache.buffer)):
        run = direct.run
        pieces = run.pick([*map(torch.flatten, sources), *_fillers(run, cache.buffer)])
        torch.cat(pieces, out=cache.buffer.narrow(0, run.start, run.length))
        return
    dests = list(cache.get(("direct", plan, names), lambda _: _direct_views(state, plan, direct)))
    if scale != 1.0:  # value × scale in float32 (bit-identical to scaling each value alone), cast on copy
        if all(s.dtype == torch.float32 for s in sources):
            sources = torch._foreach_mul(sources, scale)
        else:  # other dtypes: one cat (promoting), one cast, one multiply; then flat pieces into flat fragments
            flat = torch.cat([s.reshape(-1) for s in sources]).to(torch.float32).mul_(scale)
            sources = list(flat.split_with_sizes([d.numel() for d in dests]))
            dests = [d.view(-1) for d in dests]
    torch._foreach_copy_(dests, sources)


def _concatenable(sources: list[torch.Tensor], buffer: torch.Tensor) -> bool:
    """Whether one ``torch.cat(..., out=)`` can write ``sources`` into their run of ``buffer``: every source
    contiguous (``flatten`` is then a view) on the buffer's device, and none in the buffer's own memory (``cat``
    refuses an input overlapping its output; ``copy_`` of a fragment onto itself is allowed; values that alias
    elsewhere were copied first by :func:`~zero_dtensor.ops.writes.set_full_`). Three C-level passes over the
    sources (and a sort of their addresses), no device operation."""
    if not all(map(torch.Tensor.is_contiguous, sources)):
        return False
    device = buffer.device
    if not all(map(operator.eq, map(_DEVICE, sources), repeat(device))):
        return False
    return not shares_memory(sources, (buffer,))


def _direct_views(state: FlatState, plan: GroupPlan, direct: _DirectWrite) -> list[torch.Tensor]:
    """New views of the partition for the fragments ``direct`` writes, in its order: in the parameter's shape where
    this rank holds it whole (one ``as_strided`` each, by a C-level pass), flat where it holds a part. Made once per
    partition buffer: again every step where the partition is DeepSpeed's own memory, so one view per parameter and
    no per-piece tiling first."""
    buffer = state.view_caches[plan.index].buffer
    base = buffer.storage_offset()
    whole = list(map(buffer.as_strided, direct.whole_shapes, direct.whole_strides,
                     map(base.__add__, direct.whole_offsets)))
    return whole + [buffer.narrow(0, plan.frag_offset[k], length) for _, k, _, length in direct.partial]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
