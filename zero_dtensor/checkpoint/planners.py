"""DCP planners that serialize each distinct small value once.

torch's flattened optimizer format has one ``param_groups.<fqn>.<hyperparameter>`` entry per parameter and
hyperparameter (11 per parameter for AdamW): thousands of tiny pickled entries holding a few distinct values (one
``lr``, one ``betas``, ... per parameter group). DCP's default planners ``torch.save`` each entry at save and
``torch.load`` each at load (a fraction of a millisecond each: 0.05-0.1 s per call for 1,122 entries). These
planners do the same work once per distinct value: the bytes written are exactly ``torch.save``'s (deterministic
for equal values), so any DCP reader, torch's own included, reads them back unchanged.

A save planner given a ``plan_key`` also uses DCP's plan cache (``enable_plan_caching``): a rank whose plan has
not changed since its last save sends an empty plan, and the coordinator reuses the global plan and metadata it
made then. DCP compares a cached plan by names, sizes and boxes only, so :func:`plan_key` adds what it does not
compare (the process group's ranks, every entry's dtype and kind); the caches stay for the life of the process, one
per key. Where the coordinator has no cache but another rank sends an empty plan (a coordinator that restarted while
the others kept their caches), DCP's global planning cannot work (torch 2.13 fails with a ``TypeError``):
:class:`CachingSavePlanner` refuses that with :class:`PlansNotCachedError`, and :func:`forget_plans` lets every rank
drop its cache before a full replan. :class:`CachingLoadPlanner` also builds DCP's local load plan without DCP's
runtime-protocol check per tensor. Nothing here communicates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_from_tensor,
    _create_read_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.tensor import DTensor

from .binding import is_binding

__all__ = ["CachingLoadPlanner", "CachingSavePlanner", "PlansNotCachedError", "SmallObjects", "forget_plans",
           "plan_key"]

#: values cached by content: immutable, with a ``repr`` that identifies them (``bool`` and ``int`` kept apart by type)
_SCALARS = (bool, int, float, str, type(None))
#: entries larger than this are not cached at load (small pickles only)
_MAX_CACHED_BYTES = 1 << 16


def _key(value: Any) -> tuple[Any, ...] | None:
    """A cache key that equals only for values ``torch.save`` writes identically; ``None``: do not cache."""
    if isinstance(value, _SCALARS):
        return (type(value), repr(value))
    if isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value):
        return (tuple, tuple((type(v), repr(v)) for v in value))
    return None


def _immutable(value: Any) -> bool:
    return _key(value) is not None


#: the start of every plan-cache key made here (DCP's caches are shared by every planner in the process)
_KEY_PREFIX = "zero_dtensor:"
#: DCP's class-level plan caches, by key
_PLAN_CACHES = ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
                "_cached_metadata")


class PlansNotCachedError(RuntimeError):
    """The coordinator has no cached plans for a key for which another rank sent an empty (cached) plan."""


def plan_key(entries: Mapping[str, Mapping[str, Any]], group_ranks: Sequence[int]) -> str:
    """A plan-cache key for saving ``entries`` (sections of name -> value, the same on every rank: DTensors by
    their global shape) over the ranks ``group_ranks``: equal only where the group, the names, and every entry's
    kind, dtype and shape are equal."""
    digest = hashlib.blake2b(repr(tuple(group_ranks)).encode(), digest_size=16)
    for section, values in entries.items():
        for name, value in values.items():
            digest.update(f"\0{section}.{name}:{_look(value)}".encode())
    return _KEY_PREFIX + digest.hexdigest()


def _look(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} {value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def forget_plans(key: str) -> None:
    """Drop this process's cached plans for ``key`` (its next save with it plans in full)."""
    for cache in _PLAN_CACHES:
        getattr(SavePlanner, cache, {}).pop(key, None)


