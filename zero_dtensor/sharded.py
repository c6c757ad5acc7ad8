"""``ShardedGrads``: a live, sharded view of every reduced gradient of a DeepSpeed ZeRO engine (the public front).

Nothing here communicates unless its docstring says so. Each collective call must run on every rank of the
data-parallel group, in the same order, or the job hangs (as with any ``torch.distributed`` collective); bulk reads
and writes agree first (see :mod:`zero_dtensor.agreement`), and a call whose arguments or settings differ between
ranks, or that one rank refuses (an unknown name, a bad ``out=`` entry or ``dtype``), raises on every rank there,
before anything is sent. The
work is done by modules that take the internal state explicitly: :mod:`~zero_dtensor.materialize` (full tensors),
:mod:`~zero_dtensor.transforms` (elementwise, clone), :mod:`~zero_dtensor.reductions` (norms, dots, stats,
clipping).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import reductions, transforms, writes
from . import redistribute as _redistribute
from .agreement import Refusal, agree
from .collectives import mesh_for
from .layout import GradLayout, ParamLayout
from .materialize import bulk as _bulk
from .materialize import stream as _stream
from .materialize.results import PendingFullTensors
from .param_values import ParamValues
from .reductions import GradStats
from .state import GradState, ParamSelection, Selection, short_names
from .storage import GradStorage
from .transforms import Scalar

__all__ = ["ParamGrad", "ShardedGrads", "check_dtype"]


class ParamGrad:
    """The gradient of one parameter: its local fragment on this rank and, on request, the full tensor.

    For ZeRO-1/2 the fragments are ragged (a parameter straddles ranks at arbitrary offsets), so a parameter is *not*
    a DTensor; for ZeRO-3 (``torch.chunk`` pieces) and replicated groups :meth:`as_dtensor` gives an exact one.
    """

    __slots__ = ("_grads", "_param")

    def __init__(self, grads: ShardedGrads, param: ParamLayout) -> None:
        self._grads = grads
        self._param = param

    def __repr__(self) -> str:
        return (
            f"ParamGrad({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"local_range={self.local_range}, group={self._param.group})"
        )

    @property
    def name(self) -> str:
        return self._param.name

    @property
    def shape(self) -> torch.Size:
        return self._param.shape

    @property
    def numel(self) -> int:
        return self._param.numel

    @property
    def dtype(self) -> torch.dtype:
        """The dtype DeepSpeed stores this gradient in (its gradient-accumulation dtype)."""
        return self._grads.layout.groups[self._param.group].dtype

    @property
    def group(self) -> int:
        """Index of the flat group (``ShardedGrads.groups``) holding this parameter."""
        return self._param.group

    @property
    def local_range(self) -> tuple[int, int]:
        """``(start, stop)`` of this rank's fragment within the flattened parameter (``start == stop``: none)."""
        start, stop, _ = self._grads._state.plan.fragments[self.name]
        return start, stop

    def to_local(self) -> torch.Tensor:
        """This rank's fragment, 1-D, ``local_range`` long: a **live view** of the gradient memory.

        Writes to it change what ``engine.step()`` uses; it changes when the gradient does. Under
        ``keep_full_grads`` the view is of the kept full buffer, whose slice DeepSpeed owns is copied into
        DeepSpeed's partition at the start of ``engine.step()`` (and after every write through the API).
        No communication. Under fp16 loss scaling the stored values are ``true gradient × grads.loss_scale``.
        """
        state = self._grads._state
        state.check_current()
        return state.fragment(self._param).view(-1)  # a new view: the cached fragment object stays internal

    def full_tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full (true, unscaled) gradient, shape ``self.shape``: a snapshot in memory the caller owns.
        **Collective**: call on every rank of the group.

        Communication (the placement's, :mod:`zero_dtensor.placement`): none for a replicated group; ZeRO-3: one
        ``all_gather`` of the ``ceil(numel/N)`` chunks (``(N-1)/N·numel`` elements received per rank); ZeRO-1/2: one
        sum ``all_reduce`` of a zero-padded ``numel``-element buffer in the stored dtype (exact: every element has
        one non-zero contributor). To gather many parameters use :meth:`ShardedGrads.full_tensors` (one collective
        per group).
        """
        state = self._grads._state
        state.check_current()
        with Refusal() as refusal:
            check_dtype(dtype, "ParamGrad.full_tensor")
        storage = state.storage
        param = self._param
        pg = storage.process_groups[param.group]
        communicates = state.group(param.group).placement.is_sharded
        agree("ParamGrad.full_tensor", (self.name, str(dtype)), [pg] if communicates else [], storage.device,
              refused=refusal.error)
        group = state.group(param.group)
        full = group.placement.gather_param(group, param, storage.partitions[param.group], pg, storage.device)
        return state.finish(full.view(param.shape), dtype)

    def as_dtensor(self) -> DTensor:
        """This gradient as an exact DTensor of shape ``(numel,)`` aliasing DeepSpeed's storage (a live view). No
        communication.

        ``Shard(0)`` for ZeRO-3 (``torch.chunk`` pieces), ``Replicate()`` for replicated groups. ZeRO-1/2 pieces are
        ragged, which DTensor cannot describe: use :meth:`to_local`, :meth:`full_tensor` or ``grads.groups``.
        """
        group = self._grads._state.group(self._param.group)
        if not group.placement.exact_param_shards:
            raise TypeError(
                f"{self.name!r}: ZeRO-1/2 stores a parameter in ragged pieces that a Shard(0) DTensor would describe "
                "wrongly; use grads.groups[...] (an exact Shard(0) DTensor per flat group), to_local() or full_tensor()"
            )
        return self._grads._dtensor(self.to_local(), self._param.group, (self.numel,))


def _is_grads(obj: Any) -> bool:
    return isinstance(obj, ShardedGrads)


class ShardedGrads(Mapping[str, ParamGrad]):
    """Every trainable parameter's reduced gradient, sharded as DeepSpeed stores it. A mapping ``name -> ParamGrad``.

    Valid from ``engine.backward()`` at an accumulation boundary until ``engine.step()``; afterwards every call raises
    :class:`~zero_dtensor.errors.StaleGradientsError`. Views and group DTensors alias DeepSpeed's storage: in-place
    changes are what ``engine.step()`` uses. Frozen parameters (``requires_grad=False``) are absent; a tied
    parameter appears once, under its first name in ``named_parameters()``.

    Transforms (``mul_`` … ``add_noise_``) work on the local shards with **no communication**; reductions
    (``norms``, ``global_norm``, ``dots``, ``clip_*``) issue **one all_reduce of a (k,) vector per process group**
    (``stats`` at most two). Every operation takes ``params=``: ``None`` (all trainable parameters), a collection of
    names, or a predicate ``name -> bool``; unknown names raise ``KeyError`` before anything is written (the
    reductions check that every rank agrees only in debug mode: a name unknown on one rank raises there alone, and
    the other ranks wait in the all_reduce). Operands and results are in true (unscaled) units under fp16 loss
    scaling. Each call runs a fixed number of tensor operations whatever the number of parameters (see
    :mod:`zero_dtensor.plan`).
    """

    def __init__(self, storage: GradStorage) -> None:
        self._state = GradState(storage)

    def __zero_dtensor_state__(self) -> GradState:
        """The internal state (for zero_dtensor's own modules)."""
        return self._state

    def __repr__(self) -> str:
        storage = self._state.storage
        return f"ShardedGrads({storage.describe}, {len(self)} params, {len(self.layout.groups)} groups)"

    # --- mapping -----------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ParamGrad:
        self._state.check_current()
        param = self.layout.by_name.get(name) if isinstance(name, str) else None
        if param is None:
            raise KeyError(f"{name!r} is not a trainable parameter of this engine; known: {short_names(self.names)}")
        return ParamGrad(self, param)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.params)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.layout.by_name

    # --- description -------------------------------------------------------------------------------------------
    @property
    def layout(self) -> GradLayout:
        return self._state.layout

    @property
    def names(self) -> tuple[str, ...]:
        """Trainable parameter names in model (``named_parameters()``) order."""
        return self.layout.names

    @property
    def loss_scale(self) -> float:
        """Stored values are ``true gradient × loss_scale`` (fp16 dynamic loss scaling; 1.0 otherwise)."""
        return self._state.loss_scale

    @property
    def local_partitions(self) -> tuple[torch.Tensor, ...]:
        """Per group, this rank's whole partition (1-D, padding included): the memory ``engine.step()`` reads (live
        views). No communication."""
        self._state.check_current()
        return tuple(part.view(-1) for part in self._state.storage.partitions)  # new views: they pin the memory

    def is_current(self) -> bool:
        """False once ``engine.step()`` (or a new micro-step) has consumed these gradients. No communication."""
        return self._state.is_current()

    @cached_property
    def _group_dtensors(self) -> tuple[DTensor, ...]:
        return tuple(self._dtensor(part.view(-1), g.index, (g.flat_numel,))
                     for g, part in zip(self.layout.groups, self._state.storage.partitions))

    @property
    def groups(self) -> tuple[DTensor, ...]:
        """One DTensor per flat group over the padded flat buffer: ``Shard(0)`` (``Replicate()`` where every rank
        holds the full gradient), aliasing DeepSpeed's storage (live views). No communication to build. ZeRO-3 groups
        are in chunk order (each rank's partition holds every parameter's chunk back to back), not parameter order.
        """
        self._state.check_current()
        return self._group_dtensors

    # --- materialization ---------------------------------------------------------------------------------------
    def full_tensors(
        self,
        names: list[str] | None = None,
        *,
        dtype: torch.dtype | None = None,
        out: dict[str, torch.Tensor] | None = None,
        dst: int | None = None,
        async_op: bool = False,
        strategy: str = "auto",
    ) -> dict[str, torch.Tensor] | PendingFullTensors:
        """``{name: full gradient}`` (true, unscaled values). **Collective**: call on every rank with the same arguments.

        Args:
            names: parameters to materialize: a list of names (results in that order), a predicate
                ``name -> bool`` (model order) or ``None`` for all. Only flat groups holding one of them
                communicate.
            dtype: output dtype (default: the stored dtype; fp32 under fp16 loss scaling). Communication always
                uses the stored dtype; the cast happens after it, once per flat group.
            out: a dict to fill in place, e.g. the result of a previous call: zero allocation on later steps. A
                previous result (a :class:`~zero_dtensor.materialize.GatheredGrads`) also carries its buffers, so
                the collective writes straight into them and its entries keep their addresses. With a user-made
                dict, entries must have the parameter's shape and the output dtype, on the gradient's device,
                contiguous, not requiring grad; they are filled with one ``_foreach_copy_`` per flat group; missing
                entries are created; the gather buffer is then a kept workspace
                (``zero_dtensor.materialize.release_workspace()`` frees it).
            dst: a global rank: only it receives full tensors, every other rank gets an empty dict.
                ``all_gather``/``all_to_all``/``auto``: one ``gather`` per flat group (gather has no coalesced
                form): each rank sends ``S/N``, the destination receives ``(N-1)/N·S`` and only it allocates ``S``. ``all_reduce``: one
                sum ``reduce`` per transfer of a zero-padded ``S`` buffer that every rank allocates.
            async_op: return a :class:`~zero_dtensor.materialize.PendingFullTensors` whose ``wait()`` gives the
                dict; do not change the gradients (``engine.step()``) before ``wait()``.
            strategy: ``"all_gather"``, ``"all_to_all"``, ``"all_reduce"`` or ``"auto"`` (see
                :mod:`zero_dtensor.materialize.strategy`).

        Communication (``N`` ranks, ``S`` the padded flat bytes of the groups involved, in the stored dtype): first
        the rank agreement (one all_gather of two int64 per rank and process group communicated on, on the call as
        resolved: the selection, ``dtype``, the strategy each transfer uses or that it calibrates, and the settings;
        see :mod:`zero_dtensor.agreement`; arguments that any rank refuses — names, ``dtype``, ``out=`` entries, ``dst``,
        ``strategy`` — raise there on every rank, this rank's own error or the same class naming the refusing
        rank), then ``all_gather``: one all_gather per (process group, dtype, device),
        coalesced over the flat groups sharing them, ``(N-1)/N·S`` bytes per rank (ZeRO-3 transfers of 16 MiB or
        more: two all_gathers issued at once, splitting every partition at a parameter boundary near 3/4, the same
        bytes; each part is reordered into parameter order once it has arrived, the first while the second travels
        where the group runs collectives in issue order, as NCCL does; gloo moves both at once,
        :func:`~zero_dtensor.materialize.strategy.pipelines`). ``all_to_all``: the same gather by one
        ``all_to_all_single`` per flat group, the same bytes (gloo receives it in place, where its all_gather
        stages and copies out; ZeRO-3 copies this rank's partition into parameter order while the others' travel).
        ``all_reduce``: one sum all_reduce
        per (process group, dtype, device) of a zero-filled ``S`` buffer, ``2(N-1)/N·S`` bytes per rank. ``auto`` on
        gloo, for transfers of at least 1 MiB: the first call per (process group, dtype, power-of-two size) also
        calibrates (9 more collectives, 13 where the all_gather is pipelined, 4 more where the transfer is one flat
        group and all_to_all is timed too); pin it with ``ZERO_DTENSOR_GATHER_STRATEGY`` or
        :func:`~zero_dtensor.materialize.set_gather_strategy`. Replicated groups (``BF16_Optimizer``,
        ``keep_full_grads``): none.

        Results are a **snapshot** the caller owns: changing them does not change the gradient, and
        ``engine.step()`` does not change them. Entries are views of one parameter-order buffer per flat group
        (ZeRO-1/2: the gathered buffer itself; ZeRO-3: one reordering copy after an all_gather or all_to_all;
        replicated: one local copy). Without ``out=`` the buffers are recycled from the previous call once none of that call's
        tensors (nor its dict) is alive, so a loop that drops each step's result allocates only once; a live result
        is never overwritten (``zero_dtensor.materialize.BUFFERS.recycle = False`` turns this off).
        """
        self._state.check_current()
        selected: list[ParamLayout] | None = None
        plans: tuple[str, ...] = ()
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "full_tensors")
            _bulk.check_request(self._state, selected, dtype=dtype, out=out, dst=dst, strategy=strategy)
            plans = _bulk.planned_strategies(self._state, selected, dst, strategy)
        self._agree("full_tensors", selected, refusal.error, str(dtype), dst, async_op, strategy, plans,
                    type(out).__name__)
        return _bulk.full_tensors(self._state, selected, dtype=dtype, out=out, dst=dst, async_op=async_op,
                                  strategy=strategy)

    def iter_full(
        self,
        names: list[str] | None = None,
        *,
        bucket_bytes: int = _stream.DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        strategy: str = "auto",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full gradient)`` window by window, for models whose full gradient does not fit in memory.
        **Collective**: every rank must iterate to the end (a rank that stops early leaves the others waiting in
        the next window's collective).

        Parameters come per flat group, in buffer order (not model order). Consecutive parameters form windows of
        at most ``bucket_bytes`` of buffers allocated here (stored dtype); a parameter larger than that gets a
        window of its own. First the rank agreement (one small all_gather per process group, once per call;
        it carries any rank's refusal of the arguments, which then raises on every rank), then one collective per
        window, nothing for replicated groups (one local copy per window): ZeRO-1/2
        ``all_reduce`` (the default on gloo and NCCL): the window ``[a, b)`` of the global flat buffer,
        zero-filled, each rank writing its overlap, ``2(N-1)/N·W`` bytes per rank; ``all_gather``: each rank's
        overlap padded to the largest one (``m``), ``(N-1)·m`` bytes received per rank. ZeRO-3 ``all_gather`` (NCCL
        default): the window's chunk range of every rank's partition, ``(N-1)/N·W``, then one reordering copy;
        ``all_reduce`` (gloo default): a zero-filled parameter-order buffer, ``2(N-1)/N·W``.

        Peak extra memory: one window (plus the local shard DeepSpeed already holds), provided the caller drops
        each tensor before asking for the next window. Yielded tensors are **snapshots** (views of their window's
        buffer, valid as long as they are referenced); ``dtype`` casts and fp16 unscaling convert the window once.
        """
        self._state.check_current()
        selected: list[ParamLayout] | None = None
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "iter_full")
            _stream.check_request(bucket_bytes, strategy)
        self._agree("iter_full", selected, refusal.error, bucket_bytes, str(dtype), strategy)
        return _stream.iter_full(self._state, selected, bucket_bytes=bucket_bytes, dtype=dtype, strategy=strategy)

    def set_full_(self, mapping: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the gradients of the named parameters with full tensors. **No communication**.

        Each rank copies its own fragment of each value (rescaled by ``loss_scale`` under fp16) into DeepSpeed's
        storage: per flat group, small values staged with one ``cat`` per trailing shape and moved with one row
        copy, large ones with one ``_foreach_copy_`` (see :mod:`zero_dtensor.writes`); values of parameters a rank
        holds nothing of are not read there, only their shapes and devices checked. Values must be equal on every
        rank (for replicated groups each rank writes the whole value). Everything is validated on every rank before
        the first write: a bad entry anywhere raises on every rank and nothing is changed. Values may be any
        floating dtype (cast on write), on the engine's device or where the gradient is stored; writes never record
        autograd history.
        """
        state = self._state
        state.check_current()
        writes.set_full_(state, writes.validate_full(state, mapping))

    # --- transforms (no communication) and reductions (one collective) -----------------------------------------
    def mul_(self, factor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Multiply the selected gradients by ``factor``: a number, a 0-d tensor, or a mapping ``name -> factor``
        (per-parameter factors; it must cover every selected parameter). **No communication.** Returns ``self``."""
        sel = self._state.pick(params)
        transforms.mul_(self._state, sel, transforms.per_param(self._state, factor, sel, "factor"))
        return self

    def div_(self, divisor: Scalar | Mapping[str, Scalar], *, params: ParamSelection = None):
        """Divide the selected gradients by ``divisor`` (number, 0-d tensor or per-parameter mapping).
        **No communication.** Returns ``self``."""
        sel = self._state.pick(params)
        transforms.div_(self._state, sel, transforms.per_param(self._state, divisor, sel, "divisor"))
        return self

    def zero_(self, *, params: ParamSelection = None):
        """Set the selected gradients to zero. **No communication.** Returns ``self``."""
        transforms.zero_(self._state, self._state.pick(params))
        return self

    def add_(self, other: Any, *, alpha: Scalar | Mapping[str, Scalar] = 1.0, params: ParamSelection = None):
        """``g += alpha * other`` in true units. **No communication.** Returns ``self``.

        With a ``ShardedGrads`` operand and ``alpha != 1``, ``alpha * other`` is formed in float32 and then added
        (one rounding to the stored dtype), so results do not depend on how fragments fall on vector boundaries.

        ``other``: a number or 0-d tensor (added to every element), or another ``ShardedGrads``/clone with the same
        layout (its own loss scale is taken into account). ``alpha``: a number, 0-d tensor, or a mapping
        ``name -> alpha`` (per-parameter, e.g. PCGrad projection coefficients).
        """
        sel = self._state.pick(params)
        per_alpha = transforms.per_param(self._state, alpha, sel, "alpha")
        if _is_grads(other):
            self._check_same_layout(other)
            transforms.add_other_(self._state, other._state, sel, per_alpha)
        else:
            transforms.add_scalar_(self._state, sel, transforms.scalar(other, "other"), per_alpha)
        return self

    def clamp_(self, min: Scalar | None = None, max: Scalar | None = None, *, params: ParamSelection = None):
        """Clamp the selected true gradients to ``[min, max]`` (numbers or 0-d tensors; the stored values are clamped
        to the bounds × ``loss_scale``). **No communication.** Returns ``self``."""
        if min is None and max is None:
            raise ValueError("clamp_: give at least one of min, max")
        lo = None if min is None else transforms.scalar(min, "min")
        hi = None if max is None else transforms.scalar(max, "max")
        transforms.clamp_(self._state, self._state.pick(params), lo, hi)
        return self

    def lerp_(self, end: Any, weight: Scalar, *, params: ParamSelection = None):
        """``g = g + weight * (end - g)`` (``torch.lerp``) in true units, e.g. an EMA ``ema.lerp_(grads, 1 - beta)``.

        ``end``: another ``ShardedGrads``/clone with the same layout, or a number/0-d tensor. **No communication.**
        Returns ``self``.
        """
        w = transforms.scalar(weight, "weight")
        sel = self._state.pick(params)
        if _is_grads(end):
            self._check_same_layout(end)
            transforms.lerp_other_(self._state, end._state, sel, w)
        else:
            transforms.lerp_scalar_(self._state, sel, transforms.scalar(end, "end"), w)
        return self

    def copy_(self, other: Any, *, params: ParamSelection = None):
        """Overwrite the selected gradients with those of ``other`` (a ``ShardedGrads`` or clone with the same
        layout, e.g. a snapshot from :meth:`clone`), converting between loss scales. **No communication.**
        Returns ``self``."""
        if not _is_grads(other):
            raise TypeError(
                f"copy_ takes another ShardedGrads or a clone with the same layout, got {type(other).__name__} "
                "(to write full tensors use set_full_)"
            )
        self._check_same_layout(other)
        transforms.copy_(self._state, other._state, self._state.pick(params))
        return self

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor | None], *, params: ParamSelection = None):
        """Apply a user function to the selected gradients. **No communication.**

        Contract for ``fn(x)``: it must be **elementwise** (each output element depends only on the input element at
        the same position, never on its neighbours, position, length or rank) and **shape-preserving**. ``x`` is a
        1-D tensor holding some of this rank's elements of one flat group: when every parameter of the group is
        selected, the whole local partition including its padding (a view of the stored gradient without loss
        scaling; the padding is reset to zero afterwards), else the selected fragments concatenated (a copy, written
        back afterwards). ``fn`` runs once per flat group, whatever the number of parameters. Values are in true
        units (under fp16 loss scaling ``x`` is an unscaled float32 copy). ``fn`` may modify ``x`` in place and
        return ``None``, or return a tensor of ``x``'s shape, which is cast and written back.

        The selection is validated before ``fn`` first runs; if ``fn`` raises or returns a wrong shape, groups
        already processed stay modified (with one flat group, nothing is written). Returns ``self``.
        """
        if not callable(fn):
            raise TypeError(f"apply_ takes a callable, got {type(fn).__name__}")
        transforms.apply_(self._state, self._state.pick(params), fn)
        return self

    def add_noise_(self, std: Scalar, seed: int, *, params: ParamSelection = None):
        """Add Gaussian noise ``std · N(0, 1)`` (true units) that does not depend on how the gradient is sharded.

        Element ``j`` of the flattened parameter ``name`` receives ``std · counter_normal(seed, name, numel)[j]``
        (see :func:`~zero_dtensor.noise.counter_normal`): the noise depends only on ``(seed, parameter name, element
        position)``, so results are identical at every world size and ZeRO stage, and equal a single-process
        reference built with ``counter_normal`` on the full parameter. Each rank computes only its own elements,
        for all selected parameters at once. Under fp16 the noise is multiplied by ``loss_scale``. Use a new
        ``seed`` per step. **No communication.** Returns ``self``.
        """
        std_v = transforms.scalar(std, "std")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"add_noise_: seed must be an int, got {type(seed).__name__}")
        transforms.add_noise_(self._state, self._state.pick(params), std_v, int(seed))
        return self

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
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"clone: dtype must be floating, got {dtype}")
        return type(self)(transforms.clone_storage(self._state, dtype))

    def norms(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> ParamValues:
        """``{name: norm of the true gradient}`` as 0-d float32 tensors (on the storage device; no host sync): a
        read-only mapping (:class:`~zero_dtensor.ParamValues`) whose ``.vector`` is every norm as one ``(k,)``
        tensor in result order; entries are made when read (``dict(result)`` for a plain dict).

        ``norm_type``: any ``p > 0`` or ``inf``. **Communication: one all_reduce of a (k,) float32 vector per process
        group** (sum of ``|g|^p`` partials; ``max`` for inf), none for replicated or single-rank groups.
        """
        sel = self._agreed_selection("norms", params, norm_type=norm_type)
        return reductions.norms(self._state, sel, float(norm_type))

    def global_norm(self, norm_type: float = 2.0, *, params: ParamSelection = None) -> torch.Tensor:
        """The norm of all selected true gradients taken together (as ``torch.nn.utils.get_total_norm``), a 0-d
        float32 tensor. **Communication: one all_reduce of a (k,) float32 vector per process group.**"""
        sel = self._agreed_selection("global_norm", params, norm_type=norm_type)
        return reductions.global_norm(self._state, sel, float(norm_type))

    def dots(self, other: Any, *, params: ParamSelection = None, with_norms: bool = False):
        """Per-parameter dot products ``{name: <g, other_g>}`` of true gradients (0-d float32 tensors), e.g. for
        PCGrad conflict tests. ``other``: a ``ShardedGrads``/clone with the same layout.

        With ``with_norms=True`` returns ``(dots, self_norms, other_norms)`` (2-norms), still in one collective.
        Each is a read-only :class:`~zero_dtensor.ParamValues` mapping (``.vector``: one ``(k,)`` tensor).
        **Communication: one all_reduce of a (k,) — (3k,) with norms — float32 vector per process group.**
        """
        if not _is_grads(other):
            raise TypeError(f"dots takes another ShardedGrads or a clone, got {type(other).__name__}")
        self._check_same_layout(other)
        sel = self._agreed_selection("dots", params, bool(with_norms))
        return reductions.dots(self._state, other._state, sel, with_norms)

    def stats(self, *, params: ParamSelection = None) -> Mapping[str, GradStats]:
        """``{name: GradStats}``: 2-norm, max ``|g|``, mean, nan and inf counts of each true gradient, as Python
        numbers (one host sync); a read-only mapping whose ``GradStats`` are made when read. **Communication: at
        most two all_reduces per process group** (a (k, 4) float64 sum vector and a (k,) float32 max vector), none
        for replicated or single-rank groups.
        """
        return reductions.stats(self._state, self._agreed_selection("stats", params))

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
        sel = self._agreed_selection("clip_grad_norm_", params, norm_type=norm_type)
        return reductions.clip_grad_norm_(self._state, sel, max_norm, float(norm_type), error_if_nonfinite)

    def clip_per_param_(
        self, max_norm: float, norm_type: float = 2.0, *, params: ParamSelection = None
    ) -> ParamValues:
        """Clip each selected gradient on its own to norm ``max_norm`` (coefficient
        ``clamp(max_norm / (norm + 1e-6), max=1.0)`` per parameter); returns ``{name: norm before clipping}`` (a
        :class:`~zero_dtensor.ParamValues` mapping).
        **Communication: one all_reduce of a (k,) float32 vector per process group.**
        """
        sel = self._agreed_selection("clip_per_param_", params, norm_type=norm_type)
        return reductions.clip_per_param_(self._state, sel, max_norm, float(norm_type))

    # --- redistribution (zero_dtensor.redistribute): Shard(0) rows and whole parameters on owners --------------
    def to_dtensors(self, names: list[str] | None = None, *, dtype: torch.dtype | None = None) -> dict[str, DTensor]:
        """``{name: DTensor}``: each selected gradient (true units) with the parameter's shape, placement
        ``Shard(0)`` (rows split as ``torch.chunk`` splits them, as FSDP2 lays parameters out; a 0-d parameter,
        which ``Shard(0)`` cannot describe, is ``Replicate()``), on a 1-D ``DeviceMesh`` over its data-parallel
        process group. **Collective**: call on every rank with the same arguments.

        Communication: the rank agreement (one all_gather of two int64 per rank and process group), then one
        ``all_to_all_single`` with uneven splits per (process group, stored dtype) for all selected parameters
        together, in the stored dtype: each rank sends the part of its fragments that other ranks' rows cover and
        receives the part of its rows that others store, about ``(N-1)/N · S/N`` bytes each way (``S`` the
        selected bytes; ``full_tensors`` receives ``(N-1)/N · S``). None for replicated groups (each rank slices its
        own rows) or where the stored pieces already are whole rows (ZeRO-3 when every row count divides by ``N``):
        the plan decides this from the layout alone, identically on every rank. Results are **snapshots** the caller
        owns (views into one buffer per process group), valid after ``engine.step()``; ``dtype`` casts after the
        exchange.
        """
        self._check_current()
        selected: list[ParamLayout] | None = None
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "to_dtensors")
        self._agree("to_dtensors", selected, refusal.error, str(dtype))
        return _redistribute.to_dtensors(self._storage, selected, dtype=dtype)

    def set_dtensors_(self, mapping: Mapping[str, DTensor]) -> None:
        """Write ``Shard(0)`` DTensors shaped as :meth:`to_dtensors` returns them (true units, any floating dtype)
        back into DeepSpeed's storage. **Collective**: call on every rank with the same names.

        Every entry (name, DTensor type, mesh over the group's ranks, placement, global shape, dtype, this rank's
        local shard shape, device) is checked on every rank before anything is sent or written; a bad entry on any
        rank raises on every rank. Communication: the rank agreement (one all_gather of two int64 per rank; it carries
        any rank's refusal), then one ``all_to_all_single`` per (process group, dtype), the reverse of the read, about ``(N-1)/N · S/N`` bytes each way per rank (replicated groups
        too: every rank needs the whole new value, ``(N-1)/N · S`` received). Writes never record autograd history.
        """
        self._check_current()
        selected: list[ParamLayout] | None = None
        storage = self._storage
        values: dict[str, torch.Tensor] = {}
        with Refusal() as refusal:
            selected = self._select(_redistribute.mapping_names(mapping, "set_dtensors_"))
            values = _redistribute.checked_dtensors(storage, selected, mapping)
        signature = () if refusal.error else ([p.name for p in selected], _redistribute.dtensor_signature(mapping))
        agree("set_dtensors_", signature, _redistribute.agreement_groups(storage, selected), storage.device,
              refused=refusal.error)
        assert selected is not None  # a refusal raised above
        _redistribute.set_dtensors_(storage, selected, values)

    def owners(self, names: list[str] | None = None, *, owners: Mapping[str, int] | None = None) -> dict[str, int]:
        """``{name: global rank}`` that :meth:`owned` and :meth:`map_full_` give each selected parameter to. **No
        communication**: deterministic from the layout and the selection, identical on every rank; balanced by size
        (largest first onto the least-loaded rank of its process group; ties: selection order, then lower rank).
        ``owners=`` (a complete mapping for the selection) is validated and returned instead.
        """
        self._check_current()
        return _redistribute.owners(self._storage, self._select(names), owners)

    def owned(self, names: list[str] | None = None, *, owners: Mapping[str, int] | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``{name: whole gradient}`` (true units, the parameter's shape) of the selected parameters this rank owns
        (:meth:`owners`; ``owners=`` overrides); other ranks' parameters are absent. **Collective**: call on every
        rank with the same arguments.

        Communication: the rank agreement, then one ``all_to_all_single`` per (process group, stored dtype)
        of sharded groups: each rank sends its fragments of other owners' parameters and receives the rest of its
        own, about ``(N-1)/N · S/N`` bytes each way for a balanced assignment. Replicated groups: none. Results are
        **snapshots** the caller owns.
        """
        self._check_current()
        selected: list[ParamLayout] | None = None
        assignment: dict[str, int] = {}
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "owned")
            assignment = _redistribute.owners(self._storage, selected, owners)
        self._agree("owned", selected, refusal.error, str(dtype), tuple(assignment.values()))
        return _redistribute.owned(self._storage, selected, assignment, dtype=dtype)

    def set_owned_(self, mapping: Mapping[str, torch.Tensor], *, owners: Mapping[str, int] | None = None) -> None:
        """Write whole gradients (true units, the parameter's shape, any floating dtype) from the ranks that hold
        them, usually the (modified) result of :meth:`owned`: each rank passes its own, each parameter comes from
        at most one rank; with ``owners=`` every key must be owned by the passing rank. **Collective**: call on
        every rank (with its own mapping, possibly empty).

        Every entry is checked before anything is sent or written; a bad entry on any rank raises on every rank.
        Communication: the rank agreement, which also tells every rank which rank passed which parameter (one
        all_gather of ``2 + k`` int64 per rank and process group, ``k`` its parameters), then one
        ``all_to_all_single`` per (process group, dtype), about ``(N-1)/N · S/N`` bytes each way per rank (replicated groups: the owner's values reach every
        rank). Writes never record autograd history.
        """
        self._check_current()
        _redistribute.set_owned_(self._storage, mapping, assignment=owners)

    def map_full_(self, fn: Callable[[str, torch.Tensor], torch.Tensor], names: list[str] | None = None, *,
                  owners: Mapping[str, int] | None = None) -> None:
        """Replace each selected gradient by ``fn(name, whole gradient)``, computed once in the job, on the
        parameter's owner (:meth:`owners`): :meth:`owned`, ``fn``, then the reverse exchange. ``fn`` gets true
        units in the stored dtype (float32 under fp16) and returns a tensor of the parameter's shape (any floating
        dtype). **Collective**: call on every rank with the same arguments.

        Communication: the rank agreement, one ``all_to_all_single`` per (process group, dtype) each way (the
        second also carries one error code per peer): about ``(N-1)/N · S/N`` bytes each way per rank per
        exchange. An exception in ``fn`` (or a result of the wrong shape or dtype) on any rank raises on every rank
        and nothing is written: the original exception where it happened,
        :class:`~zero_dtensor.errors.RankFailedError` elsewhere. ``fn`` runs on each parameter's owner only, so it
        must not communicate: a zero_dtensor collective inside it raises ``RuntimeError`` at once (compute with
        :meth:`owned` and write back with :meth:`set_owned_` where the computation needs other ranks).
        """
        self._check_current()
        storage = self._storage
        selected: list[ParamLayout] | None = None
        assignment: dict[str, int] = {}
        with Refusal() as refusal:
            selected = self._select(names)
            if not callable(fn):
                raise TypeError(f"map_full_ takes a function fn(name, full_gradient) -> tensor, got "
                                f"{type(fn).__name__}")
            assignment = _redistribute.owners(storage, selected, owners)
        signature = () if refusal.error else ([p.name for p in selected], tuple(assignment.values()))
        agree("map_full_", signature, _redistribute.agreement_groups(storage, selected), storage.device,
              refused=refusal.error)
        assert selected is not None  # a refusal raised above
        _redistribute.map_full_(storage, selected, assignment, fn)

    # --- internals -----------------------------------------------------------------------------------------------
    def _agree(self, what: str, selected: list[ParamLayout] | None, refused: Exception | None,
               *signature: Any) -> None:
        """The rank agreement of a bulk read (:func:`zero_dtensor.agreement.agree`) over the process groups the
        call will communicate on (none for replicated or single-rank groups). ``refused``: this rank's validation
        error, which every rank then raises (``selected`` is ``None`` when the selection itself failed: the
        agreement then runs over the process groups of every sharded group)."""
        storage = self._state.storage
        used = range(len(self.layout.groups)) if selected is None else sorted(self._state.plan.by_group(selected))
        groups = [storage.process_groups[i] for i in used if self.layout.groups[i].placement.is_sharded]
        if refused is not None or selected is None:
            agree(what, (), groups, storage.device, refused=refused)
            return
        names = "<all, model order>" if self._state.plan.is_everything(selected) else [p.name for p in selected]
        agree(what, (names, *signature), groups, storage.device)

    def _agreed_selection(self, what: str, params: ParamSelection, *signature: Any, norm_type: Any = None) -> Selection:
        """A reduction's ``params=`` selection, validated (with ``norm_type`` where given) and agreed on every rank
        of the process groups it reduces over (:func:`zero_dtensor.agreement.agree`; none where no group
        communicates): a selection, a norm type or a setting that differs between ranks raises on every rank."""
        state = self._state
        state.check_current()
        sel: Selection | None = None
        with Refusal() as refusal:
            sel = state.pick(params)
            if norm_type is not None:
                reductions.check_norm_type(float(norm_type))
        names: Any = None
        if refusal.error is None:
            assert sel is not None
            names = "<all>" if params is None else sel.names
        agree(what, (names, None if norm_type is None else float(norm_type), *signature),
              reductions.communicating_groups(state), state.device, refused=refusal.error)
        assert sel is not None  # a refusal raised above
        return sel

    @property
    def _storage(self) -> GradStorage:
        return self._state.storage

    def _check_current(self) -> None:
        self._state.check_current()

    def _select(self, names: Any) -> list[ParamLayout]:
        return self._state.select(names)

    def _finish(self, full: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return self._state.finish(full, dtype)

    def _check_same_layout(self, other: ShardedGrads) -> None:
        other._state.check_current()
        a, b = self.layout, other.layout
        if a is b:
            return
        if a.params != b.params or [_shape_of(g) for g in a.groups] != [_shape_of(g) for g in b.groups]:
            raise ValueError(
                "the two gradient sets have different layouts (other engine, model, stage or world size): "
                f"{len(a.params)} vs {len(b.params)} params, groups {[_shape_of(g) for g in a.groups]} vs "
                f"{[_shape_of(g) for g in b.groups]}"
            )

    def _dtensor(self, local: torch.Tensor, group: int, shape: tuple[int, ...]) -> DTensor:
        storage = self._state.storage
        mesh = mesh_for(storage.process_groups[group], local.device.type)
        placement = self.layout.groups[group].placement.dtensor_placement()
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=(1,))


def _shape_of(group: Any) -> tuple:
    return (group.world_size, group.rank, group.partition_numel, group.packing, group.replicated)


def check_dtype(dtype: Any, what: str) -> None:
    """``dtype=`` of a read: ``None`` or a floating ``torch.dtype`` (an integer or bool cast would truncate)."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what}: dtype must be a torch.dtype or None, got {type(dtype).__name__} ({dtype!r})")
    if not dtype.is_floating_point:
        raise TypeError(f"{what}: dtype must be a floating dtype (e.g. torch.float32), got {dtype}: a cast of a "
                        "gradient to it would silently truncate")
