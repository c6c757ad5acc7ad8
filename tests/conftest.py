"""Multi-rank test harness: one reusable pool of gloo ranks per world size (1-4), started on first use.

A test calls ``ranks(world_size).run(fn, *args)``; ``fn`` must be a module-level function in ``tests/workers/``
(importable in the workers as ``workers.<module>``). The workers are forked from a ``forkserver`` that imported
torch, DeepSpeed and zero_dtensor once (a 2-rank start took 4-5 s spawned, about 2.5 s so; 4 ranks 9 s, 4.5 s),
so the pools' first starts and the restarts after a failure cost little more than joining the process group. Any
rank's exception fails the test with every rank's traceback; a hang becomes a failure after ``timeout`` and the
pool is restarted for the next test.

The slow subprocess runs (examples, notebooks, smoke runs) start at collection and run in the background meanwhile:
``background.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
# spawned workers import test code as ``workers.*``
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p)

from background import Done, Runner  # noqa: E402
from zero_dtensor.launch import RankPool  # noqa: E402

#: how the pools start their workers: forked from a server process that imported these once (its environment is
#: this process's when the first pool starts, with ``PYTHONPATH`` as set above)
START_METHOD = "forkserver"
multiprocessing.get_context(START_METHOD).set_forkserver_preload(["torch", "deepspeed", "zero_dtensor"])
_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = RankPool(world_size, start_method=START_METHOD)
    return pool


@pytest.fixture(scope="session")
def ranks() -> Callable[[int], RankPool]:
    """``ranks(n)`` is a started, reused pool of ``n`` gloo ranks."""
    yield get_pool
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


_BACKGROUND = Runner()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "background(spec): the test's subprocess runs in the background "
                                       "(tests/background.py)")


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        _BACKGROUND.plan(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _BACKGROUND.close()


@pytest.fixture
def background_run(request: pytest.FixtureRequest) -> Callable[[], Done]:
    """``background_run()``: this test's background run, once it ended (tests/background.py). Called in the test,
    after its own skips."""
    return lambda: _BACKGROUND.result(request.node.nodeid)
