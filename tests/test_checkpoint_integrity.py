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
