"""``ShardedTensors``: a live, sharded view of one *family* of a DeepSpeed ZeRO engine's flat tensors (the generic
public front under :class:`~zero_dtensor.grads.ShardedGrads`, :class:`~zero_dtensor.families.master.ShardedMasterParams` and
:class:`~zero_dtensor.families.master.ShardedOptimizerState`).

A family is any set of flat, sharded tensors with one layout (:class:`~zero_dtensor.core.storage.FlatStorage`): the
reduced gradients, the fp32 master weights, one optimizer-state key. Everything here works the same on each; what
differs (when the values are valid, what a write must be followed by) is the family's storage and subclass.

Nothing here communicates unless its docstring says so. Each collective call must run on every rank of the
data-parallel group, in the same order, or the job hangs (as with any ``torch.distributed`` collective); bulk reads
and the writes that communicate agree first (see :mod:`zero_dtensor.comm.agreement`), and a call whose arguments or
settings differ between ranks, or that one rank refuses (an unknown name, a bad ``out=`` entry or ``dtype``), raises
on every rank there, before anything is sent. ``set_full_`` does not communicate: its values must be the same on
every rank (every rank checks every entry, so a bad entry given to every rank is refused on every rank; one given to
a single rank is refused there alone). The work is done by modules that take the internal state explicitly:
:mod:`~zero_dtensor.materialize` (full tensors), :mod:`~zero_dtensor.ops.transforms` (elementwise, clone),
:mod:`~zero_dtensor.ops.reductions` (norms, dots, stats, clipping), :mod:`~zero_dtensor.redistribute`; the methods are
grouped by concept: this module (mapping, materialization, writes), :mod:`~zero_dtensor.families.param_view` (one
parameter's view), :mod:`~zero_dtensor.families.tensor_math`
(transforms), :mod:`~zero_dtensor.families.tensor_reductions` (reductions), :mod:`~zero_dtensor.families.tensor_owners`
(DTensors and whole tensors on owners).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..ops import reductions, writes
from ..comm.agreement import Refusal, agree_on
from ..comm.collectives import mesh_for
from ..comm.signature import collective
from ..errors import StaleTensorsError
from ..layout.flat import FlatLayout, ParamLayout
from ..materialize import bulk as _bulk
from ..materialize import stream as _stream
from ..materialize.results import PendingFullTensors
from .param_view import ParamView
from ..core.state import FlatState, ParamSelection, Selection, check_dtype, short_names
from ..core.storage import FlatStorage
from .tensor_math import TensorMath
from .tensor_reductions import TensorReductions
from .tensor_owners import TensorOwners

__all__ = ["ParamView", "ShardedTensors", "check_dtype"]


class ShardedTensors(TensorMath, TensorReductions, TensorOwners, Mapping[str, ParamView]):
    """One family of flat tensors (gradients, fp32 masters, an optimizer-state key), sharded as DeepSpeed stores
    it: a mapping ``name -> ParamView`` over every trainable parameter.

    When the values are valid depends on the family (the subclasses say: gradients between ``backward()`` and
    ``step()``, masters and optimizer state between steps too); a use after that raises
    :class:`~zero_dtensor.errors.StaleTensorsError` (for gradients its subclass
    :class:`~zero_dtensor.errors.StaleGradientsError`). Views and group DTensors alias DeepSpeed's storage: in-place
    changes are what ``engine.step()`` uses. Frozen parameters (``requires_grad=False``) are absent; a tied
    parameter appears once, under its first name in ``named_parameters()``.

    Transforms (``mul_`` … ``add_noise_``) work on the local shards with **no communication**; reductions
    (``norms``, ``global_norm``, ``dots``, ``clip_*``) issue **one all_reduce of a (k,) vector per process group**
    (``stats`` at most two), after the rank agreement (on every argument: :mod:`zero_dtensor.comm.signature`).
    Every operation takes ``params=``: ``None`` (all trainable
    parameters), a collection of names, or a predicate ``name -> bool``; unknown names raise ``KeyError`` before
    anything is written. Operands and results are in true (unscaled) units under fp16 loss scaling (only gradients
    are ever scaled). Operations between two families (``add_``, ``lerp_``, ``copy_``, ``dots``) need the same
    geometry: a family that is replicated where the other is sharded (``BF16_Optimizer``'s gradient against its
    masters) is refused with a ``ValueError`` saying so. Each call runs a fixed number of tensor operations
    whatever the number of parameters (see :mod:`zero_dtensor.layout.plan`). Memory: none beyond DeepSpeed's own until a
    call materializes something (each call's docstring says how much).
    """

    #: the per-parameter view class of this family
    _VIEW: type[ParamView] = ParamView

    def __init__(self, storage: FlatStorage) -> None:
        self._state = FlatState(storage, stale=self._stale_error)

    def _stale_error(self) -> Exception:
        """The error a use after the values went stale raises (the family's subclass says when and what to do)."""
        storage = self._state.storage
        return StaleTensorsError(
            f"{storage.describe}: DeepSpeed no longer holds these tensors (e.g. engine.load_checkpoint replaced the "
            "optimizer state): make the sharded view again"
        )

    def __zero_dtensor_state__(self) -> FlatState:
        """The internal state (for zero_dtensor's own modules)."""
        return self._state

    def __repr__(self) -> str:
        storage = self._state.storage
        return f"{type(self).__name__}({storage.describe}, {len(self)} params, {len(self.layout.groups)} groups)"

    def __zero_dtensor_agreement__(self) -> str:
        """Which tensors these are, as the rank agreement compares an argument (:mod:`zero_dtensor.comm.signature`):
        the family's fingerprint. No communication."""
        return f"family({self._state.storage.family!r})"

    # --- mapping -----------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ParamView:
        self._state.check_current()
        param = self.layout.by_name.get(name) if isinstance(name, str) else None
        if param is None:
            raise KeyError(f"{name!r} is not a trainable parameter of this engine; known: {short_names(self.names)}")
        return self._VIEW(self, param)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.params)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.layout.by_name

    # --- description -------------------------------------------------------------------------------------------
    @property
    def layout(self) -> FlatLayout:
        return self._state.layout

    @property
    def names(self) -> tuple[str, ...]:
        """Trainable parameter names in model (``named_parameters()``) order."""
        return self.layout.names

    @property
    def loss_scale(self) -> float:
        """Stored values are ``true values × loss_scale`` (fp16 dynamic loss scaling; 1.0 otherwise)."""
        return self._state.loss_scale

    @property
    def local_partitions(self) -> tuple[torch.Tensor, ...]:
        """Per group, this rank's whole partition (1-D, padding included): the memory ``engine.step()`` reads (live
        views). No communication."""
        self._state.check_current()
        return tuple(part.view(-1) for part in self._state.storage.partitions)  # new views: they pin the memory

    def is_current(self) -> bool:
        """Whether DeepSpeed still holds these values; a use after it does not raises ``StaleTensorsError``.

        Returns:
            bool: False once gradients were consumed by ``engine.step()`` (or a new micro-step began), or the optimizer
                state was replaced by ``engine.load_checkpoint``.

        Raises nothing.

        Communication:
            None.

        Device and memory:
            Nothing allocated.

        Example:
            ```python
            if not master.is_current():
                master = zd.sharded_master_params(engine)
            ```
        """
        return self._state.is_current()

    @cached_property
    def _group_dtensors(self) -> tuple[DTensor, ...]:
        return tuple(self._dtensor(part.view(-1), g.index, (g.flat_numel,))
                     for g, part in zip(self.layout.groups, self._state.storage.partitions))

    @property
    def groups(self) -> tuple[DTensor, ...]:
        """One DTensor per flat group over the padded flat buffer: ``Shard(0)`` (``Replicate()`` where every rank
        holds the full tensor), aliasing DeepSpeed's storage (live views). No communication to build. ZeRO-3 groups
        are in chunk order (each rank's partition holds every parameter's chunk back to back), not parameter order.
        """
        self._state.check_current()
        return self._group_dtensors

    # --- materialization ---------------------------------------------------------------------------------------
    @collective
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
        """Every selected tensor in full (true, unscaled values): one collective for all parameters.

        Call on every rank with the same arguments. The result is a snapshot the caller owns: ``engine.step()`` does not
        change it. Which strategy does what, window sizes and copies: ``docs/design.md`` and the guide's "Calls in detail".

        Args:
            names: a list of names (results in that order), a predicate ``name -> bool`` (model order), or ``None``
                for every parameter. Only flat groups holding one of them communicate.
            dtype: result dtype (default: the stored dtype; float32 under fp16). The collective uses the stored dtype.
            out: a dict to fill in place, e.g. the previous result: no allocation on later steps.
            dst: a global rank: only it receives the tensors (one ``gather`` per flat group); the others get ``{}``.
            async_op: return a handle whose ``wait()`` gives the dict; every collective is issued by the call, so
                its ``is_completed()`` turns true without ``wait()``. Change nothing before ``wait()``.
            strategy: ``"auto"``, ``"all_gather"``, ``"all_to_all"``, ``"send_recv"`` or ``"all_reduce"``.

        Returns:
            dict[str, torch.Tensor]: ``{name: full tensor}`` of the parameter's shape (with ``async_op``, a
                ``PendingFullTensors`` handle).

        Raises:
            KeyError: an unknown name.
            TypeError: a bad ``names``, ``dtype`` or ``out=`` entry.
            ValueError: an unknown strategy, or ``send_recv`` for CUDA tensors on gloo.
            RankDisagreementError: the ranks' calls differ. Every refusal raises on every rank before data moves.
            StaleTensorsError: the values are no longer DeepSpeed's (``StaleGradientsError`` for gradients).

        Communication:
            The agreement, then one ``all_gather`` per process group and dtype, ``(N-1)/N·S`` bytes per rank in the
            stored dtype (ZeRO-3 from 16 MiB: two; over 64 MiB: one per column window, about 8); ``all_reduce``:
            ``2(N-1)/N·S``. One rank, or replicated groups: none. ``auto`` picks all_gather on NCCL and measures once
            on gloo (pin it with ``zd.set_gather_strategy``).

        Device and memory:
            Results on the communication device (CUDA under NCCL, also with offload): ``S`` bytes, plus at most one
            window (64 MiB or ``S/8``) for large ZeRO-3 transfers. Without ``out=`` the buffers of a previous result
            are reused once nothing of it is alive.

        Example:
            ```python
            full = grads.full_tensors()
            full = grads.full_tensors(out=full)                  # next step: no allocation
            ```
        """
        self._state.check_current()
        selected: list[ParamLayout] | None = None
        transfers: list[Any] = []
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "full_tensors")
            _bulk.check_request(self._state, selected, dtype=dtype, out=out, dst=dst, strategy=strategy)
            transfers = _bulk.plan_transfers(self._state, selected, dst, strategy)
        self._agree("full_tensors", selected, refusal.error, tuple(t.strategy for t in transfers))
        return _bulk.full_tensors(self._state, selected, dtype=dtype, out=out, dst=dst, async_op=async_op,
                                  strategy=strategy, transfers=transfers)

    @collective
    def iter_full(
        self,
        names: list[str] | None = None,
        *,
        bucket_bytes: int = _stream.DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        strategy: str = "auto",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor)`` a window at a time, for models whose full tensors do not fit in memory.

        Every rank must iterate to the end: a rank that stops early leaves the others waiting. Parameters come per
        flat group in buffer order (not model order); yielded tensors are snapshots, views of their window's buffer.

        Args:
            names: a list of names, a predicate ``name -> bool``, or ``None`` for every parameter.
            bucket_bytes: the most bytes of one window (a larger parameter gets a window of its own).
            dtype: result dtype (default: the stored dtype; float32 under fp16).
            strategy: ``"auto"``, ``"all_gather"``, ``"send_recv"`` or ``"all_reduce"``.

        Returns:
            Iterator[tuple[str, torch.Tensor]]: the parameters, full, window by window.

        Raises:
            KeyError: an unknown name.
            TypeError: a bad ``names`` or ``dtype``.
            RankDisagreementError: the ranks' calls differ (raised on every rank before data moves).

        Communication:
            The agreement once, then one collective per window (``send_recv`` on gloo: about ``(N-1)/N·W`` bytes per
            rank; ``all_reduce``: ``2(N-1)/N·W``). Replicated groups: none.

        Device and memory:
            One window of extra memory (on the communication device), provided each tensor is dropped before the next
            window is asked for.

        Example:
            ```python
            for name, full in grads.iter_full(bucket_bytes=16 << 20):
                log(name, full.norm())
            ```
        """
        self._state.check_current()
        selected: list[ParamLayout] | None = None
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "iter_full")
            _stream.check_request(bucket_bytes, strategy, self._state, selected)
        self._agree("iter_full", selected, refusal.error)
        return _stream.iter_full(self._state, selected, bucket_bytes=bucket_bytes, dtype=dtype, strategy=strategy)

    def set_full_(self, mapping: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the named parameters' values with full tensors.

        Each rank copies its own part of each value into DeepSpeed's memory (rescaled under fp16 loss scaling). Values
        must be equal on every rank. Writes never record autograd history.

        Args:
            mapping: ``{name: full tensor}`` of the parameter's shape, any floating dtype, a plain tensor or a subclass
                such as ``nn.Parameter`` (not a DTensor), on the engine's device or where the values are stored;
                also views of this family's own memory (e.g. of ``local_partitions``), which are copied first.

        Returns:
            None.

        Raises:
            KeyError: an unknown name.
            ValueError: a wrong shape.
            TypeError: a value that is not a floating-point tensor, or a DTensor. Every entry is checked on every rank
                before the first write: nothing is half-applied (values that differ between ranks are not compared:
                each rank checks what it was given).
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            In place; small values are staged with one ``cat`` per shape, large ones copied straight into place.

        Example:
            ```python
            full = grads.full_tensors()
            grads.set_full_({n: t.clamp(-1, 1) for n, t in full.items()})
            ```
        """
        state = self._state
        state.check_current()
        writes.set_full_(state, writes.validate_full(state, mapping))


    # --- internals -----------------------------------------------------------------------------------------------
    def _agree(self, what: str, selected: list[ParamLayout] | None, refused: Exception | None,
               *signature: Any) -> None:
        """The rank agreement of a bulk read (:func:`zero_dtensor.comm.agreement.agree`) over the process groups the
        call will communicate on (none for replicated or single-rank groups): the call's arguments by construction
        (:mod:`zero_dtensor.comm.signature`), the selection and ``signature``, what the call resolved from them. ``refused``: this rank's validation
        error, which every rank then raises (``selected`` is ``None`` when the selection itself failed: the
        agreement then runs over the process groups of every sharded group)."""
        storage = self._state.storage
        used = range(len(self.layout.groups)) if selected is None else sorted(self._state.plan.by_group(selected))
        groups = [storage.process_groups[i] for i in used if self.layout.groups[i].placement.is_sharded]
        if refused is not None or selected is None:
            agree_on(storage, what, (), groups, refused=refused)
            return
        names = "<all, model order>" if self._state.plan.is_everything(selected) else [p.name for p in selected]
        agree_on(storage, what, (names, *signature), groups)

    def _agreed_selection(self, what: str, params: ParamSelection, *, norm_type: Any = None) -> Selection:
        """A reduction's ``params=`` selection, validated (with ``norm_type`` where given) and agreed on every rank
        of the process groups it reduces over (:func:`zero_dtensor.comm.agreement.agree`; none where no group
        communicates), with every argument of the call (:mod:`zero_dtensor.comm.signature`): a selection, any
        argument or a setting that differs between ranks raises on every rank."""
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
        agree_on(state.storage, what, (names,), reductions.communicating_groups(state), refused=refusal.error)
        assert sel is not None  # a refusal raised above
        return sel

    @property
    def _storage(self) -> FlatStorage:
        return self._state.storage

    def _check_current(self) -> None:
        self._state.check_current()

    def _select(self, names: Any) -> list[ParamLayout]:
        return self._state.select(names)

    def _finish(self, full: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return self._state.finish(full, dtype)

    def _check_same_layout(self, other: ShardedTensors) -> None:
        other._state.check_current()
        a, b = self.layout, other.layout
        if a is b:
            return
        mixed = [ga.index for ga, gb in zip(a.groups, b.groups) if ga.replicated != gb.replicated]
        if a.params == b.params and len(a.groups) == len(b.groups) and mixed:
            mine, theirs = self._state.storage.describe, other._state.storage.describe
            raise ValueError(
                f"{mine} and {theirs} do not share a geometry in flat group(s) {mixed}: one holds the whole flat "
                "group on every rank (replicated), the other only this rank's 1/N of it (sharded), as with "
                "BF16_Optimizer's gradient against its fp32 masters. Elementwise operations between them would pair "
                "different elements; gather one side (full_tensors) and write it with set_full_, or work on the "
                "replicated one's full_tensors()"
            )
        if a.params != b.params or [_shape_of(g) for g in a.groups] != [_shape_of(g) for g in b.groups]:
            raise ValueError(
                "the two tensor sets have different layouts (other engine, model, stage or world size): "
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
