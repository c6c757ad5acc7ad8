"""CRC-32 checks of checkpoint data: what :class:`~zero_dtensor.checkpoint.reader.DirectReader` uses to verify every
tensor entry's bytes against the CRC-32 its ``torch.save`` archive records (torch's zip reader does not check it).

A mismatch raises ``OSError`` naming the entry (the load turns it into ``CheckpointReadError``). Where the data
record's CRC-32 lies is what its zip local header says: in the header, or (flag bit 3, what torch's writer always
sets) in a data descriptor right after the data, which must then start with its signature ``PK\x07\x08`` (torch
always writes it; a descriptor without it is damage, not an older layout). A recorded 0 means "no CRC-32" only
where the archive says so: where every record before the data records 0 too
(``torch.serialization.set_crc32_options(False)`` writes archives so, :func:`archive_records_crcs`); in an archive
with CRC-32s, a recorded 0 is compared like any other value. No communication.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from concurrent.futures import Future as _TaskFuture
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch

__all__ = [
    "HAS_DESCRIPTOR",
    "Checksums",
    "archive_records_crcs",
    "check_loaded",
    "compare",
    "crc32",
    "descriptor_crc",
    "record_crc",
]

try:  # zlib-ng's CRC-32 (carry-less multiplication, SIMD): zlib's checksum, about 4x less CPU per byte
    from zlib_ng.zlib_ng import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; zlib's gives the same values, slower
    _fast_crc32 = None

#: ``crc32(data, value=0)``: zip's CRC-32 of a bytes-like ``data`` continuing ``value`` (``zlib.crc32``'s contract,
#: the same values): zlib-ng's where the ``zlib-ng`` package is installed (a dependency: 14-15 GB/s on one core of
#: the development machine, against 3.7 GB/s for the ``zlib`` 1.2.13 that Python links), else ``zlib.crc32``. Both
#: release the GIL while they run.
crc32 = _fast_crc32 if _fast_crc32 is not None else zlib.crc32

#: the signature of a zip data descriptor (optional in the zip format; torch's writer always puts it, with the CRC-32,
#: after every record, and :func:`descriptor_crc` requires it)
DESCRIPTOR = b"PK\x07\x08"
#: a local file header's general-purpose flag saying that the CRC-32 and sizes follow the data (a data descriptor)
HAS_DESCRIPTOR = 0x08


#: a record :class:`Checksums` checks: its start and length in the file, the recorded CRC-32 (``None``: in the data
#: descriptor after the data), the entry (as errors name it), and whether a recorded 0 is compared
_Record = tuple[int, int, "int | None", str, bool]


class Checksums:
    """CRC-32s of records checked apart from reading them into place (a deferred destination, a record read only
    in part), computed over a read-only map of the file (``mmap``: the page cache's own pages, no copy into a
    buffer; 64 MiB from the page cache in 5.5 ms of CPU on the development machine, against 26 ms read into a 1 MiB
    buffer a piece at a time and CRC-ed there, and 16-18 ms to only read them into place). Records are taken in
    batches (consecutive records of one file, up to ``batch`` bytes; a record's data descriptor, where its CRC-32
    lies, is read from the map too: no read, no seek, no ``fstat`` per record); a batch of at least ``threaded``
    bytes is CRC-ed by one of ``threads`` threads while the reader reads on (records are independent;
    :data:`crc32` releases the GIL), a shorter one at once. :meth:`finish` waits for every comparison and raises
    the first mismatch in reading order; the maps stay open after it (:meth:`source`), so the reader copies the
    checked records into place from pages already mapped rather than reading them again (64 MiB from the page
    cache on the 2-core development machine: CRC over the map and copy from it 6.7 ms of CPU more than a plain
    read into place, against 10.7 ms CRC-ed over the map and read again). Memory: no buffer (the maps are the page
    cache's pages, unmapped by :meth:`close`). A file truncated before a record is checked raises ``OSError``; one truncated by another
    process while its record is being CRC-ed or copied (a checkpoint overwritten during the load) ends this process
    with ``SIGBUS``, as any read of a mapped file does. No communication."""

    def __init__(self, threads: int, threaded: int, batch: int = 8 << 20) -> None:
        self._threads, self._threaded, self._batch = threads, threaded, batch
        self._pool: ThreadPoolExecutor | None = None
        self._maps: dict[str, tuple[mmap.mmap, memoryview]] = {}  # per file, its map (the reader's stream closes)
        self._compared: list[_TaskFuture[None]] = []
        self._pending: list[_Record] = []
        self._pending_file: str | None = None
        self._pending_bytes = 0

    def check(self, file: str, stream: IO[bytes], start: int, record: int, recorded: int | None, entry: str, *,
              required: bool = True) -> None:
        """Have the CRC-32 of the ``record`` bytes at ``start`` of ``stream`` (the file named ``file``) compared
        with ``recorded`` (:func:`compare`, ``required`` as there), or, where ``recorded`` is ``None``, with the
        one in the data descriptor right after them (:func:`descriptor_crc`, its signature required);
        ``OSError`` naming ``entry`` where the file ends before them (here or at the latest in :meth:`finish`)."""
        if file != self._pending_file:
            self.flush()
        if file not in self._maps:
            mapped = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[file] = (mapped, memoryview(mapped))
        self._pending_file = file
        self._pending.append((start, record, recorded, entry, required))
        self._pending_bytes += record
        if self._pending_bytes >= self._batch:
            self.flush()

    def flush(self) -> None:
        """CRC the records taken so far (:meth:`check`): at once, or by a thread (a batch of ``threaded`` bytes or
        more); ``OSError`` naming the first record the file now ends before (touching a page past the end of a
        mapped file is ``SIGBUS``)."""
        batch, file = self._pending, self._pending_file
        self._pending, self._pending_file, self._pending_bytes = [], None, 0
        if not batch or file is None:
            return
        mapped, view = self._maps[file]
        size = min(len(view), mapped.size())  # the file now (the map's own descriptor: the stream may be closed)
        for start, record, recorded, entry, _ in batch:
            if start + record > size:
                raise OSError(f"{entry}: {max(size - start, 0)} of {record} bytes in the file (a truncated file?)")
            if recorded is None and start + record + 8 > size:
                raise OSError(f"{entry}: its data descriptor is cut off (a truncated file?)")
        if sum(record for _, record, *_ in batch) < self._threaded:
            _compare_all(view, batch)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="zero_dtensor-crc32")
        self._compared.append(self._pool.submit(_compare_all, view, batch))

    def finish(self) -> None:
        """CRC what is left, wait for every comparison and end the threads; ``OSError`` for the first mismatch (in
        reading order; everything closed then). The maps stay open for :meth:`source` until :meth:`close`."""
        try:
            self.flush()
            for compared in self._compared:
                compared.result()
        except BaseException:
            self.close()
            raise
        self._end_threads()

    def source(self, file: str) -> tuple[memoryview, int] | None:
        """The map of ``file`` (a view of it) and the file's size now, where records of it were checked: their
        bytes, already checked, can be copied from there (no second read); ``None`` where none were."""
        if file not in self._maps:
            return None
        mapped, view = self._maps[file]
        return view, min(len(view), mapped.size())

    def _end_threads(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._compared.clear()

    def close(self) -> None:
        """End the threads (waiting for those running) and unmap the files."""
        self._end_threads()
        self._pending, self._pending_file, self._pending_bytes = [], None, 0
        for mapped, view in self._maps.values():
            view.release()
            mapped.close()
        self._maps.clear()


def _compare_all(view: memoryview, records: list[_Record]) -> None:
    """:func:`compare` of each record's CRC-32 over ``view`` (the file's map) in order; the first mismatch raised
    (every slice released first: the file's map can be closed)."""
    for start, record, recorded, entry, required in records:
        with view[start:start + record] as data:
            actual = crc32(data)
        if recorded is None:
            with view[start + record:start + record + 8] as tail:
                recorded = descriptor_crc(bytes(tail), entry)
        compare(recorded, actual, entry, required=required)


def descriptor_crc(tail: bytes, entry: str = "the data record") -> int:
    """The CRC-32 of a zip data descriptor (``tail``: its first 8 bytes, signature and CRC-32). The zip format lets
    a writer leave the signature out, but torch's writer always puts it, so one without it is damage (read as a
    CRC-32, a zeroed signature would hide a changed datum): ``OSError`` naming ``entry``."""
    if len(tail) < 8:
        raise OSError(f"{entry}: its data descriptor is cut off (a truncated file?)")
    if tail[:4] != DESCRIPTOR:
        raise OSError(f"{entry}: no data descriptor signature after its data ({bytes(tail[:4])!r} where torch's "
                      "writer puts PK\\x07\\x08): a damaged file")
    return int.from_bytes(tail[4:8], "little")


def record_crc(head: bytes, archive: Any, name: str) -> int | None:
    """The CRC-32 that the zip archive ``archive`` (a ``torch._C.PyTorchFileReader``) records for its record
    ``name``, read from ``head`` (the archive's first bytes): from the record's local header, or from the data
    descriptor after its data (the header's flag bit 3; the signature required, :func:`descriptor_crc`). ``None``
    where ``head`` does not reach it or the archive has no such record."""
    if not archive.has_record(name):
        return None
    header = archive.get_record_header_offset(name)
    if header + zipfile.sizeFileHeader > len(head) or head[header:header + 4] != zipfile.stringFileHeader:
        return None
    fields = struct.unpack(zipfile.structFileHeader, head[header:header + zipfile.sizeFileHeader])
    if not fields[zipfile._FH_GENERAL_PURPOSE_FLAG_BITS] & HAS_DESCRIPTOR:
        return int(fields[zipfile._FH_CRC])
    end = archive.get_record_offset(name) + archive.get_record_size(name)
    if end + 8 > len(head):
        return None
    return descriptor_crc(head[end:end + 8], f"record {name!r}")


#: the records torch.save writes before a tensor's data: one recording a CRC-32 says the archive has them
_BEFORE_DATA = ("data.pkl", ".format_version", ".storage_alignment", "byteorder")


def archive_records_crcs(head: bytes, archive: Any) -> bool:
    """Whether the ``torch.save`` archive ``archive`` (a ``torch._C.PyTorchFileReader`` over it; ``head``: its
    bytes up to its tensor data) records CRC-32s: where any record before the data records a non-zero CRC-32 (their
    data are never all of CRC-32 0). ``torch.serialization.set_crc32_options(False)`` writes 0 for every record;
    an archive that records them records the data's too, so a recorded 0 there is damage, not "none"."""
    return any(record_crc(head, archive, name) for name in _BEFORE_DATA)


def compare(recorded: int, actual: int, entry: str, *, required: bool = True) -> None:
    """``OSError`` naming ``entry`` where the data's CRC-32 (``actual``) is not the one its archive records. A
    recorded 0 is none only where the archive records no CRC-32s (``required`` false: see
    :func:`archive_records_crcs`)."""
    if (required or recorded != 0) and recorded != actual:
        raise OSError(f"{entry}: the CRC-32 of its data is {actual:#010x} but the file records {recorded:#010x} "
                      "(a damaged file: the data changed after it was written)")


def check_loaded(archive: IO[bytes], loaded: torch.Tensor, entry: str, record: str, reader: Any = None) -> None:
    """Compare the CRC-32 of ``loaded``'s storage (``torch.load`` does not) with the one ``archive`` (a
    ``torch.save`` archive, seekable) records for its data record; ``OSError`` naming ``entry`` on a mismatch.
    ``reader``: a ``torch._C.PyTorchFileReader`` already open over ``archive`` (else one is opened)."""
    if reader is None:
        archive.seek(0)
        reader = torch._C.PyTorchFileReader(archive)
    if not reader.has_record(record):
        return  # no storage (a tensor without data): nothing to check
    data = reader.get_record_offset(record)
    archive.seek(0)
    head = archive.read(data)
    start = reader.get_record_header_offset(record)
    if start + zipfile.sizeFileHeader > len(head) or head[start:start + 4] != zipfile.stringFileHeader:
        raise OSError(f"{entry}: no zip header before its data (not a torch.save archive?)")
    fields = struct.unpack(zipfile.structFileHeader, head[start:start + zipfile.sizeFileHeader])
    storage = loaded.untyped_storage()
    if fields[zipfile._FH_GENERAL_PURPOSE_FLAG_BITS] & HAS_DESCRIPTOR:
        archive.seek(data + storage.nbytes())
        recorded = descriptor_crc(archive.read(8), entry)
    else:
        recorded = fields[zipfile._FH_CRC]
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    try:
        required = archive_records_crcs(head, reader)
    except OSError as exc:  # a record before the data without its descriptor's signature: damaged
        raise OSError(f"{entry}: {exc}") from exc
    compare(recorded, crc32(memoryview(raw.numpy()) if raw.numel() else b""), entry, required=required)
