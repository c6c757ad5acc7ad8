"""What a checkpoint's DCP ``.metadata`` says, read and compared with the engine before anything is loaded: its
identity (DCP's ``save_id``), its entries' names and shapes against the engine's (:func:`check_metadata`). No
communication.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..errors import CheckpointReadError, IncompleteCheckpointError
from .target import Target

__all__ = ["METADATA", "check_metadata", "collector_paused", "identity", "read_metadata"]

METADATA = ".metadata"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (and restored as it was). DCP builds, pickles and
    unpickles tens of thousands of small plan objects per call (a write item per piece, a metadata entry per
    name); their allocations start a collection of the whole heap (every torch and DeepSpeed object, about 420,000
    in the benchmark's process) in most saves: measured 250-280 ms of a 0.5-0.8 s save at 4 ranks. The objects
    are freed by reference counting when DCP drops them; nothing here builds cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def identity(metadata: Metadata) -> str:
    """The checkpoint's identity, as :func:`load`'s agreement compares it: DCP's ``save_id`` (a new UUID per save,
    written into ``.metadata`` by every writer built on ``FileSystemWriter``), else the number of entries and the
    first and last entry names (a checkpoint written without storage metadata)."""
    meta = getattr(metadata, "storage_meta", None)
    save_id = getattr(meta, "save_id", None)
    if save_id:
        return f"save_id {save_id}"
    names = sorted(metadata.state_dict_metadata)
    return f"{len(names)} entries {names[:1]}..{names[-1:]}"


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The checkpoint's DCP metadata; :class:`IncompleteCheckpointError` where there is none (a save that did not
    finish), :class:`CheckpointReadError` where it cannot be read (truncated, damaged). No communication."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, METADATA)):
        state = "does not exist" if not os.path.isdir(path) else "has no .metadata (a save that did not finish?)"
        raise IncompleteCheckpointError(f"checkpoint {path!r} {state}; nothing was loaded")
    try:
        with collector_paused():  # thousands of entries unpickled
            return FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a truncated or damaged .metadata: unpickling fails any way it likes
        raise CheckpointReadError(f"checkpoint {path!r}: its .metadata cannot be read ({type(exc).__name__}: {exc}); "
                                  "a truncated or damaged file? Nothing was loaded") from exc


def _tensor_shape(meta: Any) -> tuple[int, ...] | None:
    return tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None


def check_metadata(target: Target, metadata: Metadata) -> list[str]:
    """What differs between the checkpoint and the engine: names, shapes, optimizer-state keys."""
    entries = metadata.state_dict_metadata
    model = {k[len("model."):]: v for k, v in entries.items() if k.startswith("model.")}
    shapes = target.shapes()
    aliases = target.alias_shapes()  # optional: FSDP2 and save write them, a checkpoint without them loads too
    problems = []
    missing = sorted(set(shapes) - set(model))
    extra = sorted(set(model) - set(shapes) - set(aliases))
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing}")
    if extra:
        problems.append(f"parameters in the checkpoint that the engine does not have: {extra}")
    problems += [f"{n}: shape {_tensor_shape(model[n])} in the checkpoint, {tuple(s)} in the engine"
                 for n, s in {**shapes, **aliases}.items() if n in model and _tensor_shape(model[n]) != tuple(s)]
    found: dict[str, dict[str, Any]] = {}
    for key, meta in entries.items():
        if key.startswith("optim.state."):
            fqn, _, name = key[len("optim.state."):].rpartition(".")
            found.setdefault(fqn, {})[name] = meta
    expected = set(target.entry_keys())
    for p in target.pieces:
        keys = found.get(p.name, {})
        if set(keys) != expected:
            problems.append(f"optimizer state of {p.name}: {sorted(keys)} in the checkpoint, {sorted(expected)} "
                            "in the engine (another optimizer, or a checkpoint saved before its first step?)")
            continue
        for name, meta in keys.items():
            want = () if name == "step" else tuple(p.shape)
            if _tensor_shape(meta) != want:
                problems.append(f"optimizer state {name} of {p.name}: shape {_tensor_shape(meta)} in the "
                                f"checkpoint, {want} in the engine")
    stray = sorted(set(found) - set(target.names))
    if stray:
        problems.append(f"optimizer state for parameters the engine does not train: {stray}")
    return problems
