"""A DCP file-system reader that reads tensor entries straight into their destination.

DCP's :class:`~torch.distributed.checkpoint.FileSystemReader` ``torch.load``s every tensor entry (a ``torch.save``
zip archive in a ``.distcp`` file) into new memory and then copies it into the destination: per entry the
weights-only unpickler, a zip reader and a fresh allocation (about 0.25 ms of Python per entry; 408 entries, 78 MB,
took 72-107 ms against 24 ms for reading their bytes, one process), then a second pass over the bytes.

:class:`DirectReader` reads the same files (any DCP checkpoint: written here, by FSDP2, by ``dcp.save``) and gives
the planner the same values. Per tensor entry it opens the archive with torch's own zip reader
(``torch._C.PyTorchFileReader``) and looks up its pickled header (``data.pkl``) and byte order: a header seen before
in this load says what the entry holds (dtype, shape, strides, storage size: headers are equal exactly when these
are); the first entry of each header is ``torch.load``ed as DCP does and its tensor describes the header. An entry
of the same length as one opened before, whose bytes before its data are equal to that one's but for the data's
CRC-32 (its header, byte order and other records, and the data record's zip header: one read), holds the same at
the same place and is not opened again (the zip reader costs about 0.1 ms per entry; the zip directory after the
data is then not read). Where the
entry is one contiguous little-endian storage of the destination's dtype and the wanted elements are one run of it
(a whole entry, or whole rows of it), ``readinto`` puts the bytes straight into the destination (a CPU tensor; for
another device, into a host buffer and one copy); otherwise, and for transformed entries, DCP's own path. A file
shorter than its entries raises before any of them is read, a short read too. Every tensor entry's data is
checked against the CRC-32 its archive records (torch's zip reader does not: a flipped bit loaded silently): bytes
read straight into place are CRC-ed there (:func:`~.crc.crc32`: zlib-ng's, else ``zlib.crc32``), an entry
``torch.load``ed over its loaded storage, and a record read only in part, or bound for a deferred destination, is
CRC-ed whole in the first pass over a read-only map of the file (:class:`Checksums`: the page cache's pages, not
copied; records taken in batches of up to 8 MiB, a batch of 256 KiB or more CRC-ed by one of a few threads while the
reader reads on); a deferred one is then copied into place in the second pass from that map (its pages already
mapped: no second read). Bytes read into place are CRC-ed 1 MiB at a time right after each
read (in cache: :data:`_CHUNK`); the CRC-32 is the data record's zip data descriptor's
(torch's writer puts one after the data, with its signature, which is required) or its local header's. A mismatch
raises ``OSError`` naming the file and the entry, in the first pass (before ``between``). A recorded 0 is "none"
only in an archive that records no CRC-32 for any record (``torch.serialization.set_crc32_options(False)``, see
:func:`~.crc.archive_records_crcs`): not checked. Each file's ``save_id`` entry is checked before its other entries
are read (:mod:`.binding`). Bytes entries carry no CRC-32 here. Entries are read in file order. With
``defer`` the reads into some destinations wait for a second pass (:class:`DirectReader`). Memory: no more than
DCP's path (one entry at a time, and only for destinations off the CPU), except that entries taking DCP's path into
deferred destinations are held until the second pass, and, until the second pass ends, read-only maps of the files
whose records are checked apart (:class:`Checksums`: the page cache's pages; up to 4 threads in the first pass). No communication
(``between`` may communicate).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import IO, Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .binding import FileBindings
from .layouts import DATA, Layout, Stored, Where, describe, run_of
from .crc import Checksums, archive_records_crcs, check_loaded, compare, crc32, descriptor_crc

__all__ = ["DirectReader", "read_bytes_entries"]

#: the zip records of a ``torch.save``d tensor that :class:`DirectReader` reads
_HEADER, _BYTE_ORDER = "data.pkl", "byteorder"
#: :func:`read_bytes_entries` reads entries less than this many bytes apart with one read (the bytes between too)
_GAP = 1 << 16
#: bytes read at a time where a record's data is CRC-ed as it is read into place: each piece is CRC-ed right after
#: its read, while it is in the core's cache (64 MB from the page cache, 2-core Xeon, ``zlib.crc32``: read in 0.5-1
#: MiB pieces, each CRC-ed, 22-23 ms of CPU; in 4 MiB pieces 28 ms; read whole, then CRC-ed, 43 ms)
_CHUNK = 1 << 20
#: batches (:data:`_BATCH`) of records checked apart (deferred, or read in part) at least this long are CRC-ed by
#: :class:`Checksums`' threads (over a map of the file) while the reader reads on; shorter ones at once
_THREADED = 1 << 18
#: :class:`Checksums` takes records checked apart in batches of up to this many bytes (consecutive records of one
#: file): one task, one size check and one comparison loop per batch rather than per record
_BATCH = 8 << 20
#: :class:`Checksums`' threads (records are independent: each is CRC-ed by one thread)
_THREADS = min(4, os.cpu_count() or 1)


@dataclass(frozen=True)
class _Deferred:
    """A checked read held back for the second pass: ``file_offset`` of the bytes for ``target`` in ``item``'s
    file, or (``file_offset`` ``None``) a ``loaded`` source to copy."""

    file_offset: int | None
    loaded: torch.Tensor | None
    target: torch.Tensor
    item: ReadItem


class DirectReader(FileSystemReader):
    """:class:`~torch.distributed.checkpoint.FileSystemReader` whose ``read_data`` reads tensor entries straight into
    their destinations where they allow it (module docstring); everything else as DCP does.

    Two passes, where ``defer`` says a destination must not be written before ``between`` has returned (the
    engine's own memory, loaded in place): the first reads every other entry, and for these checks the file size,
    the archive, its header and the bytes' place (an entry DCP's path must read is read into new memory then); then
    ``between()`` (checks and an agreement between ranks: if it raises, nothing deferred is written); the second
    pass reads the deferred bytes straight into place (and copies the entries read into new memory, which are held
    until then)."""

    def __init__(self, path: str, *args: Any, defer: Callable[[torch.Tensor], bool] | None = None,
                 between: Callable[[], None] | None = None, bindings: FileBindings | None = None,
                 **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        #: the files' ``save_id`` check (:mod:`.binding`): given, or made from the metadata DCP hands over
        self._bindings, self._given_bindings = bindings, bindings is not None
        self._headers: dict[tuple[bytes, bytes], Stored] = {}
        self._layouts: dict[int, list[Layout]] = {}  # per entry length, the layouts seen (:meth:`_located`)
        self._defer, self._between = defer, between
        self._deferred: list[_Deferred] = []
        self._checksums: Checksums | None = None  # :meth:`_check_record`'s threads (one load's)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if not self._given_bindings:
            self._bindings = FileBindings.of(metadata)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return self._read_data(plan, planner)
        finally:
            if self._checksums is not None:  # end the threads (a failed pass: their results unused), unmap
                self._checksums.close()
                self._checksums = None

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            items.sort(key=lambda it: self.storage_data[it.storage_index].offset)
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                _check_size(cast(IO[bytes], stream), relative_path, items, self.storage_data)
                if self._bindings is not None:  # the file is this checkpoint's, before any of its entries is read
                    self._bindings.check(cast(IO[bytes], stream), relative_path)
                for item in items:
                    self._read_item(cast(IO[bytes], stream), item, planner)
        if self._checksums is not None:  # every record's CRC-32 compared before anything deferred is written
            self._checksums.finish()  # its maps stay open: the second pass copies the checked bytes from them
        if self._between is not None:
            self._between()
        self._read_deferred(planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_deferred(self, planner: LoadPlanner) -> None:
        """The second pass: every held-back read, file by file in file order (copied from the file's map where
        :class:`Checksums` checked its records, else read)."""
        deferred, self._deferred = self._deferred, []
        per_file: dict[str, list[_Deferred]] = {}
        for read in deferred:
            per_file.setdefault(self.storage_data[read.item.storage_index].relative_path, []).append(read)
        for relative_path, reads in per_file.items():
            mapped = self._checksums.source(relative_path) if self._checksums is not None else None
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for read in reads:
                    if read.file_offset is None:
                        read.target.copy_(cast(torch.Tensor, read.loaded))
                    elif mapped is not None and read.file_offset + read.target.nbytes <= mapped[1]:
                        _copy_to(mapped[0], read.file_offset, read.target)  # checked bytes, from the file's map
                    else:
                        stream.seek(read.file_offset)
                        _read_to(cast(IO[bytes], stream), read.target, read.item)
                    planner.commit_tensor(read.item, read.target)

    def _deferring(self, target: torch.Tensor) -> bool:
        return self._defer is not None and self._defer(target)

    def _read_item(self, stream: IO[bytes], item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        if info.transform_descriptors:  # compressed or otherwise transformed: DCP's own path
            return self._read_as_dcp(stream, item, planner)
        if item.type == LoadItemType.BYTE_IO:
            stream.seek(info.offset)
            planner.load_bytes(item, io.BytesIO(_read_exactly(stream, info.length, item)))
            return None
        where = self._located(stream, info)
        if where is None:
            where = self._opened(stream, info, item, planner)
            if where is None:  # the first entry of its header: read (and checked) by torch.load
                return None
        stored, data = where.stored, where.data
        run = run_of(stored, item) if stored.direct else None
        target = planner.resolve_tensor(item).detach()
        if run is None or target.dtype != stored.dtype or not target.is_contiguous() \
                or target.numel() != run[1]:
            return self._read_as_dcp(stream, item, planner)
        size = target.element_size()
        record = math.prod(stored.shape) * size  # the data record's bytes (the entry's whole storage)
        if data + record + (8 if where.crc is None else 0) > info.length:  # would run past the entry: DCP's path
            return self._read_as_dcp(stream, item, planner)
        whole = run[0] == 0 and run[1] * size == record
        if self._deferring(target) or not whole:  # checked here, read into place later (or only a part of it)
            self._check_record(stream, item, where, info.offset + data, record)
        if self._deferring(target):
            self._deferred.append(_Deferred(info.offset + data + run[0] * size, None, target, item))
            return None
        stream.seek(info.offset + data + run[0] * size)
        crc = _read_to(stream, target, item, crc=whole)
        if whole:
            compare(self._recorded(stream, where, item), cast(int, crc), self._entry(item), required=where.required)
        planner.commit_tensor(item, target)
        return None

    def _entry(self, item: ReadItem) -> str:
        """The entry ``item`` reads, as an error names it: the file and the entry (name, and offset of a piece)."""
        index = item.storage_index
        piece = f" (the piece at {tuple(index.offset)})" if index.offset is not None and any(index.offset) else ""
        return f"checkpoint file {self.storage_data[index].relative_path!r}, entry {index.fqn!r}{piece}"

    def _recorded(self, stream: IO[bytes], where: Where, item: ReadItem) -> int:
        """The CRC-32 the archive records for the data record just read (``stream`` right after its data)."""
        return where.crc if where.crc is not None else descriptor_crc(stream.read(8), self._entry(item))

    def _check_record(self, stream: IO[bytes], item: ReadItem, where: Where, start: int, record: int) -> None:
        """Have the CRC-32 of the data record at ``start`` (``record`` bytes) compared with the archive's, over a
        map of the file (:class:`Checksums`: in batches, a long one by a thread; a mismatch raised by
        :meth:`read_data` before ``between``, at the latest); ``OSError`` on a mismatch or a short file."""
        if self._checksums is None:
            self._checksums = Checksums(_THREADS, _THREADED, _BATCH)
        self._checksums.check(self.storage_data[item.storage_index].relative_path, stream, start, record, where.crc,
                              self._entry(item), required=where.required)

    def _located(self, stream: IO[bytes], info: Any) -> Where | None:
        """What the entry holds, where its data starts and its CRC-32 lies, where its bytes before the data are
        those of an entry of the same length read before (but for the data's checksum): one read of those bytes,
        no zip reader."""
        layouts = self._layouts.get(info.length)
        if not layouts:
            return None
        stream.seek(info.offset)
        head = stream.read(max(layout.data for layout in layouts))
        for layout in layouts:
            if layout.fits(head):
                return Where(layout.stored, layout.data, None if layout.descriptor else layout.header_crc(head),
                              layout.crcs)
        return None

    def _opened(self, stream: IO[bytes], info: Any, item: ReadItem, planner: LoadPlanner) -> Where | None:
        """The entry read by torch's zip reader: what it holds and where its data and CRC-32 lie (learning its
        layout for :meth:`_located`). The first entry of each header is read here, by ``torch.load`` and checked
        (then ``None``); an entry whose data record's zip header is not found takes DCP's path (checked there)."""
        archive = torch._C.PyTorchFileReader(self._slice_file(stream, info))
        key = (archive.get_record(_HEADER), archive.get_record(_BYTE_ORDER) if archive.has_record(_BYTE_ORDER)
               else b"")
        stored = self._headers.get(key)
        first = stored is None
        if first:
            loaded = self._load(stream, info, item, archive)
            stored = self._headers[key] = describe(loaded, key[1], archive.get_all_records())
        data = archive.get_record_offset(DATA) if stored.direct else -1
        layout = None
        if stored.direct and archive.get_record_offset(_BYTE_ORDER) < data:  # the byte order before the data
            stream.seek(info.offset)
            head = stream.read(data)
            try:
                crcs = archive_records_crcs(head, archive)
            except OSError as exc:  # a record before the data without its descriptor's signature: damaged
                raise OSError(f"{self._entry(item)}: {exc}") from exc
            layout = Layout.of(head, stored, crcs)
            if layout is not None:
                self._layouts.setdefault(info.length, []).append(layout)
        if first:
            self._copy(loaded, item, planner)
            return None
        if layout is None:  # where its CRC-32 lies is not known here: DCP's path
            return Where(replace(stored, direct=False), -1, None, True)
        return Where(stored, data, None if layout.descriptor else layout.header_crc(head), layout.crcs)

    def _load(self, stream: IO[bytes], info: Any, item: ReadItem, reader: Any = None) -> torch.Tensor:
        """The entry ``torch.load``ed, its data checked (``reader``: the zip reader already open over it)."""
        archive = self._slice_file(stream, info)
        loaded = cast(torch.Tensor, torch.load(archive, map_location="cpu", weights_only=True))
        _check_loaded(archive, loaded, self._entry(item), reader)
        return loaded

    def _copy(self, loaded: torch.Tensor, item: ReadItem, planner: LoadPlanner) -> None:
        """DCP's copy of a loaded entry into the destination."""
        tensor = narrow_tensor_by_index(loaded, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        if self._deferring(target):
            self._deferred.append(_Deferred(None, tensor, target, item))
            return
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _read_as_dcp(self, stream: IO[bytes], item: ReadItem, planner: LoadPlanner) -> None:
        """DCP's own read of ``item`` (transforms included), the loaded tensor's data checked against its
        CRC-32."""
        info = self.storage_data[item.storage_index]
        source = self.transforms.transform_load_stream(item, info.transform_descriptors or (),
                                                       self._slice_file(stream, info))
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(source.read(-1)))
            return
        seekable = source if source.seekable() else io.BytesIO(source.read(-1))
        loaded = cast(torch.Tensor, torch.load(seekable, map_location="cpu", weights_only=True))
        _check_loaded(seekable, loaded, self._entry(item))
        self._copy(loaded, item, planner)


