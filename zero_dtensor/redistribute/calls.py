"""The redistribution calls: ``to_dtensors`` / ``set_dtensors_``, ``owned`` / ``set_owned_``, ``map_full_``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import compress
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..comm import collectives, process_groups
from ..comm.agreement import Refusal, agree_on, error_code, local_only, raise_outcome
from ..layout.flat import ParamLayout
from ..core.storage import FlatStorage
from ..comm.dtensor_new import from_specs
from .checks import check_dtensor, check_full, build_dtensor, agreement_groups, mapping_names, slot_specs
from .exchange import my_rank, read_targets, write_targets
from .assignment import check_owner_entry
from .plan import OWNERS, Plan, ROWS, plan_for


def to_dtensors(storage: FlatStorage, selected: Sequence[ParamLayout], *, dtype: torch.dtype | None = None
                ) -> dict[str, DTensor]:
    """Every selected parameter's gradient as a ``Shard(0)`` DTensor of its shape (0-d: ``Replicate``) on a 1-D mesh
    over its data-parallel process group; a snapshot (true units, ``dtype``). **Collective**: one
    ``all_to_all_single`` per (process group, dtype) of sharded groups (none for replicated groups or where the
    stored pieces already are the rows), about ``(N-1)/N · S/N`` bytes sent and received per rank."""
    plan = plan_for(storage, selected, ROWS)
    result: dict[str, DTensor] = {}
    shard, replicate = Shard(0), Replicate()
    for bucket, views in read_targets(storage, plan, dtype):
        if not views:
            continue
        mesh = collectives.mesh_for(storage.process_groups[bucket.groups[0]], views[0].device.type)
        specs = slot_specs(bucket, mesh, views[0].dtype)
        if specs is not None:  # the specs of a cached plan: no per-tensor spec lookup
            result.update(zip(bucket.present[0], from_specs(views, specs)))
            continue
        for slot, local in zip(bucket.params, views):
            result[slot.name] = build_dtensor(local, mesh, replicate if slot.replicate else shard, slot)
    if len(plan.buckets) == 1:  # one bucket holds the selection in its order
        return result
    return {p.name: result[p.name] for p in selected}


def checked_dtensors(storage: FlatStorage, selected: Sequence[ParamLayout], mapping: Mapping[str, Any]
                     ) -> dict[str, torch.Tensor]:
    """This rank's local shards of ``set_dtensors_``'s entries, each checked (DTensor type, mesh over the group's
    ranks, placement, global shape, dtype, this rank's local shard shape, device); raises at the first bad one.
    No communication."""
    plan = plan_for(storage, selected, ROWS)
    values: dict[str, torch.Tensor] = {}
    for bucket in plan.buckets:
        pg = storage.process_groups[bucket.groups[0]]
        for slot in bucket.params:
            values[slot.name] = check_dtensor(storage, slot, mapping[slot.name], pg)
    return values


def set_dtensors_(storage: FlatStorage, selected: Sequence[ParamLayout], values: Mapping[str, torch.Tensor]) -> None:
    """Write the local shards of ``Shard(0)`` DTensors (:func:`checked_dtensors`, agreed on every rank) back.
    **Collective**: one ``all_to_all_single`` per (process group, dtype), replicated groups included, about
    ``(N-1)/N · S/N`` bytes each way per rank (replicated: ``(N-1)/N · S`` received)."""
    write_targets(storage, plan_for(storage, selected, ROWS), values)
    storage.after_write([p.name for p in selected])


def owned(storage: FlatStorage, selected: Sequence[ParamLayout], assignment: Mapping[str, int], *,
          dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole gradients of the selected parameters ``assignment`` gives this rank (true units, ``dtype``); a
    snapshot. **Collective**: one ``all_to_all_single`` per (process group, dtype) of sharded groups: with the
    default owners, ZeRO-1/2 ranks send only the pieces of the parameters their partition boundaries cut (each
    owner's run lies mostly in its own partition), ZeRO-3 ranks about ``(N-1)/N · S/N`` bytes each way."""
    plan = plan_for(storage, selected, OWNERS, assignment)
    return _owned_views(storage, plan, dtype)


def _owned_views(storage: FlatStorage, plan: Plan, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    result: dict[str, torch.Tensor] = {}
    for bucket, views in read_targets(storage, plan, dtype):
        names, mask = bucket.present
        result.update(zip(compress(names, mask), compress(views, mask)))
    if len(plan.buckets) == 1:  # one bucket holds the selection in its order
        return result
    return {n: result[n] for n in plan.names if n in result}


def _provided(storage: FlatStorage, mapping: Any, restrict: Mapping[str, int] | None) -> dict[str, torch.Tensor]:
    """This rank's ``set_owned_`` entries, each checked; raises at the first bad one. No communication."""
    values: dict[str, torch.Tensor] = {}
    names = mapping_names(mapping, "set_owned_")
    me = my_rank(storage)
    for name in names:
        param = storage.layout.by_name.get(name) if isinstance(name, str) else None
        if param is None:
            raise KeyError(f"set_owned_: {name!r} is not a trainable parameter of this engine")
        if restrict is not None and restrict.get(name) != me:
            owner = f"rank {restrict[name]}" if name in restrict else "not given"
            raise ValueError(f"set_owned_: rank {me} passed {name!r}, whose owner under owners= is {owner}: "
                             "pass each parameter on its owner only")
        values[name] = check_full(storage, "set_owned_", param, mapping[name])
    return values


def _restriction(storage: FlatStorage, assignment: Any) -> dict[str, int] | None:
    """``set_owned_``'s ``owners=``, checked (``None`` when not given). No communication."""
    if assignment is None:
        return None
    if not isinstance(assignment, Mapping):
        raise TypeError(f"owners= must be a mapping name -> global rank, got {type(assignment).__name__}")
    return {name: check_owner_entry(storage, name, rank) for name, rank in assignment.items()}


def set_owned_(storage: FlatStorage, mapping: Mapping[str, torch.Tensor], *,
               assignment: Mapping[str, int] | None = None) -> None:
    """Write whole gradients from the ranks holding them (each parameter from at most one rank; ``assignment``
    given: from its owner there). **Collective**: the rank agreement, which also tells every rank which rank passed
    which parameter (per multi-rank process group one ``all_gather`` of ``2 + k`` int64 per rank, ``k`` the
    group's parameters), then one ``all_to_all_single`` per (process group, dtype) where any piece crosses ranks,
    about ``(N-1)/N · S/N`` bytes each way per rank (replicated groups: the owner's values to every rank)."""
    values: dict[str, torch.Tensor] = {}
    restrict: dict[str, int] | None = None
    with Refusal() as refusal:
        restrict = _restriction(storage, assignment)
        values = _provided(storage, mapping, restrict)
    signature = () if refusal.error else (None if restrict is None else sorted(restrict.items()),)
    layout = storage.layout
    by_pg: dict[int, tuple[Any, list[ParamLayout]]] = {}  # id(process group) -> (it, its parameters in model order)
    for p in layout.params:
        pg = storage.process_groups[p.group]
        by_pg.setdefault(id(pg), (pg, []))[1].append(p)
    rows = agree_on(storage, "set_owned_", signature, agreement_groups(storage, None), refused=refusal.error,
                    payload=lambda pg: [int(p.name in values) for p in by_pg[id(pg)][1]])
    provider = _providers(storage, values, rows, by_pg)
    selection = [p.name for p in layout.params if p.name in provider]
    plan = plan_for(storage, [layout.by_name[n] for n in selection], OWNERS, provider)
    write_targets(storage, plan, values)
    storage.after_write(selection)


def _providers(storage: FlatStorage, values: Mapping[str, torch.Tensor], rows: Mapping[int, list[list[int]]],
               by_pg: Mapping[int, tuple[Any, list[ParamLayout]]]) -> dict[str, int]:
    """``{name: global rank that passed it}`` from the agreement's rows (the same on every rank; per process group
    one ``(N, k)`` matrix of who passed what); a parameter passed by more than one rank raises ``ValueError`` on
    every rank. No communication."""
    provider: dict[str, int] = {}
    twice: list[str] = []
    for key, (pg, params) in by_pg.items():
        if key not in rows:  # a single-rank group: this rank alone
            provider.update({p.name: my_rank(storage) for p in params if p.name in values})
            continue
        passed = torch.tensor(rows[key], dtype=torch.int64)[:, 2:]  # (N, k): rank r passed parameter j
        counts, who = passed.sum(0).tolist(), passed.argmax(0).tolist()
        members = process_groups.group_ranks(pg)
        twice += [p.name for p, c in zip(params, counts) if c > 1]
        provider.update({p.name: members[w] for p, c, w in zip(params, counts, who) if c == 1})
    if twice:
        raise ValueError(f"set_owned_: {twice[:8]} were passed by more than one rank; pass each parameter on one "
                         "rank only (its owner: see grads.owners()). Nothing was written on any rank.")
    return provider


def map_full_(storage: FlatStorage, selected: Sequence[ParamLayout], assignment: Mapping[str, int],
              fn: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """``fn(name, whole gradient)`` on each parameter's owner, written back: each gradient computed once in the job.
    **Collective**: :func:`owned`'s ``all_to_all_single`` (none where nothing crosses ranks), then the reverse
    ``all_to_all_single`` per (process group, dtype) carrying one error code per peer besides the data: at most
    about ``2 · (N-1)/N · S/N`` bytes each way per rank in all. ``fn`` runs on the owner only and must not
    communicate. An exception in ``fn`` (or a bad result)
    on any rank raises on every rank before anything is written: there the original one, elsewhere
    :class:`~zero_dtensor.errors.RankFailedError` (or the same validation error class)."""
    plan = plan_for(storage, selected, OWNERS, assignment)
    mine = _owned_views(storage, plan, None)
    results: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        with local_only():
            for name, full in mine.items():
                param = storage.layout.by_name[name]
                results[name] = check_full(storage, "map_full_", param, fn(name, full))
    except Exception as exc:  # noqa: BLE001 - any failure of the user's function must reach every rank
        error = exc
    failed = write_targets(storage, plan, results, code=error_code(error))
    raise_outcome("map_full_", error, failed)
    storage.after_write([p.name for p in selected])
