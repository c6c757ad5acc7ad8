"""``set_full_``: validate full tensors, then write each rank's fragments into DeepSpeed's storage. **No
communication.**

Validation runs over all values with C-level passes (types, ``numel``, dtypes, the first value's device); the
staging ``cat`` below checks every staged value's dimensions and device against its block's first value, whose
dimensions are checked against the block (so with the ``numel`` every value's exact shape); the values it does not
stage, and the per-parameter path's, are checked for shape and device in two more passes. A request of the same
names, shapes, dtypes and devices as the last one written (a training loop's every step) that reads values the
staging does not (ZeRO-1/2: the other ranks' parameters; the per-parameter path) is checked in two passes instead
(types; shape, dtype and device together). Only when something fails does a per-entry pass run, to name the first
bad entry. Every group is staged (or checked) before the first write: nothing is half-applied, and every rank
refuses a bad entry wherever it is, also one for a parameter the rank holds nothing of. A value that is a view of
the family's own memory (a partition, at any offset) is written as any other: staged values are copied before the
first write anyway, and a per-parameter-path value that aliases is copied first (so no rank raises alone for it).

Writing, per flat group (:class:`_RowWrite`, planned once per request and cached): the values of the parameters
this rank holds part of are staged in one buffer with one ``cat`` per trailing shape (values of shape ``(d, *rest)``
concatenated along dimension 0; 0-d values stacked), so reading 10,000 separate tensors costs a C++ loop of memcpys,
not 10,000 dispatches; the values of parameters it holds nothing of (ZeRO-1/2: most of the other ranks') are not
read. Then every fragment this rank holds moves from the staging buffer into the partition with one row copy
(:mod:`zero_dtensor.layout.rows`: one ``index_select``, plus an ``index_copy_`` for a subset, or one strided copy per run
family where the parameters repeat), casting to the stored dtype.
Under fp16 loss scaling the staged values are scaled in float32 first (one multiply: bit-identical to scaling each
value alone). The staging buffers (one per flat group) are kept between calls
(``zero_dtensor.materialize.release_workspace()`` frees them). Staging copies whole every value this rank holds part
of (ZeRO-1/2: about the bytes a rank keeps; ZeRO-3: every value, ``N`` times them), so it serves requests of small
parameters (under :data:`STAGE_BELOW` elements on average), where a dispatch per parameter costs more than the
bytes. Otherwise (large parameters, rows too narrow, values on several devices, over :data:`MAX_SHAPE_CLASSES`
trailing shapes) each value goes straight into its fragment (:mod:`.direct_write`): one ``torch.cat(..., out=)``
into the run of the partition the fragments form, else one ``_foreach_copy_`` into cached views of them. Writes never record autograd history.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..layout.flat import ParamLayout
from ..materialize.buffers import BUFFERS
from ..layout.plan import FlatPlan, GroupPlan
from ..layout.rows import RowMap, row_map
from ..core.state import FlatState, short_names
from ..core.storage import shares_memory
from .direct_write import write_direct

__all__ = ["CheckedValues", "check_shapes", "set_full_", "validate_full"]

_SHAPE = operator.attrgetter("shape")
_NAME = operator.attrgetter("name")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_NUMEL = operator.attrgetter("numel")
_META = operator.attrgetter("shape", "dtype", "device")


@dataclass(frozen=True)
class CheckedValues:
    """``mapping``'s entries in its order: the request (its names and parameters), the values, the values' dtypes.
    Checked: every type, ``numel`` and dtype, the first value's device; a value's exact shape and the other devices
    are checked by the write that uses them, before anything is written (:func:`set_full_`), unless ``exact``:
    every value's shape, dtype and device are those of a request of the same names that was written before."""

    request: _Request
    values: list[torch.Tensor]
    dtypes: frozenset[torch.dtype]
    devices: frozenset[torch.device]  # where values may be: the engine's device, where the gradient is stored
    exact: bool = False

    @property
    def names(self) -> list[str]:
        return self.request.names

    @property
    def params(self) -> list[ParamLayout]:
        return self.request.params