def _check_loaded(archive: IO[bytes], loaded: torch.Tensor, entry: str, reader: Any = None) -> None:
    """:func:`~zero_dtensor.checkpoint.crc.check_loaded` of the archive's data record (``reader``: the zip reader
    already open over the archive, if any)."""
    check_loaded(archive, loaded, entry, DATA, reader)


def _check_size(stream: IO[bytes], relative_path: str, items: list[ReadItem], storage_data: Any) -> None:
    """``OSError`` where the file ends before an entry ``items`` read (a truncated file), before any is read."""
    size = os.fstat(stream.fileno()).st_size
    end = max((storage_data[item.storage_index].offset + storage_data[item.storage_index].length for item in items),
              default=0)
    if end > size:
        raise OSError(f"checkpoint file {relative_path!r} holds {size} bytes but its entries run to {end} "
                      "(a truncated file?)")


def _read_to(stream: IO[bytes], target: torch.Tensor, item: ReadItem, *, crc: bool = False) -> int | None:
    """``target``'s bytes from ``stream`` (through a host copy for a tensor off the CPU); with ``crc`` their CRC-32
    (computed on the bytes as read, a piece at a time, before the copy)."""
    host = target if target.device.type == "cpu" else torch.empty_like(target, device="cpu")
    checksum = _read_into(stream, host, item, crc=crc)
    if host is not target:
        target.copy_(host)
    return checksum


