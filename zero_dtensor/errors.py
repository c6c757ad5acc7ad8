"""Exceptions raised by zero_dtensor. Each message says what to do."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "GradHookError",
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
    """Ranks called a collective with different arguments or settings, or one rank never reached it: raised on
    every rank by the rank agreement (:mod:`zero_dtensor.agreement`) before any data moved."""


class RankFailedError(RuntimeError):
    """Something failed on *another* rank: raised on the ranks whose own part succeeded (a user function such as
    ``map_full_``'s ``fn`` or an ``on_grads`` hook raised elsewhere). ``failed_ranks`` lists the global ranks that
    failed; their own exception was raised there. Nothing was written on any rank."""

    def __init__(self, message: str, failed_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)


class GradHookError(RankFailedError):
    """A gradient hook (``on_grads``) raised on other ranks; the optimizer step was not run on any rank."""
