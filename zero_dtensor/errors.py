"""Exceptions raised by zero_dtensor. Each message says what to do."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CheckpointMismatchError",
    "CheckpointReadError",
    "ConversionError",
    "GradHookError",
    "GradientsNotReadyError",
    "IncompleteCheckpointError",
    "ModelParamsNotSyncedError",
    "OptimizerStateNotReadyError",
    "RankDisagreementError",
    "RankFailedError",
    "StaleGradientsError",
    "StaleTensorsError",
    "UnsupportedDeepSpeedError",
]


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed version, optimizer class or configuration is not one zero_dtensor knows."""


class GradientsNotReadyError(RuntimeError):
    """Gradients were requested outside the window ``engine.backward()`` (at a boundary) … ``engine.step()``."""


class StaleTensorsError(RuntimeError):
    """A sharded view (``ShardedGrads``, ``ShardedMasterParams``, ``ShardedOptimizerState``, or a view of one) was
    used after DeepSpeed stopped holding its values (gradients: consumed by ``engine.step()``; optimizer state:
    replaced by ``engine.load_checkpoint``). Make the view again."""


class StaleGradientsError(GradientsNotReadyError, StaleTensorsError):
    """A ``ShardedGrads`` (or a view of it) was used after ``engine.step()`` consumed its gradients."""


class OptimizerStateNotReadyError(RuntimeError):
    """The optimizer state was requested before it exists: torch's optimizers create it in their first ``step()``
    (so after the first ``engine.step()`` that was not skipped for fp16 overflow)."""


class ModelParamsNotSyncedError(RuntimeError):
    """A forward started after a write into the fp32 master weights that has not reached the model's working
    weights yet: call ``zero_dtensor.sync_model_params(engine)`` on every rank after writing masters."""


class RankDisagreementError(RuntimeError):
    """Ranks called a collective with different arguments or settings, or one rank never reached it: raised on
    every rank by the rank agreement (:mod:`zero_dtensor.comm.agreement`) before any data moved."""


class RankFailedError(RuntimeError):
    """Something failed on *another* rank: raised on the ranks whose own part succeeded (a user function such as
    ``map_full_``'s ``fn`` or an ``on_grads`` hook raised elsewhere). ``failed_ranks`` lists the global ranks that
    failed; their own exception was raised there. Nothing was written on any rank."""

    def __init__(self, message: str, failed_ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)


class GradHookError(RankFailedError):
    """A gradient hook (``on_grads``) raised on other ranks; the optimizer step was not run on any rank."""


class CheckpointMismatchError(ValueError):
    """A checkpoint or state dict does not fit the engine: missing or extra parameter names, other shapes, other
    optimizer-state keys, or values the engine cannot hold (one step for parameters that share one, different
    hyperparameters for parameters of one group), or an engine inside a gradient accumulation cycle (``zd.load``:
    the gradients it holds would meet the loaded state at a shifted boundary). The message lists what differs.
    Nothing was written."""


class IncompleteCheckpointError(RuntimeError):
    """The directory holds no finished checkpoint: DCP writes ``.metadata`` last, after every rank's data, so a save
    that was killed (or is still running) has none. Nothing was read into the engine."""


class CheckpointReadError(RuntimeError):
    """DCP failed to read the checkpoint (a missing or damaged data file, tensor data whose CRC-32 differs from the
    one its archive records, an unreadable ``.metadata``) on some rank; raised on every rank, naming the checkpoint,
    ``__cause__`` is the read's own error where it failed, :class:`RankFailedError` elsewhere. Every entry is
    checked (file sizes, archives, headers, the CRC-32 of its data) before any of the engine's memory is written, so
    a missing, truncated or damaged file leaves the engine unchanged; only an I/O error in the second pass, after those checks, leaves
    the failing rank's masters and optimizer state partly overwritten (the message says so)."""


class ConversionError(ValueError):
    """A DeepSpeed checkpoint folder that :func:`zero_dtensor.convert` cannot convert: a missing or truncated rank
    file, files of different saves, a mixture-of-experts, pipeline- or model-parallel or stage-0 checkpoint, or an
    unknown format. The message names the file and what to do; raised before anything is written."""
