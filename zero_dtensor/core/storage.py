"""What an adapter hands to the rest of the library: a layout plus live handles on one family's memory
(the gradients, the fp32 masters or one optimizer-state key)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress

import torch
import torch.distributed as dist

from ..layout.devices import Devices
from ..layout.flat import FlatLayout
from ..layout.views import ViewCache

__all__ = ["FlatStorage", "shares_memory"]


def shares_memory(values: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> bool:
    """Whether any non-empty value lies in the memory of one of ``buffers`` (anywhere in the storage it views: a
    value that is a view of a family's own partition, at any offset). A write whose source shares memory with its
    destination must stage the source first (``copy_`` refuses a partial overlap on the rank that has it, ``cat``
    any overlap; a larger write could read what it already overwrote). Two C-level passes over the values and a sort
    of their addresses; no tensor operation, no communication."""
    starts = sorted(map(torch.Tensor.data_ptr, compress(values, map(torch.Tensor.numel, values))))
    count = len(starts)
    for buffer in buffers:  # the same calls whatever the values (the interpreter's work must not depend on them)
        memory = buffer.untyped_storage()
        lo = memory.data_ptr()
        hi = lo + memory.nbytes()
        inside = bisect_left(starts, lo)
        if inside < count and starts[inside] < hi:
            return True
    return False


def _no_write_hook(names: Sequence[str]) -> None:
    del names


@dataclass(frozen=True)
class FlatStorage:
    """One family's memory of one engine (gradients: between ``backward()`` at a boundary and ``step()``; masters
    and optimizer state: between steps).

    Attributes:
        layout: the neutral layout.
        partitions: per group, this rank's partition as one 1-D contiguous tensor that *is* the memory the optimizer
            step reads (writes to it change what ``engine.step()`` uses).
        process_groups: per group, the data-parallel process group it is partitioned over.
        loss_scale: stored values equal the true gradient times this (fp16 dynamic loss scaling; 1.0 otherwise).
        device: the engine's compute device (where users' tensors normally live), which is also the
            communication device (:attr:`devices`).
        is_current: answers whether the memory still holds this step's gradient (False after ``engine.step()``).
        after_write: refreshes the optimizer's own bookkeeping (e.g. precomputed offload norms) for written params.
        describe: a short name of the optimizer kind, for messages.
        view_caches: per group, a :class:`~zero_dtensor.layout.views.ViewCache` of its partition when the adapter keeps
            the partition tensor across steps (its per-parameter views are then made once, not every step); empty
            when every step's partition is new.
        family: which tensors of the engine these are, the same on every rank and never shared by two different
            ones: ``"gradients"``, ``"master weights"``, ``"optimizer state 'exp_avg'"`` …, ``"clone #3 of
            master weights"`` (clones are numbered in the order this process made them from that family). Every
            rank agreement of a call on the family hashes it (:func:`zero_dtensor.comm.agreement.agree_on`): the
            families share one layout and plan, so names alone cannot tell them apart.
    """

    layout: FlatLayout
    partitions: tuple[torch.Tensor, ...]
    process_groups: tuple[dist.ProcessGroup, ...]
    loss_scale: float
    device: torch.device
    is_current: Callable[[], bool]
    after_write: Callable[[Sequence[str]], None] = _no_write_hook
    describe: str = ""
    view_caches: tuple[ViewCache, ...] = ()
    family: str = "gradients"

    @property
    def devices(self) -> Devices:
        """The storage device (where :attr:`partitions` live: the CPU under offload) and the communication device
        (:attr:`device`: where collectives run and reductions return their results). See
        :mod:`zero_dtensor.layout.devices`."""
        storage = self.partitions[0].device if self.partitions else self.device
        return Devices(storage=storage, comm=self.device)

    def to_true(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored values in true units: ``stored`` itself without loss scaling, else an unscaled float32 tensor."""
        return stored if self.loss_scale == 1.0 else stored.to(torch.float32) / self.loss_scale

    def to_stored(self, true: torch.Tensor) -> torch.Tensor:
        """True values in stored units: ``true`` itself without loss scaling, else a scaled float32 tensor."""
        return true if self.loss_scale == 1.0 else true.to(torch.float32) * self.loss_scale
