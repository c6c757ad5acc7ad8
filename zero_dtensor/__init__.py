"""zero_dtensor: whole-model access to DeepSpeed ZeRO gradients as DTensors, between backward() and step()."""

from .api import get_full_model_grads, set_full_model_grads, sharded_grads
from .hooks import GradHookError, GradHookHandle, attach_to_trainer, on_grads, on_grads_in_trainer
from .errors import GradientsNotReadyError, StaleGradientsError, UnsupportedDeepSpeedError
from .launch import RankPool, launch
from .layout import GradLayout, GroupLayout, Packing, ParamLayout
from .sharded import ParamGrad, ShardedGrads
from .stats_logger import GradStatsLogger

__version__ = "0.1.0"

__all__ = [
    "GradHookError",
    "GradHookHandle",
    "GradLayout",
    "GradStatsLogger",
    "GradientsNotReadyError",
    "GroupLayout",
    "Packing",
    "ParamGrad",
    "ParamLayout",
    "ShardedGrads",
    "StaleGradientsError",
    "UnsupportedDeepSpeedError",
    "RankPool",
    "get_full_model_grads",
    "attach_to_trainer",
    "launch",
    "on_grads",
    "on_grads_in_trainer",
    "set_full_model_grads",
    "sharded_grads",
]
