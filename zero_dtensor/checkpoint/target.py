"""What one DeepSpeed engine holds, as a checkpoint sees it: every entry's name and shape, this rank's pieces, the
optimizer's state keys and parameter groups. Built from :mod:`zero_dtensor._deepspeed.families` and the neutral
layout; the DeepSpeed-specific rest comes from :mod:`zero_dtensor._deepspeed.checkpointing`. No communication.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._deepspeed import checkpointing as ds
from .._deepspeed import families
from ..comm.collectives import mesh_for
from ..errors import UnsupportedDeepSpeedError
from ..comm.process_groups import global_world_size, world_size_of
from ..core.storage import FlatStorage
from .boxes import box_dtensor

__all__ = ["Piece", "Target", "describe", "fragment", "hyperparameters_by_name", "model_dict", "optim_dict",
           "tied_aliases"]


@dataclass(frozen=True)
class Piece:
    """This rank's part of one parameter: elements ``[start, stop)`` of the flattened parameter, found in flat
    group ``group`` (``-1``: a frozen parameter) at ``local`` (offset into the group's partition)."""

    name: str
    shape: torch.Size
    group: int
    start: int
    stop: int
    local: int


@dataclass(frozen=True)
class Target:
    """One engine's checkpoint geometry (this rank's view)."""

    masters: FlatStorage
    #: trainable parameters, model order (a tied parameter under its first name)
    pieces: tuple[Piece, ...]
    frozen: tuple[ds.FrozenParam, ...]
    #: the optimizer-state keys shaped like the parameter (``exp_avg``, ...), and whether there is a ``step``
    state_keys: tuple[str, ...]
    has_step: bool
    #: whether the optimizer state exists (else :func:`optim_dict` is given zero-filled partitions)
    ready: bool
    #: per flat group, its inner optimizer parameter group
    param_group: tuple[int, ...]
    process_group: dist.ProcessGroup
    #: ``(alias, name)`` for every further name of a tied parameter (``mid2.weight`` -> ``mid.weight``), module order
    aliases: tuple[tuple[str, str], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pieces)

    def shapes(self) -> dict[str, torch.Size]:
        """Every model entry's shape (trainable and frozen; a tied parameter under its first name)."""
        return {**{p.name: p.shape for p in self.pieces}, **{f.name: f.shape for f in self.frozen}}

    def alias_shapes(self) -> dict[str, torch.Size]:
        """The further names of tied parameters, with their shapes."""
        shapes = self.shapes()
        return {alias: shapes[name] for alias, name in self.aliases if name in shapes}

    def entry_keys(self) -> tuple[str, ...]:
        """The optimizer-state keys of each parameter (``step`` last where there is one)."""
        return self.state_keys + (("step",) if self.has_step else ())


def tied_aliases(module: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """``(alias, first name)`` for every name under which ``module`` lists a parameter it already listed (tied
    weights: ``named_parameters()`` keeps the first name only; torch's ``get_model_state_dict`` keeps them all)."""
    first: dict[int, str] = {}
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return tuple(out)


def describe(engine: Any) -> Target:
    """``engine``'s :class:`Target`. Refuses engines whose data-parallel group is not the whole world (model,
    pipeline or sequence parallelism: every data-parallel group would write the same keys)."""
    masters = families.master_storage(engine)
    pg = masters.process_groups[0]
    if world_size_of(pg) != global_world_size():
        raise UnsupportedDeepSpeedError(
            f"zero_dtensor checkpoints need the data-parallel group to be the whole world ({world_size_of(pg)} of "
            f"{global_world_size()} ranks): model, pipeline or sequence parallelism is not supported")
    layout = masters.layout
    pieces = []
    for p in layout.params:
        g = layout.groups[p.group]
        start, stop = p.rank_range(g, g.rank)
        local = p.local_offset(g, g.rank) if stop > start else 0
        pieces.append(Piece(p.name, p.shape, p.group, start, stop, local))
    ready = families.optimizer_state_ready(engine)
    if ready:
        keys = families.optimizer_state_keys(engine)
        has_step = all(s is not None for s in families.optimizer_steps(engine))
    else:
        keys, has_step = ds.probe_state_keys(engine)
    return Target(masters=masters, pieces=tuple(pieces), frozen=ds.frozen_params(engine, set(layout.names)),
                  state_keys=keys, has_step=has_step, ready=ready,
                  param_group=ds.param_group_of_flat_groups(engine), process_group=pg,
                  aliases=tied_aliases(engine.module))


def fragment(target: Target, piece: Piece, partitions: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The 1-D fragment of ``piece`` in ``partitions`` (a view)."""
    return partitions[piece.group][piece.local:piece.local + piece.stop - piece.start]


def _entry(target: Target, fragment_: torch.Tensor, shape: torch.Size, start: int, exact: bool) -> Any:
    mesh = mesh_for(target.process_group, fragment_.device.type)
    return box_dtensor(fragment_, shape, start, mesh, exact=exact)


def model_dict(target: Target, partitions: tuple[torch.Tensor, ...],
               frozen: Mapping[str, torch.Tensor], *, exact: bool = False) -> dict[str, Any]:
    """``{fqn: value}``: trainable parameters as box DTensors over ``partitions`` (masters' geometry), frozen ones
    from ``frozen`` (this rank's 1-D piece; replicated ones as the plain full tensor). Ranks holding none of a
    parameter omit it. A tied parameter's further names hold the same value, as in torch's FSDP2 state dict (DCP
    then writes its bytes once per name). No copy. ``exact``: boxes over storages of exactly their bytes
    (:func:`~.boxes.box_dtensor`; for writing only)."""
    out: dict[str, Any] = {}
    for piece in target.pieces:
        value = _entry(target, fragment(target, piece, partitions), piece.shape, piece.start, exact)
        if value is not None:
            out[piece.name] = value
    for f in target.frozen:
        local = frozen[f.name]
        if f.replicated:
            out[f.name] = local.view(f.shape)
        else:
            value = _entry(target, local, f.shape, f.start, exact)
            if value is not None:
                out[f.name] = value
    for alias, name in target.aliases:
        if name in out:
            out[alias] = out[name]
    return out


def optim_dict(target: Target, states: Mapping[str, tuple[torch.Tensor, ...]], steps: tuple[float, ...],
               hyperparameters: Mapping[str, Mapping[str, Any]], *, exact: bool = False) -> dict[str, Any]:
    """torch's flattened optimizer state dict: ``state.<fqn>.<key>`` box DTensors over ``states[key]`` (per flat
    group partitions), ``state.<fqn>.step`` a 0-d float32 tensor per parameter (from ``steps``, per flat group), and
    ``param_groups.<fqn>.<name>`` from ``hyperparameters[fqn]``. No copy of the state. ``exact``: as in
    :func:`model_dict`."""
    out: dict[str, Any] = {}
    for piece in target.pieces:
        for key in target.state_keys:
            value = _entry(target, fragment(target, piece, states[key]), piece.shape, piece.start, exact)
            if value is not None:
                out[f"state.{piece.name}.{key}"] = value
        if target.has_step:
            out[f"state.{piece.name}.step"] = torch.tensor(float(steps[piece.group]), dtype=torch.float32)
        for name, value in hyperparameters.get(piece.name, {}).items():
            out[f"param_groups.{piece.name}.{name}"] = value
    return out


def hyperparameters_by_name(engine: Any, target: Target) -> dict[str, dict[str, Any]]:
    """Per trainable parameter, every hyperparameter of its inner parameter group (a copy of the values)."""
    groups = ds.group_hyperparameters(engine)
    return {p.name: dict(groups[target.param_group[p.group]]) for p in target.pieces}
