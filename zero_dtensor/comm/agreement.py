"""Rank agreement, written once: validate → agree → run, for every collective call of the library.

A collective must be entered by every rank of its process group, in the same order, with matching buffers. Ranks
that disagree (other names, another dtype, a setting changed on one rank, a bad argument on one rank only) would
hang, abort the backend or, worse, pair mismatched buffers and return wrong values. Every collective call of
zero_dtensor therefore runs in three steps:

1. **validate** this rank's arguments inside a :class:`Refusal` block, which keeps the first ``TypeError`` /
   ``ValueError`` / ``KeyError`` instead of raising it;
2. **agree** (:func:`agree`): one small collective per distinct multi-rank process group the call communicates on
   (DeepSpeed models have one process group, so one in all): an ``all_gather`` of ``[hash, error code]`` int64
   (``N·16`` bytes received per rank), or, where that is cheaper
   (:func:`~zero_dtensor.comm.collectives.prefers_all_reduce`: NCCL, gloo from 4 ranks on), an ``all_reduce`` (MAX) of
   ``[hash, -hash, error code, -error code]`` (every hash is equal where the largest hash is minus the largest
   negation; some rank refused where the largest code is not 0, every rank where the smallest is not). A call that
   needs every rank's values (``set_owned_``'s ``payload``) always gathers ``[hash, error code, payload…]``
   (``N·8·(2+len(payload))`` bytes received per rank). The hash covers what the call will actually do: every
   argument of the public call, by construction (:mod:`zero_dtensor.comm.signature`: each communicating call is
   marked :func:`~zero_dtensor.comm.signature.collective`, its arguments bound to its signature with the defaults
   applied, floats bitwise; the arguments left out, or agreed in another form, are named with their reason in one
   table, :data:`~zero_dtensor.comm.signature.NOT_BY_VALUE`), what the call resolved from them (the selection a
   predicate picks, the gather strategy each transfer will use, or that it will calibrate) and
   :func:`zero_dtensor.settings.fingerprint` (the pinned strategy, the environment variables, debug mode). An
   agreement outside any marked call is a bug of the library and raises ``RuntimeError`` before communicating. Where every rank agrees and none refused, the call runs; otherwise one
   ``all_gather_object`` of each rank's description follows and every rank raises before a byte of data moves: a
   refusing rank its own error, the other ranks the same class naming it (:func:`raise_refusals`), and where the
   arguments merely differ :class:`~zero_dtensor.errors.RankDisagreementError` listing every rank's call;
3. **run** the data collectives.

Calls that communicate nothing (replicated groups, one rank) agree on nothing and raise their refusal locally. A
call whose outcome depends on a user function that runs between its collectives (``map_full_``, ``on_grads``)
reports the function's failure with its next collective: ``map_full_`` carries one error code per peer inside its
write exchange; ``on_grads`` agrees with :func:`agree_outcome` (the same small collective on ``[hash, code]``; where
it reduced and some rank failed, one all_gather of the codes more, to name it). Either way the failing rank
re-raises its own exception and every other rank raises :class:`~zero_dtensor.errors.RankFailedError` (or a
subclass) naming it; nothing is written.

Every agreement waits at most the world process group's timeout (or :func:`~zero_dtensor.settings.set_debug`'s
``timeout``): a rank that never arrives (it skipped the call) makes the waiting ranks raise
``RankDisagreementError`` after that long; the process group is then unusable (a collective is left pending).

**Debug mode** (:mod:`zero_dtensor.settings`) adds one agreement at the entry of ``engine.step()`` of every engine
seen by ``sharded_grads`` (:func:`install_step_checkpoint`): a rank that skipped a collective call and went on to
the step meets the others' agreement there, and every rank raises instead of hanging in DeepSpeed's step. The
checkpoint is armed and disarmed only by an agreement that passed (debug mode is part of the fingerprint), so it
runs on every rank or on none.

A user function that runs on some ranks only (``map_full_``'s ``fn`` runs on each parameter's owner) must not
communicate: a collective there has no partner on the other ranks. Inside such a function every agreement raises
``RuntimeError`` at once (:func:`local_only`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .. import settings
from .collectives import all_gather_objects, gather_int_rows_within, max_int_values_within, prefers_all_reduce
from ..errors import RankDisagreementError, RankFailedError
from .process_groups import communicates, group_ranks, world_timeout
from .signature import current_calls, internal_call

__all__ = [
    "REFUSALS",
    "Refusal",
    "agree",
    "agree_on",
    "agree_outcome",
    "distinct_groups",
    "error_code",
    "install_step_checkpoint",
    "local_only",
    "raise_outcome",
    "step_checkpoint_armed",
    "wait_timeout",
]

#: the exceptions a validation raises; :class:`Refusal` holds them for the agreement
REFUSALS: tuple[type[Exception], ...] = (TypeError, ValueError, KeyError)

_ARMED = False  # the step checkpoint: set by an agreement that passed, from the (agreed) debug flag
_LOCAL_ONLY = 0  # depth of user functions that run on some ranks only


class Refusal:
    """A ``with`` block that validates a collective call's arguments on this rank: it keeps the first
    :data:`REFUSALS` exception raised in it (``error``) instead of raising it, so that :func:`agree` can tell every
    rank before any rank raises. Other exceptions pass through. No communication."""

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


def error_code(error: BaseException | None) -> int:
    """An error as one int that ranks can exchange: 0 none, ``1 + i`` for ``REFUSALS[i]``, ``len(REFUSALS) + 1``
    for any other exception. No communication."""
    if error is None:
        return 0
    for i, cls in enumerate(REFUSALS):
        if isinstance(error, cls):
            return i + 1
    return len(REFUSALS) + 1


def wait_timeout() -> datetime.timedelta:
    """How long an agreement waits: :func:`~zero_dtensor.settings.set_debug`'s ``timeout``, else the world process
    group's own timeout."""
    return settings.debug_timeout() or world_timeout()


