"""Offline conversion of checkpoints that DeepSpeed's ``engine.save_checkpoint`` wrote: :func:`convert`, and
``python -m zero_dtensor.convert SRC DST [--to dcp|safetensors] [--tag TAG] [--dtype ...]`` (:mod:`.__main__`).

Modules: :mod:`.to_dcp` (the DCP checkpoint :func:`zero_dtensor.save` writes: masters, optimizer state, counters,
scheduler, scaler, client state) and :mod:`.to_safetensors` (the weights as Hugging Face safetensors). DeepSpeed's
files are read by :mod:`zero_dtensor._deepspeed.checkpoint_layout`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable

import torch

from .._deepspeed.checkpoint_layout import open_checkpoint
from ..errors import ConversionError
from . import to_dcp, to_safetensors

__all__ = ["ConversionError", "convert"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    found = _DTYPES.get(str(dtype).removeprefix("torch."))
    if found is None:
        raise ValueError(f"dtype {dtype!r}: one of fp32, bf16, fp16")
    return found


def _temporary(dst: str) -> str:
    parent = os.path.dirname(os.path.abspath(dst))
    return os.path.join(parent, f".{os.path.basename(os.path.abspath(dst))}.converting-{uuid.uuid4().hex[:8]}")


def _sync_folder(path: str) -> None:
    """``fsync`` the folder ``path`` (its entries: names created or renamed in it), where the system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a folder that cannot be fsynced (some file systems, Windows): the files were
        pass
    finally:
        os.close(fd)


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, tag: str | None = None, to: str = "dcp",
            dtype: torch.dtype | str = torch.float32, max_shard_size: int | str = "5GB", sync_files: bool = True,
            progress: Callable[[int, int], None] | None = None) -> str:
    """Convert a checkpoint that DeepSpeed's ``engine.save_checkpoint`` wrote into torch's DCP format or safetensors.

    Offline, in one process: no engine, no GPU, no process group. ZeRO stages 1-3 and ``BF16_Optimizer``, fp32 /
    bf16 / fp16, any world size, tied and frozen parameters, several parameter groups. The result is written into a
    temporary folder beside ``dst`` and renamed to ``dst`` at the end, so a conversion that fails or is killed
    leaves nothing at ``dst`` (a killed one leaves its ``.<dst>.converting-*`` folder).

    Args:
        src: the folder ``engine.save_checkpoint`` wrote (its ``latest`` file names the tag), or the tag folder.
        dst: the folder to create; it must not exist or be empty.
        tag: the tag to convert instead of the one ``latest`` names.
        to: ``"dcp"``: the checkpoint ``zd.save`` writes (fp32 masters under ``model.*``, frozen weights in their
            dtype, every optimizer-state key, the step, each group's hyperparameters, the engine's counters, the lr
            scheduler, the loss scaler and the client state); load it with ``zd.load`` into an engine of any world
            size and ZeRO stage, or into FSDP2 + a torch optimizer with ``torch.distributed.checkpoint``.
            ``"safetensors"``: the weights as Hugging Face safetensors files with an index (those of DeepSpeed's
            ``zero_to_fp32``, byte for byte where it can write them).
        dtype: ``to="safetensors"`` only: the floating-point dtype written (``fp32``, ``bf16``, ``fp16``).
        max_shard_size: ``to="safetensors"`` only: the largest file (``"5GB"``, or bytes), as ``zero_to_fp32``.
        sync_files: ``to="dcp"`` only: fsync each file before ``.metadata`` is written (as ``zd.save``), then the
            folder and, after the rename, its parent: the checkpoint is on the disk when the call returns.
            ``False``: the operating system writes it back when it likes (as DeepSpeed's own tools do).
        progress: called as ``progress(bytes_done, bytes_total)`` after each tensor is written (the library prints
            nothing; the command line draws a progress bar with it).

    Returns:
        str: ``dst``.

    Raises:
        ConversionError: before anything is written, naming the file and what to do: a missing or truncated rank
            file, files of different saves (``ds_version``, world size or step), a mixture-of-experts, pipeline- or
            model-parallel checkpoint, a ZeRO stage-0 checkpoint, an unknown format; or ``dst`` is not empty.

    Communication:
        None: one process reads the rank files and writes the result.

    Device and memory:
        CPU only. The partition files are read memory-mapped and one parameter is assembled at a time: besides the
        page cache, at most about twice the largest parameter (``to="dcp"``: one being written by a second thread
        while the next is assembled, up to 128 MiB, larger ones one at a time; ``to="safetensors"``: one, twice
        where a dtype is cast) and the plan's metadata.

    Example:
        ```python
        zd.convert("checkpoints/", "checkpoints-dcp/")      # then zd.load(engine, "checkpoints-dcp/") at any world size
        zd.convert("checkpoints/", "hf/", to="safetensors", dtype="bf16")
        ```
    """
    if to not in ("dcp", "safetensors"):
        raise ValueError(f"to={to!r}: 'dcp' or 'safetensors'")
    out_dtype = _dtype(dtype)
    dst = os.fspath(dst)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise ConversionError(f"{dst}: exists and is not an empty folder; remove it or pick another destination. "
                              "Nothing was written.")
    files = open_checkpoint(src, tag)
    if to == "dcp":
        total = to_dcp.total_bytes(to_dcp.dcp_entries(files)[0])
    else:
        total = to_safetensors.total_bytes(files, out_dtype)
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    temporary = _temporary(dst)
    try:
        if to == "dcp":
            to_dcp.write_dcp(files, temporary, advance, sync_files=sync_files)
        else:
            to_safetensors.write_safetensors(files, temporary, advance, dtype=out_dtype,
                                             max_shard_size=max_shard_size)
        durable = to == "dcp" and sync_files
        if durable:  # the files were fsynced by the writer; their names in the folder too, before it is renamed
            _sync_folder(temporary)
        if os.path.isdir(dst):
            os.rmdir(dst)  # empty (checked above)
        os.rename(temporary, dst)
        if durable:  # and the rename: the checkpoint is on the disk when the call returns
            _sync_folder(os.path.dirname(os.path.abspath(dst)))
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return dst
