"""Which rank owns each whole parameter: the balanced assignment and ``owners=`` given by the caller. No communication."""

from __future__ import annotations

import functools
import heapq
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..layout import FlatLayout, ParamLayout
from ..storage import FlatStorage
from .plan import PLAN_CACHE_SIZE, group_ranks_of, process_group_keys


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _balanced(layout: FlatLayout, names: tuple[str, ...], pg_keys: tuple[int, ...]) -> tuple[int, ...]:
    """Group rank per name: largest parameter first onto the least-loaded rank of its process group (ties: the
    earlier name in the selection, then the lower rank)."""
    params = [layout.by_name[n] for n in names]
    loads: dict[int, list[tuple[int, int]]] = {}
    owner = [0] * len(params)
    for j in sorted(range(len(params)), key=lambda j: (-params[j].numel, j)):
        key = pg_keys[params[j].group]
        heap = loads.get(key)
        if heap is None:
            heap = loads[key] = [(0, r) for r in range(layout.groups[params[j].group].world_size)]
        load, rank = heapq.heappop(heap)
        owner[j] = rank
        heapq.heappush(heap, (load + params[j].numel, rank))
    return tuple(owner)


def balanced_owners(storage: FlatStorage, selected: Sequence[ParamLayout]) -> dict[str, int]:
    """The default assignment: ``{name: global rank}``, deterministic from the layout and the selection, identical
    on every rank. No communication."""
    ranks = _balanced(storage.layout, tuple(p.name for p in selected), process_group_keys(storage))
    return {p.name: group_ranks_of(storage, p)[r] for p, r in zip(selected, ranks)}


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