def distinct_groups(groups: Iterable[dist.ProcessGroup]) -> list[dist.ProcessGroup]:
    """The multi-rank process groups among ``groups``, each once, in first-seen order. No communication."""
    seen: list[dist.ProcessGroup] = []
    for group in groups:
        if not any(group is s for s in seen) and communicates(group):
            seen.append(group)
    return seen


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    """Mark a user function that runs on some ranks only: any agreement inside raises ``RuntimeError`` (a
    collective there would have no partner). No communication."""
    global _LOCAL_ONLY
    _LOCAL_ONLY += 1
    try:
        yield
    finally:
        _LOCAL_ONLY -= 1


def _check_not_local(what: str) -> None:
    if _LOCAL_ONLY:
        raise RuntimeError(
            f"zero_dtensor: {what} is a collective call, made inside a function that runs on some ranks only "
            "(map_full_'s fn runs on each parameter's owner): it would wait for ranks that never call it. Compute "
            "without communicating there, or gather first (full_tensors / owned) and write back after (set_full_ "
            "/ set_owned_); on_grads' functions run on every rank and may communicate.")


def agree(what: str, signature: Any, groups: Iterable[dist.ProcessGroup], device: torch.device, *,
          refused: Exception | None = None,
          payload: Callable[[dist.ProcessGroup], Sequence[int]] | None = None,
          family: str | None = None) -> dict[int, list[list[int]]]:
    """Agree on a collective call before it moves data (see the module docstring); raise on every rank unless
    every rank passes an equal ``signature`` and the same settings and none refused.

    ``signature``: what the call resolved from its arguments (plain values: the selection's names, strategies)
    whose ``repr`` is identical across ranks; the arguments themselves are hashed by construction
    (:func:`~zero_dtensor.comm.signature.current_calls`); ignored where ``refused`` (this rank's :class:`Refusal`
    error). Raises ``RuntimeError`` outside a marked call (:func:`~zero_dtensor.comm.signature.collective`,
    :func:`~zero_dtensor.comm.signature.internal_call`). ``family``: the fingerprint of the tensors the call
    reads or writes (:attr:`~zero_dtensor.core.storage.FlatStorage.family`; :func:`agree_on` passes it), hashed with the
    signature. ``groups``: the process groups the call communicates
    on (single-rank ones and repeats are skipped; a refusing rank that cannot tell which groups the call uses
    passes all of them: their first must be the others' first). ``payload(group)``: extra int64 values to gather
    with the agreement (the same length on every rank), returned as ``{id(group): one row per group rank}``.

    **Collective**: per distinct multi-rank group one ``all_gather`` of ``2 + len(payload)`` int64 per rank, or,
    without ``payload`` where :func:`~zero_dtensor.comm.collectives.prefers_all_reduce`, one ``all_reduce`` (MAX) of
    4 int64 (its returned rows are then empty lists); waited on for at most :func:`wait_timeout`; where a rank
    differs or refused, one ``all_gather_object`` more, then every rank raises (where every rank refused, each
    raises its own error without it). No group: no communication (``refused`` raises on this rank).
    """
    _check_not_local(what)
    calls = _calls(what)
    fingerprint = settings.fingerprint()
    on = "" if family is None else f" on {family}"
    text = (f"{what}{signature!r}{on} called as {calls} with {fingerprint!r}" if refused is None
            else _refusal_text(what, refused))
    mine = [_hash(text), error_code(refused)]
    gathered: dict[int, list[list[int]]] = {}
    for group in distinct_groups(groups):
        rows: list[list[int]] = []
        if payload is None and prefers_all_reduce(group):
            same, any_refused, all_refused = _max_check(what, mine[0], mine[1], group, device)
        else:
            rows = _gather(what, [*mine, *(payload(group) if payload is not None else ())], group, device)
            same, any_refused, all_refused = _row_check(rows)
        if same and not any_refused:
            gathered[id(group)] = rows
            continue
        if refused is not None and all_refused:  # every rank refused: each raises its own
            refused.add_note(f"zero_dtensor: {what} raised on every rank (every rank refused the arguments); "
                             "nothing was communicated or written")
            raise refused
        texts: list[Any] = all_gather_objects((text, mine[1]), group)
        raise_refusals(what, texts, group, refused)
        lines = "\n".join(f"  rank {r}: {t}" for r, (t, _) in zip(group_ranks(group), texts))
        raise RankDisagreementError(
            f"ranks called a zero_dtensor collective with different arguments or settings (it would hang or mix up "
            f"buffers); call it on every rank of the data-parallel group, in the same order, with the same "
            f"arguments, and keep zero_dtensor's settings (set_gather_strategy, set_debug, clear_calibration, the "
            f"ZERO_DTENSOR_* environment variables) the same on every rank:\n{lines}")
    if refused is not None:  # no group to tell: this rank alone
        raise refused
    if gathered:  # only an agreement that reached other ranks may arm or disarm the step checkpoint
        _arm(settings.is_debug())
    return gathered


