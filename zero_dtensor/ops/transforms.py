"""Elementwise transforms and snapshots of the local shards: **no communication**.

Each works on this rank's fragments of DeepSpeed's gradient memory, batched: per flat group, either one operation
on the whole partition (every parameter selected, one operand for all; the padding is zeroed again afterwards, with
one ``_foreach_zero_``) or one ``torch._foreach_*`` call over the selected fragments (views from one
``split_with_sizes`` of the partition, cached per step). The number of tensor operations does not grow with the
number of parameters. Values are in true (unscaled) units; under fp16 loss scaling operands are scaled to the
stored units (``x · loss_scale``) first. Writes never record autograd history.

Devices (:mod:`zero_dtensor.layout.devices`): every operand (0-d tensors, per-parameter factors, masks, counters; checked
by :mod:`zero_dtensor.ops.operands`) is moved to the **storage device** (where the partitions live: the CPU under ``offload_optimizer: cpu``) before it meets the
data, once per call (a per-parameter mapping as one stacked vector). On a CUDA device a uniform 0-d factor of
``mul_`` / ``div_`` is cast to the data's dtype and applied with one ``_foreach_mul_`` / ``_foreach_div_`` over the
selected groups' partitions (CUDA casts a 0-d CUDA operand to the data's dtype anyway: bitwise equal, and the
multi-tensor kernel reads and writes at bandwidth); on the CPU ``x.mul_(factor)`` keeps the CPU's scalar semantics.

The public entry points are the ``ShardedGrads`` methods (``mul_``, ``div_``, ``add_``, ``clamp_``, ``zero_``,
``lerp_``, ``copy_``, ``apply_``, ``add_noise_``, ``clone``); the functions here take the state they work on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..layout.devices import to_device, to_storage
from .noise import normal_from_counters, stream_key
from .operands import (PerParam, Scalar, foreach_operands, group_operands, per_param, scalar,  # noqa: F401
                       to_storage_operand)
from ..core.state import FlatState, Selection
from ..core.storage import FlatStorage

__all__ = [
    "PerParam",
    "Scalar",
    "add_noise_",
    "add_other_",
    "add_scalar_",
    "apply_",
    "clamp_",
    "clone_storage",
    "copy_",
    "div_",
    "lerp_other_",
    "lerp_scalar_",
    "mul_",
    "per_param",
    "run",
    "scalar",
    "zero_",
]


@torch.no_grad()
def run(state: FlatState, sel: Selection, whole_op: Callable[[torch.Tensor, Any], Any],
        foreach_op: Callable[[list[torch.Tensor], Any], Any], operand: Any = None) -> None:
    """Apply an elementwise op to the selected gradients, then tell the optimizer (``after_write``).

    ``whole_op(partition, operand)`` runs where every parameter of a group is selected and the operand is uniform
    (the padding is zeroed again afterwards); elsewhere ``foreach_op(fragments, operand)`` runs once per group,
    with ``operand`` a list in fragment order when it is a :class:`PerParam`.
    """
    operand = to_storage_operand(state, operand)
    per = group_operands(sel, operand, state) if isinstance(operand, PerParam) else None
    for g, indices in sel.by_group.items():
        plan = state.plan.groups[g]
        if per is None and sel.whole(plan):
            whole_op(state.storage.partitions[g], operand)
            padding = state.padding_of(g)
            if padding:
                torch._foreach_zero_(padding)
            continue
        keep = [i for i, k in enumerate(indices) if plan.frag_len[k]]
        if not keep:
            continue
        frags = state.fragments_of(g, [indices[i] for i in keep])
        if per is not None:
            values = [per[g][i] for i in keep]
            foreach_op(frags, foreach_operands(values, state.storage.devices.storage))
        else:
            foreach_op(frags, operand)
    state.storage.after_write(sel.names)


def _other_fragments(state: FlatState, other: FlatState, g: int, indices: list[int]) -> torch.Tensor:
    """The other set's selected fragments of group ``g``, concatenated on this set's storage device (one ``cat``,
    then at most one move)."""
    return to_storage(torch.cat(other.fragments_of(g, indices)), state.storage.devices)


def _with_other(state: FlatState, other: FlatState, sel: Selection,
                whole_op: Callable[[torch.Tensor, torch.Tensor, Any], Any],
                flat_op: Callable[[torch.Tensor, torch.Tensor, Any], Any], operand: Any = None,
                per_op: Callable[[list[torch.Tensor], torch.Tensor, list[int], list[Any]], Any] | None = None
                ) -> None:
    """Elementwise ops whose second operand is another gradient set with the same layout.

    Whole groups (uniform operand): ``whole_op(partition, other_partition, operand)``. Otherwise per group the
    selected fragments are concatenated (one ``cat`` each side), ``flat_op`` runs once on the concatenations and
    the result is written back with one ``_foreach_copy_``. A :class:`PerParam` operand goes to
    ``per_op(fragments, other_concatenated, lengths, values)`` instead (``values`` numbers or 0-d tensors on the
    storage device, one per fragment): ``_foreach_*`` calls with per-fragment operands, no per-element expansion.
    """
    operand = to_storage_operand(state, operand)
    per = group_operands(sel, operand, state) if isinstance(operand, PerParam) else None
    devices = state.storage.devices
    with torch.no_grad():
        for g, indices in sel.by_group.items():
            plan = state.plan.groups[g]
            if per is None and sel.whole(plan):
                part = state.storage.partitions[g]
                whole_op(part, to_storage(other.storage.partitions[g], devices), operand)
                padding = state.padding_of(g)
                if padding:
                    torch._foreach_zero_(padding)
                continue
            keep = [indices[i] for i in range(len(indices)) if plan.frag_len[indices[i]]]
            if not keep:
                continue
            frags = state.fragments_of(g, keep)
            lengths = [plan.frag_len[k] for k in keep]
            if per is not None:
                if per_op is None:
                    raise TypeError("per-parameter operands are not supported here")
                pos = {k: i for i, k in enumerate(indices)}
                values = foreach_operands([per[g][pos[k]] for k in keep], devices.storage)
                per_op(frags, _other_fragments(state, other, g, keep), lengths, values)
                continue
            flat, flat_other = torch.cat(frags), _other_fragments(state, other, g, keep)
            flat_op(flat, flat_other, operand)
            torch._foreach_copy_(frags, flat.split_with_sizes(lengths))
        state.storage.after_write(sel.names)


# --- the transforms --------------------------------------------------------------------------------------------------
def _scale_op(op: str) -> Callable[[torch.Tensor, Any], Any]:
    """``x.mul_(f)`` / ``x.div_(f)`` on a whole partition. On CUDA a 0-d tensor ``f`` is cast to ``x``'s dtype and
    applied by ``torch._foreach_mul_([x], f)``: CUDA casts a 0-d device operand to the common dtype itself, so the
    values are bitwise those of ``x.mul_(f)``, but the multi-tensor kernel reads and writes at bandwidth where
    ``x.mul_(f)`` takes the strided dynamic-cast path (3.9x a ``mul_`` of bf16 data on an H200). On the CPU a 0-d
    tensor is a scalar kept in float (casting it first would change bf16 results): ``x.mul_(f)``."""
    inplace = getattr(torch.Tensor, f"{op}_")
    foreach = getattr(torch, f"_foreach_{op}_")

    def whole(x: torch.Tensor, f: Any) -> Any:
        if isinstance(f, torch.Tensor) and x.device.type == "cuda" and f.device == x.device:
            return foreach([x], f.to(x.dtype))
        return inplace(x, f)

    return whole


def mul_(state: FlatState, sel: Selection, factor: float | torch.Tensor | PerParam) -> None:
    run(state, sel, _scale_op("mul"), lambda xs, f: torch._foreach_mul_(xs, _cast_on_cuda(xs, f)), factor)


def div_(state: FlatState, sel: Selection, divisor: float | torch.Tensor | PerParam) -> None:
    run(state, sel, _scale_op("div"), lambda xs, d: torch._foreach_div_(xs, _cast_on_cuda(xs, d)), divisor)


def _cast_on_cuda(xs: list[torch.Tensor], f: Any) -> Any:
    """A 0-d tensor operand of a ``_foreach_*`` over CUDA fragments (uniform, or a list of per-fragment 0-d tensors
    on their device), cast to their dtype (the fast multi-tensor path needs equal dtypes; CUDA casts a 0-d device
    operand to the data's dtype itself, so values are bitwise equal, see :func:`_scale_op`): one ``stack``, one
    cast and an ``unbind`` for a list, whatever its length; else ``f``."""
    if not xs or xs[0].device.type != "cuda":
        return f
    if isinstance(f, torch.Tensor) and f.device == xs[0].device:
        return f.to(xs[0].dtype)
    if (isinstance(f, list) and f and all(isinstance(v, torch.Tensor) and v.device == xs[0].device for v in f)
            and any(v.dtype != xs[0].dtype for v in f)):
        return list(torch.stack(f).to(xs[0].dtype).unbind(0))
    return f


def zero_(state: FlatState, sel: Selection) -> None:
    run(state, sel, lambda x, _: x.zero_(), lambda xs, _: torch._foreach_zero_(xs))


def add_scalar_(state: FlatState, sel: Selection, value: float | torch.Tensor,
                alpha: float | torch.Tensor | PerParam) -> None:
    """``g += value · alpha`` (true units): the stored addend is ``value · alpha · loss_scale``."""
    scale = state.loss_scale
    value, alpha = to_storage_operand(state, value), to_storage_operand(state, alpha)
    if isinstance(alpha, PerParam):
        if any(isinstance(a, torch.Tensor) for a in alpha.values) or isinstance(value, torch.Tensor):
            device = state.storage.devices.storage
            numbers = to_storage(torch.tensor([0.0 if isinstance(a, torch.Tensor) else a for a in alpha.values],
                                              dtype=torch.float32), state.storage.devices)
            tensors = [i for i, a in enumerate(alpha.values) if isinstance(a, torch.Tensor)]
            if tensors:  # one stack of the tensor alphas (already on the storage device), one index_copy_
                numbers.index_copy_(0, to_device(torch.tensor(tensors), device), torch.stack(
                    [alpha.values[i].to(torch.float32) for i in tensors]))
            addends: list[Any] = list((numbers * (value * scale)).unbind(0))
        else:
            addends = [value * a * scale for a in alpha.values]
        run(state, sel, lambda x, c: x.add_(c), lambda xs, c: torch._foreach_add_(xs, c), PerParam(addends))
        return
    addend = value * alpha * scale
    run(state, sel, lambda x, c: x.add_(c), lambda xs, c: torch._foreach_add_(xs, c), addend)


def add_other_(state: FlatState, other: FlatState, sel: Selection, alpha: float | torch.Tensor | PerParam) -> None:
    """``g += alpha · other`` in true units. Where ``alpha · ratio != 1`` the product is formed in float32 and then
    added (one rounding to the stored dtype), so results do not depend on how fragments fall on vector
    boundaries (torch's ``add_(o, alpha=)`` on 16-bit tensors rounds differently in its vectorized body and its
    scalar tail)."""
    ratio = state.loss_scale / other.loss_scale

    def whole(x: torch.Tensor, o: torch.Tensor, a: Any) -> Any:
        if not isinstance(a, torch.Tensor) and a * ratio == 1.0:
            return x.add_(o)
        factor = (a * ratio).to(o.device) if isinstance(a, torch.Tensor) else a * ratio
        return x.add_(o.to(torch.float32) * factor)

    def per(xs: list[torch.Tensor], o: torch.Tensor, lengths: list[int], alphas: list[Any]) -> None:
        """Per fragment ``x += float32(o) · (alpha · ratio)``, one rounding, as :func:`whole` does: one float32
        copy of the other fragments' concatenation (split into views), one ``_foreach_mul_`` by per-fragment
        factors (0-d float32 tensors, or numbers), one ``_foreach_add_``: a fixed number of operations."""
        if isinstance(alphas[0], torch.Tensor):
            factors: list[Any] = list((torch.stack(alphas).to(torch.float32) * ratio).unbind(0))
        else:  # numbers: their float32 products with the ratio, as the tensor path forms them
            factors = (torch.tensor(alphas, dtype=torch.float32) * ratio).tolist()
        products = list(o.to(torch.float32, copy=True).split_with_sizes(lengths))
        torch._foreach_mul_(products, factors)
        torch._foreach_add_(xs, products)

    _with_other(state, other, sel, whole, whole, alpha, per)


def clamp_(state: FlatState, sel: Selection, lo: float | torch.Tensor | None, hi: float | torch.Tensor | None) -> None:
    scale = state.loss_scale
    lo, hi = to_storage_operand(state, lo), to_storage_operand(state, hi)
    lo = None if lo is None else lo * scale
    hi = None if hi is None else hi * scale

    def many(xs: list[torch.Tensor], _: Any) -> None:
        if lo is not None:
            torch._foreach_clamp_min_(xs, [lo] * len(xs) if isinstance(lo, torch.Tensor) else lo)
        if hi is not None:
            torch._foreach_clamp_max_(xs, [hi] * len(xs) if isinstance(hi, torch.Tensor) else hi)

    run(state, sel, lambda x, _: x.clamp_(lo, hi), many)


def lerp_scalar_(state: FlatState, sel: Selection, end: float | torch.Tensor, weight: float | torch.Tensor) -> None:
    scale = state.loss_scale
    end, weight = to_storage_operand(state, end), to_storage_operand(state, weight)

    def target(x: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(end * scale, dtype=x.dtype, device=x.device)

    def many(xs: list[torch.Tensor], _: Any) -> None:
        t = target(xs[0])
        ends = [t.expand_as(x) for x in xs]
        if isinstance(weight, torch.Tensor):
            torch._foreach_lerp_(xs, ends, [weight] * len(xs))
        else:
            torch._foreach_lerp_(xs, ends, weight)

    run(state, sel, lambda x, _: x.lerp_(target(x).expand_as(x), weight), many)


def lerp_other_(state: FlatState, other: FlatState, sel: Selection, weight: float | torch.Tensor) -> None:
    ratio = state.loss_scale / other.loss_scale
    weight = to_storage_operand(state, weight)

    def op(x: torch.Tensor, o: torch.Tensor, _: Any) -> Any:
        o = o if ratio == 1.0 and o.dtype == x.dtype else (o.to(torch.float32) * ratio).to(x.dtype)
        return x.lerp_(o, weight)

    _with_other(state, other, sel, op, op)


def copy_(state: FlatState, other: FlatState, sel: Selection) -> None:
    ratio = state.loss_scale / other.loss_scale

    def op(x: torch.Tensor, o: torch.Tensor, _: Any) -> Any:
        return x.copy_(o if ratio == 1.0 else o.to(torch.float32) * ratio)

    _with_other(state, other, sel, op, op)


def apply_(state: FlatState, sel: Selection, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """``fn`` on true values: once per whole group (the partition, padding included, zeroed again afterwards),
    else once per group on the concatenation of the selected fragments (written back with one ``_foreach_copy_``).
    """
    storage = state.storage

    def call(x: torch.Tensor) -> torch.Tensor:
        arg = storage.to_true(x)
        result = fn(arg)
        if result is None:
            result = arg
        if not isinstance(result, torch.Tensor) or result.shape != x.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise ValueError(f"apply_: fn must return None or a tensor of shape {tuple(x.shape)}, got {got}")
        return storage.to_stored(result)

    with torch.no_grad():
        for g, indices in sel.by_group.items():
            plan = state.plan.groups[g]
            if sel.whole(plan):
                part = storage.partitions[g]
                result = call(part)
                if result is not part:
                    part.copy_(result)
                padding = state.padding_of(g)
                if padding:
                    torch._foreach_zero_(padding)
                continue
            keep = [k for k in indices if plan.frag_len[k]]
            if not keep:
                continue
            frags = state.fragments_of(g, keep)
            result = call(torch.cat(frags))
            torch._foreach_copy_(frags, result.split_with_sizes([plan.frag_len[k] for k in keep]))
        storage.after_write(sel.names)


def add_noise_(state: FlatState, sel: Selection, std: float | torch.Tensor, seed: int) -> None:
    """``g += std · counter_normal(seed, name, numel)[j]`` for every local element ``j`` (true units): per group one
    counter tensor for all selected fragments, one noise draw, one ``_foreach_add_``."""
    scale = state.loss_scale
    std = to_storage_operand(state, std)
    device = state.storage.devices.storage
    with torch.no_grad():
        for g, indices in sel.by_group.items():
            plan = state.plan.groups[g]
            keep = [k for k in indices if plan.frag_len[k]]
            if not keep:
                continue
            frags = state.fragments_of(g, keep)
            lengths = [plan.frag_len[k] for k in keep]
            total = sum(lengths)
            starts, streams, counts = to_device(torch.tensor(
                [[plan.frag_start[k] for k in keep], [stream_key(seed, plan.params[k].name) for k in keep], lengths],
                dtype=torch.int64), device).unbind(0)
            firsts = torch.cumsum(counts, 0) - counts  # where each fragment starts in the batch
            counters = torch.arange(total, dtype=torch.int64, device=device) + (starts - firsts).repeat_interleave(
                counts, output_size=total)
            noise = normal_from_counters(streams.repeat_interleave(counts, output_size=total), counters)
            if isinstance(std, torch.Tensor):
                noise = noise * (std * scale)
                torch._foreach_add_(frags, noise.split_with_sizes(lengths))
            else:  # as x.add_(noise, alpha=std·scale) on each fragment: one fused multiply-add per element
                torch._foreach_add_(frags, noise.split_with_sizes(lengths), alpha=std * scale)
        state.storage.after_write(sel.names)


def _always_current() -> bool:
    return True


def clone_storage(state: FlatState, dtype: torch.dtype | None) -> FlatStorage:
    """A copy of this rank's partitions with the same layout (one copy per group), valid across steps."""
    storage = state.storage
    partitions = tuple(p.detach().to(dtype=dtype or p.dtype, copy=True) for p in storage.partitions)
    return FlatStorage(
        layout=storage.layout,  # geometry only: the same plan serves the clone, in any dtype
        partitions=partitions,
        process_groups=storage.process_groups,
        loss_scale=storage.loss_scale,
        device=storage.device,
        is_current=_always_current,
        describe=f"clone of {storage.describe}",
    )