def _copy_to(source: memoryview, offset: int, target: torch.Tensor) -> None:
    """``target``'s bytes (a contiguous tensor) from ``source[offset:]`` (a file's map; through a host copy for a
    tensor off the CPU)."""
    if not target.numel():
        return
    host = target if target.device.type == "cpu" else torch.empty_like(target, device="cpu")
    with source[offset:offset + host.nbytes] as data:
        memoryview(host.view(-1).view(torch.uint8).numpy())[:] = data
    if host is not target:
        target.copy_(host)


def _read_exactly(stream: IO[bytes], length: int, item: ReadItem) -> bytes:
    data = stream.read(length)
    if len(data) != length:
        raise OSError(f"checkpoint entry {item.storage_index.fqn!r}: {len(data)} of {length} bytes in the file "
                      "(a truncated file?)")
    return data


def _read_into(stream: IO[bytes], host: torch.Tensor, item: ReadItem, *, crc: bool = False) -> int | None:
    """``host``'s bytes read from ``stream`` (a contiguous CPU tensor), :data:`_CHUNK` bytes a read; with ``crc``
    their CRC-32, each piece CRC-ed right after its read (in cache). ``OSError`` on a short read."""
    view = memoryview(host.view(-1).view(torch.uint8).numpy()) if host.numel() else memoryview(b"")
    got, checksum, step = 0, 0, _CHUNK if crc else len(view)
    while got < len(view):
        n = stream.readinto(view[got:got + step])
        if not n:
            raise OSError(f"checkpoint entry {item.storage_index.fqn!r}: {got} of {len(view)} bytes in the file "
                          "(a truncated file?)")
        if crc:
            checksum = crc32(view[got:got + n], checksum)
        got += n
    return checksum if crc else None


