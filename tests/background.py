"""The suite's slow subprocess runs (the gpu_check and benchmark smoke runs, the notebooks, the example scripts),
started when the tests are collected and run one at a time in a background thread while the multi-rank tests run:
those leave part of the 2 CI cores idle (pytest and the ranks wait on each other). Each test then waits for its own
run and asserts on it exactly as it did on a run of its own. No lower CPU priority: the runs have time limits of
their own (gpu_check's ``--budget-s``), and the multi-rank tests' limits are minutes for seconds of work.

A test declares its run with ``@background.job(spec)``: ``spec(params, workdir)`` gets the test's parameters (a
dict) and a fresh folder of its own, and returns the :class:`Run` (the ``subprocess.run`` arguments), or None where
the test skips. The test takes the ``background_run`` fixture and calls it (after its own skips) for a
:class:`Done` with the ``CompletedProcess`` and that folder; a run past its ``timeout`` raises
``subprocess.TimeoutExpired`` in the test, as ``subprocess.run`` does. The environment and working folder are the
ones at collection. ``ZERO_DTENSOR_TESTS_BACKGROUND=0`` runs each one in its test instead.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

ENV_SWITCH = "ZERO_DTENSOR_TESTS_BACKGROUND"


@dataclasses.dataclass(frozen=True)
class Run:
    """The arguments of one ``subprocess.run(argv, capture_output=True, text=True, ...)``."""

    argv: Sequence[str]
    timeout: float
    env: dict[str, str] | None = None
    cwd: str | None = None


@dataclasses.dataclass(frozen=True)
class Done:
    proc: subprocess.CompletedProcess[str]
    workdir: Path


Spec = Callable[[dict[str, Any], Path], "Run | None"]


def job(spec: Spec) -> pytest.MarkDecorator:
    """Mark a test whose subprocess ``spec`` describes (see the module docstring)."""
    return pytest.mark.background.with_args(spec)  # with_args: a lone callable would be decorated


class _Job:
    def __init__(self, run: Run, workdir: Path) -> None:
        self.run = run
        self.workdir = workdir
        self.finished = threading.Event()
        self.outcome: subprocess.CompletedProcess[str] | BaseException | None = None


class Runner:
    """The planned runs of a session, by test node id, executed in the order of the tests."""

    def __init__(self) -> None:
        self.threaded = os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")
        self._jobs: dict[str, _Job] = {}
        self._root: str | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def plan(self, items: Sequence[pytest.Item]) -> None:
        """Ask each marked test for its run, then start the background thread (if any run and not switched off)."""
        for item in items:
            marker = item.get_closest_marker("background")
            if marker is None:
                continue
            callspec = getattr(item, "callspec", None)
            if self._root is None:
                self._root = tempfile.mkdtemp(prefix="zd-tests-background-")
            workdir = Path(tempfile.mkdtemp(prefix=item.name[:40].replace("/", "_") + "-", dir=self._root))
            run = marker.args[0](dict(callspec.params) if callspec else {}, workdir)
            if run is not None:  # the environment and folder of now: a test may change them while the run starts
                run = dataclasses.replace(run, env=dict(os.environ) if run.env is None else run.env,
                                          cwd=run.cwd or os.getcwd())
                self._jobs[item.nodeid] = _Job(run, workdir)
        if self.threaded and self._jobs:
            self._thread = threading.Thread(target=self._run_all, name="zd-tests-background", daemon=True)
            self._thread.start()

    def result(self, nodeid: str) -> Done:
        job = self._jobs.get(nodeid)
        if job is None:
            raise RuntimeError(f"{nodeid}: no background run planned (mark the test with background.job, and let its "
                               "spec return a Run where the test runs)")
        if not self.threaded and not job.finished.is_set():
            self._execute(job)
        job.finished.wait()
        if isinstance(job.outcome, BaseException):
            raise job.outcome
        assert job.outcome is not None
        return Done(job.outcome, job.workdir)

    def close(self) -> None:
        """Kill a run still going (the session ended early), wait for the thread, remove the folders."""
        with self._lock:
            self._closed = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(60.0)
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def _run_all(self) -> None:
        for job in self._jobs.values():
            if self._closed:
                break
            self._execute(job)

    def _execute(self, job: _Job) -> None:
        run = job.run
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the test session ended before this run started")
                proc = self._proc = subprocess.Popen(list(run.argv), stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, text=True, env=run.env, cwd=run.cwd)
            try:
                out, err = proc.communicate(timeout=run.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(list(run.argv), run.timeout, out, err) from None
            job.outcome = subprocess.CompletedProcess(list(run.argv), proc.returncode, out, err)
        except BaseException as exc:  # noqa: BLE001 - raised in the test that waits for it
            job.outcome = exc
        finally:
            job.finished.set()
