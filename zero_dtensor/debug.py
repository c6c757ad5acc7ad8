"""Rank agreement: every rank must enter the same collective call, or every rank raises instead of hanging.

A collective (``ShardedGrads.full_tensors``, ``iter_full``, ``ParamGrad.full_tensor``, norms and the other
reductions) must be called on every rank of the data-parallel group, in the same order, with the same arguments
(parameter names, their order, dtype). If ranks disagree, torch.distributed hangs or, worse, pairs mismatched
buffers (ZeRO-3 ranks asking for names in different flat groups receive garbage).

Two levels of checking, both built on :func:`check_same_call` (an ``all_gather`` of one int64 hash of the call
signature per process group, ``N·8`` bytes received per rank, waited on with a timeout):

**Always on** for the bulk materializations, ``full_tensors`` and ``iter_full`` (once per call, not per bucket).
Measured on 2 gloo ranks (``python -m zero_dtensor.bench``, see the README): the check costs tens of microseconds,
well under 1% of a ``full_tensors()`` of the benchmark model, and it turns mixed-up requests, which would otherwise
return wrong values, into :class:`~zero_dtensor.errors.RankDisagreementError` on every rank.
``set_rank_checks(False)`` (or ``ZERO_DTENSOR_RANK_CHECKS=0``) turns it off where every microsecond counts.

The same check carries a **refusal**: a call whose arguments fail validation on one rank only (an unknown name, a
bad ``out=`` entry, a non-floating ``dtype``) must not raise there alone while the other ranks enter the collective
and wait for it. The call validates inside a :class:`Refusal` block, and :func:`check_same_call` tells every rank:
the refusing rank raises its own error, the others the same class naming the refusing rank(s) and their messages.
No collective is added: the hash then differs, and the texts are gathered as for any disagreement.

**Debug mode** (``ZERO_DTENSOR_DEBUG=1`` at import, or :func:`set_debug`) checks every collective call (also the
per-parameter ``ParamGrad.full_tensor``, the reductions and ``found_inf``) and adds a checkpoint at the entry of the
optimizer step of every engine it has seen (``sharded_grads(engine)`` installs it): a rank that skips a collective
call and goes on to ``engine.step()`` meets the others in the checkpoint, and every rank raises
``RankDisagreementError`` instead of hanging in DeepSpeed's step.

Every check waits at most the timeout the user gave ``init_process_group`` / ``deepspeed.init_distributed`` (the
world group's; :func:`set_debug` can set another): a rank that never reaches a check (it skipped the call and went
elsewhere) makes the waiting ranks raise ``RankDisagreementError`` after that long, not after DeepSpeed's
30-minute data-parallel timeout. The process group is unusable after such a timeout (a collective is left pending):
end the job.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .collectives import all_gather_objects, gather_ints_within, group_ranks, world_size_of, world_timeout
from .errors import RankDisagreementError

__all__ = [
    "REFUSALS",
    "Refusal",
    "check_grads_call",
    "check_same_call",
    "error_code",
    "install_step_checkpoint",
    "is_debug",
    "rank_checks_enabled",
    "set_debug",
    "set_rank_checks",
]


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


_DEBUG = _env_flag("ZERO_DTENSOR_DEBUG", False)
_RANK_CHECKS = _env_flag("ZERO_DTENSOR_RANK_CHECKS", True)
_TIMEOUT: datetime.timedelta | None = None


def set_debug(enabled: bool = True, *, timeout: float | None = None) -> None:
    """Turn debug mode on or off (process-wide; set it identically on every rank). No communication.

    ``timeout`` (seconds): how long a check waits for the other ranks before raising; default the world process
    group's timeout (what ``init_process_group(timeout=...)`` was given). It applies to the always-on checks too.
    """
    global _DEBUG, _TIMEOUT
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"set_debug: timeout must be a positive number of seconds, got {timeout!r}")
    _DEBUG = bool(enabled)
    _TIMEOUT = None if timeout is None else datetime.timedelta(seconds=float(timeout))


def is_debug() -> bool:
    """Whether every collective call is checked for rank agreement (``ZERO_DTENSOR_DEBUG`` or :func:`set_debug`)."""
    return _DEBUG


def set_rank_checks(enabled: bool = True) -> None:
    """Turn the always-on agreement check of ``full_tensors`` / ``iter_full`` on or off (process-wide; set it
    identically on every rank). Debug mode checks regardless. No communication."""
    global _RANK_CHECKS
    _RANK_CHECKS = bool(enabled)


def rank_checks_enabled() -> bool:
    """Whether ``full_tensors`` / ``iter_full`` check rank agreement (on unless turned off, or in debug mode)."""
    return _RANK_CHECKS or _DEBUG


def check_timeout() -> datetime.timedelta:
    """How long a check waits: :func:`set_debug`'s ``timeout``, else the world process group's own timeout."""
    if _TIMEOUT is not None:
        return _TIMEOUT
    return world_timeout()


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _gather_hashes(mine: int, group: dist.ProcessGroup, device: torch.device, what: str) -> list[int]:
    timeout = check_timeout()
    hashes = gather_ints_within(mine, group, device, timeout)
    if hashes is None:
        raise RankDisagreementError(
            f"zero_dtensor: {what}: not every rank of the data-parallel group reached this collective call within "
            f"{timeout} (some rank skipped it, or is stuck elsewhere). Call it on every rank, in the same order; "
            "the process group is unusable now: end the job."
        )
    return hashes


#: the exceptions a validation raises; :class:`Refusal` holds them for the agreement check
REFUSALS: tuple[type[Exception], ...] = (TypeError, ValueError, KeyError)


class Refusal:
    """A ``with`` block that validates a collective call's arguments on this rank: it keeps the first
    :data:`REFUSALS` exception raised in it (``error``) instead of raising it, so that :func:`check_same_call`
    (``refused=``) can tell every rank before any rank raises. Other exceptions pass through. No communication."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: Exception | None = None

    def __enter__(self) -> Refusal:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, traceback: Any) -> bool:
        if isinstance(value, REFUSALS):
            self.error = value
            return True
        return False


