"""CRC-32 checks of checkpoint data: what :class:`~zero_dtensor.checkpoint.reader.DirectReader` uses to verify every
tensor entry's bytes against the CRC-32 its ``torch.save`` archive records (torch's zip reader does not check it).

A mismatch raises ``OSError`` naming the entry (the load turns it into ``CheckpointReadError``). A recorded 0 is none
(``torch.serialization.set_crc32_options(False)``): not checked. No communication.
"""

from __future__ import annotations

import os
import struct
import threading
import zipfile
import zlib
from concurrent.futures import Future as _TaskFuture
from concurrent.futures import ThreadPoolExecutor
from typing import IO

import torch

__all__ = ["HAS_DESCRIPTOR", "Checksums", "check_loaded", "compare", "crc_read", "descriptor_crc"]

#: the optional signature of a zip data descriptor (torch's writer puts one, with the CRC-32, after every record)
DESCRIPTOR = b"PK\x07\x08"
#: a local file header's general-purpose flag saying that the CRC-32 and sizes follow the data (a data descriptor)
HAS_DESCRIPTOR = 0x08


class Checksums:
    """CRC-32s of long records, each read and CRC-ed by one of ``threads`` threads while the reader reads on
    (records are independent; ``os.pread`` and ``zlib.crc32`` release the GIL): a thread reads its record in
    ``chunk``-byte pieces into its own buffer and CRC-s each piece right after reading it (:func:`crc_read`).
    :meth:`finish` waits for every comparison and raises the first mismatch in reading order. Memory: one
    ``chunk``-byte buffer per thread, and a duplicate descriptor per file read. No communication."""

    def __init__(self, threads: int, chunk: int) -> None:
        self._chunk = chunk
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zero_dtensor-crc32")
        self._buffers = threading.local()
        self._files: dict[str, int] = {}  # per file, a descriptor of its own (the reader's stream closes)
        self._compared: list[_TaskFuture[None]] = []

    def check(self, file: str, stream: IO[bytes], start: int, record: int, recorded: int, entry: str) -> None:
        """Have the ``record`` bytes at ``start`` of ``stream`` (the file named ``file``) read and their CRC-32
        compared with ``recorded``."""
        if file not in self._files:
            self._files[file] = os.dup(stream.fileno())
        self._compared.append(self._pool.submit(self._check, self._files[file], start, record, recorded, entry))

    def _check(self, fd: int, start: int, record: int, recorded: int, entry: str) -> None:
        buffer = getattr(self._buffers, "buffer", None)
        if buffer is None:
            buffer = self._buffers.buffer = bytearray(self._chunk)
        compare(recorded, crc_read(fd, start, record, buffer, entry), entry)

    def finish(self) -> None:
        """Wait for every comparison; ``OSError`` for the first mismatch (in reading order)."""
        try:
            for compared in self._compared:
                compared.result()
        finally:
            self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


def crc_read(fd: int, start: int, length: int, buffer: bytearray, entry: str) -> int:
    """The CRC-32 of the ``length`` bytes at ``start`` of file ``fd``, read into ``buffer`` a piece at a time (each
    CRC-ed right after its read, in cache); ``OSError`` naming ``entry`` on a short read."""
    view, crc, done = memoryview(buffer), 0, 0
    while done < length:
        n = os.preadv(fd, [view[:min(length - done, len(view))]], start + done)
        if not n:
            raise OSError(f"{entry}: {done} of {length} bytes in the file (a truncated file?)")
        crc = zlib.crc32(view[:n], crc)
        done += n
    return crc


def descriptor_crc(tail: bytes) -> int:
    """The CRC-32 of a zip data descriptor (``tail``: its first 8 bytes; the signature is optional)."""
    if tail[:4] == DESCRIPTOR:
        tail = tail[4:]
    if len(tail) < 4:
        raise OSError("the data record's descriptor is cut off (a truncated file?)")
    return int.from_bytes(tail[:4], "little")


def compare(recorded: int, actual: int, entry: str) -> None:
    """``OSError`` naming ``entry`` where the data's CRC-32 (``actual``) is not the one its archive records. A
    recorded 0 is none: ``torch.serialization.set_crc32_options(False)`` writes archives without CRC-32s."""
    if recorded != 0 and recorded != actual:
        raise OSError(f"{entry}: the CRC-32 of its data is {actual:#010x} but the file records {recorded:#010x} "
                      "(a damaged file: the data changed after it was written)")


def check_loaded(archive: IO[bytes], loaded: torch.Tensor, entry: str, record: str) -> None:
    """Compare the CRC-32 of ``loaded``'s storage (``torch.load`` does not) with the one ``archive`` (a
    ``torch.save`` archive, seekable) records for its data record; ``OSError`` naming ``entry`` on a mismatch."""
    archive.seek(0)
    reader = torch._C.PyTorchFileReader(archive)
    if not reader.has_record(record):
        return  # no storage (a tensor without data): nothing to check
    data = reader.get_record_offset(record)
    archive.seek(0)
    head = archive.read(data)
    start = head.rfind(zipfile.stringFileHeader)
    if start < 0 or len(head) - start < zipfile.sizeFileHeader:
        raise OSError(f"{entry}: no zip header before its data (not a torch.save archive?)")
    fields = struct.unpack(zipfile.structFileHeader, head[start:start + zipfile.sizeFileHeader])
    storage = loaded.untyped_storage()
    if fields[zipfile._FH_GENERAL_PURPOSE_FLAG_BITS] & HAS_DESCRIPTOR:
        archive.seek(data + storage.nbytes())
        recorded = descriptor_crc(archive.read(8))
    else:
        recorded = fields[zipfile._FH_CRC]
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    compare(recorded, zlib.crc32(memoryview(raw.numpy()) if raw.numel() else b""), entry)
