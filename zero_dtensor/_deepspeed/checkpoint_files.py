"""The files ``engine.save_checkpoint`` writes, read offline: which files a checkpoint folder holds, checked to be one
save, and where every element of every parameter lies in them (a neutral :class:`SavedLayout`); the rules that
build it from the files are in :mod:`.checkpoint_layout`.

DeepSpeed 0.19.8 (``ENG`` ``runtime/engine.py``, ``S12`` ``runtime/zero/stage_1_and_2.py``, ``S3``
``runtime/zero/stage3.py``, ``BF`` ``runtime/bf16_optimizer.py``; the same keys since 0.18.x):

- ``mp_rank_00_model_states.pt`` (ZeRO-1/2, ``BF16_Optimizer``; written by rank 0) or
  ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` (ZeRO-3, every rank): ``module`` (working weights and buffers;
  ZeRO-3 parameters are empty placeholders), ``param_shapes`` (trainable names and shapes in flat order, one dict
  per optimizer group, ZeRO-3 per sub-group), ``frozen_param_shapes`` / ``frozen_param_fragments`` (stage >= 2),
  ``shared_params`` (tied aliases, rank 0's file only), ``buffer_names``, the counters, ``lr_scheduler``,
  ``ds_version``, ``ds_config`` and the client state at the top level (ENG:4897-4919, 5245-5388).
- ``{bf16_}zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank: the flat fp32 partitions
  (ZeRO-1/2 ``single_partition_of_fp32_groups`` without the tail padding, ``BF16_Optimizer`` with it, ZeRO-3
  ``fp32_flat_groups`` per sub-group) and the torch optimizer's ``state_dict()`` over them (S12:2594-2638,
  BF:495-509, S3:3165-3197).

ZeRO-1/2: a group's parameters concatenated in ``param_shapes`` order, padded at the end, cut into equal partitions
(one per rank). ZeRO-3: each parameter cut into ``ceil(numel / world)`` pieces, one per rank, concatenated per
sub-group. Files are opened memory-mapped (``torch.load(mmap=True)``) with DeepSpeed's pickled classes read as
plain records, so neither DeepSpeed nor memory proportional to the checkpoint is needed. No communication.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConversionError

__all__ = ["DEEPSPEED_KEYS", "SavedFiles", "SavedLayout", "SavedParam", "Span", "load_file", "scaler_numbers"]

#: top-level keys of the model-states file that DeepSpeed writes itself (the rest is the user's client state)
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
    "ds_config", "ds_version", "universal_checkpoint_info", "num_experts", "ds_autoep_layers"})


# ---- reading DeepSpeed's pickles without DeepSpeed ------------------------------------------------------------------

class _Record:
    """A DeepSpeed object from a checkpoint (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``): its
    constructor arguments and attributes, nothing else."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.record_args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


class _Unpickler(pickle.Unpickler):
    _classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
            key = f"{module}.{name}"
            if key not in self._classes:
                self._classes[key] = type(name, (_Record,), {"__module__": "zero_dtensor.deepspeed_record"})
            return self._classes[key]
        return super().find_class(module, name)


class _PickleModule:
    """A ``pickle_module`` for ``torch.load`` that reads DeepSpeed's classes as :class:`_Record`."""

    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    __name__ = "zero_dtensor_deepspeed_pickle"


def load_file(path: str) -> dict[str, Any]:
    """One checkpoint file, memory-mapped; :class:`ConversionError` naming it where it is missing or unreadable."""
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: file missing; the checkpoint folder is incomplete (copy every rank's file, "
                              "or pass the folder of a complete save). Nothing was written.")
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_PickleModule)
    except Exception as exc:  # noqa: BLE001 - a truncated zip, a legacy pickle, anything unreadable
        raise ConversionError(f"{path}: cannot be read ({type(exc).__name__}: {exc}); a truncated or damaged file, "
                              "or one written with checkpoint_serialization=false (re-save it, or load it with "
                              "torch.load and save it again with torch.save). Nothing was written.") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: not a DeepSpeed checkpoint file (a {type(data).__name__}). "
                              "Nothing was written.")
    return data


def scaler_numbers(scaler: Any) -> dict[str, Any] | None:
    """A loss scaler's numeric attributes (``cur_scale``, ``cur_iter``, ...; one-element tensors as numbers), or
    ``None`` for no scaler: of a live engine's (:func:`~zero_dtensor._deepspeed.checkpointing.loss_scaler_state`)
    and of one read from a checkpoint file alike."""
    if scaler is None:
        return None
    state = {}
    for key, value in vars(scaler).items():
        if torch.is_tensor(value) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (bool, int, float)) and not (isinstance(value, float) and math.isnan(value)):
            state[key] = value
    return state


# ---- the neutral layout ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """Elements ``[start, stop)`` of rank ``rank``'s flat tensor of flat group ``group`` (``-1``: frozen
    fragments of parameter ``name``'s own tensor)."""

    rank: int
    group: int
    start: int
    stop: int


