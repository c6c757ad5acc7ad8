"""Opt-in check that every rank enters the same collective call (debug mode).

A collective (``ShardedGrads.full_tensors``, ``ParamGrad.full_tensor``, norms and other reductions) must be called
on every rank of the data-parallel group, in the same order, with the same arguments (parameter names, their order,
dtype). If ranks disagree, torch.distributed hangs or, worse, pairs mismatched buffers. In debug mode every
collective method first calls :func:`check_same_call`, which costs **one small collective per process group**: an
``all_gather`` of one int64 hash of the call signature. On a mismatch every rank sees the same gathered hashes, so
every rank raises :class:`~zero_dtensor.errors.RankDisagreementError` (after one more ``all_gather_object`` of the
readable signatures, for the message) instead of hanging.

Enable with the environment variable ``ZERO_DTENSOR_DEBUG=1`` (read at import) or :func:`set_debug`. It detects
disagreement among ranks that *reach* a collective method; a rank that never calls one at all still hangs the others
(as in any torch.distributed program), which a timeout (e.g. ``dist.init_process_group(timeout=...)``) turns into an
error.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .errors import RankDisagreementError

__all__ = ["check_grads_call", "check_same_call", "is_debug", "set_debug"]

_DEBUG = os.environ.get("ZERO_DTENSOR_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def set_debug(enabled: bool = True) -> None:
    """Turn the rank-agreement check of every collective method on or off (process-wide)."""
    global _DEBUG
    _DEBUG = bool(enabled)


def is_debug() -> bool:
    """Whether collective methods check that every rank makes the same call (``ZERO_DTENSOR_DEBUG`` or set_debug)."""
    return _DEBUG


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def check_same_call(what: str, signature: Any, groups: Iterable[dist.ProcessGroup], device: torch.device) -> None:
    """In debug mode, raise :class:`RankDisagreementError` on every rank unless all ranks pass equal arguments.

    ``signature`` must be built from plain values (names, dtypes, ints) whose ``repr`` is identical across ranks.
    One ``all_gather`` of one int64 per distinct group in ``groups`` (call-order of the distinct groups is kept).
    No-op (no communication) when debug mode is off.
    """
    if not _DEBUG:
        return
    text = f"{what}{signature!r}"
    mine = _hash(text)
    seen: list[dist.ProcessGroup] = []
    for group in groups:
        if any(group is s for s in seen):
            continue
        seen.append(group)
        world = dist.get_world_size(group)
        local = torch.tensor([mine], dtype=torch.int64, device=device)
        gathered = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(gathered, local, group=group)
        hashes = gathered.tolist()
        if len(set(hashes)) == 1:
            continue
        texts: list[Any] = [None] * world
        dist.all_gather_object(texts, text, group=group)
        lines = "\n".join(f"  rank {r}: {t}" for r, t in enumerate(texts))
        raise RankDisagreementError(
            f"ranks called a zero_dtensor collective with different arguments (it would hang or mix up buffers); "
            f"call it on every rank of the data-parallel group, in the same order, with the same names and dtype:\n"
            f"{lines}"
        )


def check_grads_call(grads: Any, what: str, *signature: Any) -> None:
    """:func:`check_same_call` over every process group of a ``ShardedGrads`` (one line at the top of a collective
    method: ``check_grads_call(self, "full_tensors", names, dtype)``). No-op unless debug mode is on."""
    if not _DEBUG:
        return
    storage = grads._storage
    check_same_call(what, signature, storage.process_groups, storage.device)
