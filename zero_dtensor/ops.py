"""Sharded gradient transforms (elementwise, snapshots, reductions, clipping, noise) mixed into ``ShardedGrads``.

Everything here works on this rank's local fragments of DeepSpeed's gradient memory; nothing gathers a gradient.

Communication per call:

* elementwise ops (:meth:`~GradOpsMixin.mul_`, ``div_``, ``add_``, ``clamp_``, ``zero_``, ``lerp_``, ``copy_``,
  ``apply_``, ``add_noise_``) and :meth:`~GradOpsMixin.clone`: **none**;
* :meth:`~GradOpsMixin.norms`, ``global_norm``, ``dots``, ``clip_grad_norm_``, ``clip_per_param_``: **one**
  ``all_reduce`` of a ``(k,)`` float32 vector per distinct process group of the selected parameters (``k`` = the
  number of selected parameters in that group; DeepSpeed models normally have one data-parallel group, so one
  collective in all), whatever the number of parameters;
* :meth:`~GradOpsMixin.stats`: at most two (one sum, one max) per process group.

Groups whose process group has a single rank, and replicated groups (``BF16_Optimizer``: every rank holds the full
gradient), need no collective: their local values are already complete.

Units. Under fp16 dynamic loss scaling DeepSpeed stores ``true gradient × loss_scale``. Every operand and result here
is in *true* units: ``add_(x)`` adds ``x`` to the true gradient (``x·loss_scale`` to the stored value), ``clamp_``
clamps the true gradient, reductions report norms/dots/stats of the true gradient, and another ``ShardedGrads``
operand (or a clone) is converted from its own scale. Scale-invariant ops (``mul_``, ``div_``, ``zero_``) are
unaffected.

Selection. Every op takes ``params=``: ``None`` (all trainable parameters), a collection of names, or a predicate
``name -> bool``. Unknown names raise ``KeyError`` naming them, before anything is written. When every parameter of a
flat group is selected, elementwise ops run once over the whole local partition (one kernel instead of one per
parameter) and the partition's padding is set back to zero afterwards, so padding never carries values (DeepSpeed's
own norms include it).

All calls on a ``ShardedGrads`` must be made on every rank with the same arguments (as for any collective); the
elementwise ones do not communicate, but ranks that skip an op hold different gradients from the others.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any, Union

import torch
import torch.distributed as dist

from . import debug as _debug
from .collectives import _all_reduce_op

__all__ = ["GradOpsMixin", "GradStats", "NOISE_BLOCK", "counter_normal"]

ParamSelection = Union[None, Collection[str], Callable[[str], bool]]
Scalar = Union[numbers.Real, torch.Tensor]

NOISE_BLOCK = 1 << 16
"""Elements per independently seeded noise block of :func:`counter_normal`."""


# --- counter-based noise -----------------------------------------------------------------------------------------
def _block_seed(seed: int, key: str, block: int) -> int:
    digest = hashlib.blake2b(f"zero_dtensor-noise\0{int(seed)}\0{key}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def counter_normal(
    seed: int,
    key: str,
    numel: int,
    start: int = 0,
    stop: int | None = None,
    *,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Elements ``[start, stop)`` of a standard-normal float32 vector of length ``numel`` identified by ``(seed, key)``.

    Counter-based: the vector is cut into blocks of :data:`NOISE_BLOCK` elements; block ``b`` is drawn with
    ``torch.randn`` from a ``torch.Generator`` on ``device`` seeded by a hash of ``(seed, key, b)``, always at its
    full length (``min(NOISE_BLOCK, numel - b·NOISE_BLOCK)``). So any slice equals the same slice of the whole
    vector, whoever computes it: the cost is the slice plus at most two partial blocks. Values depend on the
    device type's generator (CPU and CUDA draw different numbers); on one device type they are sharding-invariant.
    No communication.
    """
    stop = numel if stop is None else stop
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"counter_normal: bad range [{start}, {stop}) for numel {numel}")
    device = torch.device(device)
    out = torch.empty(stop - start, dtype=torch.float32, device=device)
    if stop == start:
        return out
    first, last = start // NOISE_BLOCK, (stop - 1) // NOISE_BLOCK
    for block in range(first, last + 1):
        b_lo = block * NOISE_BLOCK
        b_len = min(NOISE_BLOCK, numel - b_lo)
        gen = torch.Generator(device=device)
        gen.manual_seed(_block_seed(seed, key, block))
        values = torch.randn(b_len, generator=gen, dtype=torch.float32, device=device)
        lo, hi = max(start, b_lo), min(stop, b_lo + b_len)
        out[lo - start : hi - start] = values[lo - b_lo : hi - b_lo]
    return out