def _calls(what: str) -> str:
    """The running marked calls with their bound arguments (:func:`~zero_dtensor.comm.signature.current_calls`);
    ``RuntimeError`` outside any: an agreement whose arguments nobody hashes is a bug of the library."""
    calls = current_calls()
    if calls is None:
        raise RuntimeError(
            f"zero_dtensor: internal error: the agreement of {what} runs outside any call marked "
            "zero_dtensor.comm.signature.collective, so its arguments would not be agreed; mark the public call")
    return calls


def agree_on(storage: Any, what: str, signature: Any, groups: Iterable[dist.ProcessGroup], *,
             refused: Exception | None = None,
             payload: Callable[[dist.ProcessGroup], Sequence[int]] | None = None) -> dict[int, list[list[int]]]:
    """:func:`agree` for a call on one family's tensors (``storage``: its
    :class:`~zero_dtensor.core.storage.FlatStorage`): the family's fingerprint (``storage.family``: the gradients, the
    masters, one optimizer-state key, a numbered clone) is hashed with the signature, so that ranks naming the same
    parameters of *different* tensors (``exp_avg`` on one rank, ``exp_avg_sq`` on another) raise on every rank
    instead of exchanging pieces of different tensors. Every communicating call of
    :class:`~zero_dtensor.families.tensors.ShardedTensors` agrees through here. The same collective as :func:`agree`."""
    return agree(what, signature, groups, storage.device, refused=refused, payload=payload, family=storage.family)


_HASH_BITS = (1 << 62) - 1  # a hash and its negation both fit an int64


def _max_check(what: str, hashed: int, code: int, group: dist.ProcessGroup,
               device: torch.device) -> tuple[bool, bool, bool]:
    """``(every rank's hash equal, some rank's code set, every rank's code set)`` from one all_reduce (MAX) of
    ``[hash, -hash, code, -code]`` int64."""
    h = hashed & _HASH_BITS
    top = max_int_values_within([h, -h, code, -code], group, device, wait_timeout())
    if top is None:
        _raise_absent(what)
    return top[0] == -top[1], top[2] != 0, top[3] != 0


def _row_check(rows: list[list[int]]) -> tuple[bool, bool, bool]:
    """:func:`_max_check`'s answer from gathered ``[hash, code, …]`` rows."""
    return len({row[0] for row in rows}) == 1, any(row[1] for row in rows), all(row[1] for row in rows)


def _raise_absent(what: str) -> NoReturn:
    raise RankDisagreementError(
        f"zero_dtensor: {what}: not every rank of the data-parallel group reached this collective call within "
        f"{wait_timeout()} (some rank skipped it, or is stuck elsewhere). Call it on every rank, in the same order; "
        "the process group is unusable now: end the job.")


