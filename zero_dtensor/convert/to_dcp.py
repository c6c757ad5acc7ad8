"""A DeepSpeed checkpoint written as the DCP checkpoint :func:`zero_dtensor.save` writes, one parameter at a time.

The state dict handed to ``torch.distributed.checkpoint.save`` holds **meta tensors** (shapes and dtypes only) for
the masters, the optimizer state and the frozen weights; DCP plans the checkpoint from them, and its writer asks
:class:`StreamingPlanner` for each tensor as it writes it (``resolve_data``): the tensor is then assembled from the
memory-mapped partition files (a view of the file where the parameter lies in one piece, else its pieces joined
into one of two reused buffers, :class:`JoinBuffers`), written and dropped. The writer is
:class:`~zero_dtensor.checkpoint.pipelined_writer.PipelinedWriter`: the files :func:`zero_dtensor.save`'s
:class:`~zero_dtensor.checkpoint.writer.DirectWriter` writes, one tensor's bytes written by a second thread while
the next tensor is assembled and checksummed. One process, no process group (``no_dist``). No communication.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .._deepspeed.checkpoint_files import SavedFiles, SavedParam
from ..checkpoint.boxes import storage_exact
from ..checkpoint.binding import bind
from ..checkpoint.planners import CachingSavePlanner
from ..checkpoint.pipelined_writer import PipelinedWriter

__all__ = ["dcp_entries", "write_dcp"]

#: what one entry of the DCP state dict is made of: the parameter and which of its values
Source = tuple[SavedParam, str]


def _blob(value: Any) -> io.BytesIO:
    """``value`` pickled into one DCP bytes entry, as :func:`zero_dtensor.save` writes its extras."""
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def dcp_entries(files: SavedFiles) -> tuple[dict[str, Any], dict[str, Source]]:
    """The state dict to save (``model`` / ``optim`` / ``zero_dtensor`` sections, tensors as meta tensors) and, per
    flattened DCP key of a meta tensor, where its value comes from."""
    layout = files.layout
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for p in layout.params:
        model[p.name] = torch.empty(p.shape, dtype=torch.float32, device="meta")
        sources[f"model.{p.name}"] = (p, "fp32")
        for key in layout.state_keys:
            optim[f"state.{p.name}.{key}"] = torch.empty(p.shape, dtype=files.dtype(p, key), device="meta")
            sources[f"optim.state.{p.name}.{key}"] = (p, key)
        step = layout.steps[p.group]
        if step is not None:
            optim[f"state.{p.name}.step"] = torch.tensor(step, dtype=torch.float32)
        for name, value in layout.hyperparameters[p.group].items():
            optim[f"param_groups.{p.name}.{name}"] = value
    for f in layout.frozen:
        model[f.name] = torch.empty(f.shape, dtype=files.dtype(f, "frozen"), device="meta")
        sources[f"model.{f.name}"] = (f, "frozen")
    for alias, owner in layout.aliases:  # a tied parameter under each of its names, as torch's state dict lists it
        if owner in model:
            model[alias] = model[owner]
            sources[f"model.{alias}"] = sources[f"model.{owner}"]
    extras = {"engine": _blob(layout.counters), "lr_scheduler": _blob(layout.lr_scheduler),
              "loss_scaler": _blob(layout.loss_scaler), "client_state": _blob(layout.client_state)}
    return {"model": model, "optim": optim, "zero_dtensor": extras}, sources


try:  # torch's count of the references to a storage (tensors, views, storage slices)
    _STORAGE_USE_COUNT = torch._C._storage_Use_Count
except AttributeError:  # pragma: no cover - a torch without it: no buffer is reused (a new tensor per join)
    _STORAGE_USE_COUNT = None


def _use_count(buffer: torch.Tensor) -> int | None:
    """How many tensors and storages share ``buffer``'s memory (views, storage slices), where torch says."""
    return None if _STORAGE_USE_COUNT is None else int(_STORAGE_USE_COUNT(buffer.untyped_storage()._cdata))


