"""Exceptions raised by zero_dtensor. Each message says what to do."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "GradientsNotReadyError",
    "RankDisagreementError",
    "RankFailedError",
    "StaleGradientsError",
    "UnsupportedDeepSpeedError",
]


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed version, optimizer class or configuration is not one zero_dtensor knows."""


class GradientsNotReadyError(RuntimeError):
    """Gradients were requested outside the window ``engine.backward()`` (at a boundary) … ``engine.step()``."""


class StaleGradientsError(GradientsNotReadyError):
    """A ``ShardedGrads`` (or a view of it) was used after ``engine.step()`` consumed its gradients."""


class RankDisagreementError(RuntimeError):
    """Ranks called the same collective with different arguments (raised on every rank in debug mode)."""


class RankFailedError(RuntimeError):
    """Raised on the ranks whose own part succeeded when a user function (``map_full_``'s ``fn``) raised on other
    ranks. ``failed_ranks`` lists their global ranks. Nothing was written on any rank."""

    def __init__(self, message: str, failed_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)
