"""``ParamView``: one parameter of a family (gradient, fp32 master or optimizer-state key): its live local fragment
and, on request, its full tensor or an exact DTensor (re-exported by :mod:`zero_dtensor.families.tensors`)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from ..comm.agreement import Refusal, agree_on
from ..comm.signature import collective
from ..layout.flat import ParamLayout
from ..materialize.placements import assembly_of
from ..core.state import FlatState, check_dtype

__all__ = ["ParamView", "ViewOwner"]


class ViewOwner(Protocol):
    """What a :class:`ParamView` reads from the family that made it (a
    :class:`~zero_dtensor.families.tensors.ShardedTensors`): the family's state and how it builds one DTensor of it."""

    _state: FlatState

    def _dtensor(self, local: torch.Tensor, group: int, shape: tuple[int, ...]) -> DTensor: ...


class ParamView:
    """The tensor of one parameter: its local fragment on this rank and, on request, the full tensor.

    For ZeRO-1/2 the fragments are ragged (a parameter straddles ranks at arbitrary offsets), so a parameter is *not*
    a DTensor; for ZeRO-3 (``torch.chunk`` pieces) and replicated groups :meth:`as_dtensor` gives an exact one.
    """

    __slots__ = ("_owner", "_param")

    def __init__(self, owner: ViewOwner, param: ParamLayout) -> None:
        self._owner = owner
        self._param = param

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"local_range={self.local_range}, group={self._param.group})"
        )

    @property
    def name(self) -> str:
        return self._param.name

    def __zero_dtensor_agreement__(self) -> str:
        """Which tensor this is, as the rank agreement compares an argument (:mod:`zero_dtensor.comm.signature`):
        the family's fingerprint and the parameter's name. No communication."""
        return f"param({self._owner._state.storage.family!r}, {self.name!r})"

    @property
    def shape(self) -> torch.Size:
        return self._param.shape

    @property
    def numel(self) -> int:
        return self._param.numel

    @property
    def dtype(self) -> torch.dtype:
        """The dtype DeepSpeed stores this family in (gradients: the gradient-accumulation dtype; masters and optimizer
        state: float32)."""
        return self._owner._state.storage.partitions[self._param.group].dtype

    @property
    def group(self) -> int:
        """Index of the flat group (``ShardedTensors.groups``) holding this parameter."""
        return self._param.group

    @property
    def local_range(self) -> tuple[int, int]:
        """``(start, stop)`` of this rank's fragment within the flattened parameter (``start == stop``: none)."""
        start, stop, _ = self._owner._state.plan.fragments[self.name]
        return start, stop

    def to_local(self) -> torch.Tensor:
        """This rank's fragment of the parameter, 1-D and ``local_range`` long: a live view of the stored memory.

        Writes to it change what ``engine.step()`` uses (masters: call ``mark_written()`` and sync after). Under
        fp16 the stored values are ``true values × loss_scale``. Under ``keep_full_grads`` it views the kept full
        buffer.

        Returns:
            torch.Tensor: a view, possibly empty (this rank holds nothing of the parameter).

        Raises:
            StaleTensorsError: the values are no longer DeepSpeed's (``StaleGradientsError`` for gradients).

        Communication:
            None.

        Device and memory:
            No copy; on the storage device (the CPU under offload).

        Example:
            ```python
            grads["fc1.weight"].to_local().mul_(0.5)
            ```
        """
        state = self._owner._state
        state.check_current()
        return state.fragment(self._param).view(-1)  # a new view: the cached fragment object stays internal

    @collective
    def full_tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full (true, unscaled) tensor of this one parameter, a snapshot the caller owns.

        To gather many parameters, use ``full_tensors()`` (one collective for all). Call on every rank of the group.

        Args:
            dtype: result dtype (default: the stored dtype; float32 under fp16).

        Returns:
            torch.Tensor: the parameter's shape.

        Raises:
            TypeError: a bad ``dtype``.
            RankDisagreementError: the ranks asked for different parameters.
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            The agreement, then ZeRO-3: one ``all_gather`` of the ``ceil(numel/N)`` chunks; ZeRO-1/2: one
            ``all_reduce`` of a zero-padded ``numel`` buffer; replicated: none.

        Device and memory:
            The result on the communication device.

        Example:
            ```python
            w = grads["fc1.weight"].full_tensor()
            ```
        """
        state = self._owner._state
        state.check_current()
        what = f"{type(self).__name__}.full_tensor"
        with Refusal() as refusal:
            check_dtype(dtype, what)
        storage = state.storage
        param = self._param
        pg = storage.process_groups[param.group]
        communicates = state.group(param.group).placement.is_sharded
        agree_on(storage, what, (), [pg] if communicates else [], refused=refusal.error)
        group = state.group(param.group)
        full = assembly_of(group).gather_param(group, param, storage.partitions[param.group], pg, storage.device)
        return state.finish(full.view(param.shape), dtype)

    def as_dtensor(self) -> DTensor:
        """This tensor as an exact 1-D DTensor of shape ``(numel,)`` aliasing DeepSpeed's memory (a live view).

        ``Shard(0)`` for ZeRO-3 (``torch.chunk`` pieces), ``Replicate()`` for replicated groups.

        Returns:
            DTensor: the view.

        Raises:
            TypeError: ZeRO-1/2, whose ragged pieces a DTensor cannot describe (use ``to_local()``, ``full_tensor()``
                or ``groups``).
            StaleTensorsError: the values are no longer DeepSpeed's.

        Communication:
            None.

        Device and memory:
            No copy.

        Example:
            ```python
            dt = grads["fc1.weight"].as_dtensor()       # ZeRO-3
            ```
        """
        group = self._owner._state.group(self._param.group)
        if not group.placement.exact_param_shards:
            raise TypeError(
                f"{self.name!r}: ZeRO-1/2 stores a parameter in ragged pieces that a Shard(0) DTensor would describe "
                "wrongly; use .groups[...] (an exact Shard(0) DTensor per flat group), to_local() or full_tensor()"
            )
        return self._owner._dtensor(self.to_local(), self._param.group, (self.numel,))
