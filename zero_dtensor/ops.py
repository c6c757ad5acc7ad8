"""Sharded gradient transforms (elementwise, reductions, clipping, noise) mixed into ``ShardedGrads``."""

from __future__ import annotations

__all__ = ["GradOpsMixin"]


class GradOpsMixin:
    """Operations on the local shards of a :class:`~zero_dtensor.sharded.ShardedGrads`."""
