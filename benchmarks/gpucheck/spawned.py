"""A set of spawned processes that answer on one queue, each with its stderr in a file: answers read with
deadlines, and a process that dies or stays silent described by its exit code or signal and its last stderr lines."""

from __future__ import annotations

import os
import queue as queue_mod
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .rank_deaths import death_report, mark
from .runtime import free_port

AT = "at"  # a message saying what the sender is about to do: (rank, "at", "what")
GRACE_S = 5.0  # after a death, how long the others get to answer


def announce(answers: Any, rank: int, what: str) -> None:
    """In a child: tell the parent what comes next, on the queue and (synchronously) on stderr."""
    mark(what)
    answers.put((rank, AT, what))


class Spawned:
    """``world`` processes running ``target(rank, world, port, answers, stderr_path, *args)`` (spawned: CUDA cannot
    be forked). A process sends ``(rank, kind, payload)`` tuples on ``answers``, and ``(rank, "at", what)`` before
    each step, so that a death can be placed."""

    def __init__(self, world: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        port = free_port()
        self.world = world
        self.answers = ctx.Queue()
        self.doing: dict[int, str] = {}
        self.backlog: list[tuple[int, str, Any]] = []  # answers read ahead, for later collect() calls
        self.logs = tempfile.mkdtemp(prefix="gpu_check_ranks_")
        self.stderr = [os.path.join(self.logs, f"rank{r}.stderr") for r in range(world)]
        self.procs = [ctx.Process(target=target, args=(r, world, port, self.answers, self.stderr[r], *args),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def _next(self) -> tuple[int, str, Any] | None:
        try:
            return self.answers.get(timeout=0.5)
        except queue_mod.Empty:
            return None

    def collect(self, kind: str, timeout: float, key: str | None = None) -> dict[int, tuple[str, Any]]:
        """Each rank's next answer of ``kind`` (with ``key``: one whose payload starts with ``key``), or what it sent
        instead. Ranks that say nothing within ``timeout`` seconds, or died, are missing from the result."""
        got: dict[int, tuple[str, Any]] = {}
        later: list[tuple[int, str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < self.world and time.monotonic() < deadline:
            message = self.backlog.pop(0) if self.backlog else self._next()
            if message is None:
                if any(not p.is_alive() for r, p in enumerate(self.procs) if r not in got):
                    deadline = min(deadline, time.monotonic() + GRACE_S)  # a rank died: the others get a moment
                continue
            rank, what, payload = message
            if what == AT:
                self.doing[rank] = payload
                continue
            if rank in got:  # this rank is ahead of the others: keep its answer for the next call
                later.append(message)
                continue
            if what == kind and key is not None and payload[0] != key:
                continue  # a late answer for an earlier step
            got[rank] = (what, payload)
            if what != kind:
                deadline = min(deadline, time.monotonic() + GRACE_S)
        self.backlog = later + self.backlog
        return got

    def reports(self, ranks: list[int]) -> list[dict[str, Any]]:
        """How each of ``ranks`` ended (or that it is still running), what it was doing, its stderr tail. A rank
        still alive is given a moment to finish dying (a fault handler writing its dump)."""
        for r in ranks:
            self.procs[r].join(timeout=1.0)
        return [death_report(r, self.procs[r].exitcode, self.stderr[r], self.doing.get(r)) for r in ranks]

    def close(self, finished: bool) -> None:
        """Join the processes (they exit by themselves after their last step), killing any still alive; remove
        the stderr files."""
        for p in self.procs:
            p.join(timeout=10.0 if finished else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        shutil.rmtree(self.logs, ignore_errors=True)