def _refusal_text(what: str, error: Exception) -> str:
    return f"{what}: refused its arguments: {type(error).__name__}: {error}"


def _raise_refusals(what: str, texts: list[tuple[str, int]], group: dist.ProcessGroup,
                    refused: Exception | None) -> None:
    """Raise on this rank if any rank refused: its own error where it refused, else the first refusing rank's class
    with every refusing rank's message. Returns when no rank refused."""
    members = group_ranks(group)
    refusing = [(members[r], text, code) for r, (text, code) in enumerate(texts) if code]
    if not refusing:
        return
    ranks = [r for r, _, _ in refusing]
    if refused is not None:
        refused.add_note(f"zero_dtensor: {what} raised on every rank (rank(s) {ranks} refused the arguments); "
                         "nothing was communicated or written")
        raise refused
    lines = "\n".join(f"  rank {r}: {text}" for r, text, _ in refusing)
    raise REFUSALS[refusing[0][2] - 1](
        f"zero_dtensor: {what}: rank(s) {ranks} refused the call's arguments, so no rank communicated or wrote "
        f"anything (this rank's arguments were fine; mend those ranks' call):\n{lines}")


def error_code(error: BaseException | None) -> int:
    """An error as one int that ranks can exchange: 0 none, ``1 + i`` for ``REFUSALS[i]``, ``len(REFUSALS) + 1``
    for any other exception. No communication."""
    if error is None:
        return 0
    for i, cls in enumerate(REFUSALS):
        if isinstance(error, cls):
            return i + 1
    return len(REFUSALS) + 1


def check_same_call(what: str, signature: Any, groups: Iterable[dist.ProcessGroup], device: torch.device,
                    *, always: bool = False, refused: Exception | None = None) -> None:
    """Raise :class:`RankDisagreementError` on every rank unless all ranks pass equal arguments; with
    ``refused`` (this rank's :class:`Refusal` error), raise on every rank: that error here, the same class naming
    this rank elsewhere.

    ``signature`` must be built from plain values (names, dtypes, ints) whose ``repr`` is identical across ranks
    (ignored when ``refused``). One ``all_gather`` of one int64 per distinct group in ``groups`` (call order of the
    distinct groups is kept), waited on for at most :func:`check_timeout`; where the hashes differ, one
    ``all_gather_object`` of the call's text. Runs in debug mode, and with ``always`` while
    :func:`rank_checks_enabled`; otherwise no communication (and ``refused`` is raised on this rank only).
    **Collective**: ``groups`` must be the same on every rank (a refusing rank that cannot tell which groups the
    call uses passes all of them: their first must be the others' first).
    """
    if not (_DEBUG or (always and _RANK_CHECKS)):
        if refused is not None:
            raise refused
        return
    text = f"{what}{signature!r}" if refused is None else _refusal_text(what, refused)
    mine = _hash(text)
    seen: list[dist.ProcessGroup] = []
    for group in groups:
        if any(group is s for s in seen):
            continue
        seen.append(group)
        if world_size_of(group) == 1:
            continue
        hashes = _gather_hashes(mine, group, device, what)
        if len(set(hashes)) == 1:
            continue
        texts: list[Any] = all_gather_objects((text, error_code(refused)), group)
        _raise_refusals(what, texts, group, refused)
        lines = "\n".join(f"  rank {r}: {t}" for r, (t, _) in enumerate(texts))
        raise RankDisagreementError(
            f"ranks called a zero_dtensor collective with different arguments (it would hang or mix up buffers); "
            f"call it on every rank of the data-parallel group, in the same order, with the same names and dtype:\n"
            f"{lines}"
        )
    if refused is not None:  # every rank refused alike (or no group to tell): each raises its own
        raise refused


def check_grads_call(grads: Any, what: str, *signature: Any, always: bool = False) -> None:
    """:func:`check_same_call` over the process groups of ``grads`` (a ``GradState``, or a ``GradStorage``: anything
    with ``process_groups`` and ``device``)."""
    if not (_DEBUG or (always and _RANK_CHECKS)):
        return
    storage = grads.storage if hasattr(grads, "storage") else grads
    check_same_call(what, signature, storage.process_groups, storage.device, always=always)


_STEP_ATTR = "_zero_dtensor_step_checkpoint"


def install_step_checkpoint(optimizer: Any, groups: Iterable[dist.ProcessGroup], device: torch.device) -> None:
    """In debug mode, make ``optimizer.step()`` start with a rank-agreement check (idempotent; an instance
    attribute, so the class is untouched). A rank that skipped a collective call of zero_dtensor and went on to
    ``engine.step()`` then meets the others' check and every rank raises. The check runs only while debug mode is
    on. No communication to install."""
    if getattr(optimizer, _STEP_ATTR, None) is not None:
        return
    original = optimizer.step
    pgs = tuple(groups)

    def step(*args: Any, **kwargs: Any) -> Any:
        check_same_call("engine.step", (), pgs, device)
        return original(*args, **kwargs)

    step.__wrapped__ = original  # type: ignore[attr-defined]
    optimizer.step = step
    setattr(optimizer, _STEP_ATTR, step)
