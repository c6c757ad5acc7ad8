"""Full (unsharded) gradients from ZeRO partitions: bulk (:func:`full_tensors`) and streaming (:func:`iter_full`).

Both are reached through :meth:`ShardedGrads.full_tensors` / :meth:`ShardedGrads.iter_full`; this module holds the
gathering, unpacking and strategy logic. Everything here is **collective**: every rank of a group's data-parallel
process group must make the same calls with the same arguments, in the same order.

Notation in the docstrings: ``N`` ranks in a group's process group, ``S`` the bytes of the padded flat buffers being
materialized, in the dtype DeepSpeed stores them (the gradient-accumulation dtype). "Bytes per rank" follows the
usual ring model (nccl-tests ``PERFORMANCE.md``): all_gather and reduce-scatter move ``(N-1)/N·S``, all_reduce
``2(N-1)/N·S``, broadcast/reduce ``S``; a gather sends ``S/N`` from every rank and delivers ``(N-1)/N·S`` to the root.

Two ways to turn partitions into full buffers (``strategy``):

``"all_gather"``
    one ``all_gather`` of the equal-size partitions per (process group, dtype, device), coalesced over the flat groups
    that share them: ``(N-1)/N·S`` bytes per rank. The default on NCCL.
``"all_reduce"``
    each rank writes its partition into a zeroed full-size buffer, then one sum ``all_reduce`` of that buffer:
    ``2(N-1)/N·S`` bytes per rank, plus a memset of ``S``. Exact (every element has exactly one non-zero
    contributor; ``x + 0 == x`` in every float format). On gloo it is often *faster* than all_gather (gloo's
    all_gather is slow), and for ZeRO-3 it writes straight into parameter order, which skips the strided unpack.
``"auto"``
    the pinned strategy if one is set (:func:`set_gather_strategy` or the ``ZERO_DTENSOR_GATHER_STRATEGY``
    environment variable), else ``all_gather`` on every backend but gloo; on gloo both are measured once per
    (process group, device, dtype, power-of-two size bucket) and the faster one is cached (see :func:`calibrate`).
    Buckets under ``CALIBRATION_MIN_BYTES`` (1 MiB) are not measured and use all_gather.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from .collectives import (
    _all_gather_single,
    all_gather_into,
    comm_device,
    all_reduce_sum_work,
    gather_to,
    max_across,
    reduce_sum_to,
)
from .layout import GroupLayout, Packing, ParamLayout

if TYPE_CHECKING:
    from .sharded import ShardedGrads

__all__ = [
    "CALIBRATION_COLLECTIVES",
    "DEFAULT_BUCKET_BYTES",
    "ENV_STRATEGY",
    "FullGrads",
    "FullTensorsHandle",
    "STRATEGIES",
    "calibrate",
    "clear_calibration",
    "full_tensors",
    "gather_flat_groups",
    "gather_strategy",
    "iter_full",
    "plan_windows",
    "release_workspace",
    "set_gather_strategy",
    "strategy_decisions",
    "unpack",
]

STRATEGIES = ("auto", "all_gather", "all_reduce")
ENV_STRATEGY = "ZERO_DTENSOR_GATHER_STRATEGY"
DEFAULT_BUCKET_BYTES = 64 * 2**20
#: Collectives one calibration issues: 3 timed all_gathers + 3 timed all_reduces of the bucket's size (capped at
#: ``CALIBRATION_MAX_BYTES``) + 1 ``all_reduce(MAX)`` of the two timings so that every rank takes the same decision.
CALIBRATION_COLLECTIVES = 7
CALIBRATION_MAX_BYTES = 128 * 2**20
#: Below this size ``auto`` does not calibrate and uses all_gather (fewer bytes): small transfers are latency-bound,
#: their timings are noise, and calibrating would cost more than any choice could save.
CALIBRATION_MIN_BYTES = 2**20

_PINNED: str | None = None
_DECISIONS: dict[tuple[Any, ...], str] = {}
_WORKSPACE: dict[tuple[Any, ...], torch.Tensor] = {}


#: Recycle the flat buffer of ``full_tensors()`` calls without ``out=`` once every tensor of the previous result is
#: gone (see :func:`full_tensors`). ``False`` allocates a fresh buffer on every call.
RECYCLE = True
_RECYCLED: dict[tuple[Any, ...], tuple[torch.Tensor, int]] = {}


# --- allocation (one place, so tests can account for every buffer this module allocates) -----------------------------
def _alloc(numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False) -> torch.Tensor:
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _recycled_or_new(key: tuple[Any, ...], numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The cached buffer for ``key`` if nothing but the cache refers to its memory any more (every tensor of the
    result it was handed out in is gone), else a new one (cached when the slot is empty)."""
    entry = _RECYCLED.get(key)
    if entry is not None:
        buf, idle_refs = entry
        if _storage_refs(buf) == idle_refs:
            return buf
        return _alloc(numel, dtype, device)  # still in use by a live result: do not cache a second one
    buf = _alloc(numel, dtype, device)
    if RECYCLE:
        _RECYCLED[key] = (buf, _storage_refs(buf))
    return buf