def read_bytes_entries(path: str, infos: Mapping[str, Any], bindings: FileBindings | None = None) -> dict[str, bytes]:
    """The stored bytes of untransformed bytes entries, ``infos`` mapping a name to the entry's storage info
    (``_StorageInfo`` from the checkpoint's metadata), by one read per run of entries less than 64 KiB apart in a
    file (DCP writes a file's bytes entries first, one after another: thousands of hyperparameter entries in a few
    reads, instead of a planned read item, a seek and a read each); by the same names. ``OSError`` on a short read,
    and, with ``bindings``, for a file that does not hold the checkpoint's ``save_id`` (checked before anything else
    of it is read, :class:`~.binding.FileBindings`). Memory: the runs read. No communication."""
    per_file: dict[str, list[tuple[int, int, str]]] = {}
    for key, info in infos.items():
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length, key))
    found: dict[str, bytes] = {}
    for relative_path, entries in per_file.items():
        entries.sort()
        with open(os.path.join(path, relative_path), "rb") as stream:
            if bindings is not None:  # the file is this checkpoint's (:mod:`.binding`), before anything is read
                bindings.check(stream, relative_path)
            for run in _runs(entries):
                first, end = run[0][0], max(offset + length for offset, length, _ in run)
                stream.seek(first)
                data = stream.read(end - first)
                if len(data) != end - first:
                    raise OSError(f"checkpoint file {relative_path!r}: {len(data)} of {end - first} bytes at offset "
                                  f"{first} (a truncated file?)")
                for offset, length, key in run:
                    found[key] = data[offset - first:offset - first + length]
    return found


def _runs(entries: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """``entries`` (sorted by offset) cut where the next starts more than :data:`_GAP` bytes after the run's end."""
    runs: list[list[tuple[int, int, str]]] = []
    end = -1
    for entry in entries:
        if not runs or entry[0] > end + _GAP:
            runs.append([])
        runs[-1].append(entry)
        end = max(end, entry[0] + entry[1])
    return runs
