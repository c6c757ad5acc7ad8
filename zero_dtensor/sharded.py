"""``ShardedGrads``: a live, sharded view of every reduced gradient of a DeepSpeed ZeRO engine.

Nothing here communicates unless its docstring says so. Each collective call must run on every rank of the
data-parallel group, in the same order, or the job hangs (as with any ``torch.distributed`` collective).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import debug as _debug
from .collectives import _all_gather_single, all_reduce_sum_work, mesh_for, on_comm_device
from .errors import StaleGradientsError
from .layout import GradLayout, Packing, ParamLayout
from . import materialize as _materialize
from .materialize import FullTensorsHandle
from .ops import GradOpsMixin
from .storage import GradStorage

__all__ = ["ParamGrad", "ShardedGrads"]

_STALE = (
    "these gradients were consumed by engine.step() (or a later micro-step began); call "
    "zero_dtensor.sharded_grads(engine) again after the next engine.backward() at an accumulation boundary"
)


class ParamGrad:
    """The gradient of one parameter: its local fragment on this rank and, on request, the full tensor.

    For ZeRO-1/2 the fragments are ragged (a parameter straddles ranks at arbitrary offsets), so a parameter is *not*
    a DTensor; for ZeRO-3 (``torch.chunk`` pieces) and replicated groups :meth:`as_dtensor` gives an exact one.
    """

    def __init__(self, grads: ShardedGrads, param: ParamLayout) -> None:
        self._grads = grads
        self._param = param
        self._group = grads.layout.groups[param.group]

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
        return self._group.dtype

    @property
    def group(self) -> int:
        """Index of the flat group (``ShardedGrads.groups``) holding this parameter."""
        return self._param.group

    @property
    def local_range(self) -> tuple[int, int]:
        """``(start, stop)`` of this rank's fragment within the flattened parameter (``start == stop``: none)."""
        start, stop, _ = self._grads._fragments[self.name]
        return start, stop

    def to_local(self) -> torch.Tensor:
        """This rank's fragment, 1-D, ``local_range`` long: a **live view** of the gradient memory.

        Writes to it change what ``engine.step()`` uses; it changes when the gradient does. Under
        ``keep_full_grads`` the view is of the kept full buffer, whose slice DeepSpeed owns is copied into
        DeepSpeed's partition at the start of ``engine.step()`` (and after every write through the API).
        No communication. Under fp16 loss scaling the stored values are ``true gradient × grads.loss_scale``.
        """
        self._grads._check_current()
        return self._grads._local(self._param)

    def full_tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full (true, unscaled) gradient, shape ``self.shape``: a snapshot in memory the caller owns.
        **Collective**: call on every rank of the group.

        Communication: none for a replicated group; ZeRO-3: one ``all_gather`` of the ``ceil(numel/N)`` chunks
        (``(N-1)/N·numel`` elements received per rank); ZeRO-1/2: one sum ``all_reduce`` of a zero-padded
        ``numel``-element buffer in the stored dtype (exact: every element has one non-zero contributor).
        To gather many parameters use :meth:`ShardedGrads.full_tensors` (one collective per group).
        """
        self._grads._check_current()
        check_dtype(dtype, "ParamGrad.full_tensor")
        storage = self._grads._storage
        _debug.check_same_call("ParamGrad.full_tensor", (self.name, str(dtype)),
                               [storage.process_groups[self._param.group]], storage.device)
        group, param = self._group, self._param
        pg = storage.process_groups[param.group]
        if group.replicated:  # a copy: the result is the caller's, never a view of DeepSpeed's storage
            full = self._grads._local(param).clone()
        elif group.packing is Packing.CHUNKED:  # every rank stores a padded chunk_numel-long chunk at param.offset
            chunk = storage.partitions[param.group].narrow(0, param.offset, param.chunk_numel)
            chunk = on_comm_device(chunk, pg, storage.device)
            gathered = torch.empty(group.world_size * param.chunk_numel, dtype=chunk.dtype, device=chunk.device)
            _all_gather_single(gathered, chunk, group=pg)
            full = gathered.narrow(0, 0, param.numel)
        else:
            local = on_comm_device(self._grads._local(param), pg, storage.device)
            full = torch.zeros(param.numel, dtype=local.dtype, device=local.device)
            start, stop = self.local_range
            full.narrow(0, start, stop - start).copy_(local)
            all_reduce_sum_work(full, pg)
        return self._grads._finish(full.view(param.shape), dtype)

    def as_dtensor(self) -> DTensor:
        """This gradient as an exact DTensor of shape ``(numel,)`` aliasing DeepSpeed's storage. No communication.

        ``Shard(0)`` for ZeRO-3 (``torch.chunk`` pieces), ``Replicate()`` for replicated groups. ZeRO-1/2 pieces are
        ragged, which DTensor cannot describe: use :meth:`to_local`, :meth:`full_tensor` or ``grads.groups``.
        """
        group = self._group
        if group.packing is Packing.CONTIGUOUS and not group.replicated:
            raise TypeError(
                f"{self.name!r}: ZeRO-1/2 stores a parameter in ragged pieces that a Shard(0) DTensor would describe "
                "wrongly; use grads.groups[...] (an exact Shard(0) DTensor per flat group), to_local() or full_tensor()"
            )
        placement = Replicate() if group.replicated else Shard(0)
        return self._grads._dtensor(self.to_local(), self._param.group, placement, (self.numel,))


class ShardedGrads(GradOpsMixin, Mapping[str, ParamGrad]):
    """Every trainable parameter's reduced gradient, sharded as DeepSpeed stores it. A mapping ``name -> ParamGrad``.

    Valid from ``engine.backward()`` at an accumulation boundary until ``engine.step()``; afterwards every call raises
    :class:`~zero_dtensor.errors.StaleGradientsError`. Views and group DTensors alias DeepSpeed's storage: in-place
    changes are what ``engine.step()`` uses. Frozen parameters (``requires_grad=False``) are absent; a tied
    parameter appears once, under its first name in ``named_parameters()``.
    """

    def __init__(self, storage: GradStorage) -> None:
        self._storage = storage
        self._views = {p.name: ParamGrad(self, p) for p in storage.layout.params}

    def __repr__(self) -> str:
        return f"ShardedGrads({self._storage.describe}, {len(self)} params, {len(self.layout.groups)} groups)"

    # --- mapping -----------------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ParamGrad:
        self._check_current()
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a trainable parameter of this engine; known: {_short(self.names)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    # --- description -------------------------------------------------------------------------------------------
    @property
    def layout(self) -> GradLayout:
        return self._storage.layout

    @property
    def names(self) -> tuple[str, ...]:
        """Trainable parameter names in model (``named_parameters()``) order."""
        return self.layout.names

    @property
    def loss_scale(self) -> float:
        """Stored values are ``true gradient × loss_scale`` (fp16 dynamic loss scaling; 1.0 otherwise)."""
        return self._storage.loss_scale

    @property
    def local_partitions(self) -> tuple[torch.Tensor, ...]:
        """Per group, this rank's whole partition (1-D, padding included): the memory ``engine.step()`` reads.
        No communication."""
        self._check_current()
        return self._storage.partitions

    def is_current(self) -> bool:
        """False once ``engine.step()`` (or a new micro-step) has consumed these gradients. No communication."""
        return self._storage.is_current()

    @cached_property
    def _group_dtensors(self) -> tuple[DTensor, ...]:
        return tuple(
            self._dtensor(part, g.index, Replicate() if g.replicated else Shard(0), (g.flat_numel,))
            for g, part in zip(self.layout.groups, self._storage.partitions)
        )

    @property
    def groups(self) -> tuple[DTensor, ...]:
        """One DTensor per flat group over the padded flat buffer: ``Shard(0)`` (``Replicate()`` where every rank
        holds the full gradient), aliasing DeepSpeed's storage. No communication to build. ZeRO-3 groups are in
        chunk order (each rank's partition holds every parameter's chunk back to back), not parameter order.
        """
        self._check_current()
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
    ) -> dict[str, torch.Tensor] | FullTensorsHandle:
        """``{name: full gradient}`` (true, unscaled values). **Collective**: call on every rank with the same arguments.

        Args:
            names: parameters to materialize (default: all). Only flat groups holding one of them communicate.
            dtype: output dtype (default: the stored dtype; fp32 under fp16 loss scaling). Communication always
                uses the stored dtype; the cast happens after it.
            out: a dict to fill in place, e.g. the result of a previous call: zero allocation on later steps. A
                previous result (a :class:`~zero_dtensor.materialize.FullGrads`) also carries its flat gather
                buffers, so the collective writes straight into them and ZeRO-1/2 entries in the stored dtype are
                views of them (no copy at all); ZeRO-3 entries get a strided copy into the existing tensors. With a
                user-made dict, entries must have the parameter's shape and the output dtype, on the gradient's
                device, contiguous; missing entries are created; the gather buffer is then a module-level workspace
                kept between calls (``zero_dtensor.materialize.release_workspace()`` frees it).
            dst: a global rank: only it receives full tensors, every other rank gets an empty dict.
                ``all_gather``/``auto``: one ``gather`` per flat group (gather has no coalesced form): each rank sends
                ``S/N``, the destination receives ``(N-1)/N·S`` and only it allocates ``S``. ``all_reduce``: one
                sum ``reduce`` per bucket of a zero-padded ``S`` buffer that every rank allocates.
            async_op: return a :class:`~zero_dtensor.materialize.FullTensorsHandle` whose ``wait()`` gives the
                dict; do not change the gradients (``engine.step()``) before ``wait()``.
            strategy: ``"all_gather"``, ``"all_reduce"`` or ``"auto"`` (see :mod:`zero_dtensor.materialize`).

        Communication (``N`` ranks, ``S`` the padded flat bytes of the groups involved, in the stored dtype):
        ``all_gather``: one all_gather per (process group, dtype, device), coalesced over the flat groups sharing
        them, ``(N-1)/N·S`` bytes per rank. ``all_reduce``: one sum all_reduce per (process group, dtype, device)
        of a zero-filled ``S`` buffer, ``2(N-1)/N·S`` bytes per rank. ``auto`` on gloo, for buckets of at least
        1 MiB: the first call per (process group, dtype, power-of-two size) also calibrates (7 more collectives;
        see :func:`~zero_dtensor.materialize.calibrate`); pin it with ``ZERO_DTENSOR_GATHER_STRATEGY`` or
        :func:`~zero_dtensor.materialize.set_gather_strategy`. Replicated groups (``BF16_Optimizer``): none.

        Results: ZeRO-1/2 entries in the stored dtype are views into one gathered buffer; ZeRO-3 entries are copies
        (a strided unpack; with ``all_reduce`` they are views, since each rank writes its chunks in parameter order);
        replicated entries are copies (one local copy, no communication). Every result is a **snapshot** the caller
        owns: changing it does not change the gradient, and ``engine.step()`` does not change it. Without ``out=``
        the flat buffer is recycled from the previous call once none of that call's tensors (nor its dict) is alive,
        so a loop that drops each step's result allocates only once; a live result is never overwritten
        (``zero_dtensor.materialize.RECYCLE = False`` turns this off, ``release_workspace()`` frees the cache).
        """
        self._check_current()
        selected = self._select(names)
        check_dtype(dtype, "full_tensors")
        self._check_agreement("full_tensors", selected, str(dtype), dst, async_op, strategy)
        return _materialize.full_tensors(
            self, [p.name for p in selected], dtype=dtype, out=out, dst=dst, async_op=async_op, strategy=strategy
        )

    def iter_full(
        self,
        names: list[str] | None = None,
        *,
        bucket_bytes: int = _materialize.DEFAULT_BUCKET_BYTES,
        dtype: torch.dtype | None = None,
        strategy: str = "auto",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full gradient)`` bucket by bucket, for models whose full gradient does not fit in memory.
        **Collective**: every rank must iterate to the end (a rank that stops early leaves the others waiting in
        the next bucket's collective).

        Parameters come per flat group, in buffer order (not model order). Consecutive parameters form buckets of
        at most ``bucket_bytes`` of buffers allocated here (stored dtype); a parameter larger than that gets a
        bucket of its own (and its own, larger, buffer). One collective per bucket, nothing for replicated groups:
        ZeRO-1/2 ``all_reduce`` (the default on gloo and NCCL): the bucket's window ``[a, b)`` of the global flat
        buffer, zero-filled, each rank writing its overlap, ``2(N-1)/N·W`` bytes per rank; ``all_gather``: each
        rank's overlap padded to the largest one (``m``), ``(N-1)·m`` bytes received per rank (up to ``N/2×``
        the all_reduce when the window lies within one rank). ZeRO-3 ``all_gather`` (NCCL default): the bucket's
        chunk range of every rank's partition, ``(N-1)/N·W``; ``all_reduce`` (gloo default): a zero-filled
        parameter-order buffer, ``2(N-1)/N·W``.

        Peak extra memory: one bucket (plus the local shard DeepSpeed already holds), provided the caller drops
        each tensor before asking for the next bucket. (On gloo the backend's worker thread can release a finished
        collective's buffer a moment after the call returned, so two buckets may briefly coexist.) Yielded tensors of the stored dtype are views into their
        bucket's buffer (valid as long as they are referenced); ``dtype`` casts and fp16 unscaling add one
        converted copy per yielded tensor.
        """
        self._check_current()
        selected = self._select(names)
        check_dtype(dtype, "iter_full")
        self._check_agreement("iter_full", selected, bucket_bytes, str(dtype), strategy)
        return _materialize.iter_full(self, [p.name for p in selected], bucket_bytes=bucket_bytes, dtype=dtype,
                                      strategy=strategy)

    def set_full_(self, mapping: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the gradients of the named parameters with full tensors. **No communication**.

        Each rank copies its own fragment of each value (rescaled by ``loss_scale`` under fp16) into DeepSpeed's
        storage; values must be equal on every rank (for replicated groups each rank writes the whole value).
        Everything is validated before the first write: a bad entry raises and nothing is changed. Values may be
        any floating dtype (cast on write), on the engine's device or where the gradient is stored.
        """
        self._check_current()
        checked = self._validate(mapping)
        storage, fragments = self._storage, self._fragments
        with torch.no_grad():  # a value that requires grad must not give DeepSpeed's memory an autograd history
            for param, value in checked:
                start, stop, offset = fragments[param.name]
                if stop == start:
                    continue
                source = storage.to_stored(value.detach().reshape(-1).narrow(0, start, stop - start))
                storage.partitions[param.group].narrow(0, offset, stop - start).copy_(source)
        self._storage.after_write([p.name for p, _ in checked])

    # --- internals -----------------------------------------------------------------------------------------------
    def _check_agreement(self, what: str, selected: list[ParamLayout], *signature: Any) -> None:
        """The always-on rank-agreement check of a bulk read (see :mod:`zero_dtensor.debug`): over the process
        groups the call will communicate on (none for replicated or single-rank groups); in debug mode over all."""
        storage = self._storage
        if _debug.is_debug():
            groups = storage.process_groups
        else:
            used = sorted({p.group for p in selected})
            groups = tuple(storage.process_groups[i] for i in used
                           if not self.layout.groups[i].replicated and self.layout.groups[i].world_size > 1)
        _debug.check_same_call(what, ([p.name for p in selected], *signature), groups, storage.device, always=True)

    @cached_property
    def _fragments(self) -> dict[str, tuple[int, int, int]]:
        """``name -> (start, stop, offset in this rank's partition)`` of this rank's fragment."""
        out = {}
        for p in self.layout.params:
            group = self.layout.groups[p.group]
            start, stop = p.rank_range(group, group.rank)
            out[p.name] = (start, stop, p.local_offset(group, group.rank))
        return out

    def _local(self, param: ParamLayout) -> torch.Tensor:
        """This rank's fragment of ``param``: a 1-D view of its partition (empty where it holds none). No check."""
        start, stop, offset = self._fragments[param.name]
        return self._storage.partitions[param.group].narrow(0, offset, stop - start)

    def _comm_partition(self, group: int) -> torch.Tensor:
        """This rank's partition of ``group`` on a device its process group communicates on (a copy only for
        CPU-offloaded gradients whose group cannot take CPU tensors, e.g. NCCL)."""
        storage = self._storage
        return on_comm_device(storage.partitions[group], storage.process_groups[group], storage.device)

    def _check_current(self) -> None:
        if not self._storage.is_current():
            raise StaleGradientsError(_STALE)

    def _select(self, names: Any) -> list[ParamLayout]:
        """The requested parameters in request order (all, in model order, for ``None``); raises before anything
        communicates: a single string, non-string entries, duplicates and unknown names are refused."""
        if names is None:
            return list(self.layout.params)
        if isinstance(names, (str, bytes)):
            raise TypeError(f"names must be a list of parameter names, not a single string: pass [{names!r}]")
        if isinstance(names, Mapping) or not isinstance(names, Iterable):
            raise TypeError(f"names must be a list of parameter names or None, got {type(names).__name__}")
        names = list(names)
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"names must be parameter names (str); got {[type(b).__name__ for b in bad[:4]]}")
        seen: set[str] = set()
        duplicates = sorted({n for n in names if n in seen or seen.add(n)})
        if duplicates:
            raise ValueError(f"names lists {duplicates} more than once; give each parameter once")
        unknown = [n for n in names if n not in self.layout.by_name]
        if unknown:
            raise KeyError(f"not trainable parameters of this engine: {unknown}; known: {_short(self.names)}")
        return [self.layout.by_name[n] for n in names]

    def _finish(self, full: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        full = self._storage.to_true(full)
        return full if dtype is None or full.dtype == dtype else full.to(dtype)

    def _dtensor(self, local: torch.Tensor, group: int, placement, shape: tuple[int, ...]) -> DTensor:
        mesh = mesh_for(self._storage.process_groups[group], local.device.type)
        return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=(1,))

    def _validate(self, mapping: Mapping[str, torch.Tensor]) -> list[tuple[ParamLayout, torch.Tensor]]:
        if not isinstance(mapping, Mapping):
            raise TypeError(f"set_full_ takes a mapping name -> full gradient tensor, got {type(mapping).__name__}")
        devices = {self._storage.device, *(p.device for p in self._storage.partitions)}
        checked = []
        for name, value in mapping.items():
            param = self.layout.by_name.get(name)
            if param is None:
                raise KeyError(f"set_full_: {name!r} is not a trainable parameter of this engine; known: {_short(self.names)}")
            if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"set_full_: value for {name!r} must be a full torch.Tensor of shape {tuple(param.shape)}, "
                    f"got {type(value).__name__} (for a DTensor pass value.full_tensor())"
                )
            if value.shape != param.shape:
                raise ValueError(
                    f"set_full_: value for {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}"
                )
            if not value.is_floating_point():
                raise TypeError(f"set_full_: value for {name!r} has dtype {value.dtype}, expected a floating dtype")
            if value.device not in devices:
                raise ValueError(
                    f"set_full_: value for {name!r} is on {value.device}, expected one of "
                    f"{sorted(str(d) for d in devices)} (the engine's device or where the gradient is stored)"
                )
            checked.append((param, value))
        return checked


def check_dtype(dtype: Any, what: str) -> None:
    """``dtype=`` of a read: ``None`` or a floating ``torch.dtype`` (an integer or bool cast would truncate)."""
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what}: dtype must be a torch.dtype or None, got {type(dtype).__name__} ({dtype!r})")
    if not dtype.is_floating_point:
        raise TypeError(f"{what}: dtype must be a floating dtype (e.g. torch.float32), got {dtype}: a cast of a "
                        "gradient to it would silently truncate")


def _short(names: tuple[str, ...] | list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', …' if len(names) > limit else ''}] ({len(names)} in all)"