# --- strategy ------------------------------------------------------------------------------------------------------
def _check_strategy(strategy: str | None, *, allow_none: bool = False) -> None:
    if strategy is None and allow_none:
        return
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def set_gather_strategy(strategy: str | None) -> None:
    """Pin what ``strategy="auto"`` means in this process (``None`` unpins; then the environment variable
    ``ZERO_DTENSOR_GATHER_STRATEGY`` applies, then calibration). Set it identically on every rank. No communication."""
    global _PINNED
    _check_strategy(strategy, allow_none=True)
    _PINNED = None if strategy == "auto" else strategy


def gather_strategy() -> str:
    """The pinned strategy (setter first, then ``ZERO_DTENSOR_GATHER_STRATEGY``), or ``"auto"``. No communication."""
    if _PINNED is not None:
        return _PINNED
    env = os.environ.get(ENV_STRATEGY, "").strip() or "auto"
    _check_strategy(env)
    return env


def strategy_decisions() -> dict[tuple[Any, ...], str]:
    """Calibrated ``auto`` decisions so far: ``{(process group, device type, dtype, size bucket, ZeRO-3): strategy}``.
    No communication."""
    return dict(_DECISIONS)


def clear_calibration() -> None:
    """Forget calibrated decisions (the next ``auto`` call on gloo measures again; call on every rank). No
    communication."""
    _DECISIONS.clear()


def release_workspace() -> None:
    """Free the buffers kept between calls: the gather buffers of ``out=`` calls with user-made dicts and the
    recycled buffers of calls without ``out=`` (see :meth:`ShardedGrads.full_tensors`). Live results stay valid.
    No communication."""
    _WORKSPACE.clear()
    _RECYCLED.clear()


def _size_bucket(nbytes: int) -> int:
    return max(int(nbytes), 1).bit_length()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


