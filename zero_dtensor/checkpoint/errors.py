"""Exceptions of :mod:`zero_dtensor.checkpoint`. Each is raised on every rank, before the engine changes."""

from __future__ import annotations

__all__ = ["CheckpointMismatchError", "CheckpointReadError", "IncompleteCheckpointError"]


class CheckpointMismatchError(ValueError):
    """A checkpoint or state dict does not fit the engine: missing or extra parameter names, other shapes, other
    optimizer-state keys, or values the engine cannot hold (one step for parameters that share one, different
    hyperparameters for parameters of one group). The message lists what differs. Nothing was written."""


class IncompleteCheckpointError(RuntimeError):
    """The directory holds no finished checkpoint: DCP writes ``.metadata`` last, after every rank's data, so a save
    that was killed (or is still running) has none. Nothing was read into the engine."""


class CheckpointReadError(RuntimeError):
    """DCP failed to read the checkpoint (a missing or damaged data file); ``__cause__`` is DCP's
    ``CheckpointException``. The data was read into staging buffers, so the engine is unchanged."""