class JoinBuffers:
    """Memory reused for the values that are joined from several pieces (every ZeRO-3 parameter): at most
    ``count`` buffers of ``size`` bytes, each lent again once nothing holds a view of it any more (torch's use
    count of its storage back to what it was when made). A fresh tensor's pages are zero-filled by the kernel as
    they are first touched, one page fault per 4 KiB: about 25 ms per 64 MiB on the 2-core development machine,
    three times the join's own copy (measured: joining a 64 MiB ZeRO-3 value from the page cache 33 ms into a new
    tensor, 7.5 ms into a reused one), paid for every value of the checkpoint. Values over ``size`` bytes get a
    new tensor, and the idle buffers are let go first, so that one such value is never held beside them."""

    def __init__(self, size: int, count: int = 2) -> None:
        self._size, self._count = size, count
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, its use count when idle)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A 1-D ``dtype`` tensor of ``numel`` elements over an idle buffer, or ``None`` (make a new one)."""
        nbytes = numel * dtype.itemsize
        if nbytes > self._size or _STORAGE_USE_COUNT is None:
            self._buffers = [b for b in self._buffers if _use_count(b[0]) != b[1]]  # the idle ones let go
            return None
        idle = [b for b, count in self._buffers if _use_count(b) == count]
        if not idle:
            if len(self._buffers) == self._count:
                return None  # both lent (not with one value in flight, as the writer keeps it): a new tensor
            buffer = torch.empty(self._size, dtype=torch.uint8)
            self._buffers.append((buffer, _use_count(buffer)))
            idle = [buffer]
        return idle[0][:nbytes].view(dtype)


class StreamingPlanner(CachingSavePlanner):
    """DCP's save planner whose tensors are built when the writer asks for them (module docstring); ``progress``
    is called with each tensor's bytes once it is built. Values joined from several pieces are joined into
    :class:`JoinBuffers` of up to ``join_bytes`` (what the writer holds while the next value is built)."""

    def __init__(self, files: SavedFiles, sources: dict[str, Source], progress: Callable[[int], None],
                 join_bytes: int = 0) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
        self._files, self._sources, self._progress = files, sources, progress
        joined = [p.numel * files.dtype(p, key).itemsize for p, key in sources.values() if files.joined(p)]
        self._joins = JoinBuffers(max([n for n in joined if n <= join_bytes], default=0))

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        source = self._sources.get(write_item.index.fqn)
        if write_item.type == WriteItemType.BYTE_IO or source is None:
            return super().resolve_data(write_item)
        param, key = source
        out = self._joins.take(param.numel, self._files.dtype(param, key)) if self._files.joined(param) else None
        tensor = self._files.read(param, key, out)
        planned = write_item.tensor_data
        if planned is None or tuple(tensor.shape) != tuple(planned.size) or tensor.dtype != planned.properties.dtype:
            raise AssertionError(f"{write_item.index.fqn}: built {tuple(tensor.shape)} {tensor.dtype}, planned "
                                 f"{planned}")  # DCP would write a wrong-size tensor without a word
        self._progress(tensor.numel() * tensor.element_size())
        return storage_exact(tensor.contiguous())


def total_bytes(state: dict[str, Any]) -> int:
    """The bytes of the meta tensors of :func:`dcp_entries`' state dict (what the progress counts up to)."""
    return sum(v.numel() * v.element_size() for section in ("model", "optim") for v in state[section].values()
               if isinstance(v, torch.Tensor) and v.is_meta)


def write_dcp(files: SavedFiles, path: str, progress: Callable[[int], None], *, sync_files: bool = True) -> None:
    """Write the DCP checkpoint of ``files`` into the folder ``path`` (one ``__0_0.distcp`` and ``.metadata``).
    **Memory**: two parameters' values at most (the one being written and the next; none where a value lies in
    one piece of one file: written from the mapped file; values joined from pieces, up to the writer's
    ``pipeline_bytes`` each, in two buffers kept for the whole conversion), plus DCP's plan (a few hundred bytes
    per entry)."""
    state, sources = dcp_entries(files)
    bind(state, 0)  # the one data file holds this checkpoint's save_id, as zd.save's files do
    with warnings.catch_warnings():  # DCP warns that it assumes one process without a process group: it is one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        writer = PipelinedWriter(path, sync_files=sync_files)
        dcp.save(state, storage_writer=writer, planner=StreamingPlanner(files, sources, progress,
                                                                        writer.pipeline_bytes), no_dist=True)
