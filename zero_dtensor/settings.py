"""Every process-wide setting of zero_dtensor, and the environment variables that set them.

Each of these changes what a collective call does (which collective travels, which extra checks run), so each must
be the same on every rank. They are not trusted to be: every collective call agrees on :func:`fingerprint` together
with its arguments (:mod:`zero_dtensor.comm.agreement`), and a setting that differs between ranks raises
:class:`~zero_dtensor.errors.RankDisagreementError` on every rank before any data moves.

=================================  ==========================================  ==================================
environment variable               what it sets                                values (default first)
=================================  ==========================================  ==================================
``ZERO_DTENSOR_GATHER_STRATEGY``   what ``strategy="auto"`` means for          ``auto``, ``all_gather``,
                                   ``full_tensors`` / ``iter_full`` (read at   ``all_to_all``, ``all_reduce``,
                                   every call; :func:`set_gather_strategy`     ``send_recv``
                                   takes precedence)
``ZERO_DTENSOR_DEBUG``             debug mode at import (:func:`set_debug`):   ``0``, ``1`` (also ``true``/``on``)
                                   a rank-agreement checkpoint at the entry
                                   of ``engine.step()``
=================================  ==========================================  ==================================

Nothing here communicates.
"""

from __future__ import annotations

import datetime
import os

__all__ = [
    "ENV_DEBUG",
    "ENV_STRATEGY",
    "STRATEGIES",
    "check_strategy",
    "debug_timeout",
    "fingerprint",
    "gather_strategy",
    "is_debug",
    "pinned",
    "set_debug",
    "set_gather_strategy",
]

ENV_STRATEGY = "ZERO_DTENSOR_GATHER_STRATEGY"
ENV_DEBUG = "ZERO_DTENSOR_DEBUG"
STRATEGIES = ("auto", "all_gather", "all_to_all", "all_reduce", "send_recv")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


_DEBUG = _env_flag(ENV_DEBUG, False)
_TIMEOUT: datetime.timedelta | None = None
_PINNED: str | None = None


def check_strategy(strategy: object, *, allow_none: bool = False) -> None:
    """``ValueError`` unless ``strategy`` is one of :data:`STRATEGIES` (or ``None`` with ``allow_none``)."""
    if strategy is None and allow_none:
        return
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def set_gather_strategy(strategy: str | None) -> None:
    """Pin what ``strategy="auto"`` means in this process (``None`` or ``"auto"`` unpins; then
    ``ZERO_DTENSOR_GATHER_STRATEGY`` applies, then calibration). Set it identically on every rank: a rank that
    differs makes the next collective call raise on every rank. No communication."""
    global _PINNED
    check_strategy(strategy, allow_none=True)
    _PINNED = None if strategy == "auto" else strategy


def pinned() -> str | None:
    """What :func:`set_gather_strategy` pinned (``None``: nothing)."""
    return _PINNED


def gather_strategy() -> str:
    """The pinned strategy (setter first, then ``ZERO_DTENSOR_GATHER_STRATEGY``), or ``"auto"``. ``ValueError``
    for an unknown value in the environment variable."""
    if _PINNED is not None:
        return _PINNED
    env = os.environ.get(ENV_STRATEGY, "").strip() or "auto"
    if env not in STRATEGIES:
        raise ValueError(f"{ENV_STRATEGY}={env!r} is not a gather strategy; use one of {STRATEGIES} (or unset it)")
    return env


def set_debug(enabled: bool = True, *, timeout: float | None = None) -> None:
    """Turn debug mode on or off in this process (set it identically on every rank; the next collective call of
    zero_dtensor agrees on it, and from then on ``engine.step()`` of every engine seen by ``sharded_grads`` starts
    with a rank-agreement checkpoint). No communication.

    ``timeout`` (seconds): how long any agreement waits for the other ranks before raising; default the world
    process group's timeout (what ``init_process_group(timeout=...)`` was given).
    """
    global _DEBUG, _TIMEOUT
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"set_debug: timeout must be a positive number of seconds, got {timeout!r}")
    _DEBUG = bool(enabled)
    _TIMEOUT = None if timeout is None else datetime.timedelta(seconds=float(timeout))


def is_debug() -> bool:
    """Whether debug mode was asked for in this process (``ZERO_DTENSOR_DEBUG`` or :func:`set_debug`)."""
    return _DEBUG


def debug_timeout() -> datetime.timedelta | None:
    """:func:`set_debug`'s ``timeout``, or ``None`` (then the world process group's own)."""
    return _TIMEOUT


def fingerprint() -> tuple[str, ...]:
    """The settings that change what a collective call does, as plain strings (the environment variable's raw
    value: an invalid one differs too). Part of every rank agreement."""
    return (f"strategy={_PINNED or os.environ.get(ENV_STRATEGY, '').strip() or 'auto'}", f"debug={int(_DEBUG)}")
