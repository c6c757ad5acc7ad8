"""Issue 51 (items 2, 3, 6) at 2 ranks, ZeRO-2 and ZeRO-3: every data file bound to its checkpoint's ``save_id``; the
CRC-32 taken where damage cannot hide it; DeepSpeed's ``engine.load_checkpoint`` clears the write mark. Each case
loaded silently (a mixture, a flipped bit) or raised ``ModelParamsNotSyncedError`` before."""

from __future__ import annotations

import pytest

from workers import checkpoint_integrity as ci


@pytest.mark.parametrize("stage", [2, 3], ids=["z2", "z3"])
def test_foreign_files_hidden_damage_and_load_checkpoint(ranks, tmp_path, stage) -> None:
    """A data file from another run at the same step (rank 1's, or every one), a flipped bit with the data
    descriptor's signature or CRC-32 field zeroed (a master and an ``exp_avg_sq`` piece): ``CheckpointReadError`` on
    both ranks, the engine bitwise unchanged (checked in the worker); after an unsynced master write,
    ``engine.load_checkpoint`` clears the mark (and one that loads nothing keeps it)."""
    results = ranks(2).run(ci.integrity, str(tmp_path), stage, timeout=240.0)
    for rank, messages in enumerate(results):
        assert set(messages) == {"rank 1's file foreign", "every file foreign", "master, signature zeroed",
                                 "exp_avg_sq, signature zeroed", "master, crc zeroed", "exp_avg_sq, crc zeroed"}
        if rank == 1:
            assert "signature" in messages["master, signature zeroed"], messages
            assert "CRC-32" in messages["master, crc zeroed"], messages
            assert "CRC-32" in messages["exp_avg_sq, crc zeroed"], messages


def _bound_save(path: str, seed: int) -> dict:
    """A one-process DCP save of a few tensors as another writer (the offline converter) makes one: the state
    dict bound (``binding.bind``), written by ``DirectWriter`` and ``CachingSavePlanner``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from zero_dtensor.checkpoint.binding import bind
    from zero_dtensor.checkpoint.planners import CachingSavePlanner
    from zero_dtensor.checkpoint.writer import DirectWriter

    g = torch.Generator().manual_seed(seed)
    values = {"a": torch.randn(8, 4, generator=g), "b": torch.randn(5, generator=g)}
    state = {"model": dict(values)}
    bind(state, 0)
    dcp.save(state, storage_writer=DirectWriter(path), planner=CachingSavePlanner(), no_dist=True)
    return values


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bound_files_one_process(tmp_path) -> None:
    """The recipe for another writer: ``bind`` + ``DirectWriter`` + ``CachingSavePlanner`` write the ``save_id`` that
    ``.metadata`` records into the file (``dcp.load`` of the entry gives it back); ``DirectReader`` reads such a
    checkpoint, and refuses it, naming the file, with the data file of another such save."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from zero_dtensor.checkpoint.reader import DirectReader

    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    values = _bound_save(ours, 0)
    _bound_save(theirs, 1)
    metadata = FileSystemReader(ours).read_metadata()
    entry = {"zero_dtensor": {"save_id.0": ""}}
    dcp.load(entry, storage_reader=FileSystemReader(ours), no_dist=True)
    assert entry["zero_dtensor"]["save_id.0"] == metadata.storage_meta.save_id
    loaded = {"model": {k: torch.zeros_like(v) for k, v in values.items()}}
    dcp.load(loaded, storage_reader=DirectReader(ours), no_dist=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in values.items())
    shutil.copyfile(tmp_path / "theirs" / "__0_0.distcp", tmp_path / "ours" / "__0_0.distcp")
    with pytest.raises(CheckpointException) as raised:
        dcp.load(loaded, storage_reader=DirectReader(ours), no_dist=True)
    (failure, _), = raised.value.failures.values()
    assert "'__0_0.distcp' belongs to another checkpoint" in str(failure), failure