# --- results -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GradStats:
    """Statistics of one parameter's true (unscaled) gradient, from :meth:`GradOpsMixin.stats`.

    ``norm`` is the 2-norm; ``max_abs`` the largest ``|g|`` (``nan`` if any element is nan); ``mean`` the mean over
    all elements; ``nan_count``/``inf_count`` count non-finite elements.
    """

    norm: float
    max_abs: float
    mean: float
    nan_count: int
    inf_count: int
    numel: int


# --- the mixin ---------------------------------------------------------------------------------------------------
class GradOpsMixin:
    """Operations on the local shards of a :class:`~zero_dtensor.sharded.ShardedGrads` (see the module docstring).

    The host class provides ``_storage`` (a :class:`~zero_dtensor.storage.GradStorage`), ``layout``,
    ``loss_scale``, ``names``, ``_check_current()``, ``_fragments`` (``name -> (start, stop, offset)`` of this rank's
    fragment) and ``_local(param)`` (that fragment as a view of the partition).
    """

    # ---------------------------------------------------------------------------------------------------------
    # elementwise, no communication
    # ---------------------------------------------------------------------------------------------------------
    def mul_(self, factor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Multiply the selected gradients by ``factor``: a number, a 0-d tensor, or a mapping ``name -> factor``
        (per-parameter factors; it must cover every selected parameter). **No communication.** Returns ``self``."""
        selected = self._pick(params)
        per = self._per_param(factor, selected, "factor")
        self._elementwise(selected, lambda x, f: x.mul_(f), per)
        return self

    def div_(self, divisor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Divide the selected gradients by ``divisor`` (number, 0-d tensor or per-parameter mapping).
        **No communication.** Returns ``self``."""
        selected = self._pick(params)
        per = self._per_param(divisor, selected, "divisor")
        self._elementwise(selected, lambda x, d: x.div_(d), per)
        return self

    def zero_(self, *, params: ParamSelection = None):
        """Set the selected gradients to zero. **No communication.** Returns ``self``."""
        selected = self._pick(params)
        self._elementwise(selected, lambda x, _: x.zero_(), None)
        return self

    def add_(self, other: Any, *, alpha: Scalar | Mapping[str, Scalar] = 1.0, params: ParamSelection = None):
        """``g += alpha * other`` in true units. **No communication.** Returns ``self``.

        With a ``ShardedGrads`` operand and ``alpha != 1``, ``alpha * other`` is formed in float32 and then added
        (one rounding to the stored dtype), so results do not depend on how fragments fall on vector boundaries.

        ``other``: a number or 0-d tensor (added to every element), or another ``ShardedGrads``/clone with the same
        layout (its own loss scale is taken into account). ``alpha``: a number, 0-d tensor, or a mapping
        ``name -> alpha`` (per-parameter, e.g. PCGrad projection coefficients).
        """
        selected = self._pick(params)
        per_alpha = self._per_param(alpha, selected, "alpha")
        scale = self.loss_scale
        if self._is_grads(other):
            self._check_same_layout(other)
            ratio = scale / other.loss_scale

            def op(x, a, o):
                if not isinstance(a, torch.Tensor) and a * ratio == 1.0:
                    return x.add_(o)
                # the product in float32, then one add: torch's add_(o, alpha=) on 16-bit tensors rounds differently
                # in its vectorized body and its scalar tail, which would make results depend on sharding
                factor = (a * ratio).to(o.device) if isinstance(a, torch.Tensor) else a * ratio
                return x.add_(o.to(torch.float32) * factor)

            self._elementwise(selected, op, per_alpha, other=other)
        else:
            value = self._scalar(other, "other")

            def op(x, a, _o=None):
                return x.add_(value * a * scale)

            self._elementwise(selected, op, per_alpha)
        return self

    def clamp_(self, min: Scalar | None = None, max: Scalar | None = None, *, params: ParamSelection = None):
        """Clamp the selected true gradients to ``[min, max]`` (numbers or 0-d tensors; the stored values are clamped
        to the bounds × ``loss_scale``). **No communication.** Returns ``self``."""
        if min is None and max is None:
            raise ValueError("clamp_: give at least one of min, max")
        lo = None if min is None else self._scalar(min, "min")
        hi = None if max is None else self._scalar(max, "max")
        selected = self._pick(params)
        scale = self.loss_scale
        lo = None if lo is None else lo * scale
        hi = None if hi is None else hi * scale
        self._elementwise(selected, lambda x, _: x.clamp_(lo, hi), None)
        return self

    def lerp_(self, end: Any, weight: Scalar, *, params: ParamSelection = None):
        """``g = g + weight * (end - g)`` (``torch.lerp``) in true units, e.g. an EMA ``ema.lerp_(grads, 1 - beta)``.

        ``end``: another ``ShardedGrads``/clone with the same layout, or a number/0-d tensor. **No communication.**
        Returns ``self``.
        """
        w = self._scalar(weight, "weight")
        selected = self._pick(params)
        scale = self.loss_scale
        if self._is_grads(end):
            self._check_same_layout(end)
            ratio = scale / end.loss_scale

            def op(x, _, o):
                o = o if ratio == 1.0 and o.dtype == x.dtype else (o.to(torch.float32) * ratio).to(x.dtype)
                return x.lerp_(o, w)

            self._elementwise(selected, op, None, other=end)
        else:
            value = self._scalar(end, "end")

            def op(x, _, _o=None):
                target = torch.as_tensor(value * scale, dtype=x.dtype, device=x.device)
                return x.lerp_(target.expand_as(x), w)

            self._elementwise(selected, op, None)
        return self

    def copy_(self, other: Any, *, params: ParamSelection = None):
        """Overwrite the selected gradients with those of ``other`` (a ``ShardedGrads`` or clone with the same
        layout, e.g. a snapshot from :meth:`clone`), converting between loss scales. **No communication.**
        Returns ``self``."""
        if not self._is_grads(other):
            raise TypeError(
                f"copy_ takes another ShardedGrads or a clone with the same layout, got {type(other).__name__} "
                "(to write full tensors use set_full_)"
            )
        self._check_same_layout(other)
        selected = self._pick(params)
        ratio = self.loss_scale / other.loss_scale

        def op(x, _, o):
            return x.copy_(o if ratio == 1.0 else o.to(torch.float32) * ratio)

        self._elementwise(selected, op, None, other=other)
        return self

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor | None], *, params: ParamSelection = None):
        """Apply a user function to the selected gradients, fragment by fragment. **No communication.**

        Contract for ``fn(x)``: it must be **elementwise** (each output element depends only on the input element at
        the same position, never on its neighbours, position, length or rank) and **shape-preserving**. ``x`` is a
        1-D tensor holding any contiguous run of this rank's elements: one parameter's fragment, possibly empty, or,
        when every parameter of a flat group is selected, the whole local partition including its padding (reset to
        zero afterwards). Values are in true units: without loss scaling ``x`` is a view of the stored gradient (in
        the stored dtype); under fp16 loss scaling it is an unscaled float32 copy. ``fn`` may modify ``x`` in place
        and return ``None``, or return a tensor of ``x``'s shape, which is cast and written back.

        The selection is validated before ``fn`` first runs; if ``fn`` raises or returns a wrong shape, fragments
        already processed stay modified. Returns ``self``.
        """
        if not callable(fn):
            raise TypeError(f"apply_ takes a callable, got {type(fn).__name__}")
        selected = self._pick(params)
        storage = self._storage

        def op(x, _, _o=None):
            arg = storage.to_true(x)
            result = fn(arg)
            if result is None:
                result = arg
            if not isinstance(result, torch.Tensor) or result.shape != x.shape:
                got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
                raise ValueError(f"apply_: fn must return None or a tensor of shape {tuple(x.shape)}, got {got}")
            result = storage.to_stored(result)
            if result is not x:
                x.copy_(result)
            return x

        self._elementwise(selected, op, None)
        return self

    def add_noise_(self, std: Scalar, seed: int, *, params: ParamSelection = None):
        """Add Gaussian noise ``std · N(0, 1)`` (true units) that does not depend on how the gradient is sharded.

        Element ``j`` of the flattened parameter ``name`` receives ``std · counter_normal(seed, name, numel)[j]``
        (see :func:`counter_normal`): the noise depends only on ``(seed, parameter name, element position)``, so
        results are identical at every world size and ZeRO stage, and equal a single-process reference built with
        ``counter_normal`` on the full parameter (on the same device type). Each rank draws only the blocks that
        overlap its fragment. Under fp16 the noise is multiplied by ``loss_scale``. Use a new ``seed`` per step.
        **No communication.** Returns ``self``.
        """
        std_v = self._scalar(std, "std")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"add_noise_: seed must be an int, got {type(seed).__name__}")
        selected = self._pick(params)
        scale = self.loss_scale
        for param in selected:
            start, stop, _ = self._fragments[param.name]
            if stop == start:
                continue
            x = self._local(param)
            noise = counter_normal(int(seed), param.name, param.numel, start, stop, device=x.device)
            if isinstance(std_v, torch.Tensor):
                x.add_(noise * (std_v * scale).to(x.device))
            else:
                x.add_(noise, alpha=std_v * scale)
        self._storage.after_write([p.name for p in selected])
        return self

    # ---------------------------------------------------------------------------------------------------------
    # snapshots
    # ---------------------------------------------------------------------------------------------------------
    def clone(self, *, dtype: torch.dtype | None = None):
        """A sharded copy: a new ``ShardedGrads`` with the same layout, backed by a copy of this rank's partitions.

        **No communication.** The clone keeps the loss scale of the moment (its values stay ``true × that scale``),
        is never stale (it stays valid after ``engine.step()`` and across steps), is not seen by the optimizer, and
        supports every ``ShardedGrads`` operation: views, ``full_tensors()`` (collective), reductions, and serving as
        the ``other`` of :meth:`add_`, :meth:`lerp_`, :meth:`copy_` and :meth:`dots` (e.g. keep the previous step's
        gradient, or an EMA, without gathering). ``dtype`` stores the copy in another floating dtype (e.g. an fp32
        EMA of bf16 gradients). Memory: the local partition sizes, in that dtype.
        """
        self._check_current()
        storage = self._storage
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"clone: dtype must be floating, got {dtype}")
        partitions = tuple(p.detach().to(dtype=dtype or p.dtype, copy=True) for p in storage.partitions)
        groups = tuple(replace(g, dtype=part.dtype) for g, part in zip(storage.layout.groups, partitions))
        layout = replace(storage.layout, groups=groups)
        from .storage import GradStorage

        snapshot = GradStorage(
            layout=layout,
            partitions=partitions,
            process_groups=storage.process_groups,
            loss_scale=storage.loss_scale,
            device=storage.device,
            is_current=_always_current,
            describe=f"clone of {storage.describe}",
        )
        return type(self)(snapshot)

    # ---------------------------------------------------------------------------------------------------------
    # reductions: one collective per process group
    # ---------------------------------------------------------------------------------------------------------
    def norms(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> dict[str, torch.Tensor]:
        """``{name: norm of the true gradient}`` as 0-d float32 tensors (on the storage device; no host sync).

        ``norm_type``: any ``p > 0`` or ``inf``. **Communication: one all_reduce of a (k,) float32 vector per process
        group** (sum of ``|g|^p`` partials; ``max`` for inf), none for replicated or single-rank groups.
        """
        selected = self._pick(params)
        values = self._norm_values(selected, float(norm_type))
        return dict(zip((p.name for p in selected), values.unbind(0)))

    def global_norm(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> torch.Tensor:
        """The norm of all selected true gradients taken together (as ``torch.nn.utils.get_total_norm``), a 0-d
        float32 tensor. **Communication: one all_reduce of a (k,) float32 vector per process group.**"""
        selected = self._pick(params)
        return self._total_norm(selected, float(norm_type))

    def dots(self, other: Any, *, params: ParamSelection = None, with_norms: bool = False):
        """Per-parameter dot products ``{name: <g, other_g>}`` of true gradients (0-d float32 tensors), e.g. for
        PCGrad conflict tests. ``other``: a ``ShardedGrads``/clone with the same layout.

        With ``with_norms=True`` returns ``(dots, self_norms, other_norms)`` (2-norms), still in one collective.
        **Communication: one all_reduce of a (k,) — (3k,) with norms — float32 vector per process group.**
        """
        if not self._is_grads(other):
            raise TypeError(f"dots takes another ShardedGrads or a clone, got {type(other).__name__}")
        self._check_same_layout(other)
        selected = self._pick(params)
        cols = 3 if with_norms else 1
        local = torch.zeros(len(selected), cols, dtype=torch.float32, device=self._result_device())
        for i, param in enumerate(selected):
            a = self._local(param).to(torch.float32)
            b = other._local(param).to(device=a.device, dtype=torch.float32)
            if a.numel():
                local[i, 0] = torch.dot(a, b)
                if with_norms:
                    local[i, 1] = torch.dot(a, a)
                    local[i, 2] = torch.dot(b, b)
        reduced = self._reduce(selected, local, dist.ReduceOp.SUM)
        s, so = self.loss_scale, other.loss_scale
        names = [p.name for p in selected]
        dots = dict(zip(names, (reduced[:, 0] / (s * so)).unbind(0)))
        if not with_norms:
            return dots
        mine = dict(zip(names, (reduced[:, 1].sqrt() / s).unbind(0)))
        theirs = dict(zip(names, (reduced[:, 2].sqrt() / so).unbind(0)))
        return dots, mine, theirs

    def stats(self, *, params: ParamSelection = None) -> dict[str, GradStats]:
        """``{name: GradStats}``: 2-norm, max ``|g|``, mean, nan and inf counts of each true gradient, as Python
        numbers (one host sync). **Communication: at most two all_reduces per process group** (a (k, 4) float64
        sum vector and a (k,) float32 max vector), none for replicated or single-rank groups.
        """
        selected = self._pick(params)
        device = self._result_device()
        sums = torch.zeros(len(selected), 4, dtype=torch.float64, device=device)  # sumsq, sum, nan, inf
        maxes = torch.zeros(len(selected), dtype=torch.float32, device=device)
        for i, param in enumerate(selected):
            x = self._local(param)
            if not x.numel():
                continue
            x = x.to(torch.float32)
            nan = torch.isnan(x)
            inf = torch.isinf(x)
            sums[i, 0] = torch.dot(x, x)
            sums[i, 1] = x.sum(dtype=torch.float64)
            sums[i, 2] = nan.sum()
            sums[i, 3] = inf.sum()
            maxes[i] = x.abs().masked_fill_(nan, 0).amax()
        sums = self._reduce(selected, sums, dist.ReduceOp.SUM)
        maxes = self._reduce(selected, maxes, dist.ReduceOp.MAX)
        scale = self.loss_scale
        rows, mx = sums.tolist(), maxes.tolist()
        out = {}
        for param, (sumsq, total, nans, infs), m in zip(selected, rows, mx):
            n = param.numel
            out[param.name] = GradStats(
                norm=math.sqrt(sumsq) / scale if not math.isnan(sumsq) else math.nan,
                max_abs=math.nan if nans else m / scale,
                mean=total / n / scale if n else 0.0,
                nan_count=int(nans),
                inf_count=int(infs),
                numel=n,
            )
        return out

    # ---------------------------------------------------------------------------------------------------------
    # clipping: one collective
    # ---------------------------------------------------------------------------------------------------------
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        params: ParamSelection = None,
    ) -> torch.Tensor:
        """Clip the selected gradients together, like ``torch.nn.utils.clip_grad_norm_``; returns the total (true)
        norm before clipping as a 0-d float32 tensor.

        Every selected gradient is multiplied by ``clamp(max_norm / (total_norm + 1e-6), max=1.0)`` (torch's
        formula). **Communication: one all_reduce of a (k,) float32 vector per process group**; the multiply is
        local.
        """
        selected = self._pick(params)
        total = self._total_norm(selected, float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients is non-finite, so it cannot be clipped. "
                "To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._elementwise(selected, lambda x, c: x.mul_(c.to(x.device)), _Uniform(coef))
        return total

    def clip_per_param_(
        self, max_norm: float, norm_type: float = 2.0, *, params: ParamSelection = None
    ) -> dict[str, torch.Tensor]:
        """Clip each selected gradient on its own to norm ``max_norm`` (coefficient
        ``clamp(max_norm / (norm + 1e-6), max=1.0)`` per parameter); returns ``{name: norm before clipping}``.
        **Communication: one all_reduce of a (k,) float32 vector per process group.**
        """
        selected = self._pick(params)
        values = self._norm_values(selected, float(norm_type))
        coefs = torch.clamp(max_norm / (values + 1e-6), max=1.0)
        per = {p.name: coefs[i] for i, p in enumerate(selected)}
        self._elementwise(selected, lambda x, c: x.mul_(c.to(x.device)), per)
        return dict(zip((p.name for p in selected), values.unbind(0)))

    # ---------------------------------------------------------------------------------------------------------
    # internals
    # ---------------------------------------------------------------------------------------------------------
    @staticmethod
    def _is_grads(obj: Any) -> bool:
        return isinstance(obj, GradOpsMixin)

    def _pick(self, params: ParamSelection) -> list:
        """Validated selection, in layout order. Raises ``StaleGradientsError`` first: every op calls it before
        touching the gradients, so the helpers below do not check again."""
        self._check_current()
        layout = self.layout
        if params is None:
            return list(layout.params)
        if isinstance(params, str):
            raise TypeError(f"params must be a collection of names or a predicate, not a single string ({params!r})")
        if callable(params) and not isinstance(params, Collection):
            keep = [p for p in layout.params if params(p.name)]
            return keep
        try:
            wanted = set(params)
        except TypeError:
            raise TypeError(
                f"params must be None, a collection of names or a predicate name -> bool, got {type(params).__name__}"
            ) from None
        unknown = sorted(n for n in wanted if n not in layout.by_name)
        if unknown:
            raise KeyError(f"not trainable parameters of this engine: {unknown}")
        return [p for p in layout.params if p.name in wanted]

    @staticmethod
    def _scalar(value: Any, what: str):
        if isinstance(value, bool):
            raise TypeError(f"{what} must be a real number or a 0-d tensor, got bool")
        if isinstance(value, numbers.Real):
            return float(value)
        if isinstance(value, torch.Tensor):
            if value.dim() != 0:
                raise ValueError(
                    f"{what} must be a number or a 0-d tensor, got a tensor of shape {tuple(value.shape)} "
                    "(for per-element operands pass another ShardedGrads or a clone)"
                )
            if value.is_complex():
                raise TypeError(f"{what} must be real, got {value.dtype}")
            from torch.distributed.tensor import DTensor

            return (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        raise TypeError(f"{what} must be a real number or a 0-d tensor, got {type(value).__name__}")

    def _per_param(self, value: Any, selected: list, what: str):
        """A uniform operand (``_Uniform``) or ``{name: operand}`` covering every selected parameter."""
        if isinstance(value, Mapping):
            unknown = sorted(str(n) for n in value if n not in self.layout.by_name)
            if unknown:
                raise KeyError(f"{what}: not trainable parameters of this engine: {unknown}")
            missing = [p.name for p in selected if p.name not in value]
            if missing:
                raise KeyError(f"{what}: no value for selected parameters {missing}")
            return {p.name: self._scalar(value[p.name], f"{what}[{p.name!r}]") for p in selected}
        return _Uniform(self._scalar(value, what))

    def _check_same_layout(self, other: Any) -> None:
        other._check_current()
        a, b = self.layout, other.layout
        if a.params != b.params or [_shape_of(g) for g in a.groups] != [_shape_of(g) for g in b.groups]:
            raise ValueError(
                "the two gradient sets have different layouts (other engine, model, stage or world size): "
                f"{len(a.params)} vs {len(b.params)} params, groups {[_shape_of(g) for g in a.groups]} vs "
                f"{[_shape_of(g) for g in b.groups]}"
            )

    def _padding_segments(self, group_index: int) -> list[tuple[int, int]]:
        cache = self.__dict__.setdefault("_zd_padding", {})
        segments = cache.get(group_index)
        if segments is None:
            group = self.layout.groups[group_index]
            covered = []
            for p in self.layout.params_of(group_index):
                start, stop, off = self._fragments[p.name]
                if stop > start:
                    covered.append((off, off + stop - start))
            covered.sort()
            segments, pos = [], 0
            for lo, hi in covered:
                if lo > pos:
                    segments.append((pos, lo - pos))
                pos = max(pos, hi)
            if pos < group.partition_numel:
                segments.append((pos, group.partition_numel - pos))
            cache[group_index] = segments
        return segments

    @torch.no_grad()  # writes never record autograd history (operands or apply_ results may require grad)
    def _elementwise(self, selected: list, op: Callable, per: Any, other: Any = None) -> None:
        """Run ``op(x, operand, other_x)`` on whole partitions where a group is fully selected with a uniform
        operand, else on each selected fragment; keep padding at zero; then notify the optimizer."""
        storage = self._storage
        chosen: dict[int, list] = {}
        for p in selected:
            chosen.setdefault(p.group, []).append(p)
        for g, plist in chosen.items():
            whole = len(plist) == len(self.layout.params_of(g)) and not isinstance(per, dict)
            if whole:
                x = storage.partitions[g]
                if other is None:
                    op(x, _operand(per, None))
                else:
                    op(x, _operand(per, None), other._storage.partitions[g].to(x.device))
                for off, length in self._padding_segments(g):
                    x.narrow(0, off, length).zero_()
            else:
                for p in plist:
                    x = self._local(p)
                    if not x.numel():
                        continue
                    if other is None:
                        op(x, _operand(per, p.name))
                    else:
                        op(x, _operand(per, p.name), other._local(p).to(x.device))
        storage.after_write([p.name for p in selected])

    def _result_device(self) -> torch.device:
        parts = self._storage.partitions
        return parts[0].device if parts else torch.device("cpu")

    def _reduce(self, selected: list, local: torch.Tensor, op: Any) -> torch.Tensor:
        """All-reduce the rows of ``local`` (one row per selected parameter): one collective per distinct process
        group of sharded, multi-rank groups; rows of replicated or single-rank groups are already complete.
        Returns the reduced rows on the engine's device."""
        _debug.check_grads_call(self, "reduce", [p.name for p in selected], str(op), tuple(local.shape[1:]))
        storage = self._storage
        # results live on the engine's device: that is where the process group communicates (with CPU offload the
        # partitions are host memory, while an NCCL group only reduces device tensors)
        local = local.to(storage.device)
        buckets: dict[int, tuple[Any, list[int]]] = {}
        for i, p in enumerate(selected):
            group = self.layout.groups[p.group]
            if group.replicated or group.world_size == 1:
                continue
            pg = storage.process_groups[p.group]
            buckets.setdefault(id(pg), (pg, []))[1].append(i)
        for pg, rows in buckets.values():
            if len(rows) == local.shape[0]:
                _all_reduce_op(local, pg, op)
            else:
                index = torch.tensor(rows, device=local.device)
                part = local.index_select(0, index)
                _all_reduce_op(part, pg, op)
                local.index_copy_(0, index, part)
        return local

    def _reduced_partials(self, selected: list, norm_type: float) -> tuple[torch.Tensor, bool]:
        """Per selected parameter, ``sum |x|^p`` (``max |x|`` for inf) over every rank, float32, stored units, and
        whether ``norm_type`` is inf: one collective per process group."""
        if not (norm_type > 0):
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
        is_inf = math.isinf(norm_type)
        local = self._partials(selected, norm_type)
        return self._reduce(selected, local, dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM), is_inf

    def _norm_values(self, selected: list, norm_type: float) -> torch.Tensor:
        """Per-parameter true norms, (k,) float32: one collective per process group."""
        reduced, is_inf = self._reduced_partials(selected, norm_type)
        values = reduced if is_inf else (reduced.sqrt() if norm_type == 2.0 else reduced.pow(1.0 / norm_type))
        return values / self.loss_scale

    def _partials(self, selected: list, norm_type: float) -> torch.Tensor:
        """Per selected parameter: local ``sum |x|^p`` (or ``max |x|`` for inf), float32, stored units."""
        local = torch.zeros(len(selected), dtype=torch.float32, device=self._result_device())
        frags, rows = [], []
        for i, p in enumerate(selected):
            x = self._local(p)
            if x.numel():
                frags.append(x)
                rows.append(i)
        if not frags:
            return local
        norms = torch._foreach_norm(frags, norm_type, dtype=torch.float32)
        vals = torch.stack([n.to(local.device) for n in norms])
        if not math.isinf(norm_type):
            vals = vals.pow(norm_type)
        local.index_copy_(0, torch.tensor(rows, device=local.device), vals)
        return local

    def _total_norm(self, selected: list, norm_type: float) -> torch.Tensor:
        """The true norm of all selected gradients together, a 0-d float32: one collective per process group."""
        reduced, is_inf = self._reduced_partials(selected, norm_type)
        if not reduced.numel():
            return torch.zeros((), dtype=torch.float32, device=reduced.device)
        if is_inf:
            total = reduced.max()
        else:
            total = reduced.sum()
            total = total.sqrt() if norm_type == 2.0 else total.pow(1.0 / norm_type)
        return total / self.loss_scale


class _Uniform:
    """One operand for every selected parameter."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _operand(per: Any, name: str | None):
    if per is None:
        return None
    if isinstance(per, _Uniform):
        return per.value
    return per[name]


def _shape_of(group: Any) -> tuple:
    return (group.world_size, group.rank, group.partition_numel, group.packing, group.replicated)


def _always_current() -> bool:
    return True
