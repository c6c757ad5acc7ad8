"""How a 1-D buffer is cut into pieces: the parameters' pieces and the padding between them.

A :class:`Tiling` is the bottom of the per-layout tables: :mod:`zero_dtensor.layout.plan` holds one per buffer kind of a
group, :mod:`zero_dtensor.layout.segments` reduces over its pieces, and the placements (:mod:`zero_dtensor.materialize.placements`)
describe streaming windows with one. Nothing here knows a layout, a placement or a process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

__all__ = ["Tiling", "tiling"]


@dataclass(frozen=True)
class Tiling:
    """A 1-D buffer of ``sum(sizes)`` elements cut into pieces: ``sizes`` tile it; ``piece[k]`` is the piece of
    the group's ``k``-th parameter (buffer order); every other piece is padding (``gaps``)."""

    sizes: tuple[int, ...]
    piece: tuple[int, ...]
    gaps: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        """The fields' hash, taken once: plans are looked up by tiling on every call, and hashing the tuples of a
        10,000-parameter tiling takes 0.1 ms."""
        return hash((self.sizes, self.piece, self.gaps))


def tiling(spans: list[tuple[int, int]], total: int) -> Tiling:
    """Pieces of ``[0, total)`` for sorted, disjoint ``spans`` ``(start, length)`` (zero-length ones allowed)."""
    sizes: list[int] = []
    piece: list[int] = []
    gaps: list[int] = []
    pos = 0
    for start, length in spans:
        if length and start > pos:
            gaps.append(len(sizes))
            sizes.append(start - pos)
            pos = start
        piece.append(len(sizes))
        sizes.append(length)
        pos = max(pos, start + length) if length else pos
    if pos < total:
        gaps.append(len(sizes))
        sizes.append(total - pos)
    return Tiling(tuple(sizes), tuple(piece), tuple(gaps))