def _picked(pick: Callable[[list[torch.Tensor]], Any], values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``pick(values)`` as a list (an ``itemgetter`` of one index returns the item itself)."""
    picked = pick(values)
    return list(picked) if isinstance(picked, tuple) else [picked]


def validate_full(state: FlatState, mapping: Mapping[str, torch.Tensor]) -> CheckedValues:
    """The entries of ``mapping`` (see ``ShardedGrads.set_full_``), checked with three C-level passes over the
    values (type, ``numel``, dtype; the names' parameters come from the last request's when the names are the same;
    a request holding a tensor subclass such as ``nn.Parameter`` takes one more type pass, a Python ``isinstance``
    per value); the per-entry check runs only to name the first bad entry. When the names are the last request's and every
    value's shape, dtype and device are those it was written with (a training loop's every step), two passes
    (type; shape, dtype and device together) check everything."""
    if not isinstance(mapping, Mapping):
        raise TypeError(f"set_full_ takes a mapping name -> full gradient tensor, got {type(mapping).__name__}")
    storage = state.storage
    devices = frozenset({storage.device, *(p.device for p in storage.partitions)})
    names, values = list(mapping.keys()), list(mapping.values())
    request = _request(state, names)
    # plain tensors by one identity pass; tensor subclasses (``nn.Parameter``, ...) by ``isinstance`` only then
    types_ok = request is not None and (all(map(operator.is_, map(type, values), repeat(torch.Tensor)))
                                        or all(map(_full_tensor_type, values)))
    accepted = _ACCEPTED.get(request) if types_ok else None
    # compared one value at a time: a list of 10,000 new (shape, dtype, device) tuples would set off the garbage
    # collector several times per call (and survive into its older generations). A request whose every value is
    # staged needs no record: the passes below and the staging ``cat`` check everything, for less
    if (accepted is not None and accepted is not _ALL_STAGED
            and all(map(operator.eq, map(_META, values), accepted[0]))):
        return CheckedValues(request, values, accepted[1], devices, exact=True)
    if (types_ok
            and list(map(torch.Tensor.numel, values)) == request.numels
            and (not request.empty or all(v.shape == p.shape for v, p in zip(values, request.params) if not p.numel))
            and (not values or values[0].device in devices)):
        dtypes = frozenset(map(_DTYPE, values))
        if all(d.is_floating_point for d in dtypes):
            return CheckedValues(request, values, dtypes, devices)
    _name_bad_entry(state, names, values, devices)
    raise AssertionError("not reached: _name_bad_entry raised")


@dataclass(frozen=True, eq=False)
class _Request:
    """The parameters a ``set_full_`` request names, in its order, and how they fall into flat groups: made once
    per plan and set of names (a training loop sends the same names every step), so that a request of 10,000
    values costs no pass over parameter records. ``groups``: per flat group its index, its parameters, their
    names and a picker of their values from the request's (``None``: all of them, in order)."""

    names: list[str]
    params: list[ParamLayout]
    numels: list[int]
    empty: bool  # some parameter has no elements (staging's ``cat`` skips empty 1-D values: their shape is checked)
    groups: tuple[tuple[int, list[ParamLayout], tuple[str, ...], Callable[[list[Any]], Any] | None], ...]

    def grouped(self, values: list[torch.Tensor]) -> list[tuple[int, list[ParamLayout], tuple[str, ...],
                                                               list[torch.Tensor]]]:
        """``(group, params, names, values)`` per flat group."""
        out = []
        for g, params, names, pick in self.groups:
            if pick is None:
                mine = values
            else:
                mine = _picked(pick, values)
            out.append((g, params, names, mine))
        return out


_REQUESTS: weakref.WeakKeyDictionary[FlatPlan, _Request] = weakref.WeakKeyDictionary()
#: per request, the ``(shape, dtype, device)`` of every value it was last written with, and their dtypes
_ACCEPTED: weakref.WeakKeyDictionary[_Request, tuple[list[tuple[Any, ...]], frozenset[torch.dtype]]] = (
    weakref.WeakKeyDictionary())
#: the record of a request whose every value was staged (no value of it is checked apart from its ``cat``): a
#: repeated one takes the three ordinary passes, cheaper than comparing every value's shape, dtype and device
_ALL_STAGED: tuple[list[tuple[Any, ...]], frozenset[torch.dtype]] = ([], frozenset())


