"""zero_dtensor: whole-model, sharded access to DeepSpeed ZeRO gradients, fp32 master weights and optimizer state as
DTensors, and elastic checkpoints of a ZeRO engine through torch's distributed checkpoint."""

from .api import (
    get_full_fp32_params,
    get_full_model_grads,
    get_full_optimizer_state,
    optimizer_state_keys,
    set_full_fp32_params,
    set_full_model_grads,
    set_full_optimizer_state,
    sharded_grads,
    sharded_master_params,
    sharded_optimizer_state,
    sync_model_params,
)
from .checkpoint import get_state_dict, load, save, set_state_dict
from .convert import convert
from .errors import (
    CheckpointMismatchError,
    CheckpointReadError,
    ConversionError,
    GradHookError,
    GradientsNotReadyError,
    IncompleteCheckpointError,
    ModelParamsNotSyncedError,
    OptimizerStateNotReadyError,
    RankDisagreementError,
    RankFailedError,
    StaleGradientsError,
    StaleTensorsError,
    UnsupportedDeepSpeedError,
)
from .integrations.hooks import GradHookHandle, attach_to_trainer, on_grads, on_grads_in_trainer
from .launch import RankPool, launch
from .layout.flat import FlatLayout, GroupLayout, Packing, ParamLayout
from .ops.noise import counter_normal
from .ops.overflow import found_inf
from .core.param_values import ParamValues
from .ops.reductions import GradStats
from .families.replicate import FullGradsHandle, KeepFullGradsHandle, keep_full_grads
from .families.master import ShardedMasterParams, ShardedOptimizerState
from .settings import set_debug, set_fused_reductions, set_gather_strategy
from .families.sharded import ParamGrad, ShardedGrads
from .integrations.stats_logger import GradStatsLogger
from .families.tensors import ParamView, ShardedTensors

__version__ = "0.2.0"

#: The name of :class:`FlatLayout` before 0.1 (it describes every family, not only gradients).
GradLayout = FlatLayout

__all__ = [
    "CheckpointMismatchError",
    "CheckpointReadError",
    "ConversionError",
    "FlatLayout",
    "FullGradsHandle",
    "GradHookError",
    "GradHookHandle",
    "GradStats",
    "GradStatsLogger",
    "GradientsNotReadyError",
    "GroupLayout",
    "IncompleteCheckpointError",
    "KeepFullGradsHandle",
    "ModelParamsNotSyncedError",
    "OptimizerStateNotReadyError",
    "Packing",
    "ParamGrad",
    "ParamLayout",
    "ParamValues",
    "ParamView",
    "RankDisagreementError",
    "RankFailedError",
    "RankPool",
    "ShardedGrads",
    "ShardedMasterParams",
    "ShardedOptimizerState",
    "ShardedTensors",
    "StaleGradientsError",
    "StaleTensorsError",
    "UnsupportedDeepSpeedError",
    "attach_to_trainer",
    "counter_normal",
    "found_inf",
    "get_full_fp32_params",
    "get_full_model_grads",
    "get_full_optimizer_state",
    "get_state_dict",
    "keep_full_grads",
    "launch",
    "load",
    "convert",
    "on_grads",
    "on_grads_in_trainer",
    "optimizer_state_keys",
    "save",
    "set_debug",
    "set_full_fp32_params",
    "set_full_model_grads",
    "set_full_optimizer_state",
    "set_fused_reductions",
    "set_gather_strategy",
    "set_state_dict",
    "sharded_grads",
    "sharded_master_params",
    "sharded_optimizer_state",
    "sync_model_params",
]
