"""Workers of ``tests/test_checkpoint_integrity.py`` (issue 51, items 2, 3, 6): data files bound to their checkpoint
(``save_id``), CRC-32s that a zeroed descriptor signature or CRC field cannot hide, and ``engine.load_checkpoint``
clearing the write mark."""

from __future__ import annotations

import io
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from workers.checkpoint import _cast_masters_equal_working, _refused, train
from workers.common import EngineCase, build_engine, forward_backward
from zero_dtensor.checkpoint import CheckpointReadError, save
from zero_dtensor.errors import ModelParamsNotSyncedError


def _copy_with_files(path: str, other: str, name: str, files: list[str]) -> str:
    """A copy of checkpoint ``path`` whose data files ``files`` are those of checkpoint ``other`` (call on one
    rank)."""
    mixed = f"{path}-{name}"
    shutil.copytree(path, mixed)
    for file in files:
        shutil.copyfile(os.path.join(other, file), os.path.join(mixed, file))
    return mixed


def _damage(path: str, fqn_prefix: str, suffix: str, how: str, rank: int = 1) -> tuple[str, str]:
    """A copy of checkpoint ``path`` with the largest entry of rank ``rank``'s file whose name starts with
    ``fqn_prefix`` and ends with ``suffix`` damaged in two places (call on one rank): one bit of its tensor data
    flipped, and ``how``: ``"signature"`` zeroes the ``PK\\x07\\x08`` signature of the data descriptor after the data,
    ``"crc"`` the descriptor's CRC-32 field. Its path and the entry's name."""
    damaged = f"{path}-{fqn_prefix.strip('.')}{suffix}-{how}"
    shutil.copytree(path, damaged)
    file = f"__{rank}_0.distcp"
    entries = [(info.length, index.fqn, info) for index, info in FileSystemReader(path).read_metadata()
               .storage_data.items() if index.fqn.startswith(fqn_prefix) and index.fqn.endswith(suffix)
               and info.relative_path == file]
    _, fqn, info = max(entries, key=lambda e: e[0])
    with open(os.path.join(damaged, file), "r+b") as f:
        f.seek(info.offset)
        archive = torch._C.PyTorchFileReader(io.BytesIO(f.read(info.length)))
        data = info.offset + archive.get_record_offset("data/0")
        end = data + archive.get_record_size("data/0")
        f.seek(end)
        assert f.read(4) == b"PK\x07\x08", "torch's writer puts a signed data descriptor after the data"
        f.seek(data + (end - data) // 2)
        byte = f.read(1)[0]
        f.seek(data + (end - data) // 2)
        f.write(bytes([byte ^ 0x10]))
        f.seek(end if how == "signature" else end + 4)
        f.write(b"\0\0\0\0")
    return damaged, fqn


def integrity(root: str, stage: int) -> dict[str, str]:
    """Issue 51 at 2 ranks: (2) a data file from another checkpoint of the same model at the same step (rank 1's,
    and every file), (3) a flipped data bit hidden by a zeroed descriptor signature or CRC-32 field (a master piece
    and an ``exp_avg_sq`` piece of rank 1's file: the first entry of a header and one read by the direct path) are
    refused with ``CheckpointReadError`` on every rank, the engine unchanged (bitwise, ``_refused``); (6) after an
    unsynced master write, DeepSpeed's ``engine.load_checkpoint`` clears the write mark (the next forward runs, the
    working weights are the cast masters), and one that loads nothing (no ``latest``) keeps it. Returns this rank's
    messages."""
    import zero_dtensor as zd
    from zero_dtensor.families.master import needs_sync

    case = EngineCase(stage=stage, dtype="bf16", world=dist.get_world_size())
    ours, theirs = build_engine(case), build_engine(case, seed=7)
    train(ours, range(1))
    train(theirs, range(1))  # another run at the same step: same names, shapes and file layout
    good, other = os.path.join(root, f"ours-{stage}"), os.path.join(root, f"theirs-{stage}")
    save(ours, good)
    save(theirs, other)
    cases: dict[str, tuple[str, str]] = {}
    if dist.get_rank() == 0:
        files = sorted(f for f in os.listdir(good) if f.endswith(".distcp"))
        assert files == sorted(f for f in os.listdir(other) if f.endswith(".distcp")), files
        cases["rank 1's file foreign"] = (_copy_with_files(good, other, "mixed", ["__1_0.distcp"]), "__1_0.distcp")
        cases["every file foreign"] = (_copy_with_files(good, other, "swapped", files), ".distcp")
        for how in ("signature", "crc"):
            cases[f"master, {how} zeroed"] = _damage(good, "model.", "", how)
            cases[f"exp_avg_sq, {how} zeroed"] = _damage(good, "optim.state.", ".exp_avg_sq", how)
    shared = [cases]
    dist.broadcast_object_list(shared, src=0)
    messages = {}
    for what, (path, named) in shared[0].items():
        message = _refused(ours, path, CheckpointReadError)  # raises on this rank; the engine bitwise unchanged
        assert repr(path) in message, (what, message)
        if "foreign" in what:  # every rank reads every file (its hyperparameter entries): each names the file
            assert named in message and "belongs to another checkpoint" in message, (what, message)
        elif dist.get_rank() == 1:  # the rank that read the damaged entry names the file and the entry
            assert "'__1_0.distcp'" in message and repr(named) in message, (what, message)
        messages[what] = message

    ds_dir = os.path.join(root, f"ds-{stage}")
    ours.save_checkpoint(ds_dir, tag="t")
    resumed = build_engine(case, seed=4)
    train(resumed, range(1))  # at the checkpoint's step: the load's step counters do not end the mark by themselves
    master = zd.sharded_master_params(resumed)
    master.mul_(1.5)  # an unsynced write
    empty = os.path.join(root, f"empty-{stage}")
    os.makedirs(empty, exist_ok=True)
    assert resumed.load_checkpoint(empty) == (None, None)  # no "latest": nothing loaded, the write still pending
    assert needs_sync(resumed)
    try:
        forward_backward(resumed, 0)
    except ModelParamsNotSyncedError:
        pass
    else:
        raise AssertionError("a forward ran with unsynced masters after a load_checkpoint that loaded nothing")
    path, _ = resumed.load_checkpoint(ds_dir, tag="t")
    assert path is not None
    assert not needs_sync(resumed), "engine.load_checkpoint restored masters and working weights, the mark stayed"
    assert _cast_masters_equal_working(resumed)
    forward_backward(resumed, 1)  # no ModelParamsNotSyncedError
    resumed.step()
    return messages
