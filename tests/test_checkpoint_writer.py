"""``DirectWriter`` (zero_dtensor.checkpoint.writer) against DCP's own ``FileSystemWriter``, in one process: the same
files byte for byte for every kind of entry, most tensor entries written without ``torch.save`` (counted), DCP's
path where the direct archive would differ or where the writer is configured otherwise, ``fsync`` as asked, and the
writeback started while later bytes are written."""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from zero_dtensor.checkpoint import writer as direct
from zero_dtensor.checkpoint.reader import DirectReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist: one process


@pytest.fixture(autouse=True)
def fresh_headers(monkeypatch) -> None:
    """Each test starts with no header checked yet in the process."""
    monkeypatch.setattr(direct, "_HEADERS", {})


def _entries() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    values: dict[str, object] = {f"layer{i}.weight": torch.randn(16, 8 + i % 3, generator=g) for i in range(12)}
    values.update({f"layer{i}.step": torch.tensor(float(i)) for i in range(4)})
    values.update({
        "bf16": torch.randn(6, 5, generator=g).to(torch.bfloat16),
        "bf16_again": torch.randn(6, 5, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(7, generator=g).to(torch.float16),
        "int64": torch.arange(9),
        "transposed": torch.randn(8, 12, generator=g).t(),  # non-contiguous: saved with its strides
        "view": torch.randn(100, generator=g)[10:30],  # a view: DCP's loader clones it first
        "empty": torch.empty(0, 4),
        "requires_grad": torch.randn(3, generator=g, requires_grad=True),  # DCP's loader detaches it
        "lr": 0.5,
        "betas": (0.9, 0.999),
    })
    return values


def _files(path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path)) if name.endswith(".distcp")}


def _save(values: dict[str, object], writer) -> None:
    dcp.save(dict(values), storage_writer=writer, no_dist=True)


def test_same_files_as_dcp_and_loadable(tmp_path) -> None:
    values = _entries()
    _save(values, FileSystemWriter(str(tmp_path / "dcp")))
    writer = direct.DirectWriter(str(tmp_path / "direct"))
    _save(values, writer)
    expected, written = _files(tmp_path / "dcp"), _files(tmp_path / "direct")
    assert written and written == expected
    # 24 tensor entries of 11 looks (the view is written as DCP's loader's copy); each look's first goes through
    # torch.save
    assert writer.archives.direct == 13
    again = direct.DirectWriter(str(tmp_path / "again"))  # later saves in the process: every look already checked
    _save(values, again)
    assert _files(tmp_path / "again") == expected and again.archives.direct == 24
    for reader in (FileSystemReader, DirectReader):
        out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in values.items()}
        dcp.load(out, storage_reader=reader(str(tmp_path / "direct")), no_dist=True)
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                assert out[name].dtype == value.dtype and torch.equal(out[name], value.detach()), name
            else:
                assert out[name] == value, name


def test_a_look_whose_direct_archive_differs_keeps_torch_save(tmp_path, monkeypatch) -> None:
    """If torch's archive for a look ever differed from the direct one (another torch), that look is written by
    ``torch.save`` for the whole save: the file is still DCP's."""
    original = direct._Archives._write_direct

    def different(self, stream, tensor, header):
        if isinstance(stream, io.BytesIO) and tensor.dtype == torch.float32:
            stream.write(b"not torch.save's archive")
            return
        original(self, stream, tensor, header)

    monkeypatch.setattr(direct._Archives, "_write_direct", different)
    values = _entries()
    _save(values, FileSystemWriter(str(tmp_path / "dcp")))
    writer = direct.DirectWriter(str(tmp_path / "direct"))
    _save(values, writer)
    assert _files(tmp_path / "direct") == _files(tmp_path / "dcp")
    assert writer.archives.direct == 1  # float32 entries all through torch.save; only bf16_again went direct


def test_other_configurations_take_dcps_path(tmp_path) -> None:
    values = _entries()
    _save(values, FileSystemWriter(str(tmp_path / "dcp"), thread_count=2))
    writer = direct.DirectWriter(str(tmp_path / "direct"), thread_count=2)
    _save(values, writer)
    assert _files(tmp_path / "direct") == _files(tmp_path / "dcp")
    assert not hasattr(writer, "archives")


@pytest.mark.parametrize("sync_files", [True, False])
def test_fsync_as_asked(tmp_path, monkeypatch, sync_files: bool) -> None:
    """As DCP: the data file and ``.metadata`` synced, or neither."""
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    _save(_entries(), direct.DirectWriter(str(tmp_path), sync_files=sync_files))
    assert len(synced) == (2 if sync_files else 0)


