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
        """Each selected tensor as a DTensor of the parameter's shape, rows sharded as FSDP2 lays them out.

        Placement ``Shard(0)`` (rows split as ``torch.chunk`` splits them; a 0-d parameter is ``Replicate()``) on a 1-D
        mesh over the data-parallel group: works with ``torch.nn.utils.clip_grad_norm_``, DTensor math and DCP. Call on
        every rank with the same arguments.

        Args:
            names: a list of names, a predicate ``name -> bool``, or ``None`` for every parameter.
            dtype: result dtype (default: the stored dtype; float32 under fp16).

        Returns:
            dict[str, DTensor]: ``{name: DTensor}``, snapshots the caller owns, valid after ``engine.step()``.

        Raises:
            KeyError: an unknown name.
            TypeError: a bad ``names`` or ``dtype``.
            RankDisagreementError: the ranks' calls differ (raised on every rank before data moves).
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            The agreement, then one uneven ``all_to_all_single`` per process group and dtype, about ``(N-1)/N · S/N``
            bytes each way per rank (``full_tensors``: ``(N-1)/N · S``); none for replicated groups or where ZeRO-3's
            chunks already are whole rows.

        Device and memory:
            Results on the communication device, allocated once; each byte copied at most once on each side; send and
            receive buffers only where a side cannot be a view (kept between calls).

        Example:
            ```python
            dts = grads.to_dtensors(dtype=torch.float32)
            torch.nn.utils.clip_grad_norm_(list(dts.values()), 1.0)
            grads.set_dtensors_(dts)
            ```
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
        """Write DTensors shaped as ``to_dtensors`` returns them back into DeepSpeed's memory.

        Call on every rank with the same names. Writes never record autograd history.

        Args:
            mapping: ``{name: DTensor}`` in ``to_dtensors``' layout (mesh, placement, shape), any floating dtype.

        Returns:
            None.

        Raises:
            KeyError: an unknown name.
            TypeError: a value that is not such a DTensor.
            ValueError: another mesh, placement, shape or local shard. Every entry is checked on every rank before
                anything is sent or written.
            RankDisagreementError: the ranks' names differ.

        Communication:
            The agreement, then one ``all_to_all_single`` per process group and dtype, about ``(N-1)/N · S/N`` bytes
            each way per rank (replicated groups: ``(N-1)/N · S`` received).

        Device and memory:
            Nothing of the data's size is allocated; shards are sent as they lie where possible.

        Example:
            ```python
            dts = grads.to_dtensors()
            grads.set_dtensors_({n: d * 0.5 for n, d in dts.items()})
            ```
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
        """Which global rank ``owned`` and ``map_full_`` give each selected parameter to.

        Deterministic and identical on every rank: per process group, one contiguous run of parameters per rank, in
        buffer order, balanced by size.

        Args:
            names: a list of names, a predicate ``name -> bool``, or ``None`` for every parameter.
            owners: a complete mapping for the selection, validated and returned instead.

        Returns:
            dict[str, int]: ``{name: global rank}``.

        Raises:
            KeyError: an unknown name, or ``owners`` gives no rank for a selected one.
            ValueError: ``owners`` names a rank outside the parameter's process group.
            TypeError: a rank that is not an integer.

        Communication:
            None.

        Device and memory:
            Nothing of the data's size.

        Example:
            ```python
            mine = [n for n, r in grads.owners().items() if r == torch.distributed.get_rank()]
            ```
        """
        self._check_current()
        return _redistribute.owners(self._storage, self._select(names), owners)

    @collective
    def owned(self, names: list[str] | None = None, *, owners: Mapping[str, int] | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The whole tensors (parameter's shape, true units) of the selected parameters this rank owns.

        Other ranks' parameters are absent. Call on every rank with the same arguments.

        Args:
            names: a list of names, a predicate ``name -> bool``, or ``None`` for every parameter.
            owners: ``{name: rank}`` overriding ``owners()``.
            dtype: result dtype (default: the stored dtype).

        Returns:
            dict[str, torch.Tensor]: ``{name: whole tensor}`` for this rank's parameters, snapshots the caller owns.

        Raises:
            KeyError: an unknown name.
            ValueError: a bad ``owners`` mapping.
            RankDisagreementError: the ranks' calls differ.

        Communication:
            The agreement, then one ``all_to_all_single`` per process group and dtype of sharded groups: about
            ``(N-1)/N · S/N`` bytes each way per rank (ZeRO-1/2 with the default owners: only the parameters the
            partition boundaries cut).

        Device and memory:
            Results on the communication device; each byte copied at most once per side.

        Example:
            ```python
            mine = grads.owned()
            grads.set_owned_({n: t / t.norm() for n, t in mine.items()})
            ```
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
        """Write whole tensors from the ranks that own them, usually the (changed) result of ``owned``.

        Each rank passes its own (possibly ``{}``); each parameter comes from at most one rank. Call on every rank.

        Args:
            mapping: ``{name: whole tensor}`` of this rank's parameters, any floating dtype.
            owners: ``{name: rank}``; every key must then be owned by the passing rank.

        Returns:
            None.

        Raises:
            KeyError: an unknown name.
            ValueError: a wrong shape, or a parameter passed by two ranks. Every entry is checked on every rank
                before anything is sent or written.
            TypeError: a value that is not a floating-point tensor.

        Communication:
            The agreement (an ``all_gather`` of ``2 + k`` int64 that also says who passed what), then one
            ``all_to_all_single`` per process group and dtype where a piece crosses ranks, about ``(N-1)/N · S/N``
            bytes each way per rank.

        Device and memory:
            As ``set_dtensors_``: tensors ``owned`` returned are sent as they lie.

        Example:
            ```python
            grads.set_owned_({n: t.clamp(-1, 1) for n, t in grads.owned().items()})
            ```
        """
        self._check_current()
        _redistribute.set_owned_(self._storage, mapping, assignment=owners)

    @collective
    def map_full_(self, fn: Callable[[str, torch.Tensor], torch.Tensor], names: list[str] | None = None, *,
                  owners: Mapping[str, int] | None = None) -> None:
        """Replace each selected tensor by ``fn(name, whole tensor)``, computed once in the job, on its owner rank.

        ``fn`` gets true units in the stored dtype (float32 under fp16) and returns a tensor of the parameter's shape.
        It runs on owners only, so it must not communicate. Call on every rank with the same arguments.

        Args:
            fn: ``fn(name, full) -> Tensor``.
            names: a list of names, a predicate ``name -> bool``, or ``None`` for every parameter.
            owners: ``{name: rank}`` overriding ``owners()``.

        Returns:
            None.

        Raises:
            Exception: whatever ``fn`` raised, on the rank where it did (``RankFailedError`` on the others); nothing is
                written on any rank.
            ValueError: ``fn`` returned another shape.
            RuntimeError: ``fn`` called a zero_dtensor collective.
            TypeError: ``fn`` is not callable.

        Communication:
            The agreement, then one ``all_to_all_single`` per process group and dtype each way (the second also
            carries one error code per peer), about ``(N-1)/N · S/N`` bytes each way per rank per exchange.

        Device and memory:
            As ``owned`` then ``set_owned_``; ``fn``'s inputs are on the communication device.

        Example:
            ```python
            grads.map_full_(lambda name, g: newton_schulz(g), names=lambda n: n.endswith("weight"))
            ```
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

