"""``ShardedTensors``: a live, sharded view of one *family* of a DeepSpeed ZeRO engine's flat tensors (the generic
public front under :class:`~zero_dtensor.grads.ShardedGrads`, :class:`~zero_dtensor.families.master.ShardedMasterParams` and
:class:`~zero_dtensor.families.master.ShardedOptimizerState`).

A family is any set of flat, sharded tensors with one layout (:class:`~zero_dtensor.core.storage.FlatStorage`): the
reduced gradients, the fp32 master weights, one optimizer-state key. Everything here works the same on each; what
differs (when the values are valid, what a write must be followed by) is the family's storage and subclass.

Nothing here communicates unless its docstring says so. Each collective call must run on every rank of the
data-parallel group, in the same order, or the job hangs (as with any ``torch.distributed`` collective); bulk reads
and writes agree first (see :mod:`zero_dtensor.comm.agreement`), and a call whose arguments or settings differ between
ranks, or that one rank refuses (an unknown name, a bad ``out=`` entry or ``dtype``), raises on every rank there,
before anything is sent. The work is done by modules that take the internal state explicitly:
:mod:`~zero_dtensor.materialize` (full tensors), :mod:`~zero_dtensor.ops.transforms` (elementwise, clone),
:mod:`~zero_dtensor.ops.reductions` (norms, dots, stats, clipping), :mod:`~zero_dtensor.redistribute`; the methods are
grouped by concept: this module (mapping, materialization, writes), :mod:`~zero_dtensor.families.param_view` (one
parameter's view), :mod:`~zero_dtensor.families.tensor_math`
(transforms and reductions), :mod:`~zero_dtensor.families.tensor_owners` (DTensors and whole tensors on owners).
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
from ..errors import StaleTensorsError
from ..layout.flat import FlatLayout, ParamLayout
from ..materialize import bulk as _bulk
from ..materialize import stream as _stream
from ..materialize.results import PendingFullTensors
from .param_view import ParamView
from ..core.state import FlatState, ParamSelection, Selection, check_dtype, short_names
from ..core.storage import FlatStorage
from .tensor_math import TensorMath
from .tensor_owners import TensorOwners

__all__ = ["ParamView", "ShardedTensors", "check_dtype"]


class ShardedTensors(TensorMath, TensorOwners, Mapping[str, ParamView]):
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
    (``stats`` at most two), after the rank agreement. Every operation takes ``params=``: ``None`` (all trainable
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
        """False once DeepSpeed no longer holds these values (gradients: consumed by ``engine.step()`` or a new
        micro-step; optimizer state: replaced by ``engine.load_checkpoint``). No communication."""
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
        """``{name: full tensor}`` (true, unscaled values). **Collective**: call on every rank with the same arguments.

        Args:
            names: parameters to materialize: a list of names (results in that order), a predicate
                ``name -> bool`` (model order) or ``None`` for all. Only flat groups holding one of them
                communicate.
            dtype: output dtype (default: the stored dtype; fp32 under fp16 loss scaling). Communication always
                uses the stored dtype; the cast happens after it, once per flat group.
            out: a dict to fill in place, e.g. the result of a previous call: zero allocation on later steps. A
                previous result (a :class:`~zero_dtensor.materialize.GatheredGrads`) also carries its buffers, so
                the collective writes straight into them and its entries keep their addresses. With a user-made
                dict, entries must have the parameter's shape and the output dtype, on the tensor's device,
                contiguous, not requiring grad; they are filled with one ``_foreach_copy_`` per flat group; missing
                entries are created; the gather buffer is then a kept workspace
                (``zero_dtensor.materialize.release_workspace()`` frees it).
            dst: a global rank: only it receives full tensors, every other rank gets an empty dict.
                ``all_gather``/``all_to_all``/``send_recv``/``auto``: one ``gather`` per flat group (gather has no
                coalesced form): each rank sends ``S/N``, the destination receives ``(N-1)/N·S`` and only it
                allocates ``S``. ``all_reduce``: one sum ``reduce`` per transfer of a zero-padded ``S`` buffer that
                every rank allocates.
            async_op: return a :class:`~zero_dtensor.materialize.PendingFullTensors` whose ``wait()`` gives the
                dict; every collective is issued by the call, so its ``is_completed()`` turns true without
                ``wait()``; do not change the values (e.g. ``engine.step()``) before ``wait()``.
            strategy: ``"all_gather"``, ``"all_to_all"``, ``"send_recv"``, ``"all_reduce"`` or ``"auto"`` (see
                :mod:`zero_dtensor.materialize.strategy`).

        Communication (``N`` ranks, ``S`` the padded flat bytes of the groups involved, in the stored dtype): first
        the rank agreement (one small collective of a few int64 per process group communicated on, on the call as
        resolved: the selection, ``dtype``, the strategy each transfer uses or that it calibrates, and the settings;
        see :mod:`zero_dtensor.comm.agreement`; arguments that any rank refuses — names, ``dtype``, ``out=`` entries,
        ``dst``, ``strategy`` — raise there on every rank, this rank's own error or the same class naming the
        refusing rank), then ``all_gather``: one all_gather per (process group, dtype, device),
        coalesced over the flat groups sharing them, ``(N-1)/N·S`` bytes per rank (ZeRO-3 transfers of 16 MiB or
        more: two all_gathers issued at once, splitting every partition at a parameter boundary near 3/4, the same
        bytes; each part is reordered into parameter order once it has arrived, the first while the second travels
        where the group runs collectives in issue order, as NCCL does; gloo moves both at once,
        :func:`~zero_dtensor.materialize.strategy.pipelines`; ZeRO-3 transfers of more than ``WINDOW_BYTES``, 64 MiB,
        with every gather strategy: one collective per column window through a staging buffer of
        ``max(64 MiB, S/8)`` (two windows of half of it in flight, about 16 collectives for a large transfer, where
        that keeps within ``2·S/window`` plus one per flat group; else one window of all of it at a time), each
        reordered into the result as it arrives while the next travels; with ``async_op`` every window is issued
        at the call,
        :func:`~zero_dtensor.materialize.strategy.windowed`; a process group of one rank: no collective, each
        partition copied, ZeRO-3 reordered, straight into the result).
        ``all_to_all``: the same gather by one
        ``all_to_all_single`` per flat group, the same bytes (gloo receives it in place, where its all_gather
        stages and copies out; ZeRO-3 copies this rank's partition into parameter order while the others' travel).
        ``send_recv``: the same gather by one batch of ``isend``/``irecv`` per (process group, dtype, device), the
        same bytes, every partition sent as it is and received in place (no copy of ``S``; ``CommDebugMode`` does
        not count point-to-point ops, :func:`zero_dtensor.comm.point_to_point.counting_p2p` does).
        ``all_reduce``: one sum all_reduce
        per (process group, dtype, device) of a zero-filled ``S`` buffer, ``2(N-1)/N·S`` bytes per rank. ``auto`` on
        gloo, for transfers of at least 1 MiB: the first call per (process group, dtype, power-of-two size) also
        calibrates (9 more collectives, 13 where the all_gather is pipelined, 4 more where the transfer is one flat
        group and all_to_all is timed too, and 4 point-to-point batches: send_recv is timed too, except for CUDA tensors on gloo, whose ``isend``/``irecv`` cannot move them:
        there ``send_recv`` is never picked, and asked for it raises ``ValueError`` before anything moves,
        :func:`zero_dtensor.comm.process_groups.comm_support`); pin it with ``ZERO_DTENSOR_GATHER_STRATEGY`` or
        :func:`~zero_dtensor.materialize.set_gather_strategy`. Replicated groups (``BF16_Optimizer``,
        ``keep_full_grads``): none.

        Results are a **snapshot** the caller owns: changing them does not change the tensor, and
        ``engine.step()`` does not change them. Entries are views of one parameter-order buffer per flat group
        (ZeRO-1/2: the gathered buffer itself; ZeRO-3: one reordering copy after an all_gather, all_to_all or
        send_recv, from a staging area of the result's size kept with it up to 64 MiB, beyond that from one
        window buffer of at most ``max(64 MiB, S/8)`` kept between calls, ``release_workspace()`` frees it; with
        ``async_op`` the later windows travel in the result itself and ``wait()`` stages each once more to reorder
        it; one rank: the partition copied straight
        into the result, no staging; on the communication device;
        replicated: one local copy). Without ``out=`` the buffers are recycled from the previous call once none of that call's
        tensors (nor its dict) is alive, so a loop that drops each step's result allocates only once; a live result
        is never overwritten (``zero_dtensor.materialize.BUFFERS.recycle = False`` turns this off).
        """
        self._state.check_current()
        selected: list[ParamLayout] | None = None
        transfers: list[Any] = []
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "full_tensors")
            _bulk.check_request(self._state, selected, dtype=dtype, out=out, dst=dst, strategy=strategy)
            transfers = _bulk.plan_transfers(self._state, selected, dst, strategy)
        self._agree("full_tensors", selected, refusal.error, str(dtype), dst, async_op, strategy,
                    tuple(t.strategy for t in transfers), type(out).__name__)
        return _bulk.full_tensors(self._state, selected, dtype=dtype, out=out, dst=dst, async_op=async_op,
                                  strategy=strategy, transfers=transfers)

    def iter_full(
        self,
        names: list[str] | None = None,
        *,
        bucket_bytes: int = _stream.DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        strategy: str = "auto",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor)`` window by window, for models whose full tensor does not fit in memory.
        **Collective**: every rank must iterate to the end (a rank that stops early leaves the others waiting in
        the next window's collective).

        Parameters come per flat group, in buffer order (not model order). Consecutive parameters form windows of
        at most ``bucket_bytes`` of buffers allocated here (stored dtype); a parameter larger than that gets a
        window of its own. First the rank agreement (one small collective per process group, once per call;
        it carries any rank's refusal of the arguments, which then raises on every rank), then one collective per
        window, nothing for replicated groups (one local copy per window). On gloo over CPU tensors the default is ``send_recv``
        (one batch of point-to-point ops per window): ZeRO-1/2 every other rank's overlap of the window ``[a, b)``
        received straight into its place, about ``(N-1)/N·W`` bytes per rank; ZeRO-3 the window's chunk range of
        every rank's partition received into rows, then one reordering copy. Elsewhere: ZeRO-1/2 ``all_reduce``
        (the default): the window zero-filled, each rank writing its overlap, ``2(N-1)/N·W`` bytes per rank;
        ``all_gather``: each rank's overlap padded to the largest one (``m``), ``(N-1)·m`` bytes received per rank.
        ZeRO-3 ``all_gather`` (the default): the chunk range of every rank's partition, ``(N-1)/N·W``, then one
        reordering copy; ``all_reduce``: a zero-filled parameter-order buffer, ``2(N-1)/N·W``.

        Peak extra memory: one window (plus the local shard DeepSpeed already holds), provided the caller drops
        each tensor before asking for the next window. Yielded tensors are **snapshots** (views of their window's
        buffer, valid as long as they are referenced); ``dtype`` casts and fp16 unscaling convert the window once.
        """
        self._state.check_current()
        selected: list[ParamLayout] | None = None
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "iter_full")
            _stream.check_request(bucket_bytes, strategy, self._state, selected)
        self._agree("iter_full", selected, refusal.error, bucket_bytes, str(dtype), strategy)
        return _stream.iter_full(self._state, selected, bucket_bytes=bucket_bytes, dtype=dtype, strategy=strategy)

    def set_full_(self, mapping: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the values of the named parameters with full tensors. **No communication**.

        Each rank copies its own fragment of each value (rescaled by ``loss_scale`` under fp16) into DeepSpeed's
        storage: per flat group, small values staged with one ``cat`` per trailing shape and moved with one row
        copy, large ones straight into their fragments with one ``cat`` (or one ``_foreach_copy_``; see
        :mod:`zero_dtensor.ops.writes`); values of parameters a rank
        holds nothing of are not read there, only their shapes and devices checked. Values must be equal on every
        rank (for replicated groups each rank writes the whole value). Everything is validated on every rank before
        the first write: a bad entry anywhere raises on every rank and nothing is changed. Values may be any
        floating dtype (cast on write), on the engine's device or where the tensor is stored, plain tensors or
        subclasses such as ``nn.Parameter`` (not DTensors); writes never record autograd history.
        """
        state = self._state
        state.check_current()
        writes.set_full_(state, writes.validate_full(state, mapping))


    # --- internals -----------------------------------------------------------------------------------------------
    def _agree(self, what: str, selected: list[ParamLayout] | None, refused: Exception | None,
               *signature: Any) -> None:
        """The rank agreement of a bulk read (:func:`zero_dtensor.comm.agreement.agree`) over the process groups the
        call will communicate on (none for replicated or single-rank groups). ``refused``: this rank's validation
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

    def _agreed_selection(self, what: str, params: ParamSelection, *signature: Any, norm_type: Any = None) -> Selection:
        """A reduction's ``params=`` selection, validated (with ``norm_type`` where given) and agreed on every rank
        of the process groups it reduces over (:func:`zero_dtensor.comm.agreement.agree`; none where no group
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
        agree_on(state.storage, what, (names, None if norm_type is None else float(norm_type), *signature),
                 reductions.communicating_groups(state), refused=refusal.error)
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