@dataclass(frozen=True)
class SavedParam:
    """One parameter of the checkpoint: its flattened elements are its spans' elements, concatenated."""

    name: str
    shape: torch.Size
    group: int
    spans: tuple[Span, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SavedLayout:
    """What a DeepSpeed checkpoint holds, independent of its files."""

    folder: str
    kind: str  #: "zero12", "bf16" (BF16_Optimizer) or "zero3"
    stage: int
    world: int
    ds_version: str
    #: trainable parameters in flat order (a tied parameter under its first name)
    params: tuple[SavedParam, ...]
    #: frozen parameters: working dtype; spans over per-rank fragments (ZeRO-3) or one span (group -1) of the whole
    frozen: tuple[SavedParam, ...]
    frozen_source: str  #: "fragments" (ZeRO-2/3 ``frozen_param_fragments``) or "module" (ZeRO-1, BF16_Optimizer)
    working_dtype: torch.dtype
    aliases: tuple[tuple[str, str], ...]  #: (alias, owner)
    buffers: tuple[str, ...]
    #: optimizer-state keys shaped like the parameter (``exp_avg``, ``exp_avg_sq``)
    state_keys: tuple[str, ...]
    steps: tuple[float | None, ...]  #: per flat group
    hyperparameters: tuple[dict[str, Any], ...]  #: per flat group (everything but ``params``)
    counters: dict[str, int]
    lr_scheduler: Any
    loss_scaler: dict[str, Any] | None
    client_state: Any
    files: tuple[str, ...] = field(default=())

    @property
    def largest_numel(self) -> int:
        return max([p.numel for p in (*self.params, *self.frozen)], default=0)


class SavedFiles:
    """The memory-mapped files of one checkpoint and the tensors a :class:`Span` points into."""

    def __init__(self, layout: SavedLayout, optim: list[dict[str, Any]], models: list[dict[str, Any]]) -> None:
        self.layout, self._optim, self._models = layout, optim, models

    def flat(self, rank: int, group: int, key: str) -> torch.Tensor:
        """Rank ``rank``'s 1-D flat tensor of ``group``: ``"fp32"`` the master partition, else a state key."""
        inner = self._optim[rank]["optimizer_state_dict"]
        if key == "fp32":
            return _fp32_groups(inner, self.layout.kind)[group]
        return _torch_state(inner, self.layout.kind)["state"][group][key]

    def read(self, param: SavedParam, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """``param``'s value for ``key`` (``"fp32"``, a state key, or ``"frozen"``): a view into the mapped file
        where it lies in one piece, else its pieces joined into a new tensor (one parameter), or into the first
        elements of ``out`` where given (a 1-D tensor of the value's dtype, at least ``param.numel`` long)."""
        pieces = [self._piece(param, s, key) for s in param.spans]
        if not pieces:  # an empty parameter
            return torch.empty(param.shape, dtype=self.dtype(param, key))
        if len(pieces) == 1:
            flat = pieces[0]
        elif out is None:
            flat = torch.cat(pieces)
        else:
            with torch.no_grad():  # ZeRO-3's fp32 partitions are saved as parameters (requires_grad)
                flat = torch.cat(pieces, out=out[:param.numel])
        return flat.view(param.shape)

    @staticmethod
    def joined(param: SavedParam) -> bool:
        """Whether :meth:`read` joins ``param``'s value from several pieces (a copy) rather than viewing the file."""
        return len(param.spans) > 1

    def dtype(self, param: SavedParam, key: str) -> torch.dtype:
        """The dtype of ``param``'s value for ``key`` (read from the file's record, no data)."""
        return self._piece(param, param.spans[0], key).dtype if param.spans else torch.float32

    def _piece(self, param: SavedParam, span: Span, key: str) -> torch.Tensor:
        if key == "frozen":
            if self.layout.frozen_source == "module":
                return self._models[0]["module"][param.name].reshape(-1)[span.start:span.stop]
            return self._models[span.rank]["frozen_param_fragments"][param.name].reshape(-1)[span.start:span.stop]
        return self.flat(span.rank, span.group, key)[span.start:span.stop]

    @staticmethod
    def fp32_length(inner: Mapping[str, Any], kind: str, group: int) -> int:
        """The length of a rank's fp32 partition of ``group`` in its optimizer file's ``optimizer_state_dict``."""
        return int(_fp32_groups(inner, kind)[group].numel())

    def buffer(self, name: str) -> torch.Tensor:
        return self._models[0]["module"][name]


def _fp32_groups(inner: Mapping[str, Any], kind: str) -> Any:
    return inner["fp32_flat_groups"] if kind == "zero3" else inner["single_partition_of_fp32_groups"]


def _torch_state(inner: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return inner["optimizer_state_dict"] if kind == "zero3" else inner["base_optimizer_state"]
