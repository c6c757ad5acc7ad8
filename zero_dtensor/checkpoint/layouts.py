"""Where a ``torch.save``d tensor entry's data lies, as :class:`~.reader.DirectReader` learns it: what an entry holds
(:class:`Stored`, from its pickled header), the bytes before its data (:class:`Layout`: an entry of the same length
whose bytes there are equal holds the same at the same place, so it is not opened again), where its data and
CRC-32 lie (:class:`Where`), and which run of its storage a box is (:func:`run_of`). No communication, no I/O.
"""

from __future__ import annotations

import math
import struct
import sys
import zipfile
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import ReadItem

from .crc import HAS_DESCRIPTOR

__all__ = ["DATA", "Layout", "Stored", "Where", "describe", "run_of"]

#: the data record of a ``torch.save``d tensor
DATA = "data/0"


@dataclass(frozen=True)
class Stored:
    """What a ``torch.save``d tensor entry holds, from its pickled header: ``direct`` when it is one contiguous
    little-endian storage of exactly its elements (then ``readinto`` may take any run of whole rows)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    direct: bool


def describe(tensor: torch.Tensor, byte_order: bytes, records: list[str]) -> Stored:
    """What an entry whose header loaded as ``tensor`` holds; ``records``: its archive's records."""
    contiguous = tensor.is_contiguous() and tensor.storage_offset() == 0
    exact = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    one_storage = [r for r in records if r.startswith("data/")] == [DATA]
    little = byte_order == b"little" and sys.byteorder == "little"
    return Stored(tensor.dtype, tuple(tensor.shape), contiguous and exact and one_storage and little)


def run_of(stored: Stored, item: ReadItem) -> tuple[int, int] | None:
    """``(first element, elements)`` of the box ``item`` wants from the entry where it is one run of its storage
    (whole rows: every dimension after the first taken whole), else ``None``."""
    shape = stored.shape
    if not shape:
        return 0, 1
    offsets, lengths = item.storage_offsets, item.lengths
    if any(o != 0 or n != s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:])):
        return None
    row = math.prod(shape[1:])
    return offsets[0] * row, lengths[0] * row


@dataclass(frozen=True)
class Layout:
    """The bytes of a direct entry before its data (``data`` of them: the header, byte order and other records, and
    the data record's zip header): an entry of the same length whose bytes there are equal, but for the data's
    CRC-32 (``before`` the checksum, ``after`` it), holds the same (``stored``) with its data at the same place."""

    before: bytes
    after: bytes
    data: int
    stored: Stored
    #: the data record's CRC-32 follows its data (a data descriptor) rather than sitting in its local header
    descriptor: bool
    #: the archive records CRC-32s (its records before the data do, :func:`~.crc.archive_records_crcs`): a recorded
    #: 0 is then compared, not taken for "none"
    crcs: bool

    @classmethod
    def of(cls, head: bytes, stored: Stored, crcs: bool) -> Layout | None:
        """The layout of an entry whose first bytes up to its data are ``head``; ``None`` where the data record's
        zip header is not found right before it (as the zip format and torch's writer lay it out). ``crcs``: whether
        the archive records CRC-32s."""
        start = head.rfind(zipfile.stringFileHeader)
        if start < 0 or len(head) - start < zipfile.sizeFileHeader:
            return None
        fields = struct.unpack(zipfile.structFileHeader, head[start:start + zipfile.sizeFileHeader])
        name_end = start + zipfile.sizeFileHeader + fields[zipfile._FH_FILENAME_LENGTH]
        stored_whole = fields[zipfile._FH_COMPRESSION_METHOD] == zipfile.ZIP_STORED
        if (not stored_whole or name_end + fields[zipfile._FH_EXTRA_FIELD_LENGTH] != len(head)
                or not head[start + zipfile.sizeFileHeader:name_end].endswith(DATA.encode())):
            return None
        crc = start + 14  # the local file header's CRC-32: 4 bytes, after signature, versions, flags, method, time
        descriptor = bool(fields[zipfile._FH_GENERAL_PURPOSE_FLAG_BITS] & HAS_DESCRIPTOR)
        return cls(head[:crc], head[crc + 4:], len(head), stored, descriptor, crcs)

    def header_crc(self, head: bytes) -> int:
        """The CRC-32 in the data record's local header of an entry that :meth:`fits` (0 with a descriptor)."""
        return int.from_bytes(head[len(self.before):len(self.before) + 4], "little")

    def fits(self, head: bytes) -> bool:
        return head.startswith(self.before) and head[len(self.before) + 4:self.data] == self.after


@dataclass(frozen=True)
class Where:
    """Where a direct entry's data lies (``data`` bytes after the entry's start) and its CRC-32: ``crc`` from the
    data record's local header, or ``None`` where a data descriptor right after the data holds it; ``required``:
    the archive records CRC-32s (a recorded 0 is compared, not taken for "none")."""

    stored: Stored
    data: int
    crc: int | None
    required: bool
