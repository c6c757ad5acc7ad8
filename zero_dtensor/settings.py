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
``ZERO_DTENSOR_FUSED_REDUCTIONS``  fused reductions at import                  ``0``, ``1`` (also ``true``/``on``)
                                   (:func:`set_fused_reductions`): ``stats``
                                   and ``dots`` read accelerator rows once,
                                   through ``torch.compile``
``ZERO_DTENSOR_FORCE_COLLECTIVES`` a one-rank process group takes the          ``0``, ``1`` (also ``true``/``on``)
                                   collective path of N ranks (read at every
                                   call; a debug setting: on one GPU it runs
                                   every NCCL call the library makes)
=================================  ==========================================  ==================================

Nothing here communicates.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os

__all__ = [
    "ENV_DEBUG",
    "ENV_FORCE_COLLECTIVES",
    "ENV_FUSED",
    "ENV_STRATEGY",
    "STRATEGIES",
    "check_strategy",
    "debug_timeout",
    "check_fused_available",
    "fingerprint",
    "force_collectives",
    "fused_reductions",
    "fused_unavailable",
    "gather_strategy",
    "is_debug",
    "pinned",
    "set_debug",
    "set_fused_reductions",
    "set_gather_strategy",
]

ENV_STRATEGY = "ZERO_DTENSOR_GATHER_STRATEGY"
ENV_DEBUG = "ZERO_DTENSOR_DEBUG"
ENV_FUSED = "ZERO_DTENSOR_FUSED_REDUCTIONS"
ENV_FORCE_COLLECTIVES = "ZERO_DTENSOR_FORCE_COLLECTIVES"
STRATEGIES = ("auto", "all_gather", "all_to_all", "all_reduce", "send_recv")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


_DEBUG = _env_flag(ENV_DEBUG, False)
_FUSED = _env_flag(ENV_FUSED, False)
_TIMEOUT: datetime.timedelta | None = None
_PINNED: str | None = None


def check_strategy(strategy: object, *, allow_none: bool = False) -> None:
    """``ValueError`` unless ``strategy`` is one of :data:`STRATEGIES` (or ``None`` with ``allow_none``)."""
    if strategy is None and allow_none:
        return
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def set_gather_strategy(strategy: str | None) -> None:
    """Pin what ``strategy="auto"`` of ``full_tensors`` and ``iter_full`` means in this process.

    Set it identically on every rank: every agreement includes it. ``ZERO_DTENSOR_GATHER_STRATEGY`` does the same
    from the environment; the setter takes precedence.

    Args:
        strategy: ``"all_gather"``, ``"all_to_all"``, ``"all_reduce"``, ``"send_recv"``; ``None`` or ``"auto"``
            unpins (then the variable applies, then calibration on gloo).

    Returns:
        None.

    Raises:
        ValueError: an unknown strategy.

    Communication:
        None (a rank that differs makes the next collective call raise on every rank).

    Device and memory:
        Nothing allocated.

    Example:
        ```python
        zd.set_gather_strategy("all_gather")
        ```
    """
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
    """Turn debug mode on or off in this process: a rank that skips a collective raises instead of hanging.

    In debug mode, ``engine.step()`` of every engine ``sharded_grads`` saw starts with a rank-agreement checkpoint: a
    rank that skipped a zero_dtensor call and went on to the step raises ``RankDisagreementError`` on every rank
    instead of hanging in DeepSpeed's step. ``ZERO_DTENSOR_DEBUG=1`` at import does the same. Set it identically on
    every rank.

    Args:
        enabled: on or off.
        timeout: seconds any agreement waits for the other ranks before raising (default: the process group's).

    Returns:
        None.

    Raises:
        ValueError: a timeout that is not a positive number.

    Communication:
        None now; then one small agreement at the first ``sharded_grads`` of a step and one per ``engine.step()``.

    Device and memory:
        Nothing allocated.

    Example:
        ```python
        zd.set_debug(True, timeout=60)
        ```
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


def force_collectives() -> bool:
    """Whether ``ZERO_DTENSOR_FORCE_COLLECTIVES`` asks one-rank process groups to take the collective path of N
    ranks (read from the environment at every call, as the gather strategy's variable is). A debug setting: values
    are those of the one-rank path, the collectives those of N ranks (each over the one rank), so that one GPU runs
    every NCCL call the library makes. Only :func:`zero_dtensor.comm.process_groups.collective_path` asks it (the one
    switch). No communication."""
    return _env_flag(ENV_FORCE_COLLECTIVES, False)


def set_fused_reductions(on: bool) -> None:
    """Turn the fused reductions on or off in this process (default off).

    On: ``stats()`` reads each buffer on an accelerator once (exact nan/inf counts) and ``dots()`` each operand once,
    through functions ``torch.compile`` builds on first use (seconds, once per process; needs Triton on CUDA).
    Offloaded (CPU) buffers keep the eager path. Values equal the eager path's within float32 rounding per row.
    ``ZERO_DTENSOR_FUSED_REDUCTIONS=1`` at import does the same. Set it identically on every rank.

    Args:
        on: True or False.

    Returns:
        None.

    Raises:
        TypeError: ``on`` is not a bool.
        RuntimeError: turning it on where CUDA is available but Triton is not (``pip install triton``); nothing
            changed.

    Communication:
        None (it is part of every rank agreement).

    Device and memory:
        Compiled kernels, once per process; no extra buffers.

    Example:
        ```python
        zd.set_fused_reductions(True)
        ```
    """
    global _FUSED
    if not isinstance(on, bool):
        raise TypeError(f"set_fused_reductions: on must be True or False, got {on!r}")
    if on:
        check_fused_available()
    _FUSED = on


def fused_reductions() -> bool:
    """Whether the fused reductions are on in this process (:func:`set_fused_reductions`,
    ``ZERO_DTENSOR_FUSED_REDUCTIONS``)."""
    return _FUSED


@functools.cache
def fused_unavailable() -> str | None:
    """Why the fused reductions cannot run on this machine's accelerator, or ``None``: CUDA is available but
    Triton (the code generator ``torch.compile`` uses on GPUs) cannot be imported. Checked once per process."""
    import torch  # only here: the settings are a leaf module

    if torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        return ("the fused reductions need Triton on CUDA (torch.compile generates their kernels with it): "
                f"pip install triton, or turn them off (zd.set_fused_reductions(False), unset {ENV_FUSED})")
    return None


def check_fused_available() -> None:
    """``RuntimeError`` saying what to do where :func:`fused_unavailable` gives a reason."""
    reason = fused_unavailable()
    if reason is not None:
        raise RuntimeError(reason)


def fingerprint() -> tuple[str, ...]:
    """The settings that change what a collective call does, as plain strings (the environment variable's raw
    value: an invalid one differs too). Part of every rank agreement. With the fused reductions on, whether they
    can run here too (a rank without Triton differs instead of raising alone)."""
    fused = f"fused={int(_FUSED)}" + (",unavailable" if _FUSED and fused_unavailable() else "")
    return (f"strategy={_PINNED or os.environ.get(ENV_STRATEGY, '').strip() or 'auto'}", f"debug={int(_DEBUG)}",
            fused, f"force_collectives={int(force_collectives())}")
