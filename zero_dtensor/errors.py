"""Exceptions raised by zero_dtensor. Each message says what to do."""

from __future__ import annotations

__all__ = [
    "GradientsNotReadyError",
    "RankDisagreementError",
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
