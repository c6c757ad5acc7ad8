"""Which rank owns each whole parameter: the balanced assignment and ``owners=`` given by the caller. No communication."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..layout.flat import FlatLayout, ParamLayout
from ..core.storage import FlatStorage
from .plan import NAME, PLAN_CACHE_SIZE, group_members, group_ranks_of, process_group_keys


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _balanced(layout: FlatLayout, names: tuple[str, ...], pg_keys: tuple[int, ...]) -> tuple[int, ...]:
    """Group rank per name: per process group, its selected parameters in buffer order (flat group, then offset)
    cut into one contiguous run per rank, ascending, balanced by size: a parameter goes to the rank whose equal
    share of the group's running total holds the parameter's middle element. No rank exceeds its share by more
    than the largest parameter. Contiguous runs are what ZeRO stores contiguously: a ZeRO-1/2 rank then sends
    each owner one run of its partition, and a ZeRO-3 rank its pieces of one run of parameters (no packing)."""
    params = [layout.by_name[n] for n in names]
    by_pg: dict[int, list[int]] = {}
    for j in sorted(range(len(params)), key=lambda j: (params[j].group, params[j].offset, j)):
        by_pg.setdefault(pg_keys[params[j].group], []).append(j)
    owner = [0] * len(params)
    for members in by_pg.values():
        world = layout.groups[params[members[0]].group].world_size
        total = sum(params[j].numel for j in members)
        before = 0
        for j in members:
            middle = 2 * before + params[j].numel  # twice the middle element's position: integers only
            owner[j] = min(world - 1, middle * world // (2 * total)) if total else 0
            before += params[j].numel
    return tuple(owner)


def balanced_owners(storage: FlatStorage, selected: Sequence[ParamLayout]) -> dict[str, int]:
    """The default assignment: ``{name: global rank}``, deterministic from the layout and the selection, identical
    on every rank. No communication."""
    names = tuple(map(NAME, selected))
    return dict(zip(names, _balanced_global(storage.layout, names, process_group_keys(storage),
                                            group_members(storage))))


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _balanced_global(layout: FlatLayout, names: tuple[str, ...], pg_keys: tuple[int, ...],
                     members: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """:func:`_balanced` as global ranks (``members``: per flat group, its members' global ranks). Cached."""
    ranks = _balanced(layout, names, pg_keys)
    return tuple([members[layout.by_name[n].group][r] for n, r in zip(names, ranks)])


def _as_rank(name: str, rank: Any) -> int:
    """A global rank given as any integer: ``int``, a NumPy integer, a 0-d integer tensor (``operator.index``
    accepts the first two; a tensor is read once). ``TypeError`` for bools, floats and anything else."""
    if isinstance(rank, torch.Tensor) and rank.ndim == 0 and not rank.is_floating_point() \
            and not rank.is_complex() and rank.dtype != torch.bool:
        return int(rank.item())
    if not isinstance(rank, bool):
        try:
            return operator.index(rank)
        except TypeError:
            pass
    raise TypeError(f"owners=: the owner of {name!r} must be a global rank (an integer: int, a NumPy integer or a "
                    f"0-d integer tensor), got {type(rank).__name__}")


def check_owner_entry(storage: FlatStorage, name: str, rank: Any) -> int:
    param = storage.layout.by_name.get(name) if isinstance(name, str) else None
    if param is None:
        raise KeyError(f"owners=: {name!r} is not a trainable parameter of this engine")
    rank = _as_rank(name, rank)
    members = group_ranks_of(storage, param)
    if rank not in members:
        raise ValueError(f"owners=: the owner of {name!r} is rank {rank}, which is not in its data-parallel process "
                         f"group (global ranks {list(members)})")
    return int(rank)


def owners(storage: FlatStorage, selected: Sequence[ParamLayout], given: Mapping[str, int] | None = None
           ) -> dict[str, int]:
    """``{name: global owner rank}`` for ``selected``: ``given`` (validated: every selected name present, each a
    member rank of the parameter's process group, no unknown names) or :func:`balanced_owners`. No communication."""
    if given is None:
        return balanced_owners(storage, selected)
    if not isinstance(given, Mapping):
        raise TypeError(f"owners= must be a mapping name -> global rank (e.g. grads.owners()), got "
                        f"{type(given).__name__}")
    checked = {name: check_owner_entry(storage, name, rank) for name, rank in given.items()}
    missing = [p.name for p in selected if p.name not in checked]
    if missing:
        raise KeyError(f"owners= gives no rank for {missing[:8]}{' …' if len(missing) > 8 else ''}: give one for "
                       "every selected parameter (grads.owners(names) is a complete starting point)")
    return {p.name: checked[p.name] for p in selected}
