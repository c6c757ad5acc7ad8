"""A ZeRO fragment (an element range of a flattened parameter) as rectangular boxes of the parameter's real shape,
wrapped so that torch's distributed checkpoint (DCP) saves and reshards it exactly.

DCP describes every tensor as N-D chunks (offsets, sizes) of its global shape. A ``Shard(0)`` DTensor's chunk is
computed from its placement (``torch.chunk`` rows), never from its local tensor, so a ragged ZeRO-1/2 piece saved as
one would be written with wrong metadata and load silently wrong at another world size. A DTensor whose local tensor
is a ``LocalShardsWrapper`` carries explicit chunks instead: per rank any number of boxes at any offsets; DCP saves
exactly those and loads into them in place (torch 2.13, checked by running at world sizes 1-3).

A range ``[a, b)`` of a row-major flattening is at most ``2(ndim-1)+1`` boxes, each a contiguous run of the range,
so each box is a zero-copy ``view`` of the 1-D fragment. Nothing here communicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from ..comm.dtensor_new import new_dtensor
from ..layout.flat import contiguous_stride

__all__ = ["Box", "boxes", "box_dtensor", "local_boxes", "storage_exact", "storage_exact_entry"]


@dataclass(frozen=True)
class Box:
    """``sizes`` elements at ``offsets`` of the global shape; ``start`` is its first element in the fragment."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _split(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    r0, c0 = divmod(a, row)
    r1, c1 = divmod(b, row)
    inner = shape[1:]

    def in_row(r: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((r, *o), (1, *s)) for o, s in _split(inner, lo, hi)]

    if r0 == r1:
        return in_row(r0, c0, c1)
    out = []
    if c0:
        out += in_row(r0, c0, row)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *([0] * len(inner))), (r1 - r0, *inner)))
    if c1:
        out += in_row(r1, 0, c1)
    return out


def boxes(shape: torch.Size | tuple[int, ...], start: int, stop: int) -> tuple[Box, ...]:
    """The boxes of elements ``[start, stop)`` of a row-major tensor of ``shape``, in order (empty when
    ``start >= stop``)."""
    found, pos = [], 0
    for offsets, sizes in _split(tuple(shape), start, stop):
        found.append(Box(offsets, sizes, pos))
        pos += math.prod(sizes)
    return tuple(found)


def local_boxes(fragment: torch.Tensor, found: tuple[Box, ...]) -> list[torch.Tensor]:
    """Views of the 1-D ``fragment`` shaped as each box (no copy)."""
    return [fragment[b.start:b.start + b.numel].view(b.sizes) for b in found]



def box_dtensor(fragment: torch.Tensor, shape: torch.Size | tuple[int, ...], start: int, mesh: DeviceMesh, *,
                exact: bool = False) -> DTensor | None:
    """This rank's fragment (elements ``[start, start + fragment.numel())`` of the flattened tensor) as a DTensor
    of the global ``shape`` over a ``LocalShardsWrapper`` of box views (a DCP container: its ``Shard(0)`` placement
    does not describe the pieces, so use it for checkpointing only). ``None`` for an empty fragment: the rank then
    omits the entry. Zero-copy (:func:`~zero_dtensor.comm.dtensor_new.new_dtensor`: no autograd node, a cached spec);
    ``fragment`` must be on ``mesh``'s device type. ``exact``: each box made :func:`storage_exact` (for writing
    only: what ``zd.save`` hands DCP)."""
    if fragment.numel() == 0:
        return None
    found = boxes(tuple(shape), start, start + fragment.numel())
    views = local_boxes(fragment, found)
    wrapper = LocalShardsWrapper([storage_exact(v) for v in views] if exact else views, [b.offsets for b in found])
    return new_dtensor(wrapper, mesh, Shard(0), tuple(shape), contiguous_stride(tuple(shape)))


def storage_exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, on the CPU) as a tensor over a storage of exactly its bytes that aliases the same memory
    (a slice of its storage, which keeps the whole one alive); others as they are. DCP clones a CPU tensor whose
    storage is larger than it before writing it (``torch.save`` would write the whole storage): a ZeRO piece, a
    view into a flat partition, is then written without that copy. No communication, no copy."""
    storage = t.untyped_storage()
    if t.device.type != "cpu" or not t.is_contiguous() or storage.nbytes() == t.nbytes:
        return t
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(storage[start:start + t.nbytes], 0, t.shape, t.stride())


def storage_exact_entry(value: object) -> object:
    """A state-dict value made :func:`storage_exact` where it is a plain tensor; anything else (a DTensor: build it
    with ``box_dtensor(..., exact=True)``) as it is. For writing only: the result aliases the engine's memory."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return storage_exact(value.detach())
    return value