def calibrate(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, nbytes: int,
              unpack: bool = False) -> str:
    """Time both strategies at ``nbytes`` (capped at ``CALIBRATION_MAX_BYTES``) and return the faster.
    **Collective** (``CALIBRATION_COLLECTIVES`` = 7 collectives).

    Each rank times 3 all_gathers and 3 all_reduces (interleaved) on scratch buffers; with ``unpack`` (ZeRO-3,
    where only all_gather results need a strided copy into parameter order) the time of one local copy of the
    same size is added to all_gather's. The per-rank minimum of each is then maximized over the group in one
    ``all_reduce(MAX)``, so every rank takes the same decision. Scratch memory: about ``2·nbytes`` (capped),
    freed on return. Ties go to all_gather (fewer bytes).
    """
    world = dist.get_world_size(group)
    esize = torch.empty((), dtype=dtype).element_size()
    per_rank = max(1, min(int(nbytes), CALIBRATION_MAX_BYTES) // esize // world)
    full = torch.zeros(per_rank * world, dtype=dtype, device=device)
    part = full.narrow(0, 0, per_rank).clone()
    timings: dict[str, float] = {"all_gather": float("inf"), "all_reduce": float("inf")}
    for _ in range(3):
        t0 = time.perf_counter()
        _all_gather_single(full, part, group=group)
        _sync(device)
        t1 = time.perf_counter()
        dist.all_reduce(full, group=group)
        _sync(device)
        t2 = time.perf_counter()
        timings["all_gather"] = min(timings["all_gather"], t1 - t0)
        timings["all_reduce"] = min(timings["all_reduce"], t2 - t1)
    if unpack:
        copy = torch.empty_like(full)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            copy.copy_(full)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        timings["all_gather"] += best
        del copy
    ag, ar = max_across([timings["all_gather"], timings["all_reduce"]], group, device)
    return "all_reduce" if ar < ag else "all_gather"


def _explicit(strategy: str) -> str:
    """``strategy`` itself unless it is ``"auto"``, else the pinned one (``"auto"`` when none is pinned)."""
    return gather_strategy() if strategy == "auto" else strategy


def _resolve(strategy: str, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, nbytes: int,
             unpack: bool = False) -> str:
    chosen = _explicit(strategy)
    if chosen != "auto":
        return chosen
    if dist.get_backend(group) != "gloo" or nbytes < CALIBRATION_MIN_BYTES:
        return "all_gather"
    key = (group, device.type, dtype, _size_bucket(nbytes), unpack)
    decision = _DECISIONS.get(key)
    if decision is None:
        decision = _DECISIONS[key] = calibrate(group, device, dtype, nbytes, unpack)
    return decision


# --- results -------------------------------------------------------------------------------------------------------
class FullGrads(dict):
    """``{name: full gradient}`` as returned by :func:`full_tensors`; pass it back as ``out=`` to reuse its memory.

    Besides the tensors it keeps the flat gather buffers they were gathered into (``buffers``), so a later call with
    ``out=`` this dict gathers into the same memory: no allocation, and for ZeRO-1/2 in the stored dtype the
    entries *are* views of those buffers (no copy either).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles (e.g. to another process) as a plain dict: the gather buffers only serve reuse in this process.
        return (dict, (dict(self),))


class FullTensorsHandle:
    """Pending result of ``full_tensors(..., async_op=True)``. :meth:`wait` completes the collectives, unpacks and
    returns the dict (idempotent). The gradients must not be changed (no ``engine.step()``) before ``wait()``."""

    def __init__(self, works: list[Any], finish: Callable[[], dict[str, torch.Tensor]]) -> None:
        self._works = works
        self._finish: Callable[[], dict[str, torch.Tensor]] | None = finish
        self._result: dict[str, torch.Tensor] | None = None

    def is_completed(self) -> bool:
        """Whether every collective issued for this result has finished (non-blocking; no communication)."""
        return self._result is not None or all(w.is_completed() for w in self._works)

    def wait(self) -> dict[str, torch.Tensor]:
        """Wait for the collectives already issued (no new ones), unpack and return the dict (idempotent)."""
        if self._result is None:
            for work in self._works:
                work.wait()
            assert self._finish is not None
            self._result, self._finish, self._works = self._finish(), None, []
        return self._result


# --- plan ----------------------------------------------------------------------------------------------------------
@dataclass
class _Bucket:
    """Sharded flat groups that share a process group, dtype and device: they travel in one collective."""

    pg: dist.ProcessGroup
    dtype: torch.dtype
    device: torch.device
    groups: list[GroupLayout]
    partitions: list[torch.Tensor]
    strategy: str = ""
    offsets: dict[int, int] = field(default_factory=dict)  # group index -> start in the bucket buffer
    sizes: dict[int, int] = field(default_factory=dict)
    numel: int = 0

    @property
    def world(self) -> int:
        return self.groups[0].world_size

    @property
    def native_numel(self) -> int:
        return sum(g.flat_numel for g in self.groups)

    def param_order(self, group: GroupLayout) -> bool:
        """ZeRO-3 groups under all_reduce are laid out in parameter order (no strided unpack needed)."""
        return self.strategy == "all_reduce" and group.packing is Packing.CHUNKED

    def layout(self, grads: ShardedGrads) -> None:
        start = 0
        for g in self.groups:
            size = sum(p.numel for p in grads.layout.params_of(g.index)) if self.param_order(g) else g.flat_numel
            self.offsets[g.index], self.sizes[g.index] = start, size
            start += size
        self.numel = start

    def key(self) -> tuple[Any, ...]:
        return (self.pg, self.dtype, self.device, self.strategy, tuple(g.index for g in self.groups), self.numel)


def _plan(grads: ShardedGrads, group_indices: Sequence[int]) -> list[_Bucket]:
    storage = grads._storage
    buckets: dict[tuple[Any, ...], _Bucket] = {}
    for i in group_indices:
        group = grads.layout.groups[i]
        if group.replicated:
            continue
        part = grads._comm_partition(i)
        pg = storage.process_groups[i]
        key = (pg, part.dtype, part.device)
        if key not in buckets:
            buckets[key] = _Bucket(pg, part.dtype, part.device, [], [])
        buckets[key].groups.append(group)
        buckets[key].partitions.append(part)
    return list(buckets.values())


def _param_positions(grads: ShardedGrads, group: GroupLayout) -> dict[str, int]:
    """Start of each parameter in a parameter-order buffer of ``group`` (params in buffer-offset order)."""
    positions, pos = {}, 0
    for p in sorted(grads.layout.params_of(group.index), key=lambda q: q.offset):
        positions[p.name] = pos
        pos += p.numel
    return positions


def _fill_for_reduce(grads: ShardedGrads, bucket: _Bucket, buf: torch.Tensor) -> None:
    """Zero ``buf`` and write this rank's partitions at their global places (the all_reduce/reduce input)."""
    if any(bucket.param_order(g) for g in bucket.groups):
        buf.zero_()
    else:  # contiguous: the own partition is overwritten below, so zero only around it
        for group in bucket.groups:
            base, P = bucket.offsets[group.index], group.partition_numel
            buf.narrow(0, base, group.rank * P).zero_()
            after = base + (group.rank + 1) * P
            buf.narrow(0, after, base + group.flat_numel - after).zero_()
    for group, part in zip(bucket.groups, bucket.partitions):
        base = bucket.offsets[group.index]
        if bucket.param_order(group):
            positions = _param_positions(grads, group)
            for p in grads.layout.params_of(group.index):
                start, stop, offset = grads._fragments[p.name]
                if stop > start:
                    buf.narrow(0, base + positions[p.name] + start, stop - start).copy_(
                        part.narrow(0, offset, stop - start)
                    )
        else:
            buf.narrow(0, base + group.rank * group.partition_numel, group.partition_numel).copy_(part)


def _source(grads: ShardedGrads, bucket: _Bucket | None, buf: torch.Tensor | None, p: ParamLayout,
            positions: dict[int, dict[str, int]]) -> torch.Tensor:
    """Where parameter ``p``'s full values are after the collective: a contiguous view of ``p.shape``, or (ZeRO-3
    in native order) a strided ``(N, chunk)`` view whose first ``numel`` elements, row-major, are the values."""
    group = grads.layout.groups[p.group]
    if group.replicated:
        return grads._storage.partitions[p.group].narrow(0, p.offset, p.numel).view(p.shape)
    assert bucket is not None and buf is not None
    base = bucket.offsets[group.index]
    if bucket.param_order(group):
        if group.index not in positions:
            positions[group.index] = _param_positions(grads, group)
        return buf.narrow(0, base + positions[group.index][p.name], p.numel).view(p.shape)
    flat = buf.narrow(0, base, group.flat_numel)
    if group.packing is Packing.CHUNKED:
        return _chunk_rows(flat, group, p)
    return flat.narrow(0, p.offset, p.numel).view(p.shape)


def _chunk_rows(flat: torch.Tensor, group: GroupLayout, p: ParamLayout) -> torch.Tensor:
    """ZeRO-3: parameter ``p``'s ``(N, chunk)`` strided view of its group's gathered native-order flat buffer."""
    return flat.view(group.world_size, group.partition_numel).narrow(1, p.offset, p.chunk_numel)


def _is_rows(src: torch.Tensor, p: ParamLayout) -> bool:
    return src.shape != p.shape


def _copy_rows(target: torch.Tensor, rows: torch.Tensor, numel: int) -> None:
    """Unpack a ZeRO-3 ``(N, chunk)`` view (``torch.chunk`` pieces, zero-padded) into a contiguous target: at most
    two strided copies, no temporary."""
    flat = target.view(-1)
    chunk = rows.shape[1]
    if chunk == 0:
        return
    full_rows = numel // chunk
    if full_rows:
        flat.narrow(0, 0, full_rows * chunk).view(full_rows, chunk).copy_(rows.narrow(0, 0, full_rows))
    rest = numel - full_rows * chunk
    if rest:
        flat.narrow(0, full_rows * chunk, rest).copy_(rows[full_rows].narrow(0, 0, rest))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _write(target: torch.Tensor, src: torch.Tensor, p: ParamLayout, scale: float) -> None:
    """``target = true gradient`` (unscaled, cast to ``target.dtype``), bit-identical to ``ShardedGrads._finish``."""
    rows = _is_rows(src, p)
    if scale == 1.0:
        if rows:
            _copy_rows(target, src, p.numel)
        elif not _same_view(target, src):
            target.copy_(src)
        return
    if target.dtype == torch.float32:
        if rows:
            _copy_rows(target, src, p.numel)
        else:
            target.copy_(src)
        target.div_(scale)
        return
    tmp = torch.empty(p.shape, dtype=torch.float32, device=src.device)
    _write(tmp, src, p, 1.0)
    target.copy_(tmp.div_(scale))


def _target_dtype(grads: ShardedGrads, p: ParamLayout, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if grads.loss_scale != 1.0 else grads.layout.groups[p.group].dtype


def _validate_out(grads: ShardedGrads, params: list[ParamLayout], out: Any, dtype: torch.dtype | None) -> None:
    if not isinstance(out, MutableMapping):
        raise TypeError(f"out= must be a dict name -> tensor (e.g. a previous full_tensors result), got "
                        f"{type(out).__name__}")
    for p in params:
        t = out.get(p.name)
        if t is None:
            continue
        want = _target_dtype(grads, p, dtype)
        storage = grads._storage
        device = comm_device(storage.partitions[p.group], storage.process_groups[p.group], storage.device)
        if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != want or t.device != device:
            got = f"{type(t).__name__}" if not isinstance(t, torch.Tensor) else f"{tuple(t.shape)} {t.dtype} {t.device}"
            raise ValueError(f"out[{p.name!r}] must be a tensor of shape {tuple(p.shape)}, dtype {want} on {device}; "
                             f"got {got}")
        if not t.is_contiguous():
            raise ValueError(f"out[{p.name!r}] must be contiguous")
        if t.requires_grad:
            raise ValueError(f"out[{p.name!r}] requires grad; pass tensors that do not (e.g. t.detach())")


def _emit(grads: ShardedGrads, params: list[ParamLayout], sources: dict[str, torch.Tensor],
          result: MutableMapping[str, torch.Tensor], dtype: torch.dtype | None, reuse: bool) -> None:
    """Fill ``result`` with every requested parameter, in request order: existing entries (``out=``) are written in
    place; otherwise a view of the gathered buffer is used as is where possible (ZeRO-1/2, stored dtype, no loss
    scale), else one fresh block per output dtype holds the copies (one allocation, not one per parameter)."""
    scale = grads.loss_scale
    targets: dict[str, torch.Tensor] = {}
    fresh: dict[tuple[torch.dtype, torch.device], list[ParamLayout]] = {}
    for p in params:
        src = sources[p.name]
        want = _target_dtype(grads, p, dtype)
        existing = result.get(p.name) if reuse else None
        if existing is not None:
            _write(existing, src, p, scale)
            targets[p.name] = existing
        elif not _is_rows(src, p) and want == src.dtype and scale == 1.0 and not grads.layout.groups[p.group].replicated:
            targets[p.name] = src  # a view of a gather buffer this call allocated: already the caller's memory
        else:
            fresh.setdefault((want, src.device), []).append(p)
    for (want, device), todo in fresh.items():
        block = _alloc(sum(p.numel for p in todo), want, device)
        start = 0
        for p in todo:
            target = block.narrow(0, start, p.numel).view(p.shape)
            start += p.numel
            _write(target, sources[p.name], p, scale)
            targets[p.name] = target
    for p in params:
        result[p.name] = targets[p.name]


def gather_flat_groups(grads: ShardedGrads, wanted: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{group index: padded global flat buffer in native order}``. **Collective**: one all_gather per (process
    group, dtype, device), coalesced over its flat groups; replicated groups return their storage (no comm)."""
    flats: dict[int, torch.Tensor] = {}
    for i in wanted:
        if grads.layout.groups[i].replicated:
            flats[i] = grads._storage.partitions[i]
    for b in _plan(grads, wanted):
        b.strategy = "all_gather"
        b.layout(grads)
        buf = _alloc(b.numel, b.dtype, b.device)
        outs = [buf.narrow(0, b.offsets[g.index], g.flat_numel) for g in b.groups]
        all_gather_into(outs, b.partitions, b.pg)
        flats.update((g.index, o) for g, o in zip(b.groups, outs))
    return flats


def unpack(grads: ShardedGrads, flat: torch.Tensor, p: ParamLayout) -> torch.Tensor:
    """Parameter ``p``'s values (stored dtype, still scaled) from its group's native-order flat buffer: a view for
    contiguous packing, a copy (strided unpack) for ZeRO-3. No communication."""
    group = grads.layout.groups[p.group]
    if group.packing is Packing.CHUNKED and not group.replicated:
        target = _alloc(p.numel, flat.dtype, flat.device).view(p.shape)
        _copy_rows(target, _chunk_rows(flat, group, p), p.numel)
        return target
    return flat.narrow(0, p.offset, p.numel).view(p.shape)


# --- bulk ------------------------------------------------------------------------------------------------------------
def full_tensors(
    grads: ShardedGrads,
    names: Sequence[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    out: MutableMapping[str, torch.Tensor] | None = None,
    dst: int | None = None,
    async_op: bool = False,
    strategy: str = "auto",
) -> dict[str, torch.Tensor] | FullTensorsHandle:
    """See :meth:`zero_dtensor.ShardedGrads.full_tensors` (the documented entry point)."""
    grads._check_current()
    _check_strategy(strategy)
    params = grads._select(list(names) if names is not None else None)
    if out is not None:
        _validate_out(grads, params, out, dtype)
    wanted = sorted({p.group for p in params})
    if dst is not None:
        if not isinstance(dst, int) or isinstance(dst, bool) or not 0 <= dst < dist.get_world_size():
            raise ValueError(f"dst must be a global rank in [0, {dist.get_world_size()}), got {dst!r}")
        for i in wanted:
            try:
                dist.get_group_rank(grads._storage.process_groups[i], dst)
            except (ValueError, RuntimeError):
                raise ValueError(f"dst={dst} is not a member of the process group of flat group {i}") from None
    is_dst = dst is None or dist.get_rank() == dst

    buckets = _plan(grads, wanted)
    for b in buckets:
        nbytes = b.native_numel * b.partitions[0].element_size()
        if dst is not None:  # no calibration: it times all_gather/all_reduce, while dst= uses gather/reduce
            chosen = _explicit(strategy)
            b.strategy = "all_gather" if chosen == "auto" else chosen
        else:
            unpack = any(g.packing is Packing.CHUNKED for g in b.groups)
            b.strategy = _resolve(strategy, b.pg, b.device, b.dtype, nbytes, unpack)
        b.layout(grads)

    reuse = out is not None
    result: MutableMapping[str, torch.Tensor] = out if out is not None else FullGrads()
    own_buffers = result.buffers if isinstance(result, FullGrads) else _WORKSPACE
    buffers: dict[int, torch.Tensor] = {}
    works: list[Any] = []
    for n, b in enumerate(buckets):
        needs_buffer = is_dst or b.strategy == "all_reduce"
        buf = None
        if needs_buffer:
            key = b.key()
            buf = own_buffers.get(key) if reuse else None
            if buf is None:
                if reuse:
                    buf = _alloc(b.numel, b.dtype, b.device)
                else:  # a view, so that the returned dict itself pins the recycled memory while it lives
                    buf = _recycled_or_new(key, b.numel, b.dtype, b.device).view(-1)
                own_buffers[key] = buf
            buffers[n] = buf
        if b.strategy == "all_reduce":
            assert buf is not None
            _fill_for_reduce(grads, b, buf)
            if dst is None:
                works += all_reduce_sum_work(buf, b.pg, async_op=async_op)
            else:
                works += reduce_sum_to(buf, dist.get_group_rank(b.pg, dst), b.pg, async_op=async_op)
        elif dst is None:
            assert buf is not None
            outs = [buf.narrow(0, b.offsets[g.index], g.flat_numel) for g in b.groups]
            works += all_gather_into(outs, b.partitions, b.pg, async_op=async_op)
        else:
            for g, part in zip(b.groups, b.partitions):  # gather has no coalesced form: one per flat group
                lst = None
                if buf is not None:
                    lst = list(buf.narrow(0, b.offsets[g.index], g.flat_numel).view(g.world_size, -1).unbind(0))
                works += gather_to(part, lst, dist.get_group_rank(b.pg, dst), b.pg, async_op=async_op)

    def finish() -> dict[str, torch.Tensor]:
        if not is_dst:
            empty = FullGrads()
            if isinstance(result, FullGrads):
                empty.buffers = result.buffers
            return empty
        by_group = {g.index: (b, buffers.get(n)) for n, b in enumerate(buckets) for g in b.groups}
        positions: dict[int, dict[str, int]] = {}
        sources = {}
        for p in params:
            b, buf = by_group.get(p.group, (None, None))
            sources[p.name] = _source(grads, b, buf, p, positions)
        _emit(grads, params, sources, result, dtype, reuse)
        return result  # type: ignore[return-value]

    if async_op:
        return FullTensorsHandle(works, finish)
    return finish()


# --- streaming -------------------------------------------------------------------------------------------------------
def _span(group: GroupLayout, params: list[ParamLayout]) -> tuple[int, int]:
    """``[start, stop)`` of consecutive ``params``: the global flat window (contiguous packing) or the range of every
    rank's partition (chunked packing)."""
    last = params[-1]
    return params[0].offset, last.offset + (last.chunk_numel if group.packing is Packing.CHUNKED else last.numel)


@dataclass
class _Window:
    group: GroupLayout
    params: list[ParamLayout]
    strategy: str

    @property
    def start(self) -> int:
        return self.params[0].offset

    @property
    def stop(self) -> int:
        return _span(self.group, self.params)[1]


def _stream_strategy(strategy: str, group: dist.ProcessGroup, packing: Packing) -> str:
    chosen = _explicit(strategy)
    if chosen != "auto":
        return chosen
    if dist.get_backend(group) == "gloo":
        return "all_reduce"
    return "all_gather" if packing is Packing.CHUNKED else "all_reduce"


def _overlaps(group: GroupLayout, start: int, stop: int) -> list[tuple[int, int]]:
    """Per rank, the part ``[lo, hi)`` of global window ``[start, stop)`` that it holds (contiguous packing)."""
    P = group.partition_numel
    return [(max(start, r * P), max(min(stop, (r + 1) * P), max(start, r * P))) for r in range(group.world_size)]


def _window_cost(group: GroupLayout, strategy: str, params: list[ParamLayout]) -> int:
    """Elements this module allocates to materialize ``params`` (consecutive in the buffer) in one window."""
    start, stop = _span(group, params)
    if group.replicated:
        return stop - start  # one local copy of the window
    if group.packing is Packing.CHUNKED:
        numel = sum(p.numel for p in params)
        if strategy == "all_reduce":
            return numel
        return group.world_size * (stop - start) + numel  # the width includes skipped parameters
    if strategy == "all_reduce":
        return stop - start
    m = max(hi - lo for lo, hi in _overlaps(group, start, stop))
    return (group.world_size + 1) * m  # receive buffer N·m, plus a padded send buffer or a stitching temporary


def _windows(grads: ShardedGrads, params: list[ParamLayout], bucket_bytes: int, strategy: str) -> list[_Window]:
    windows: list[_Window] = []
    by_group: dict[int, list[ParamLayout]] = {}
    for p in params:
        by_group.setdefault(p.group, []).append(p)
    for gi in sorted(by_group):
        group = grads.layout.groups[gi]
        ordered = sorted(by_group[gi], key=lambda q: q.offset)
        how = "none" if group.replicated else _stream_strategy(strategy, grads._storage.process_groups[gi],
                                                                 group.packing)
        esize = grads._storage.partitions[gi].element_size()
        limit = max(1, bucket_bytes // esize)
        current: list[ParamLayout] = []
        for p in ordered:
            if current and _window_cost(group, how, current + [p]) > limit:
                windows.append(_Window(group, current, how))
                current = []
            current.append(p)
        if current:
            windows.append(_Window(group, current, how))
    return windows


def _materialize_window(grads: ShardedGrads, w: _Window) -> dict[str, torch.Tensor]:
    """One collective; returns stored-dtype (still scaled) full tensors of the window's parameters."""
    storage = grads._storage
    group = w.group
    pg, rank, world = storage.process_groups[group.index], group.rank, group.world_size
    if group.replicated:  # one local copy of the window: results never alias DeepSpeed's storage
        start, stop = _span(group, w.params)
        window = storage.partitions[group.index].narrow(0, start, stop - start).clone()
        return {p.name: window.narrow(0, p.offset - start, p.numel).view(p.shape) for p in w.params}
    part = grads._comm_partition(group.index)
    if group.packing is Packing.CHUNKED:
        if w.strategy == "all_reduce":
            buf = _alloc(sum(p.numel for p in w.params), part.dtype, part.device, zero=True)
            views, pos = {}, 0
            for p in w.params:
                start, stop, offset = grads._fragments[p.name]
                if stop > start:
                    buf.narrow(0, pos + start, stop - start).copy_(part.narrow(0, offset, stop - start))
                views[p.name] = buf.narrow(0, pos, p.numel).view(p.shape)
                pos += p.numel
            all_reduce_sum_work(buf, pg)
            return views
        width = w.stop - w.start
        gathered = _alloc(world * width, part.dtype, part.device)
        all_gather_into([gathered], [part.narrow(0, w.start, width)], pg)
        rows = gathered.view(world, width)
        outs = {}
        for p in w.params:
            target = _alloc(p.numel, part.dtype, part.device).view(p.shape)
            _copy_rows(target, rows.narrow(1, p.offset - w.start, p.chunk_numel), p.numel)
            outs[p.name] = target
        return outs
    # contiguous: the global window [start, stop)
    start, stop, P = w.start, w.stop, group.partition_numel
    overlaps = _overlaps(group, start, stop)
    if w.strategy == "all_reduce":
        buf = _alloc(stop - start, part.dtype, part.device, zero=True)
        lo, hi = overlaps[rank]
        if hi > lo:
            buf.narrow(0, lo - start, hi - lo).copy_(part.narrow(0, lo - rank * P, hi - lo))
        all_reduce_sum_work(buf, pg)
    else:
        m = max(hi - lo for lo, hi in overlaps)
        lo, hi = overlaps[rank]
        if hi - lo == m:
            send = part.narrow(0, lo - rank * P, m)
        else:
            send = _alloc(m, part.dtype, part.device, zero=True)
            if hi > lo:
                send.narrow(0, 0, hi - lo).copy_(part.narrow(0, lo - rank * P, hi - lo))
        recv = _alloc(world * m, part.dtype, part.device)
        all_gather_into([recv], [send], pg)
        del send
        # stitch in place: piece r moves left from r*m to lo_r - start (a temporary only where source and
        # destination overlap)
        for r, (lo, hi) in enumerate(overlaps):
            n, at = hi - lo, lo - start
            if n and at != r * m:
                piece = recv.narrow(0, r * m, n)
                if at + n > r * m:
                    tmp = _alloc(n, part.dtype, part.device)
                    piece = tmp.copy_(piece)
                recv.narrow(0, at, n).copy_(piece)
                piece = tmp = None  # noqa: F841 - free the temporary now
        buf = recv.narrow(0, 0, stop - start)
        del recv
    return {p.name: buf.narrow(0, p.offset - start, p.numel).view(p.shape) for p in w.params}


def iter_full(
    grads: ShardedGrads,
    names: Sequence[str] | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    strategy: str = "auto",
) -> Iterator[tuple[str, torch.Tensor]]:
    """See :meth:`zero_dtensor.ShardedGrads.iter_full` (the documented entry point)."""
    grads._check_current()
    _check_strategy(strategy)
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    params = grads._select(list(names) if names is not None else None)
    windows = _windows(grads, params, bucket_bytes, strategy)
    return _stream(grads, windows, dtype)


def _stream(grads: ShardedGrads, windows: list[_Window], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    for w in windows:
        grads._check_current()
        full = _materialize_window(grads, w)
        for p in w.params:
            value = grads._finish(full.pop(p.name), dtype)
            yield p.name, value
            del value
        del full


def plan_windows(grads: ShardedGrads, names: Sequence[str] | None = None, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, strategy: str = "auto") -> list[dict[str, Any]]:
    """The buckets :func:`iter_full` would use (for tests and the benchmark): per bucket its flat group, strategy,
    parameter names and the elements this module allocates for it. No communication."""
    params = grads._select(list(names) if names is not None else None)
    out = []
    for w in _windows(grads, params, bucket_bytes, strategy):
        cost = _window_cost(w.group, w.strategy, w.params)
        out.append({"group": w.group.index, "strategy": w.strategy, "names": [p.name for p in w.params],
                    "elements": cost, "collectives": 0 if w.group.replicated else 1})
    return out
