"""A ``TorchDispatchMode`` that sees on the CPU what a GPU run would: memory traffic, host syncs, device mixing.

:class:`DispatchProbe` watches every aten operation a call dispatches (views, ``detach``/``alias``/``lift_fresh``
and the ``prim``/``c10d`` namespaces are not counted as operations, as in ``op_counts.OpCounter``) and records:

- ``ops`` / ``by_op``: how many operations, by name;
- ``read`` / ``written``: bytes every operation reads and writes (the extent its strides cover: an expanded 0-d
  tensor is one element); ``data_read`` / ``data_written``: the same for tensors in the storage of the registered
  *data* (:meth:`DispatchProbe.watch`: e.g. the gradient partitions), with gathers (``index_select``, ``gather``,
  ``take``, ``index``) reading only what they return and in-place scatters (``index_copy_``, ``index_put_``,
  ``scatter_``) writing only what their source holds (not their whole destination); ``data_passes``: operations that read or write at least half
  of the data's bytes at once;
- ``largest`` / ``allocated``: the largest fresh storage one operation returns and the sum of them (a storage no
  input shares: the result of the call included); ``produced``: bytes of the fresh tensors operations return
  (``torch.cat``, ``clone``, ``_to_copy``, ``div`` ...; factories of uninitialized memory, ``empty*``, aside), so
  that ``written + produced`` is every byte an operation stores locally, collectives aside;
- ``syncs``: host syncs on device data: ``_local_scalar_dense`` (``.item()``, ``bool()``), ``nonzero``,
  ``masked_select``, ``unique*``, ``bincount``, ``Tensor.tolist`` / ``numpy``, and copies from the simulated
  communication device to the host, when the tensor is on the simulated communication device or derived from the
  data (``tainted``); simulated, also blocking copies from the host to the simulated device (``to_device``:
  ``.to``, ``copy_`` of a host tensor of one or more dimensions, ``torch.tensor(..., device=)``), which CUDA
  makes with a stream sync;
- **device tags** (``simulate=True``): every tensor carries a simulated device, ``"host"`` (the CPU) or ``"dev"``
  (the accelerator collectives run on under NCCL). On the CPU a library sees two devices: :data:`HOST` (``cpu:0``)
  and :data:`DEV` (``cpu:1``); torch accepts both and places the tensors on the CPU, whose ``.device`` then reads
  plain ``cpu``. A factory or copy given ``device=DEV`` makes a ``"dev"`` tensor, ``device=HOST`` or no device a
  ``"host"`` one; ``device=cpu`` (what ``device=t.device`` passes, whatever ``t``'s tag) makes an ``"any"`` tensor,
  which meets either without refusal (the probe cannot tell where ``t`` was: library code that must be checked
  moves through :mod:`zero_dtensor.layout.devices` or follows a tensor with ``new_*`` / ``*_like``); other operations'
  results take the tag of their operands (``"dev"`` if any operand is, ``"any"`` if all are). Registered tensors (:meth:`DispatchProbe.tag`) take the given tag
  whatever their origin (e.g. offloaded partitions ``"host"``, non-offloaded ones ``"dev"``). An operation whose
  operands mix the two is refused as CUDA refuses it: a ``"dev"`` tensor (even 0-d) meeting ``"host"`` data, or a
  ``"host"`` tensor of one or more dimensions meeting ``"dev"`` data (a 0-d ``"host"`` tensor is a CPU scalar,
  legal on CUDA); copies (``copy_``, ``_to_copy``, ``_foreach_copy_``) may cross; empty tensors (no storage to
  tag) are not checked. With ``nccl=True`` a collective
  (``c10d`` namespace) given a ``"host"`` tensor is refused too. A refusal raises :class:`DeviceMixError` (so the
  call fails as it would on a GPU) and is recorded in ``refused``.

``torch.tensor`` / ``torch.as_tensor`` dispatch only a ``lift_fresh``: while the probe is active they are wrapped
so that their ``device=`` argument tags the result. ``.to(device)`` of a tensor already on the real device is a
no-op that dispatches nothing: a library must move tensors through :mod:`zero_dtensor.layout.devices`
(:func:`~zero_dtensor.layout.devices.to_device`), which :func:`copying_moves` patches to copy, so that a move re-tags.

Tags and taint are kept per storage (``data_ptr``), so views share them; they are overwritten whenever an operation
returns a storage, so a reused address carries no stale tag into a result. Tags outlive the probe while a tensor
tagged with them lives (a plan's cached index tensors on the simulated device keep it, as on a GPU).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DEV", "HOST", "DeviceMixError", "DispatchProbe", "copying_moves", "simulated_offload"]

HOST = torch.device("cpu", 0)  #: stands for the host (offloaded storage)
DEV = torch.device("cpu", 1)  #: stands for the CUDA device collectives run on (torch keeps such tensors on the CPU)


def _classify(device: Any) -> str | None:
    """The tag a ``device=`` argument gives (``None``: no argument)."""
    if device is None:
        return None
    device = torch.device(device)
    if device == DEV:
        return "dev"
    return "host" if device == HOST or device.type != "cpu" else "any"

_SKIPPED = {"detach", "alias", "lift_fresh"}
_SKIPPED_NAMESPACES = {"prim", "prims", "c10d", "_c10d_functional", "c10d_functional"}
_COMM_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
_GATHERS = {"index_select", "gather", "take", "index", "embedding"}
#: in-place scatters: the argument holding what they write (they write only the destination's rows it picks)
_SCATTERS = {"index_copy_": "source", "index_put_": "values", "scatter_": "src"}
_WRITE_ONLY = {"zero_", "fill_", "copy_", "_foreach_zero_", "_foreach_copy_", "empty", "empty_like", "zeros",
               "zeros_like", "full", "full_like", "new_empty", "new_zeros", "set_"}
_UNINITIALIZED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
_CROSSING = {"copy_", "_to_copy", "_foreach_copy_", "_copy_from", "_copy_from_and_resize"}
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "bincount", "repeat_interleave"}


#: simulated devices of storages (``data_ptr`` -> tag and weak references to the tensors tagged), kept across probes:
#: index tensors a library caches on the simulated device keep their tag from one probe to the next, as they keep
#: their device on a GPU; an entry whose tensors are all gone is ignored (the address may have been reused)
_REGISTRY: dict[int, tuple[str, list[weakref.ref]]] = {}
_ACTIVE: list[DispatchProbe] = []  # the probes entered, innermost last


def _registered(p: int) -> str | None:
    found = _REGISTRY.get(p)
    if found is None:
        return None
    if any(r() is not None for r in found[1]):
        return found[0]
    del _REGISTRY[p]
    return None


class DeviceMixError(RuntimeError):
    """An operation whose operands lie on two (simulated) devices, refused as CUDA would refuse it."""


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes the strides of ``t`` cover (an expanded tensor counts its distinct elements once)."""
    n = t.numel()
    if n == 0:
        return 0
    if t.is_contiguous():
        return n * t.element_size()
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return min(n, span) * t.element_size()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _counted(func: Any) -> bool:
    if getattr(func, "namespace", "aten") in _SKIPPED_NAMESPACES or getattr(func, "is_view", False):
        return False
    return func.overloadpacket.__name__ not in _SKIPPED


