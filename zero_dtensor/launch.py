"""Run a function on N local ranks, from a script, a test suite or a notebook; pick the backend from the device.

:class:`RankPool` starts the processes once and reuses them (DeepSpeed start-up costs seconds per engine);
:func:`launch` is the one-shot form: NCCL with one GPU per rank where the machine has a GPU per rank, else gloo on
CPU ranks (:func:`backend_for`). :func:`init_distributed` is the same choice for a process that ``torchrun``
started. A failure on any rank raises :class:`RankFailure` carrying every rank's
traceback; a rank that does not answer in time (e.g. stuck in a collective) is killed, never waited on forever.
"""

from __future__ import annotations

import contextlib
import glob
import io
import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailure", "RankPool", "backend_for", "init_distributed", "launch"]



class RankFailure(RuntimeError):
    """One or more ranks raised or stopped answering. ``str()`` holds each rank's traceback."""

    def __init__(self, message: str, tracebacks: dict[int, str]) -> None:
        super().__init__(message + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items())))
        self.tracebacks = tracebacks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build_lock_hint() -> str:
    """What to do about torch's extension build locks left behind, if any: DeepSpeed JIT-builds ops (on the CPU
    its comm op) when a rank initializes, under a lock file in the build folder; a build killed midway leaves the
    file, and every later build of that op waits for it to go, without limit."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    locks = sorted(glob.glob(os.path.join(root, "**", "lock"), recursive=True))
    if not locks:
        return ""
    return (f"; torch's extension build lock {', '.join(locks)} exists: a DeepSpeed op build killed midway leaves "
            "it behind, and every later start waits on it. Delete it if no build is running")


def backend_for(device: Any = None, *, ranks: int = 1) -> str:
    """The ``torch.distributed`` backend for ranks whose tensors live on ``device``: ``"nccl"`` for CUDA, ``"gloo"``
    for anything else. ``device=None``: CUDA where torch sees at least ``ranks`` GPUs (one per rank on this
    machine), else the CPU. No communication; with ``device=None`` it asks the CUDA driver how many GPUs there are
    (``torch.cuda.device_count()``), nothing more."""
    import torch

    if device is None:
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(backend: str | None = None) -> str:
    """Join the process group of a process a launcher started (``torchrun``: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set), through ``deepspeed.init_distributed``: ``backend``, or
    :func:`backend_for` this machine's ranks (``LOCAL_WORLD_SIZE``), with ``cuda:LOCAL_RANK`` made the current
    device for NCCL. Does nothing where a process group exists. Returns the backend. Collective: every rank of the
    world must call it (it initializes the default process group)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return str(dist.get_backend())
    backend = backend or backend_for(ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return backend


def _worker(rank: int, world_size: int, port: int, backend: str, tasks: Any, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        import torch

        torch.set_num_threads(1)
        if backend == "auto":  # decided here, in the rank: the parent never touches CUDA (a fork must not)
            backend = backend_for(ranks=world_size)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints a line per rank when it loads its comm op
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        results.put((rank, "ready", None))
    except BaseException:  # noqa: BLE001 - report start-up failures to the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, fn, args, kwargs = task
        try:  # pickle here, by value: an unpicklable result must fail this call, not the queue's feeder thread
            answer = (rank, "ok", (call_id, pickle.dumps(fn(*args, **kwargs))))
        except BaseException:  # noqa: BLE001
            answer = (rank, "error", (call_id, traceback.format_exc()))
        results.put(answer)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _exit_now(results)


def _exit_now(results: Any) -> None:
    """End a finished rank at once: flush its answers and streams, then ``os._exit``. An interpreter with torch and
    DeepSpeed loaded spends about 3 s in its final clean-up (measured: a 2-rank pool closed in 5-6 s, 0.1-0.3 s with
    this), which every pool close and every ``zd.launch`` would wait for."""
    results.close()
    results.join_thread()  # every answer put is in the pipe before the process ends
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


class RankPool:
    """``nprocs`` local processes joined in one process group, started once and reused by ``run``.

    The test suite's harness, for scripts and notebooks too. With ``start_method="spawn"`` (default), functions given
    to ``run`` must be importable; a ``"fork"`` pool also knows functions of ``__main__`` or a notebook that existed
    when it started (``zd.launch`` forks a fresh pool per call).

    Args:
        nprocs: the number of ranks.
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"`` (as ``"spawn"``, but each rank is forked from
            ``multiprocessing``'s server process: with ``multiprocessing.set_forkserver_preload(["torch"])`` first,
            starts and restarts skip importing it; for CPU ranks ``"deepspeed"`` too, about half of a start.
            Importing DeepSpeed on a GPU machine asks CUDA for its devices, which forked ranks must not inherit).
        backend: ``"gloo"`` (default: CPU ranks), ``"nccl"`` (rank ``r`` on ``cuda:r``) or ``"auto"``
            (:func:`backend_for`, decided in the ranks).
        start_timeout: seconds a rank may take to answer at start (the first start includes DeepSpeed's JIT build
            of its CPU comm op: a minute or more).
        grace_s: seconds the other ranks get to finish after one failed.

    Returns:
        RankPool: the pool; ``close()`` stops it.

    Raises:
        RankFailure: a rank did not answer within ``start_timeout`` (every rank is killed).

    Communication:
        Joining the process group; then whatever the functions run.

    Device and memory:
        ``nprocs`` processes on this machine (CPU ranks).

    Example:
        ```python
        pool = zd.RankPool(2)
        print(pool.run(torch.distributed.get_rank))          # [0, 1]
        pool.close()
        ```
    """

    def __init__(self, nprocs: int, *, start_method: str = "spawn", backend: str = "gloo",
                 start_timeout: float = 600.0, grace_s: float = 15.0) -> None:
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        self.nprocs = nprocs
        self._ctx = mp.get_context(start_method)
        self._backend = backend
        self._start_timeout = start_timeout
        self._grace_s = grace_s  # after one rank fails, how long the others get to finish or fail on their own
        self._procs: list[Any] = []
        self._calls = 0
        self._start()

    def _start(self) -> None:
        port = _free_port()
        self._tasks = [self._ctx.Queue() for _ in range(self.nprocs)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(target=_worker, args=(r, self.nprocs, port, self._backend, self._tasks[r], self._results),
                              daemon=True)
            for r in range(self.nprocs)
        ]
        for p in self._procs:
            p.start()
        answers = self._collect(None, self._start_timeout, expect="ready")
        errors = {r: v for r, (kind, v) in answers.items() if kind != "ready"}
        late = [r for r in range(self.nprocs) if r not in answers]
        if late:
            hint = _build_lock_hint()
            errors.update({r: f"no answer at start within {self._start_timeout:g} s, or {self._grace_s:g} s after "
                              f"another rank failed; killed{hint}" for r in late})
        if errors:
            for r in late:  # stuck at start: no stop request would reach them (close() would wait 5 s for each)
                self._procs[r].kill()
            self.close()
            raise RankFailure(f"{len(errors)} of {self.nprocs} ranks failed to start", errors)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank and return the results in rank order.

        Args:
            fn: the function (importable, or known to a fork pool).
            *args: its positional arguments (picklable).
            timeout: seconds to wait for every rank.
            **kwargs: its keyword arguments (picklable).

        Returns:
            list: each rank's result.

        Raises:
            RankFailure: a rank raised (after the others' grace period) or did not answer within ``timeout``; its
                message holds each rank's traceback. The pool restarts before the next call.

        Communication:
            Whatever ``fn`` runs.

        Device and memory:
            Results are pickled back to this process.

        Example:
            ```python
            results = pool.run(my_check, 3)
            ```
        """
        if not self.alive:
            self.close()
            self._start()
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs))
        answers = self._collect(call_id, timeout, expect="ok")
        failed = {r: payload for r, (kind, payload) in answers.items() if kind != "ok"}
        for r in range(self.nprocs):
            if r not in answers:
                failed[r] = "no answer in time (probably waiting in a collective another rank never joined); killed"
                self._procs[r].kill()  # a stop request would wait behind its call
        if failed:
            self.close()
            raise RankFailure(f"{getattr(fn, '__qualname__', fn)} failed on ranks {sorted(failed)}", failed)
        return [pickle.loads(answers[r][1]) for r in range(self.nprocs)]

    def _collect(self, call_id: int | None, timeout: float, expect: str) -> dict[int, tuple[str, Any]]:
        answers: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.nprocs:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, kind, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in answers]
                for r in dead:
                    answers[r] = ("error", f"process exited with code {self._procs[r].exitcode}")
                if dead:
                    deadline = min(deadline, time.monotonic() + self._grace_s)
                continue
            if call_id is not None:
                got_id, payload = payload
                if got_id != call_id:
                    continue  # a late answer from an earlier, failed call
            answers[rank] = (kind, payload)
            if kind != expect:
                deadline = min(deadline, time.monotonic() + self._grace_s)
        return answers

    def close(self) -> None:
        """Stop the workers (politely, then by force).

        Returns:
            None.

        Raises nothing.

        Communication:
            None.

        Device and memory:
            Frees the worker processes.

        Example:
            ```python
            pool.close()
            ```
        """
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (ValueError, OSError):
                    pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def launch(fn: Callable[..., Any], *args: Any, nprocs: int = 2, timeout: float = 600.0,
           start_method: str = "fork", backend: str = "auto", **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` fresh local ranks and return rank 0's result.

    Works from a notebook: with ``"fork"`` (default) functions defined in cells run as they are. Use
    ``start_method="spawn"`` from code that started threads which must not be forked (CUDA).

    Args:
        fn: the function every rank runs.
        *args: its positional arguments.
        nprocs: the number of ranks.
        timeout: seconds to wait for every rank.
        start_method: ``"fork"`` or ``"spawn"``.
        backend: ``"auto"`` (default): NCCL with rank ``r`` on ``cuda:r`` where the machine has at least
            ``nprocs`` GPUs, else gloo on CPU ranks (:func:`backend_for`, decided in each rank); or ``"gloo"``,
            ``"nccl"``.
        **kwargs: its keyword arguments.

    Returns:
        object: rank 0's result.

    Raises:
        RankFailure: a rank raised or did not answer; the message holds each rank's traceback.

    Communication:
        Whatever ``fn`` runs.

    Device and memory:
        ``nprocs`` processes for the duration of the call.

    Example:
        ```python
        def job():
            engine = build_engine()
            return zd.sharded_grads(engine).names
        names = zd.launch(job, nprocs=2)
        ```
    """
    with RankPool(nprocs, start_method=start_method, backend=backend) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)[0]
