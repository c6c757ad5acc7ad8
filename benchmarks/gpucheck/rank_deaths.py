"""How a spawned process ended, in words: its exit code or signal, the last lines of its stderr (captured to a
file by the child), the innermost zero_dtensor frame of a fault dump, and the known causes on gloo over CUDA."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

TAIL_LINES = 12
TAIL_BYTES = 64 * 1024
FAULT_LINES = 6  # the fault line, a header and the innermost frames
# stderr signatures of known stack limits, and what they mean
KNOWN_CAUSES = (
    (("gloo::IoException", "Bad address"),
     "gloo point-to-point (isend/irecv, send_recv) on CUDA tensors: gloo cannot send CUDA memory; a zero_dtensor "
     "call that picks point-to-point on gloo with CUDA tensors aborts the rank (use plain collectives there)"),
    (("_coalescing_manager",),
     "a coalesced collective (torch.distributed._coalescing_manager) on gloo over CUDA tensors"),
    (("CUDA out of memory",), "the device ran out of memory"),
)
MARK = "[gpu_check] at: "  # a line a child writes to its stderr before each step (synchronous, survives a crash)
FRAME = re.compile(r'File "(?P<file>[^"]*zero_dtensor/[^"]*)", line (?P<line>\d+) in (?P<fn>\S+)')


def redirect_stderr(path: str) -> None:
    """In a child: send fd 2 (Python's and C++'s stderr) to ``path`` and dump Python's stack there on a fatal
    signal (SIGSEGV, SIGABRT, ...), so that the parent can say how the child died."""
    import faulthandler
    import sys

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=False)


def mark(what: str) -> None:
    """In a child: say on stderr (flushed at once) what it is about to do, so that a crash can be placed even when
    its queue messages are lost with it."""
    import sys

    sys.stderr.write(f"{MARK}{what}\n")
    sys.stderr.flush()


def last_mark(text: str) -> str | None:
    """The last step a child marked in ``text``."""
    at = text.rfind(MARK)
    return text[at + len(MARK):].split("\n", 1)[0] if at >= 0 else None


def read_text(path: str | None) -> str:
    """The last ``TAIL_BYTES`` of the file at ``path`` (``""`` if there is none)."""
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
        return f.read().decode("utf-8", "replace")


def split_fault(text: str, lines: int = TAIL_LINES) -> tuple[list[str], list[str]]:
    """``(the last lines before a fault dump, the dump's first lines)``: faulthandler's ``Fatal Python error`` line
    and the innermost frames (``[]`` without a dump)."""
    rows = [line.rstrip() for line in text.splitlines() if line.strip() and not line.startswith(MARK)]
    starts = [i for i, line in enumerate(rows) if line.startswith("Fatal Python error")]
    if not starts:
        return rows[-lines:], []
    i = starts[-1]
    return rows[:i][-lines:], rows[i:i + FAULT_LINES]


def exit_words(exitcode: int | None) -> str:
    """``"SIGSEGV (exit code -11)"``, ``"exit code 1"``, or ``"still running"``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"{signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"signal {-exitcode} (exit code {exitcode})"
    return f"exit code {exitcode}"


def diagnose(text: str) -> dict[str, Any]:
    """The known cause and the innermost zero_dtensor frame found in a child's stderr."""
    cause = next((why for marks, why in KNOWN_CAUSES if all(m in text for m in marks)), None)
    frame = FRAME.search(text)  # faulthandler prints the most recent call first
    where = f"{frame['file'].split('zero_dtensor/', 1)[1]}:{frame['line']} {frame['fn']}" if frame else None
    return {"cause": cause, "zero_dtensor_frame": f"zero_dtensor/{where}" if where else None}


def death_report(rank: int, exitcode: int | None, stderr_path: str | None, doing: str | None) -> dict[str, Any]:
    """A dead (or silent) rank as a record: how it ended, what it was doing, its stderr tail (before a fault dump),
    the dump's first lines, and the diagnosis."""
    text = read_text(stderr_path)
    tail, fault = split_fault(text)
    return {"rank": rank, "ended": exit_words(exitcode), "exitcode": exitcode, "doing": last_mark(text) or doing,
            "stderr_tail": tail, "fault": fault, **diagnose(text)}


def describe_death(report: dict[str, Any]) -> str:
    """One line: ``rank 1 died with SIGSEGV (exit code -11) during <doing> at <frame>: <cause>; last stderr: ...``."""
    verb = "gave no answer (still running)" if report["exitcode"] is None else f"died with {report['ended']}"
    text = f"rank {report['rank']} {verb}"
    if report.get("doing"):
        text += f" during {report['doing']}"
    if report.get("zero_dtensor_frame"):
        text += f" at {report['zero_dtensor_frame']}"
    if report.get("cause"):
        text += f": {report['cause']}"
    last = [line.strip() for line in report.get("stderr_tail", [])[-2:]] + report.get("fault", [])[:1]
    if last:
        text += f"; last stderr lines: {' | '.join(line[:300] for line in last)}"
    return text
