"""A DeepSpeed checkpoint's weights written as Hugging Face safetensors files (sharded, with an index), one
parameter at a time.

The entries are those of DeepSpeed's ``zero_to_fp32`` (``convert_zero_checkpoint_to_state_dict``), in its order:
persistent buffers, frozen parameters (also those of ZeRO-1 and ``BF16_Optimizer`` checkpoints, which it drops or
refuses), the trainable parameters' fp32 masters, then the further names of tied parameters (written as their own
copy: safetensors stores no shared tensors). Floating-point values are cast to ``dtype``, others kept. Files are cut
as ``huggingface_hub.split_torch_state_dict_into_shards`` cuts them (in entry order, a new file when the next entry
would pass ``max_shard_size``; an entry larger than that alone), named ``model.safetensors`` or
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``.

Each file is written as ``safetensors.torch.save_file`` writes it, byte for byte: its header's entry order is
``safetensors``' own (asked of the library with empty tensors of the same names and dtypes), then every tensor's
bytes in that order, each assembled from the memory-mapped partition files as it is written. torch's
``HuggingFaceStorageWriter`` was not used: it builds each whole file in memory (about 3x its bytes). No communication.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .._deepspeed.checkpoint_files import SavedFiles, SavedParam

__all__ = ["Entry", "entries", "shards", "write_safetensors"]

INDEX = "model.safetensors.index.json"
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


@dataclass(frozen=True)
class Entry:
    """One tensor of the output: ``name``, its source (``param`` and ``key``: ``fp32``, ``frozen`` or ``buffer``),
    its shape and output dtype."""

    name: str
    param: SavedParam | None
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


def _out_dtype(dtype: torch.dtype, want: torch.dtype) -> torch.dtype:
    return want if dtype.is_floating_point else dtype


def entries(files: SavedFiles, dtype: torch.dtype) -> list[Entry]:
    """The output tensors in ``zero_to_fp32``'s order (module docstring)."""
    layout = files.layout
    out = []
    for name in layout.buffers:
        value = files.buffer(name)
        out.append(Entry(name, None, "buffer", tuple(value.shape), _out_dtype(value.dtype, dtype)))
    out += [Entry(f.name, f, "frozen", tuple(f.shape), _out_dtype(files.dtype(f, "frozen"), dtype))
            for f in layout.frozen]
    out += [Entry(p.name, p, "fp32", tuple(p.shape), dtype) for p in layout.params]
    by_name = {e.name: e for e in out}
    out += [Entry(alias, by_name[owner].param, by_name[owner].key, by_name[owner].shape, by_name[owner].dtype)
            for alias, owner in layout.aliases if owner in by_name]
    return out


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5,000,000,000 (decimal units, as ``huggingface_hub`` reads them); ints as they are."""
    if isinstance(size, int):
        return size
    text = size.strip()
    unit = text[-2:].upper()
    if unit not in _UNITS:
        raise ValueError(f"max_shard_size {size!r}: a number of bytes or a size such as '5GB' (TB, GB, MB, KB)")
    return int(float(text[:-2].strip()) * _UNITS[unit])


def shards(found: list[Entry], max_shard_size: int | str) -> dict[str, list[Entry]]:
    """File name -> entries, cut as ``huggingface_hub`` cuts a state dict (module docstring)."""
    limit = parse_size(max_shard_size)
    cut: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in found:
        if entry.nbytes > limit:
            cut.append([entry])
            continue
        if size + entry.nbytes > limit:
            cut.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current:
        cut.append(current)
    if len(cut) == 1:
        return {"model.safetensors": cut[0]}
    return {f"model-{i + 1:05d}-of-{len(cut):05d}.safetensors": part for i, part in enumerate(cut)}


def _header(part: list[Entry]) -> tuple[bytes, list[Entry]]:
    """``safetensors.torch.save_file``'s header for ``part`` and the entries in its data order."""
    from safetensors.torch import save

    probe = save({e.name: torch.empty(0, dtype=e.dtype) for e in part}, metadata={"format": "pt"})
    (length,) = struct.unpack("<Q", probe[:8])
    order = json.loads(probe[8:8 + length])
    by_name = {e.name: e for e in part}
    header: dict[str, object] = {"__metadata__": order.pop("__metadata__")}
    ordered, offset = [], 0
    for name, info in order.items():
        entry = by_name[name]
        header[name] = {"dtype": info["dtype"], "shape": list(entry.shape), "data_offsets": [offset,
                                                                                          offset + entry.nbytes]}
        offset += entry.nbytes
        ordered.append(entry)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def _value(files: SavedFiles, entry: Entry) -> torch.Tensor:
    if entry.key == "buffer":
        value = files.buffer(entry.name)
    else:
        assert entry.param is not None
        value = files.read(entry.param, entry.key)
    return value.to(entry.dtype).contiguous()


def _bytes(value: torch.Tensor) -> Iterator[memoryview]:
    flat = value.reshape(-1)
    if flat.numel():
        yield memoryview(flat.view(torch.uint8).numpy())


def write_safetensors(files: SavedFiles, path: str, progress: Callable[[int], None], *, dtype: torch.dtype,
                      max_shard_size: int | str = "5GB") -> None:
    """Write the weights of ``files`` into the folder ``path`` (module docstring). **Memory**: one parameter's
    value at a time (none where it lies in one piece of one file in the output dtype: written from the mapped
    file), plus one cast copy where the dtype changes."""
    found = entries(files, dtype)
    cut = shards(found, max_shard_size)
    os.makedirs(path, exist_ok=True)
    for filename, part in cut.items():
        header, ordered = _header(part)
        with open(os.path.join(path, filename), "wb") as f:
            f.write(header)
            for entry in ordered:
                value = _value(files, entry)
                for chunk in _bytes(value):
                    f.write(chunk)
                progress(entry.nbytes)
                del value
    if len(cut) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in found)},
                 "weight_map": {e.name: name for name, part in cut.items() for e in part}}
        with open(os.path.join(path, INDEX), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def total_bytes(files: SavedFiles, dtype: torch.dtype) -> int:
    """The bytes :func:`write_safetensors` writes (tensor data)."""
    return sum(e.nbytes for e in entries(files, dtype))