def _request(state: FlatState, names: list[Any]) -> _Request | None:
    """The :class:`_Request` of ``names`` (the last one of this plan when the names are the same), ``None`` when a
    name is not a parameter (or not hashable)."""
    plan = state.plan
    found = _REQUESTS.get(plan)
    if found is not None and found.names == names:
        return found
    try:
        params = list(map(state.layout.by_name.get, names))
    except TypeError:  # an unhashable key: named by the per-entry check
        return None
    if not all(map(operator.is_not, params, repeat(None))):
        return None
    members: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        members.setdefault(p.group, []).append(i)
    groups = []
    for g, idx in members.items():
        whole = len(members) == 1
        groups.append((g, params if whole else [params[i] for i in idx],
                       tuple(names) if whole else tuple(names[i] for i in idx),
                       None if whole else operator.itemgetter(*idx)))
    numels = list(map(_NUMEL, params))
    found = _REQUESTS[plan] = _Request(list(names), params, numels, 0 in numels, tuple(groups))
    return found


def _full_tensor_type(value: object) -> bool:
    """A value type ``set_full_`` takes: a ``torch.Tensor`` or a subclass (``nn.Parameter``), not a DTensor."""
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def _name_bad_entry(state: FlatState, names: list[Any], values: list[Any], devices: frozenset[torch.device]) -> None:
    """Raise for the first bad entry, in order (returns if there is none)."""
    for name, value in zip(names, values):
        _check_entry(state, name, value, devices)