def _gather(what: str, values: list[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    rows = gather_int_rows_within(values, group, device, wait_timeout())
    if rows is None:
        _raise_absent(what)
    return rows


def _refusal_text(what: str, error: Exception) -> str:
    return f"{what}: refused its arguments: {type(error).__name__}: {error}"


def raise_refusals(what: str, texts: Sequence[tuple[str, int]], group: dist.ProcessGroup,
                   refused: Exception | None) -> None:
    """Raise on this rank if any rank refused (``texts``: every rank's ``(description, error code)``): its own
    error where it refused, else the first refusing rank's class naming every refusing rank and its message.
    Returns when no rank refused."""
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
    raise REFUSALS[min(refusing[0][2], len(REFUSALS)) - 1](
        f"zero_dtensor: {what}: rank(s) {ranks} refused the call's arguments, so no rank communicated or wrote "
        f"anything (this rank's arguments were fine; mend those ranks' call):\n{lines}")


def raise_outcome(what: str, error: BaseException | None, failed: Sequence[tuple[int, int]], *,
                  failure: type[RankFailedError] = RankFailedError, validation_classes: bool = True,
                  consequence: str = "Nothing was written on any rank.") -> None:
    """After a user function ran: re-raise this rank's ``error`` (with a note naming the failed ranks), or, where
    only other ranks failed (``failed``: ``(global rank, error code)``), raise ``failure`` naming them (with
    ``validation_classes``, a failed validation's own class instead). Returns when nothing failed."""
    if error is not None:
        error.add_note(f"zero_dtensor.{what}: failed on rank(s) {[r for r, _ in failed] or 'this one'}; "
                       f"{consequence[0].lower()}{consequence[1:]}")
        raise error
    if not failed:
        return
    ranks = [r for r, _ in failed]
    message = f"zero_dtensor.{what}: rank(s) {ranks} failed (see their traceback); this rank's part was fine. " \
              f"{consequence}"
    code = failed[0][1]
    if validation_classes and 0 < code <= len(REFUSALS):
        raise REFUSALS[code - 1](message)
    raise failure(message, ranks)


def agree_outcome(what: str, error: BaseException | None, groups: Iterable[dist.ProcessGroup],
                  device: torch.device, *, signature: Any = None, **kwargs: Any) -> None:
    """Every rank learns whether a user function failed on any rank, and raises if one did (:func:`raise_outcome`,
    ``kwargs`` passed on). ``signature``: plain values whose ``repr`` must be equal on every rank that did not fail
    (``zd.load``: the normalized path and the checkpoint's identity), hashed with the running marked calls' bound
    arguments (:func:`~zero_dtensor.comm.signature.current_calls`); where they differ and no rank failed, every
    rank raises :class:`~zero_dtensor.errors.RankDisagreementError` listing every rank's (one
    ``all_gather_object`` more, on that path only). A failure takes precedence: a failing rank may not know the
    signature. **Collective**: per distinct multi-rank group one ``all_gather`` of 2 int64 per rank, or
    where :func:`~zero_dtensor.comm.collectives.prefers_all_reduce` one ``all_reduce`` (MAX) of 4 int64 and, only
    where some rank failed, one ``all_gather`` of 2 int64 per rank more (which ranks)."""
    code = error_code(error)
    failed: dict[int, int] = {}
    calls = current_calls() if signature is not None and error is None else None
    text = (what if signature is None or error is not None
            else f"{what}{signature!r}" + ("" if calls is None else f" called as {calls}"))
    hashed = _hash(text)
    for group in distinct_groups(groups):
        if prefers_all_reduce(group):
            same, any_failed, _ = _max_check(what, hashed, code, group, device)
            rows = _gather(what, [hashed, code], group, device) if any_failed else []
        else:
            rows = _gather(what, [hashed, code], group, device)
            same, any_failed, _ = _row_check(rows)
        if not same and not any_failed:
            detail = ""
            if signature is not None:
                texts: list[Any] = all_gather_objects(text, group)
                detail = ":\n" + "\n".join(f"  rank {r}: {t}" for r, t in zip(group_ranks(group), texts))
            raise RankDisagreementError(f"zero_dtensor: {what}: ranks reached different collective calls here, or "
                                        f"called it with different arguments; every rank raised, nothing was "
                                        f"written{detail}")
        failed.update({r: row[1] for r, row in zip(group_ranks(group), rows) if row[1]})
    raise_outcome(what, error, sorted(failed.items()), **kwargs)


def _arm(debug: bool) -> None:
    global _ARMED
    _ARMED = debug


def step_checkpoint_armed() -> bool:
    """Whether ``engine.step()`` starts with an agreement (debug mode, as of the last agreement that passed)."""
    return _ARMED


_STEP_ATTR = "_zero_dtensor_step_checkpoint"


def install_step_checkpoint(optimizer: Any, groups: Iterable[dist.ProcessGroup], device: torch.device) -> None:
    """Make ``optimizer.step()`` start with an agreement while :func:`step_checkpoint_armed` (idempotent; an
    instance attribute, so the class is untouched). No communication to install; one agreement per step
    while armed."""
    if getattr(optimizer, _STEP_ATTR, None) is not None:
        return
    original = optimizer.step
    pgs = tuple(groups)

    def step(*args: Any, **kwargs: Any) -> Any:
        if _ARMED:
            with internal_call("engine.step"):
                agree("engine.step", (), pgs, device)
        return original(*args, **kwargs)

    step.__wrapped__ = original  # type: ignore[attr-defined]
    optimizer.step = step
    setattr(optimizer, _STEP_ATTR, step)