class DispatchProbe(TorchDispatchMode):
    """See the module docstring. ``simulate``: check device tags; ``nccl``: collectives refuse ``"host"``
    tensors; ``raise_on_mix``: a refusal raises :class:`DeviceMixError` (else it is only recorded)."""

    def __init__(self, *, simulate: bool = False, nccl: bool = False, raise_on_mix: bool = True) -> None:
        super().__init__()
        self.simulate, self.nccl, self.raise_on_mix = simulate, nccl, raise_on_mix
        self.ops: int = 0
        self.by_op: Counter[str] = Counter()
        self.read = self.written = self.data_read = self.data_written = 0
        self.data_passes = 0
        self.largest = self.allocated = self.produced = 0
        self.syncs: list[str] = []
        self.sync_sites: list[str] = []  # where the library made each host-to-device sync
        self.refused: list[str] = []
        self._data: set[int] = set()
        self._data_bytes = 0
        self._tags: dict[int, str] = {}
        self._pinned: set[int] = set()  # storages tagged by the caller: never re-tagged
        self._tainted: set[int] = set()
        self._patches: contextlib.ExitStack | None = None

    # --- registration --------------------------------------------------------------------------------------------
    def watch(self, tensors: Iterable[torch.Tensor]) -> DispatchProbe:
        """Count traffic to and from these tensors' storages as the data's (``data_read``, ``data_written``)."""
        for t in tensors:
            p = _ptr(t)
            if p and p not in self._data:
                self._data.add(p)
                self._data_bytes += t.untyped_storage().nbytes()
        return self

    def tag(self, tensors: Iterable[torch.Tensor], where: str) -> DispatchProbe:
        """Pin the simulated device (``"host"`` or ``"dev"``) of these tensors' storages."""
        if where not in ("host", "dev", "any"):
            raise ValueError(f"where must be 'host', 'dev' or 'any', got {where!r}")
        for t in tensors:
            p = _ptr(t)
            if p:
                self._tags[p] = where
                self._pinned.add(p)
        return self

    def where(self, t: torch.Tensor) -> str:
        """The simulated device of ``t`` (``"host"``, ``"dev"`` or ``"any"``)."""
        p = _ptr(t)
        if p in self._pinned:
            return self._tags[p]
        return _registered(p) or "host"

    def _set_tag(self, t: torch.Tensor, where: str) -> None:
        p = _ptr(t)
        if not p or p in self._pinned:
            return
        found = _REGISTRY.get(p)
        if found is not None and found[0] == where:
            found[1].append(weakref.ref(t))
        else:
            _REGISTRY[p] = (where, [weakref.ref(t)])

    def _from(self, t: torch.Tensor) -> bool:
        """Whether reading ``t`` back is a host sync: simulated, where ``t`` lies on the simulated device; else
        where it holds the data or values derived from it."""
        if self.simulate:
            return self.where(t) == "dev"
        p = _ptr(t)
        return p in self._data or p in self._tainted

    # --- context ---------------------------------------------------------------------------------------------------
    def __enter__(self) -> DispatchProbe:
        _ACTIVE.append(self)
        stack = contextlib.ExitStack()
        stack.callback(_ACTIVE.remove, self)
        probe = self
        for name in ("tensor", "as_tensor"):
            original = getattr(torch, name)

            def made(*args: Any, _original: Any = original, **kwargs: Any) -> torch.Tensor:
                out = _original(*args, **kwargs)
                where = _classify(kwargs.get("device"))
                if isinstance(out, torch.Tensor):
                    probe._set_tag(out, where or "host")
                    if where == "dev" and probe.simulate:  # host data copied to the device, blocking
                        probe.syncs.append("to_device")
                        probe.sync_sites.append(_library_site())
                return out

            setattr(torch, name, made)
            stack.callback(setattr, torch, name, original)
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)

            def read_back(t: torch.Tensor, *args: Any, _original: Any = original, _name: str = name,
                          **kwargs: Any) -> Any:
                if probe._from(t):
                    probe.syncs.append(_name)
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, read_back)
            stack.callback(setattr, torch.Tensor, name, original)
        self._patches = stack
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            if self._patches is not None:
                self._patches.close()
                self._patches = None

    # --- the mode -----------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        namespace = getattr(func, "namespace", "aten")
        inputs = _tensors((args, kwargs))
        if self.simulate:
            self._check_devices(name, namespace, inputs)
        if _counted(func):
            self.ops += 1
            self.by_op[str(func)] += 1
            self._count_traffic(func, name, args, kwargs)
        if name in _SYNC_OPS and any(self._from(t) for t in inputs):
            self.syncs.append(name)
        device = kwargs.get("device")
        if (name == "_to_copy" and _classify(device) == "host" and inputs and self.simulate
                and self.where(inputs[0]) == "dev"):
            self.syncs.append("to_host")
        if (self.simulate and inputs and not kwargs.get("non_blocking", False)
                and ((name == "_to_copy" and _classify(device) == "dev" and self.where(inputs[0]) == "host")
                     or (name == "copy_" and len(inputs) > 1 and self.where(inputs[0]) == "dev"
                         and self.where(inputs[1]) == "host" and inputs[1].dim() > 0))):
            self.syncs.append("to_device")  # a blocking copy from (pageable) host memory: CUDA syncs the stream
            self.sync_sites.append(_library_site())
        in_ptrs = {_ptr(t) for t in inputs}
        out = func(*args, **kwargs)
        self._after(name, namespace, inputs, in_ptrs, out, device)
        return out

    def _check_devices(self, name: str, namespace: str, inputs: list[torch.Tensor]) -> None:
        if namespace in _COMM_NAMESPACES:
            if self.nccl:
                host = [tuple(t.shape) for t in inputs if self.where(t) == "host" and t.numel()]  # (empty: no tag)
                if host:
                    self._refuse(f"{namespace}.{name}: a collective on NCCL got host tensors {host[:4]}")
            return
        if name in _CROSSING or namespace in _SKIPPED_NAMESPACES:
            return
        inputs = [t for t in inputs if t.numel()]  # an empty tensor has no storage to carry a tag
        dev = [t for t in inputs if self.where(t) == "dev"]
        host = [t for t in inputs if self.where(t) == "host" and t.dim() > 0]
        if dev and host:
            self._refuse(f"aten.{name}: operands on two devices (dev: {[tuple(t.shape) for t in dev[:3]]}, "
                         f"host: {[tuple(t.shape) for t in host[:3]]})")

    def _refuse(self, message: str) -> None:
        self.refused.append(message)
        if self.raise_on_mix:
            raise DeviceMixError("Expected all tensors to be on the same device (simulated): " + message)

    def _count_traffic(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        schema = func._schema.arguments
        bound = {a.name: v for a, v in zip(schema, args)}
        bound.update(kwargs)
        mutated = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
        gather = name in _GATHERS
        scattered = _SCATTERS.get(name)
        for arg, value in bound.items():
            for t in _tensors(value):
                nbytes = _extent_bytes(t)
                is_data = _ptr(t) in self._data
                if arg in mutated and scattered is not None:  # writes only what its source holds
                    picked = sum(_extent_bytes(src) for src in _tensors(bound.get(scattered)))
                    self.written += picked
                    self.data_written += picked if is_data else 0
                elif arg in mutated:
                    self.written += nbytes
                    self.data_written += nbytes if is_data else 0
                    if name not in _WRITE_ONLY and arg != "out":
                        self.read += nbytes
                        self.data_read += nbytes if is_data else 0
                elif not (gather and arg in ("self", "input", "weight")):
                    self.read += nbytes
                    self.data_read += nbytes if is_data else 0
                if is_data and nbytes * 2 >= self._data_bytes > 0:
                    self.data_passes += 1

    def _after(self, name: str, namespace: str, inputs: list[torch.Tensor], in_ptrs: set[int], out: Any,
               device: Any) -> None:
        outs = _tensors(out)
        tainted = any(self._from(t) for t in inputs)
        tags = {self.where(t) for t in inputs}
        if device is not None:
            where = _classify(device)
        elif name in ("copy_", "_foreach_copy_"):
            where = None  # the destination keeps its device
        else:
            where = "dev" if "dev" in tags else ("any" if tags == {"any"} else "host")
        gather_data = name in _GATHERS and any(_ptr(t) in self._data for t in inputs)
        for o in outs:
            p = _ptr(o)
            fresh = p not in in_ptrs
            if fresh and p:
                nbytes = o.untyped_storage().nbytes()
                if _counted_name(name, namespace):
                    self.largest = max(self.largest, nbytes)
                    self.allocated += nbytes
                    if name not in _UNINITIALIZED:
                        self.produced += _extent_bytes(o)
                if gather_data:
                    self.read += _extent_bytes(o)
                    self.data_read += _extent_bytes(o)
            if tainted and p:
                self._tainted.add(p)
            elif fresh and p:
                self._tainted.discard(p)
            if where is not None and (fresh or device is not None):
                self._set_tag(o, where)

    # --- summary ---------------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The counters as a picklable dict (for a test's parent process)."""
        return {"ops": self.ops, "by_op": dict(self.by_op), "read": self.read, "written": self.written,
                "data_read": self.data_read, "data_written": self.data_written, "data_bytes": self._data_bytes,
                "data_passes": self.data_passes, "largest": self.largest, "allocated": self.allocated,
                "produced": self.produced,
                "syncs": list(self.syncs), "sync_sites": list(self.sync_sites), "refused": list(self.refused)}


def _library_site() -> str:
    """``file:function`` of the innermost ``zero_dtensor`` frame on the stack (where a sync was made)."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if "/zero_dtensor/" in frame.filename:
            return f"{frame.filename.rsplit('/zero_dtensor/', 1)[1]}:{frame.name}"
    return "?"


def _counted_name(name: str, namespace: str) -> bool:
    return namespace not in _SKIPPED_NAMESPACES and name not in _SKIPPED


@contextlib.contextmanager
def copying_moves() -> Iterator[None]:
    """While active, :func:`zero_dtensor.layout.devices.to_device` copies (``.to(device, copy=True)``) unless the innermost
    simulating probe has the tensor on that simulated device already, so that a move between the simulated devices
    dispatches a ``_to_copy`` the probe re-tags (on the CPU ``.to(cpu)`` of a ``cpu:1`` tensor would be a no-op)
    and a move to where a tensor is costs nothing, as on a GPU."""
    try:
        from zero_dtensor.layout import devices
    except ImportError:  # a library without the seam (the code before issue 42): nothing to patch
        yield
        return
    original = devices._move

    def move(t: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
        target = _classify(device)
        if _ACTIVE and _ACTIVE[-1].simulate and target != "any" and _ACTIVE[-1].where(t) == target:
            return t  # already on that simulated device: no move, as on a GPU
        return t.to(device, copy=True)

    devices._move = move
    try:
        yield
    finally:
        devices._move = original


@contextlib.contextmanager
def simulated_offload(storages: Iterable[Any], *, offload: bool = True) -> Iterator[None]:
    """``storages`` (``FlatStorage``) made to look like a CUDA job: their communication device (``device``)
    becomes :data:`DEV`, process groups are treated as NCCL (CUDA tensors only:
    ``collectives.comm_device_types``), their storage device (``devices.storage``) becomes :data:`HOST` (``offload``) or :data:`DEV`, and moves
    copy (:func:`copying_moves`). Their partitions stay where they are: the caller tags them ``"host"`` (offloaded) or ``"dev"``. Restored on exit."""
    from zero_dtensor.comm import collectives

    from zero_dtensor.core.storage import FlatStorage

    storages = list(storages)
    simulated = {id(s) for s in storages}
    original_types, original_devices = collectives.comm_device_types, getattr(FlatStorage, "devices", None)
    originals = [s.device for s in storages]
    for s in storages:
        object.__setattr__(s, "device", DEV)
    collectives.comm_device_types = lambda group: frozenset({"cuda"})

    def devices(self: Any) -> Any:
        from zero_dtensor.layout.devices import Devices

        found = original_devices.fget(self)
        return Devices(HOST if offload else DEV, DEV) if id(self) in simulated else found

    if original_devices is not None:  # (the code before issue 42 has no devices: nothing to patch)
        FlatStorage.devices = property(devices)  # type: ignore[method-assign]
    try:
        with copying_moves():
            yield
    finally:
        collectives.comm_device_types = original_types
        if original_devices is not None:
            FlatStorage.devices = original_devices  # type: ignore[method-assign]
        for s, d in zip(storages, originals):
            object.__setattr__(s, "device", d)
