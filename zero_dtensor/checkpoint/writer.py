"""A DCP file-system writer that writes each tensor entry with torch's zip writer, without pickling it again.

DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` ``torch.save``s every tensor entry into the rank's
``.distcp`` file: per entry a new pickler, torch's ``persistent_id`` for the storage, a Python wrapper around the
stream that every chunk of the archive passes through, and a flush. That is about 0.07 ms of Python per entry, and
a ZeRO checkpoint has hundreds of entries per rank (one per parameter and family). Its bytes entries (thousands of
pickled hyperparameters) each get the same wrapper class, built anew, and a flush.

:class:`DirectWriter` writes the same bytes. The pickled header of a ``torch.save``d tensor (``data.pkl``) depends
only on what the tensor looks like (dtype, shape, strides, storage offset and size), so the first entry of each
look in the process is ``torch.save``d as DCP does. The same tensor is then written again through torch's zip
writer (``torch._C.PyTorchFileWriter``) with that header and torch's other records. Where the two archives are
equal byte for byte, later entries of that look (in this save and later ones) take the direct path; otherwise
they keep ``torch.save``. So the file is what DCP writes, whatever the torch version, and any DCP reader (torch's
own, FSDP2's) reads it. Tensors with Python state, ``requires_grad``, or a layout other than strided take
``torch.save`` every time.

Bytes entries are appended to the stream as they are. Only the single-threaded writer without stream extensions is
changed (``thread_count=1``, DCP's default); otherwise DCP's own path runs. Memory: besides DCP's, the first entry
of each look in the process is held twice more, briefly (its ``torch.save`` archive and the direct one, to
compare), and each look's header is kept (a few hundred bytes). No communication.

With ``sync_files`` (DCP's default), every :data:`WRITEBACK_BYTES` written the kernel is asked to start writing them
to the disk (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which returns at once), so the disk takes the bytes
while later ones are written and the ``fsync`` at the end, as DCP's, waits only for the rest. What reaches the
disk, and when the save returns, are DCP's; where there is no such call, or the file system refuses it, only the
``fsync`` at the end runs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import os
import queue
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    SerializationFormat,
    _item_size,
    _OverlappingCpuLoader,
    _SerialCpuLoader,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.serialization import _get_storage_alignment, get_crc32_options

from .binding import BoundPrefix

__all__ = ["DirectWriter"]

#: what a tensor's ``torch.save`` header depends on (``_Archives.look``)
_Look = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int, int]


#: per look and torch's serialization settings (crc32, alignment): torch.save's ``data.pkl`` for it, or ``None`` where
#: the direct archive differed from torch.save's. Checked once per process (a few hundred bytes per look).
_HEADERS: dict[tuple[_Look, bool, int], bytes | None] = {}

#: with ``sync_files``: the bytes written between two requests to start their writeback (module docstring); 0: none
WRITEBACK_BYTES = 16 * 2**20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, wait for nothing


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` where it has one (Linux), else ``None``."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_START_WRITEBACK = _sync_file_range()


class _Archives:
    """``torch.save``-identical archives of tensors, pickling each look's header once per process (module
    docstring)."""

    def __init__(self) -> None:
        self._crc32, self._alignment = get_crc32_options(), _get_storage_alignment()
        self.direct = 0  #: entries written by the direct path (for tests)

    @staticmethod
    def look(tensor: torch.Tensor) -> _Look | None:
        """What the pickled header of ``tensor`` depends on; ``None`` where it may depend on more (``torch.save``)."""
        plain = (type(tensor) is torch.Tensor and tensor.layout is torch.strided and tensor.is_cpu
                 and not tensor.requires_grad and not tensor.is_quantized and not tensor.is_nested
                 and not tensor.is_conj() and not tensor.is_neg() and not tensor.__dict__)
        if not plain:
            return None
        return (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(),
                tensor.untyped_storage().nbytes())

    def write(self, stream: Any, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s ``torch.save`` archive to ``stream``."""
        look = self.look(tensor)
        if look is None:
            torch.save(tensor, stream)
            return
        key = (look, self._crc32, self._alignment)
        if key not in _HEADERS:
            _HEADERS[key], saved = self._checked_header(tensor)
            stream.write(saved)
            return
        header = _HEADERS[key]
        if header is None:
            torch.save(tensor, stream)
            return
        self._write_direct(stream, tensor, header)
        self.direct += 1

    def _checked_header(self, tensor: torch.Tensor) -> tuple[bytes | None, memoryview]:
        """torch.save's header for ``tensor``'s look if the direct archive with it equals torch.save's (else
        ``None``), and torch.save's archive of ``tensor``."""
        saved = io.BytesIO()
        torch.save(tensor, saved)
        saved.seek(0)
        header = torch._C.PyTorchFileReader(saved).get_record("data.pkl")
        direct = io.BytesIO()
        self._write_direct(direct, tensor, header)
        return (header if direct.getbuffer() == saved.getbuffer() else None), saved.getbuffer()

    def _write_direct(self, stream: Any, tensor: torch.Tensor, header: bytes) -> None:
        """The records ``torch.serialization._save`` writes for one tensor, in its order, with ``header``."""
        archive = torch._C.PyTorchFileWriter(stream, self._crc32, self._alignment)
        alignment = str(self._alignment)
        archive.write_record("data.pkl", header, len(header))
        archive.write_record(".format_version", "1", 1)
        archive.write_record(".storage_alignment", alignment, len(alignment))
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        storage = tensor.untyped_storage()
        archive.write_record("data/0", storage, storage.nbytes())
        archive.write_end_of_file()


