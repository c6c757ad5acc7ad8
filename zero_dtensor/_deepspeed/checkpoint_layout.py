"""Which files a DeepSpeed checkpoint folder holds, that they are one complete save of a kind the converter reads,
and the :class:`~.checkpoint_files.SavedLayout` they describe (the rules of :mod:`.checkpoint_files`' module
docstring). Every refusal is a :class:`~zero_dtensor.errors.ConversionError` naming the file and what to do, raised
before anything is written. No communication.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ConversionError
from .checkpoint_files import DEEPSPEED_KEYS, SavedFiles, SavedLayout, SavedParam, Span, load_file, scaler_numbers
from .checkpointing import COUNTERS

__all__ = ["open_checkpoint"]

_NOTHING = " Nothing was written."
_ZERO3_MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
_MODEL = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def _tag_folder(src: str, tag: str | None) -> str:
    if not os.path.isdir(src):
        raise ConversionError(f"{src}: no such folder; pass the folder engine.save_checkpoint wrote.{_NOTHING}")
    if tag is None:
        latest = os.path.join(src, "latest")
        if os.path.isfile(latest):
            with open(latest) as f:
                tag = f.read().strip()
        elif any(n.endswith("_model_states.pt") for n in os.listdir(src)):
            return src  # the tag folder itself
        else:
            tags = sorted(n for n in os.listdir(src) if os.path.isdir(os.path.join(src, n)))
            raise ConversionError(f"{src}: no 'latest' file and no *_model_states.pt: not a DeepSpeed checkpoint "
                                  f"folder (an unknown format?); pass the folder engine.save_checkpoint wrote and "
                                  f"a tag (found folders: {tags[:8]}).{_NOTHING}")
    folder = os.path.join(src, tag)
    if not os.path.isdir(folder):
        raise ConversionError(f"{folder}: no such tag folder; pass one of "
                              f"{sorted(n for n in os.listdir(src) if os.path.isdir(os.path.join(src, n)))[:8]}."
                              f"{_NOTHING}")
    return folder


def _refuse_unsupported_files(folder: str, names: Sequence[str]) -> None:
    moe = [n for n in names if re.match(r"^(layer_\d+_expert_\d+_mp_rank_\d+_model_states|"
                                        r"expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$", n)]
    if moe:
        raise ConversionError(f"{os.path.join(folder, moe[0])}: a mixture-of-experts checkpoint (expert files); "
                              "not supported: convert it with DeepSpeed's ds_to_universal." + _NOTHING)
    pipe = [n for n in names if re.match(r"^layer_\d+-model_\d+-model_states\.pt$", n)]
    if pipe:
        raise ConversionError(f"{os.path.join(folder, pipe[0])}: a pipeline-parallel checkpoint (per-layer files); "
                              "not supported: convert it with DeepSpeed's ds_to_universal." + _NOTHING)
    mp = sorted(n for n in names if (m := re.search(r"mp_rank_(\d+)", n)) and int(m.group(1)) != 0)
    if mp:
        raise ConversionError(f"{os.path.join(folder, mp[0])}: a model-parallel checkpoint (mp_rank > 0); not "
                              "supported: convert it with DeepSpeed's ds_to_universal." + _NOTHING)


def _check_model_file(path: str, data: Mapping[str, Any]) -> None:
    missing = [k for k in ("module", "param_shapes", "buffer_names", "dp_world_size", "ds_version") if k not in data]
    if missing:
        raise ConversionError(f"{path}: not a DeepSpeed ZeRO model-states file (no {missing}): an unknown format "
                              "or a DeepSpeed version before 0.6." + _NOTHING)
    if data.get("num_experts") is not None or data.get("ds_autoep_layers"):
        raise ConversionError(f"{path}: a mixture-of-experts checkpoint; not supported: convert it with DeepSpeed's "
                              "ds_to_universal." + _NOTHING)
    dims = data.get("checkpoint_parallel_dimensions") or {}
    if int(data.get("mp_world_size", 1)) > 1 or any(int(v) > 1 for v in dims.values()):
        raise ConversionError(f"{path}: a model- or pipeline-parallel checkpoint ({dims or 'mp_world_size > 1'}); "
                              "not supported: convert it with DeepSpeed's ds_to_universal." + _NOTHING)
    if data["module"] is None:
        raise ConversionError(f"{path}: holds no module (a pipeline-parallel checkpoint); not supported." + _NOTHING)


def find_files(src: str, tag: str | None) -> tuple[str, list[str], list[str], list[dict[str, Any]]]:
    """``(folder, model paths, optimizer paths, loaded model files)`` of the checkpoint, every rank's file present."""
    folder = _tag_folder(src, tag)
    names = sorted(os.listdir(folder))
    _refuse_unsupported_files(folder, names)
    zero3 = os.path.join(folder, _ZERO3_MODEL.format(0))
    first = zero3 if os.path.isfile(zero3) else os.path.join(folder, _MODEL)
    if not os.path.isfile(first):
        raise ConversionError(f"{folder}: no {_MODEL} or {_ZERO3_MODEL.format(0)}: not a DeepSpeed checkpoint "
                              "folder, or rank 0's model file is missing (copy it from where the save ran)."
                              + _NOTHING)
    m0 = load_file(first)
    _check_model_file(first, m0)
    world = int(m0["dp_world_size"])
    optim = {int(m.group(2)): m for n in names if (m := _OPTIM.match(n))}
    if not optim:
        stage = ((m0.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
        what = ("a ZeRO stage-0 checkpoint (the optimizer state is in the model file, nothing is partitioned): load "
                "it with torch.load, or save it again from a ZeRO engine" if m0.get("optimizer") is not None
                or stage == 0 else "its optimizer files are missing (copy every rank's *_optim_states.pt)")
        raise ConversionError(f"{folder}: no zero_pp_rank_*_optim_states.pt: {what}." + _NOTHING)
    prefixes = {m.group(1) or "" for m in optim.values()}
    prefix = prefixes.pop() if len(prefixes) == 1 else None
    if prefix is None:
        raise ConversionError(f"{folder}: holds optimizer files of two saves (bf16_ and plain names); keep one "
                              "save's files per folder." + _NOTHING)
    optim_paths = [os.path.join(folder, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(world)]
    extra = sorted(r for r in optim if r >= world)
    if extra:
        raise ConversionError(f"{os.path.join(folder, optim[extra[0]].group(0))}: rank {extra[0]} of a save at "
                              f"{max(extra) + 1}+ ranks, but {first} says {world} ranks: files of different saves "
                              "(keep one save's files per folder)." + _NOTHING)
    for path in optim_paths:
        if not os.path.isfile(path):
            raise ConversionError(f"{path}: file missing (the save ran at {world} ranks, each writes one); copy it "
                                  "from where the save ran." + _NOTHING)
    model_paths = [first]
    if first == zero3:
        model_paths = [os.path.join(folder, _ZERO3_MODEL.format(r)) for r in range(world)]
    models = [m0] + [load_file(p) for p in model_paths[1:]]
    return folder, model_paths, optim_paths, models


def _one_save(model_paths: Sequence[str], optim_paths: Sequence[str], models: Sequence[Mapping[str, Any]],
              optim: Sequence[Mapping[str, Any]]) -> None:
    """Refuse files of different saves: another ``ds_version``, world size or step than rank 0's model file."""
    m0 = models[0]
    want = (m0["ds_version"], int(m0["dp_world_size"]), int(m0.get("global_steps", 0)))
    for path, m in zip(model_paths[1:], models[1:]):
        _check_model_file(path, m)
        got = (m["ds_version"], int(m["dp_world_size"]), int(m.get("global_steps", 0)))
        if got != want:
            raise ConversionError(f"{path}: from another save than {model_paths[0]} (ds_version, world size, step "
                                  f"{got} against {want}); keep one save's files per folder." + _NOTHING)
    for path, o in zip(optim_paths, optim):
        if "optimizer_state_dict" not in o:
            raise ConversionError(f"{path}: not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict): an "
                                  "unknown format." + _NOTHING)
        if o.get("ds_version", want[0]) != want[0]:
            raise ConversionError(f"{path}: written by DeepSpeed {o.get('ds_version')}, {model_paths[0]} by "
                                  f"{want[0]}: files of different saves." + _NOTHING)
        counts = o["optimizer_state_dict"].get("partition_count")
        counts = [counts] if isinstance(counts, int) else list(counts or [])
        if any(int(c) != want[1] for c in counts):
            raise ConversionError(f"{path}: partitioned over {counts} ranks, {model_paths[0]} says {want[1]}: files "
                                  "of different saves (or expert groups: not supported)." + _NOTHING)


def _kind(path: str, inner: Mapping[str, Any]) -> tuple[str, int]:
    stage = inner.get("zero_stage")
    if stage is not None:
        value = int(stage.record_args[0]) if getattr(stage, "record_args", None) else int(stage)
        return ("zero3" if value == 3 else "zero12"), value
    if "single_partition_of_fp32_groups" in inner:
        return "bf16", 1
    raise ConversionError(f"{path}: no ZeRO partitions (zero_stage / fp32 groups): an unknown format." + _NOTHING)


def _torch_state(inner: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    state = inner.get("optimizer_state_dict" if kind == "zero3" else "base_optimizer_state")
    if not isinstance(state, Mapping) or "state" not in state:
        raise ConversionError("the optimizer files hold no torch optimizer state dict (elastic checkpoints are not "
                              "supported: save with zero_optimization.elastic_checkpoint false)." + _NOTHING)
    return state


def _zero12_params(inner0: Mapping[str, Any], kind: str, shapes: Sequence[Mapping[str, Any]], world: int,
                   path: str) -> tuple[list[SavedParam], list[int]]:
    params, sizes = [], []
    alignment = inner0.get("param_alignment_paddings") or [[] for _ in shapes]
    for g, group in enumerate(shapes):
        fp32 = inner0["single_partition_of_fp32_groups"][g]
        size = fp32.numel() + (int(inner0["group_paddings"][g]) if kind == "zero12" else 0)
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            n = math.prod(shape)
            spans = []
            for r in range(offset // size, (offset + n - 1) // size + 1 if n else 0):
                lo, hi = max(offset, r * size), min(offset + n, (r + 1) * size)
                spans.append(Span(r, g, lo - r * size, hi - r * size))
            params.append(SavedParam(name, torch.Size(shape), g, tuple(spans)))
            offset += n + (int(alignment[g][i]) if i < len(alignment[g]) else 0)
        if offset > size * world:
            raise ConversionError(f"{path}: group {g} holds {size * world} elements over {world} ranks, its "
                                  f"parameters {offset}: damaged or not from this save." + _NOTHING)
        sizes.append(size)
    return params, sizes


def _zero3_params(inner0: Mapping[str, Any], shapes: Sequence[Mapping[str, Any]], world: int,
                  path: str) -> tuple[list[SavedParam], list[int]]:
    params, sizes = [], []
    for s, group in enumerate(shapes):
        offset = 0
        for name, shape in group.items():
            n = math.prod(shape)
            p = math.ceil(n / world)
            spans = tuple(Span(r, s, offset, offset + valid) for r in range(world)
                          if (valid := max(0, min(p, n - r * p))) > 0)
            params.append(SavedParam(name, torch.Size(shape), s, spans))
            offset += p
        size = inner0["fp32_flat_groups"][s].numel()
        if offset > size:
            raise ConversionError(f"{path}: sub-group {s} holds {size} elements per rank, its parameters {offset}: "
                                  "damaged or not from this save." + _NOTHING)
        sizes.append(size)
    return params, sizes


def _frozen(kind: str, models: Sequence[Mapping[str, Any]], world: int, trainable: set[str],
            aliases: set[str], buffers: set[str]) -> tuple[list[SavedParam], str]:
    m0 = models[0]
    shapes = m0.get("frozen_param_shapes")
    if shapes is None:  # ZeRO-1 and BF16_Optimizer: the working weights in ``module`` are the only copy
        names = [n for n in m0["module"] if n not in trainable | aliases | buffers]
        return [SavedParam(n, m0["module"][n].shape, -1, (Span(0, -1, 0, m0["module"][n].numel()),))
                for n in names], "module"
    out = []
    for name, shape in shapes.items():
        n = math.prod(shape)
        if kind == "zero3":
            p = math.ceil(n / world)
            spans = tuple(Span(r, -1, 0, valid) for r in range(world) if (valid := max(0, min(p, n - r * p))) > 0)
        else:
            spans = (Span(0, -1, 0, n),)
        out.append(SavedParam(name, torch.Size(shape), -1, spans))
    return out, "fragments"


def build_layout(folder: str, model_paths: Sequence[str], optim_paths: Sequence[str],
                 models: Sequence[Mapping[str, Any]], optim: Sequence[Mapping[str, Any]]) -> SavedLayout:
    """The :class:`SavedLayout` of loaded files (checked to be one save)."""
    _one_save(model_paths, optim_paths, models, optim)
    m0, inner0 = models[0], optim[0]["optimizer_state_dict"]
    world = int(m0["dp_world_size"])
    kind, stage = _kind(optim_paths[0], inner0)
    shapes = m0["param_shapes"]
    if kind == "zero3":
        params, sizes = _zero3_params(inner0, shapes, world, optim_paths[0])
    else:
        params, sizes = _zero12_params(inner0, kind, shapes, world, optim_paths[0])
    torch_state = _torch_state(inner0, kind)
    if len(torch_state["state"]) != len(sizes):
        raise ConversionError(f"{optim_paths[0]}: holds optimizer state for {len(torch_state['state'])} of "
                              f"{len(sizes)} groups: saved before the first optimizer step? Take one step and save "
                              "again." + _NOTHING)
    first = torch_state["state"][0]
    keys = tuple(k for k, v in first.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == sizes[0])
    steps = tuple(_step(torch_state["state"][g].get("step")) for g in range(len(sizes)))
    for path, o in zip(optim_paths, optim):
        state = _torch_state(o["optimizer_state_dict"], kind)["state"]
        theirs = tuple(_step(state[g].get("step")) if g in state else None for g in range(len(sizes)))
        if theirs != steps:
            raise ConversionError(f"{path}: optimizer steps {theirs}, {optim_paths[0]} {steps}: files of different "
                                  "saves; keep one save's files per folder." + _NOTHING)
        for g, size in enumerate(sizes):
            lengths = {k: state[g][k].numel() for k in keys}
            fp32 = SavedFiles.fp32_length(o["optimizer_state_dict"], kind, g)
            if any(v != size for v in lengths.values()) or fp32 > size:
                raise ConversionError(f"{path}: group {g} holds {lengths} state and {fp32} fp32 elements, rank 0's "
                                      f"partition {size}: files of different saves, or damaged." + _NOTHING)
    groups = torch_state["param_groups"]
    owner = {s: i for i, g in enumerate(groups) for s in g["params"]}
    hyper = tuple({k: v for k, v in groups[owner.get(g, g)].items() if k != "params"} for g in range(len(sizes)))
    trainable = {p.name for p in params}
    aliases = tuple((str(a), str(o)) for a, o in (m0.get("shared_params") or {}).items())
    buffers = tuple(m0["buffer_names"])
    frozen, source = _frozen(kind, models, world, trainable, {a for a, _ in aliases}, set(buffers))
    weights = [v for k, v in m0["module"].items() if k not in buffers and torch.is_tensor(v)]
    client = {k: v for k, v in m0.items() if k not in DEEPSPEED_KEYS}
    return SavedLayout(
        folder=folder, kind=kind, stage=stage, world=world, ds_version=str(m0["ds_version"]), params=tuple(params),
        frozen=tuple(frozen), frozen_source=source,
        working_dtype=weights[0].dtype if weights else torch.float32, aliases=aliases, buffers=buffers,
        state_keys=keys, steps=steps, hyperparameters=hyper,
        counters={k: int(m0[k]) for k in COUNTERS if k in m0}, lr_scheduler=m0.get("lr_scheduler"),
        loss_scaler=scaler_numbers(inner0.get("loss_scaler")), client_state=client or None,
        files=(*model_paths, *optim_paths))


def _step(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item()) if torch.is_tensor(value) else float(value)


def open_checkpoint(src: str | os.PathLike, tag: str | None = None) -> SavedFiles:
    """The checkpoint in ``src`` (a folder ``engine.save_checkpoint`` wrote: its ``latest`` file names the tag, or
    ``tag``; or the tag folder itself), its files memory-mapped and checked to be one complete save of a supported
    kind, else :class:`~zero_dtensor.errors.ConversionError` naming the file and what to do. Reads the files'
    pickled records (small) and maps their tensor data; no tensor data is read here."""
    folder, model_paths, optim_paths, models = find_files(os.fspath(src), tag)
    optim = [load_file(p) for p in optim_paths]
    layout = build_layout(folder, model_paths, optim_paths, models, optim)
    return SavedFiles(layout, optim, list(models))