class CachingSavePlanner(DefaultSavePlanner):
    """:class:`DefaultSavePlanner` whose bytes entries of equal scalars / tuples of scalars are serialized once per
    save (``torch.save``; other objects as the default planner does), and which reuses this process's plans of the
    last save with ``plan_key`` where no rank's plan changed (module docstring). Memory: one pickle per distinct
    value; per key, this rank's plans and (coordinator) every rank's, for the life of the process."""

    def __init__(self, *args: Any, plan_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, enable_plan_caching=plan_key is not None, **kwargs)
        if plan_key is not None:
            self._cached_plans_key = plan_key
        self._bytes: dict[tuple[Any, ...], bytes] = {}
        self._save_id: str | None = None  # this save's, from its plan (:meth:`finish_plan`)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        cached = self._cached_plans_key in SavePlanner._cached_all_plans
        if self._enable_plan_caching and not cached and not all(plan.usable for plan in all_plans):
            raise PlansNotCachedError(f"the coordinator holds no cached plans for {self._cached_plans_key} but "
                                      "other ranks sent empty plans: every rank drops its cache and plans again")
        return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """DCP's, keeping the storage data of the plan this save was sent (where a cached plan is reused, DCP's
        keeps the cached plan's): it carries this save's ``save_id`` (:class:`~.binding.BoundPrefix`)."""
        plan = super().finish_plan(new_plan)
        if new_plan.storage_data is not None and plan.storage_data is not new_plan.storage_data:
            plan = self.plan = dataclasses.replace(plan, storage_data=new_plan.storage_data)
        self._save_id = getattr(new_plan.storage_data, "save_id", None)
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        """DCP's, but a ``save_id`` entry (:func:`~.binding.bind`) holds this save's ``save_id``: the one the
        coordinator's writer records in ``.metadata``, sent with the plan (:class:`~.binding.BoundPrefix`)."""
        if write_item.type == WriteItemType.BYTE_IO and is_binding(write_item.index.fqn):
            save_id = self._save_id
            if save_id is None:
                raise AssertionError("a save_id entry is written only with zero_dtensor's DirectWriter (its plan "
                                     "carries the save_id)")
            return self.transform_object(write_item, save_id)
        return super().resolve_data(write_item)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - torch's signature
        key = _key(object) if write_item.type == WriteItemType.BYTE_IO else None
        if key is None:
            return super().transform_object(write_item, object)
        data = self._bytes.get(key)
        if data is None:
            buffer = io.BytesIO()
            torch.save(object, buffer)
            data = self._bytes[key] = buffer.getvalue()
        return io.BytesIO(data)


class SmallObjects:
    """Bytes entries unpickled (``torch.load``, as DCP's load planner does) once per distinct content: identical
    bytes are identical pickles, and only immutable results (scalars, tuples of scalars) are shared. Memory: one
    object per distinct entry."""

    def __init__(self) -> None:
        self._objects: dict[bytes, Any] = {}

    def load(self, data: bytes) -> Any:
        """The object pickled in ``data`` (a new one where it is mutable or large)."""
        found = self._objects.get(data)
        if found is not None or data in self._objects:
            return found
        loaded = torch.load(io.BytesIO(data), weights_only=False)
        if len(data) <= _MAX_CACHED_BYTES and _immutable(loaded):
            self._objects[data] = loaded
        return loaded


class CachingLoadPlanner(DefaultLoadPlanner):
    """:class:`DefaultLoadPlanner` that unpickles each distinct small bytes entry once per load
    (:class:`SmallObjects`), and plans a state dict of DTensors, plain tensors and bytes entries without DCP's
    per-tensor runtime-protocol check (:meth:`create_local_plan`, :meth:`lookup_tensor`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.objects = SmallObjects()

    def create_local_plan(self) -> LoadPlan:
        """DCP's default local load plan, built as ``create_default_local_load_plan`` builds it, where every key of
        the (flattened) state dict is in the checkpoint and every value is a DTensor, a plain ``torch.Tensor``, or
        read from a bytes entry: the same read items, without DCP's ``isinstance`` check of each tensor against its
        runtime-checkable protocol (``_is_checkpointable_tensor``: tens of microseconds each on Python 3.11, some
        600 per load of a ZeRO-3 engine) and without its second flattening of the state dict to tell a pre-2.4
        checkpoint's keys (no key is missing here). Any other state dict: DCP's own."""
        if self.metadata is None:
            raise AssertionError("set_up_planner must run first")
        entries = self.metadata.state_dict_metadata
        requests: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = entries.get(fqn)
            if md is None:
                return super().create_local_plan()
            if isinstance(md, BytesStorageMetadata) and not isinstance(obj, torch.Tensor):
                requests += _create_read_items(fqn, md, obj)
            elif isinstance(md, TensorStorageMetadata) and (isinstance(obj, DTensor) or type(obj) is torch.Tensor):
                if md.size != obj.size():
                    raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
                if isinstance(obj, DTensor):  # DTensor's own chunk list, as DCP asks it
                    if obj.device_mesh.get_coordinate() is not None:
                        requests += _create_read_items(fqn, md, obj)
                else:
                    requests += create_read_items_for_chunk_list(fqn, md, [_create_chunk_from_tensor(obj)])
            else:
                return super().create_local_plan()
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """A plain tensor at offset zero as it is (DCP's lookup, without its protocol check); others as DCP finds
        them."""
        obj = self.state_dict.get(index.fqn)
        if type(obj) is torch.Tensor and (index.offset is None or not any(index.offset)):
            return obj
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self._set(read_item, self.objects.load(value.getvalue()))

    def _set(self, read_item: ReadItem, obj: Any) -> None:
        """Put a loaded object where :meth:`DefaultLoadPlanner.load_bytes` puts it (torch 2.13)."""
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