class DirectWriter(FileSystemWriter):
    """:class:`~torch.distributed.checkpoint.FileSystemWriter` writing tensor entries through :class:`_Archives`
    (module docstring): the same files, less Python per entry."""

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """DCP's (each rank's file prefix), each prefix with this save's ``save_id``, the one this (the
        coordinator's) writer records in ``.metadata``: every rank writes it into its file (:mod:`.binding`)."""
        return [dataclasses.replace(plan, storage_data=BoundPrefix(plan.storage_data.prefix, self.save_id))
                if type(plan.storage_data) is _StoragePrefix else plan
                for plan in super().prepare_global_plan(plans)]

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        if (self.thread_count != 1 or self.transforms.extensions
                or self.serialization_format is not SerializationFormat.TORCH_SAVE):
            return super()._write_data(planner, file_queue)
        self.archives = _Archives()
        results: list[WriteResult] = []
        while not file_queue.empty():
            path, storage_key, items = file_queue.get_nowait()
            results += self._write_file(path, storage_key, items, planner)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, path: str | os.PathLike, storage_key: str, items: list[WriteItem],
                    planner: SavePlanner) -> list[WriteResult]:
        """One ``.distcp`` file, laid out as DCP's ``_write_files_from_queue`` lays it out (bytes entries first,
        then the tensors in its loader's order, each copied to the CPU as DCP copies it)."""
        loader = self._loader(planner)
        for item in items:
            if item.type != WriteItemType.BYTE_IO:
                loader.add(_item_size(item), item)
        loader.start_loading()
        results = []
        with self.fs.create_stream(path, "wb") as stream:
            writeback = _Writeback(stream, WRITEBACK_BYTES if self.sync_files else 0)
            out = self._output(stream, writeback)
            try:
                for item in items:
                    if item.type == WriteItemType.BYTE_IO:  # as DCP's _write_item, without its wrapper and flush
                        data = planner.resolve_data(item)
                        if not isinstance(data, io.BytesIO):
                            raise AssertionError("Data must be io.BytesIO for BYTE_IO write items")
                        offset = out.tell()
                        out.write(data.getbuffer())
                        results.append(_written(out, item, storage_key, offset))
                for tensor, item in loader.values():
                    offset = out.tell()
                    out.hold(tensor)
                    self.archives.write(out, tensor)
                    results.append(_written(out, item, storage_key, offset))
                    out.written()
            finally:
                out.close()
            stream.flush()
            if self.sync_files:
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):
                    os.sync()
        return results

    def _output(self, stream: Any, writeback: _Writeback) -> Any:
        """Where :meth:`_write_file` writes ``stream``'s bytes: straight into it (:class:`_Inline`)."""
        return _Inline(stream, writeback)

    def _loader(self, planner: SavePlanner) -> Any:
        """The loader DCP's single-threaded writer picks: copies ahead from an accelerator, else one at a time."""
        backend = getattr(torch, torch._C._get_privateuse1_backend_name(), None)
        accelerator = torch.cuda.is_available() or (backend is not None and backend.is_available())
        if accelerator and self.per_thread_copy_ahead > 0:
            return _OverlappingCpuLoader(planner.resolve_data, inflight_threshhold=self.per_thread_copy_ahead)
        return _SerialCpuLoader(planner.resolve_data)


class _Inline:
    """``stream`` as :meth:`DirectWriter._write_file` writes it by default: each write in the calling thread, the
    writeback started (:class:`_Writeback`) after each tensor."""

    def __init__(self, stream: Any, writeback: _Writeback) -> None:
        self.write, self.tell, self.flush, self.seek = stream.write, stream.tell, stream.flush, stream.seek
        self.written = writeback.written

    def hold(self, tensor: torch.Tensor) -> None:
        """Nothing to keep: every write is done when it returns."""

    def close(self) -> None:
        """Nothing queued."""


class _Writeback:
    """Asks the kernel to start writing ``stream``'s bytes to the disk, ``every`` bytes (module docstring). A hint:
    a stream without a file descriptor, or one whose file system refuses it, is left to the ``fsync`` at the end."""

    def __init__(self, stream: Any, every: int) -> None:
        self._stream, self._every, self._started = stream, every, 0
        self._fd: int | None = None
        if every > 0 and _START_WRITEBACK is not None:
            try:
                self._fd = stream.fileno()
            except (AttributeError, OSError, io.UnsupportedOperation):
                pass

    def written(self) -> None:
        """Start the writeback of what was written since the last start, if that is ``every`` bytes or more."""
        if self._fd is None or self._stream.tell() - self._started < self._every:
            return
        self._stream.flush()  # the bytes in Python's buffer reach the kernel first
        start, self._started = self._started, self._stream.tell()
        if _START_WRITEBACK(self._fd, start, self._started - start, _SYNC_FILE_RANGE_WRITE) != 0:
            self._fd = None


def _written(stream: Any, item: WriteItem, storage_key: str, offset: int) -> WriteResult:
    """DCP's record of ``item``, written into ``stream`` from ``offset`` to where the stream is now."""
    length = stream.tell() - offset
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(storage_key, offset, length))
