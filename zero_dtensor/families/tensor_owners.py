"""Redistribution of every :class:`~zero_dtensor.families.tensors.ShardedTensors` family, as a mixin: per-parameter
``Shard(0)`` DTensors (``to_dtensors``/``set_dtensors_``) and whole tensors on owner ranks (``owners``, ``owned``,
``set_owned_``, ``map_full_``). The work is done by :mod:`zero_dtensor.redistribute`; costs are in each docstring
(about ``S/N`` bytes per rank instead of ``full_tensors``' ``(N-1)/N·S``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from .. import redistribute as _redistribute
from ..comm.agreement import Refusal, agree_on
from ..comm.signature import collective
from ..layout.flat import ParamLayout
from ..core.state import check_dtype
from ..core.storage import FlatStorage

__all__ = ["TensorOwners"]


class TensorOwners:
    """Redistribution of a sharded family (see the module docstring)."""

    if TYPE_CHECKING:
        _storage: FlatStorage

        def _check_current(self) -> None: ...

        def _select(self, names: Any) -> list[ParamLayout]: ...

        def _agree(self, what: str, selected: list[ParamLayout] | None, refused: Exception | None,
                   *signature: Any) -> None: ...

    @collective
    def to_dtensors(self, names: list[str] | None = None, *, dtype: torch.dtype | None = None) -> dict[str, DTensor]:
        """``{name: DTensor}``: each selected tensor (true units) with the parameter's shape, placement
        ``Shard(0)`` (rows split as ``torch.chunk`` splits them, as FSDP2 lays parameters out; a 0-d parameter,
        which ``Shard(0)`` cannot describe, is ``Replicate()``), on a 1-D ``DeviceMesh`` over its data-parallel
        process group. **Collective**: call on every rank with the same arguments.

        Communication: the rank agreement (one small collective per process group), then one
        ``all_to_all_single`` with uneven splits per (process group, stored dtype) for all selected parameters
        together, in the stored dtype: each rank sends the part of its fragments that other ranks' rows cover and
        receives the part of its rows that others store, about ``(N-1)/N · S/N`` bytes each way (``S`` the
        selected bytes; ``full_tensors`` receives ``(N-1)/N · S``). None for replicated groups (each rank slices its
        own rows) or where the stored pieces already are whole rows (ZeRO-3 when every row count divides by ``N``):
        the plan decides this from the layout alone, identically on every rank. Results are **snapshots** the caller
        owns (views into one buffer per process group, on the communication device), valid after ``engine.step()``;
        ``dtype`` casts after the exchange (one more buffer of the result's size). Memory and copies: the result
        once; each byte copied at most once locally on the rank that sends it and once on the rank that receives it
        (the own share once; under CPU offload the move to the accelerator is that copy); send and receive
        buffers only where a side cannot be a view, each at most what this rank sends and receives, kept between
        calls.
        """
        self._check_current()
        selected: list[ParamLayout] | None = None
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "to_dtensors")
        self._agree("to_dtensors", selected, refusal.error)
        return _redistribute.to_dtensors(self._storage, selected, dtype=dtype)

    @collective
    def set_dtensors_(self, mapping: Mapping[str, DTensor]) -> None:
        """Write ``Shard(0)`` DTensors shaped as :meth:`to_dtensors` returns them (true units, any floating dtype)
        back into DeepSpeed's storage. **Collective**: call on every rank with the same names.

        Every entry (name, DTensor type, mesh over the group's ranks, placement, global shape, dtype, this rank's
        local shard shape, device) is checked on every rank before anything is sent or written; a bad entry on any
        rank raises on every rank. Communication: the rank agreement (one small collective on the names in their
        order and every entry's global shape, dtype and placements; it carries any rank's refusal), then one ``all_to_all_single`` per (process group, dtype), the reverse of the read, about
        ``(N-1)/N · S/N`` bytes each way per rank (replicated groups too: every rank needs the whole new value,
        ``(N-1)/N · S`` received). Writes never record autograd history. Memory and copies: nothing of the data's
        size is allocated; the local shards are sent as they lie where they are one run in send order (as
        :meth:`to_dtensors` returns them), else packed once, and land in DeepSpeed's partitions straight from the
        exchange where they arrive in its order, else copied into place once.
        """
        self._check_current()
        selected: list[ParamLayout] | None = None
        storage = self._storage
        values: dict[str, torch.Tensor] = {}
        with Refusal() as refusal:
            selected = self._select(_redistribute.mapping_names(mapping, "set_dtensors_"))
            values = _redistribute.checked_dtensors(storage, selected, mapping)
        signature = () if refusal.error else ([p.name for p in selected],)
        agree_on(storage, "set_dtensors_", signature, _redistribute.agreement_groups(storage, selected),
                 refused=refusal.error)
        assert selected is not None  # a refusal raised above
        _redistribute.set_dtensors_(storage, selected, values)

    def owners(self, names: list[str] | None = None, *, owners: Mapping[str, int] | None = None) -> dict[str, int]:
        """``{name: global rank}`` that :meth:`owned` and :meth:`map_full_` give each selected parameter to. **No
        communication**: deterministic from the layout and the selection, identical on every rank; balanced by size
        (per process group, its selected parameters in buffer order cut into one contiguous run per rank, in rank
        order: a parameter goes to the rank whose equal share of the running total holds its middle element; no
        rank exceeds its share by more than the largest parameter).
        ``owners=`` (a complete mapping for the selection) is validated and returned instead.
        """
        self._check_current()
        return _redistribute.owners(self._storage, self._select(names), owners)

    @collective
    def owned(self, names: list[str] | None = None, *, owners: Mapping[str, int] | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``{name: whole tensor}`` (true units, the parameter's shape) of the selected parameters this rank owns
        (:meth:`owners`; ``owners=`` overrides); other ranks' parameters are absent. **Collective**: call on every
        rank with the same arguments.

        Communication: the rank agreement, then one ``all_to_all_single`` per (process group, stored dtype)
        of sharded groups: each rank sends its fragments of other owners' parameters and receives the rest of its
        own: with the default owners, ZeRO-1/2 ranks send only the parameters their partition boundaries cut (a
        rank's run of parameters lies mostly in its own partition, sent as it lies: no packing), ZeRO-3 ranks about
        ``(N-1)/N · S/N`` bytes each way. Replicated groups: none. Results are
        **snapshots** the caller owns, on the communication device. Memory and copies as :meth:`to_dtensors`: with
        the default owners a ZeRO-1/2 rank sends its run as it lies and receives straight into the result (no local
        copy); ZeRO-3 received chunks are copied into parameter order once.
        """
        self._check_current()
        selected: list[ParamLayout] | None = None
        assignment: dict[str, int] = {}
        with Refusal() as refusal:
            selected = self._select(names)
            check_dtype(dtype, "owned")
            assignment = _redistribute.owners(self._storage, selected, owners)
        self._agree("owned", selected, refusal.error, tuple(assignment.values()))
        return _redistribute.owned(self._storage, selected, assignment, dtype=dtype)

    @collective
    def set_owned_(self, mapping: Mapping[str, torch.Tensor], *, owners: Mapping[str, int] | None = None) -> None:
        """Write whole tensors (true units, the parameter's shape, any floating dtype) from the ranks that hold
        them, usually the (modified) result of :meth:`owned`: each rank passes its own, each parameter comes from
        at most one rank; with ``owners=`` every key must be owned by the passing rank. **Collective**: call on
        every rank (with its own mapping, possibly empty).

        Every entry is checked before anything is sent or written; a bad entry on any rank raises on every rank.
        Communication: the rank agreement, which also tells every rank which rank passed which parameter (one
        all_gather of ``2 + k`` int64 per rank and process group, ``k`` its parameters), then one
        ``all_to_all_single`` per (process group, dtype) where any piece crosses ranks, about ``(N-1)/N · S/N``
        bytes each way per rank (ZeRO-1/2 with the default owners: only the parameters the partition boundaries cut;
        replicated groups: the owner's values reach every rank). Writes never record autograd history. Memory and
        copies as :meth:`set_dtensors_` (the tensors :meth:`owned` returned, modified in place, are sent as they
        lie).
        """
        self._check_current()
        _redistribute.set_owned_(self._storage, mapping, assignment=owners)

    @collective
    def map_full_(self, fn: Callable[[str, torch.Tensor], torch.Tensor], names: list[str] | None = None, *,
                  owners: Mapping[str, int] | None = None) -> None:
        """Replace each selected tensor by ``fn(name, whole tensor)``, computed once in the job, on the
        parameter's owner (:meth:`owners`): :meth:`owned`, ``fn``, then the reverse exchange. ``fn`` gets true
        units in the stored dtype (float32 under fp16) and returns a tensor of the parameter's shape (any floating
        dtype). **Collective**: call on every rank with the same arguments.

        Communication: the rank agreement (on ``names``, ``owners`` and the owners they resolve to; not on
        ``fn``, whose outcome is agreed with the write), one ``all_to_all_single`` per (process group, dtype) each
        way (the
        first only where a piece crosses ranks; the second always, as it also carries one error code per peer):
        about ``(N-1)/N · S/N`` bytes each way per rank per exchange (ZeRO-1/2 with the default owners: only the
        parameters the partition boundaries cut). An exception in ``fn`` (or a result of the wrong shape or
        dtype) on any rank raises on every rank and nothing is written: the original exception where it happened,
        :class:`~zero_dtensor.errors.RankFailedError` elsewhere. ``fn`` runs on each parameter's owner only, so it
        must not communicate: a zero_dtensor collective inside it raises ``RuntimeError`` at once (compute with
        :meth:`owned` and write back with :meth:`set_owned_` where the computation needs other ranks). Memory and
        copies: :meth:`owned`'s, then the write's own share copied straight into place and the peers' pieces once
        into the framed send buffer and once out of the framed receive buffer (kept between calls).
        """
        self._check_current()
        storage = self._storage
        selected: list[ParamLayout] | None = None
        assignment: dict[str, int] = {}
        with Refusal() as refusal:
            selected = self._select(names)
            if not callable(fn):
                raise TypeError(f"map_full_ takes a function fn(name, full_tensor) -> tensor, got "
                                f"{type(fn).__name__}")
            assignment = _redistribute.owners(storage, selected, owners)
        signature = () if refusal.error else ([p.name for p in selected], tuple(assignment.values()))
        agree_on(storage, "map_full_", signature, _redistribute.agreement_groups(storage, selected),
                 refused=refusal.error)
        assert selected is not None  # a refusal raised above
        _redistribute.map_full_(storage, selected, assignment, fn)

