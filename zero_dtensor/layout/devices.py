"""Where a family's tensors live, and the one place the library moves tensors between devices.

Every family (gradients, fp32 masters, optimizer state) has two devices (:class:`Devices`):

- the **storage** device, where its partitions are: the accelerator, or the CPU under DeepSpeed's
  ``offload_optimizer: cpu`` (pinned host memory);
- the **communication** device, where its collectives run: the engine's device (CUDA for NCCL), which is also where
  results computed from several ranks' values are returned.

The rules the library keeps: every operand, factor, index and mask meets the data on the data's (storage) device;
values that travel in a collective are moved to the communication device first; a reduction returns its result on
the communication device (see each call's docstring). Every device move goes through :func:`to_device`,
:func:`to_storage` or :func:`to_comm` (one seam: the tests replace :func:`_move` to see moves on the CPU, where
``.to(same device)`` is a no-op). Nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HOST", "Devices", "to_comm", "to_device", "to_host", "to_storage"]

HOST = torch.device("cpu")  #: where results returned as Python numbers are read back


@dataclass(frozen=True)
class Devices:
    """A family's storage device (its partitions) and communication device (its collectives and results)."""

    storage: torch.device
    comm: torch.device

    @property
    def offloaded(self) -> bool:
        """Whether the partitions live elsewhere than where the family communicates (e.g. CPU offload + NCCL)."""
        return self.storage != self.comm


def _move(t: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    return t.to(device, non_blocking=non_blocking)


def to_device(t: torch.Tensor, device: torch.device, *, non_blocking: bool = False) -> torch.Tensor:
    """``t`` on ``device``: ``t`` itself when it is there, else a copy (the library's one device move)."""
    return _move(t, device, non_blocking)


def to_storage(t: torch.Tensor, devices: Devices) -> torch.Tensor:
    """``t`` on the storage device (a factor or index about to meet the partitions)."""
    return _move(t, devices.storage)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host (a result about to be read back as Python numbers: a host sync where ``t`` is on an
    accelerator)."""
    return _move(t, HOST)


def to_comm(t: torch.Tensor, devices: Devices) -> torch.Tensor:
    """``t`` on the communication device (values about to travel, or a result about to be returned)."""
    return _move(t, devices.comm)
