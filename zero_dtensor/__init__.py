"""zero_dtensor: whole-model access to DeepSpeed ZeRO gradients as DTensors, between backward() and step()."""

from .api import get_full_model_grads, set_full_model_grads, sharded_grads
from .errors import (
    GradHookError,
    GradientsNotReadyError,
    RankDisagreementError,
    RankFailedError,
    StaleGradientsError,
    UnsupportedDeepSpeedError,
)
from .hooks import GradHookHandle, attach_to_trainer, on_grads, on_grads_in_trainer
from .launch import RankPool, launch
from .layout import GradLayout, GroupLayout, Packing, ParamLayout
from .noise import counter_normal
from .overflow import found_inf
from .param_values import ParamValues
from .reductions import GradStats
from .replicate import FullGradsHandle, KeepFullGradsHandle, keep_full_grads
from .settings import set_debug, set_gather_strategy
from .sharded import ParamGrad, ShardedGrads
from .stats_logger import GradStatsLogger

__version__ = "0.1.0"

__all__ = [
    "FullGradsHandle",
    "KeepFullGradsHandle",
    "GradHookError",
    "GradHookHandle",
    "GradLayout",
    "GradStats",
    "GradStatsLogger",
    "GradientsNotReadyError",
    "GroupLayout",
    "Packing",
    "ParamGrad",
    "ParamLayout",
    "ParamValues",
    "RankDisagreementError",
    "RankFailedError",
    "RankPool",
    "ShardedGrads",
    "StaleGradientsError",
    "UnsupportedDeepSpeedError",
    "attach_to_trainer",
    "counter_normal",
    "found_inf",
    "get_full_model_grads",
    "keep_full_grads",
    "launch",
    "on_grads",
    "on_grads_in_trainer",
    "set_debug",
    "set_full_model_grads",
    "set_gather_strategy",
    "sharded_grads",
]