def _check_entry(state: FlatState, name: object, value: object, devices: frozenset[torch.device]) -> None:
    param = state.layout.by_name.get(name) if isinstance(name, str) else None
    if param is None:
        raise KeyError(f"set_full_: {name!r} is not a trainable parameter of this engine; known: "
                       f"{short_names(state.layout.names)}")
    if not _full_tensor_type(value):
        raise TypeError(
            f"set_full_: value for {name!r} must be a full torch.Tensor of shape {tuple(param.shape)}, "
            f"got {type(value).__name__} (for a DTensor pass value.full_tensor())"
        )
    if value.shape != param.shape:
        raise ValueError(f"set_full_: value for {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"set_full_: value for {name!r} has dtype {value.dtype}, expected a floating dtype")
    if value.device not in devices:
        raise ValueError(
            f"set_full_: value for {name!r} is on {value.device}, expected one of "
            f"{sorted(str(d) for d in devices)} (the engine's device or where the gradient is stored)"
        )


def set_full_(state: FlatState, checked: CheckedValues) -> None:
    """Write validated values (true units) into this rank's fragments: every group's values staged (or, for the
    per-parameter path, their shapes and devices checked) first, then every group written."""
    with torch.no_grad():  # a value that requires grad must not give DeepSpeed's memory an autograd history
        staged: list[tuple[_RowWrite, torch.Tensor]] = []
        direct: list[tuple[GroupPlan, tuple[str, ...], list[torch.Tensor]]] = []
        for g, ps, names, vs in checked.request.grouped(checked.values):
            plan = state.plan.groups[g]
            write = (_row_write(plan, names, state.storage.partitions[g].element_size()) if len(vs) > 1
                     else None)
            buffer = write.stage(vs, checked.dtypes, checked.exact) if write is not None else None
            if write is not None and buffer is not None:
                staged.append((write, buffer))
            else:
                direct.append((plan, names, vs))
        if direct and not checked.exact:
            check_shapes(state, checked)
        if direct:
            direct = _unaliased(state, direct)
        for write, buffer in staged:  # nothing was written before this point
            write.commit(state, buffer)
        for plan, names, vs in direct:
            write_direct(state, plan, names, vs)
    if not checked.exact:  # every value passed: the next request of these names with these shapes needs no more
        all_staged = not direct and all(write.others is None for write, _ in staged)
        _ACCEPTED[checked.request] = (_ALL_STAGED if all_staged
                                      else (list(map(_META, checked.values)), checked.dtypes))
    state.storage.after_write(checked.names)


def _unaliased(state: FlatState, direct: list[tuple[GroupPlan, tuple[str, ...], list[torch.Tensor]]]
               ) -> list[tuple[GroupPlan, tuple[str, ...], list[torch.Tensor]]]:
    """The per-parameter path's values, each one that lies in the family's memory (a view of a partition, at any
    offset: :func:`~zero_dtensor.core.storage.shares_memory`, the redistribution writes' check) copied first, so that
    no write reads what another already overwrote (and ``copy_`` meets no partial overlap on the rank that has
    one); except a value that is exactly its own fragment (:func:`_in_own_place`), whose copy onto itself is
    allowed and reads nothing another write changes. Staged values need nothing: every group is staged before the
    first write. One C-level check per group; a copy only of the values that alias elsewhere."""
    partitions = state.storage.partitions
    if not any(shares_memory(vs, partitions) for _, _, vs in direct):
        return direct
    return [(plan, names, [v.clone() if shares_memory((v,), partitions) and not _in_own_place(state, n, v) else v
                           for n, v in zip(names, vs)])
            for plan, names, vs in direct]


def _in_own_place(state: FlatState, name: str, value: torch.Tensor) -> bool:
    """Whether ``value`` is exactly the memory of parameter ``name``'s whole fragment on this rank (a parameter this
    rank holds whole, ``value`` contiguous, starting where the fragment starts): writing it is a copy onto itself."""
    layout = state.layout
    param = layout.by_name[name]
    group = layout.groups[param.group]
    start, stop = param.rank_range(group, group.rank)
    if (start, stop) != (0, param.numel) or not value.is_contiguous() or value.numel() != param.numel:
        return False
    partition = state.storage.partitions[param.group]
    offset = param.local_offset(group, group.rank)
    return value.data_ptr() == partition.data_ptr() + offset * partition.element_size()


def check_shapes(state: FlatState, checked: CheckedValues) -> None:
    """Every value's exact shape and device (the per-parameter path's; staging checks them by concatenating)."""
    values = checked.values
    if not (all(map(operator.eq, map(_SHAPE, values), map(_SHAPE, checked.params)))
            and set(map(_DEVICE, values)) <= checked.devices):
        _name_bad_entry(state, checked.names, values, checked.devices)


@dataclass(frozen=True, eq=False)
class _ClassBlock:
    """The request's values of one trailing shape, concatenated along dimension 0 into ``numel`` elements at
    ``offset`` of the staging buffer (``shape`` ``None``: 0-d values, stacked)."""

    pick: Callable[[list[torch.Tensor]], Any]
    offset: int
    numel: int
    shape: tuple[int, ...] | None


@dataclass(frozen=True, eq=False)
class _OthersCheck:
    """The request's values of parameters this rank holds nothing of (it does not read their elements): their
    exact shapes, and their device, that of the staged values. Every rank checks every value, so that a bad entry is
    refused on every rank and no rank writes its part of a request another rank refuses."""

    pick: Callable[[list[torch.Tensor]], Any]
    shapes: list[torch.Size]

    def fits(self, values: list[torch.Tensor], device: torch.device) -> bool:
        """Two C-level passes (shapes, devices)."""
        picked = _picked(self.pick, values)
        return all(map(operator.eq, map(_SHAPE, picked), self.shapes)) and set(map(_DEVICE, picked)) == {device}


@dataclass(frozen=True, eq=False)
class _RowWrite:
    """The values of a request (names in request order) that this rank holds part of, staged class by class in
    one buffer, then moved into the partition by one row copy; the others' shapes checked (``others``)."""

    group: int
    blocks: tuple[_ClassBlock, ...]
    others: _OthersCheck | None
    numel: int
    rows: RowMap

    def stage(self, values: list[torch.Tensor], dtypes: frozenset[torch.dtype], exact: bool = False
              ) -> torch.Tensor | None:
        """This rank's values in one buffer (their promoted dtype, the first value's device): one ``cat`` per
        trailing shape (``stack`` for 0-d values), which also checks every staged value's dimensions and device
        against its block's; the other values' shapes and devices checked without reading them (not when
        ``exact``: already known). ``None`` when a value does not fit (a wrong shape, or values on several
        devices): the caller checks each entry then."""
        dtype = functools.reduce(torch.promote_types, dtypes)
        device = values[0].device
        if self.others is not None and not exact and not self.others.fits(values, device):
            return None
        # one kept buffer per group: every group of a request is staged before the first is written
        staged = BUFFERS.scratch(("set_full_ staging", self.group, device, dtype), self.numel, dtype, device)
        try:
            for block in self.blocks:
                picked = _picked(block.pick, values)
                region = staged.narrow(0, block.offset, block.numel)
                if block.shape is None:
                    if any(map(torch.Tensor.dim, picked)):  # stack would take equal non-0-d shapes too
                        return None
                    torch.stack(picked, out=region)
                else:
                    # cat checks every value's dimensions against the first's, and would resize its output to a
                    # shape they share rather than refuse it: the first value's are checked here
                    head = picked[0]
                    if head.dim() != len(block.shape) + 1 or head.shape[1:] != block.shape:
                        return None
                    torch.cat(picked, out=region.view(-1, *block.shape))
        except RuntimeError:
            return None
        return staged

    def commit(self, state: FlatState, staged: torch.Tensor) -> None:
        """One float32 multiply under loss scaling (bit-identical to scaling each value alone), one row copy
        (casting) into the partition."""
        if state.loss_scale != 1.0:
            staged = staged.to(torch.float32).mul_(state.loss_scale)
        self.rows.copy(staged, state.storage.partitions[self.group])


_ROW_WRITES: OrderedDict[tuple[GroupPlan, tuple[str, ...], int], _RowWrite | None] = OrderedDict()
_ROW_WRITES_KEPT = 16
#: a request with more distinct trailing shapes than this is written by the per-parameter path
MAX_SHAPE_CLASSES = 16
#: staging copies every value (``N``× the bytes a rank keeps): only for requests of parameters this small on average
#: (elements), where a dispatch per parameter costs more than the bytes
STAGE_BELOW = 4096


def _row_write(plan: GroupPlan, names: tuple[str, ...], element_size: int) -> _RowWrite | None:
    """The cached staging plan of ``names`` (request order) in ``plan``'s group (its partition of
    ``element_size``-byte elements), or ``None`` where the group's
    pieces are too narrow or too long for rows, the parameters are :data:`STAGE_BELOW` elements or more on average,
    or the request has over :data:`MAX_SHAPE_CLASSES` trailing shapes."""
    key = (plan, names, element_size)
    if key in _ROW_WRITES:
        _ROW_WRITES.move_to_end(key)
        return _ROW_WRITES[key]
    found = _ROW_WRITES[key] = _build_row_write(plan, names, element_size)
    if len(_ROW_WRITES) > _ROW_WRITES_KEPT:
        _ROW_WRITES.popitem(last=False)
    return found


def _build_row_write(plan: GroupPlan, names: tuple[str, ...], element_size: int) -> _RowWrite | None:
    positions = plan.positions
    ks = [positions[n] for n in names]
    mine = [i for i, k in enumerate(ks) if plan.frag_len[k]]  # request entries this rank holds part of
    classes: dict[tuple[int, ...] | None, list[int]] = {}
    for i in mine:
        shape = tuple(plan.params[ks[i]].shape)
        classes.setdefault(shape[1:] if shape else None, []).append(i)
    if (not mine or len(classes) > MAX_SHAPE_CLASSES
            or sum(plan.params[ks[i]].numel for i in mine) >= STAGE_BELOW * len(mine)):
        return None
    blocks: list[_ClassBlock] = []
    staged_at: dict[int, int] = {}  # where request entry i starts in the staging buffer
    at = 0
    for shape, members in classes.items():
        start = at
        for i in members:
            staged_at[i] = at
            at += plan.params[ks[i]].numel
        blocks.append(_ClassBlock(operator.itemgetter(*members), start, at - start, shape))
    src = [staged_at[i] + plan.frag_start[ks[i]] for i in mine]
    dst = [plan.frag_offset[ks[i]] for i in mine]
    lengths = [plan.frag_len[ks[i]] for i in mine]
    rows = row_map(src, dst, lengths, at, plan.group.partition_numel, element_size)
    if rows is None:
        return None
    held = set(mine)
    others = [i for i in range(len(ks)) if i not in held]
    check = (_OthersCheck(operator.itemgetter(*others), [plan.params[ks[i]].shape for i in others])
             if others else None)
    return _RowWrite(plan.index, tuple(blocks), check, at, rows)