def test_writeback_started_while_writing(tmp_path, monkeypatch) -> None:
    """With ``sync_files``, the kernel is asked to start writing every ``WRITEBACK_BYTES`` (the real call, on
    Linux): back-to-back ranges from the file's start, each at least that long and already in the file; the files
    are DCP's; without ``sync_files`` it is never asked."""
    real = direct._START_WRITEBACK
    if sys.platform == "linux":
        assert real is not None
    started: list[tuple[int, int, int, int]] = []

    def start(fd: int, offset: int, nbytes: int, flags: int) -> int:
        started.append((offset, nbytes, flags, os.fstat(fd).st_size))
        answer = real(fd, offset, nbytes, flags) if real is not None else 0
        assert answer == 0  # the kernel took it: the binding's argument types are right
        return answer

    monkeypatch.setattr(direct, "_START_WRITEBACK", start)
    monkeypatch.setattr(direct, "WRITEBACK_BYTES", 1024)
    values = _entries()
    _save(values, FileSystemWriter(str(tmp_path / "dcp")))
    _save(values, direct.DirectWriter(str(tmp_path / "direct")))
    assert _files(tmp_path / "direct") == _files(tmp_path / "dcp")
    assert len(started) >= 3
    end = 0
    for offset, nbytes, flags, size in started:
        assert (offset, flags) == (end, 2) and nbytes >= 1024 and offset + nbytes <= size
        end = offset + nbytes
    started.clear()
    _save(values, direct.DirectWriter(str(tmp_path / "unsynced"), sync_files=False))
    assert not started


def test_refused_writeback_leaves_the_fsync(tmp_path, monkeypatch) -> None:
    """A file system that refuses the writeback hint is asked once; the file is DCP's, synced at the end."""
    asked, synced = [], []
    real_fsync = os.fsync
    monkeypatch.setattr(direct, "_START_WRITEBACK", lambda fd, offset, nbytes, flags: asked.append(offset) or -1)
    monkeypatch.setattr(direct, "WRITEBACK_BYTES", 1024)
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    values = _entries()
    _save(values, direct.DirectWriter(str(tmp_path / "direct")))
    assert asked == [0] and len(synced) == 2
    _save(values, FileSystemWriter(str(tmp_path / "dcp")))
    assert _files(tmp_path / "direct") == _files(tmp_path / "dcp")


def test_only_plain_tensors_have_a_look() -> None:
    """A tensor whose pickle may hold more than its dtype, shape, strides and storage is always ``torch.save``d."""
    plain = torch.randn(4, 3)
    assert direct._Archives.look(plain) == (torch.float32, (4, 3), (3, 1), 0, 48)
    assert direct._Archives.look(plain[1:]) == (torch.float32, (3, 3), (3, 1), 3, 48)
    tagged = torch.randn(2)
    tagged.note = "python state"
    for tensor in (torch.randn(2, requires_grad=True), torch.randn(2, dtype=torch.complex64).conj(), tagged,
                   torch.nn.Parameter(torch.randn(2), requires_grad=False), torch.randn(2, 2).to_sparse()):
        assert direct._Archives.look(tensor) is None, tensor


@pytest.mark.parametrize("sync_files", [True, False])
def test_pipelined_writer_writes_dcps_files(tmp_path, monkeypatch, sync_files: bool) -> None:
    """The converter's ``PipelinedWriter``: every tensor's bytes queued to its writer thread (the chunk size at which
    they are queued lowered to 64 bytes), through direct I/O with ``sync_files`` (blocks of 8 KiB), written buffered
    without: DCP's files byte for byte."""
    from zero_dtensor.checkpoint import pipelined_writer as pipelined

    monkeypatch.setattr(pipelined._Pipelined, "_SMALL", 64)
    monkeypatch.setattr(pipelined._DirectSink, "SIZE", 8192)
    queued = []
    real_put = pipelined._Pipelined._put
    monkeypatch.setattr(pipelined._Pipelined, "_put", lambda self, chunk: (queued.append(chunk[1] is not None),
                                                                           real_put(self, chunk)))
    values = {f"w{i}": torch.randn(64, 33) for i in range(8)} | {"lr": 0.5, "small": torch.arange(3)}
    _save(values, FileSystemWriter(str(tmp_path / "dcp")))
    _save(values, pipelined.PipelinedWriter(str(tmp_path / "pipelined"), sync_files=sync_files))
    assert _files(tmp_path / "pipelined") == _files(tmp_path / "dcp")
    assert sum(queued) >= 7  # the large tensors' bytes went through the writer thread (the first look: torch.save)
