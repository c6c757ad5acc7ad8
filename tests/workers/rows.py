"""Checks as tables of named rows: one worker call runs every row of a case, each row its own pytest test.

Worker side, :class:`Rows` runs a check's operations in order on every rank. A row that raises is recorded (with
its traceback) instead of ending the check, so the rows after it still run and report for themselves; the ranks
agree after every row (one one-element all_reduce) so that each knows whether a row failed anywhere, and a row that
failed on some ranks only stops the table (their collectives may no longer line up). The check returns
``{"rows": {name: None | traceback}, ...}``.

Test side, :class:`RowResults` runs the check once per case and caches every rank's answer, and
:func:`assert_row` fails the one test of a row with that row's tracebacks. Building one engine per row would
multiply the cost of these files by the number of rows.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any


class Rows:
    """Worker side: the named rows of one check, run in order (see the module docstring)."""

    def __init__(self, names: Sequence[str], on_failure: Callable[[], None] | None = None) -> None:
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate row names in {list(names)}")
        self.names = list(names)
        self.outcomes: dict[str, str | None] = {}
        self.on_failure = on_failure  # run on every rank after a row that failed on every rank (resync state)
        self.stopped: str | None = None

    @property
    def failed(self) -> list[str]:
        return [n for n, e in self.outcomes.items() if e is not None]

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as the row ``name``; its result, or None when it failed or did not run."""
        import torch
        import torch.distributed as dist

        if name not in self.names or name in self.outcomes:
            raise ValueError(f"row {name!r} is not declared, or ran twice")
        if self.stopped is not None:
            self.outcomes[name] = f"not run: {self.stopped}"
            return None
        result, error = None, None
        try:
            result = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - recorded, reported by the row's own test
            error = traceback.format_exc()
        self.outcomes[name] = error
        failed = torch.tensor([int(error is not None)])
        dist.all_reduce(failed)
        n = int(failed)
        if 0 < n < dist.get_world_size():
            self.stopped = f"row {name!r} failed on {n} of {dist.get_world_size()} ranks"
            if error is None:
                self.outcomes[name] = f"failed on another rank ({self.stopped})"
        elif n and self.on_failure is not None:
            self.on_failure()
        return result

    def report(self, **extra: Any) -> dict[str, Any]:
        missing = [n for n in self.names if n not in self.outcomes]
        for name in missing:
            self.outcomes[name] = "not run: the check never reached this row"
        return {"rows": dict(self.outcomes), **extra}


class RowResults:
    """Test side: each (check, case) runs once; every row's test reads the cached answers."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], Any] = {}

    def get(self, ranks: Any, world: int, fn: Callable[..., Any], case: Any, *args: Any,
            timeout: float = 600.0) -> list[dict[str, Any]]:
        """Every rank's answer of ``fn(case, *args)``; a check that hangs fails every row after ``timeout`` s."""
        key = (f"{fn.__module__}.{fn.__qualname__}{args!r}", case.id)
        if key not in self._cache:
            try:
                self._cache[key] = ranks(world).run(fn, case, *args, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - every row of the case fails with it
                self._cache[key] = exc
        answer = self._cache[key]
        if isinstance(answer, Exception):
            raise answer
        return answer


def assert_row(results: list[dict[str, Any]], row: str) -> None:
    """Fail with the row's traceback from every rank where it failed."""
    import pytest

    failures = {}
    for rank, result in enumerate(results):
        outcome = result["rows"].get(row, "not reported by the check")
        if outcome is not None:
            failures[rank] = outcome
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
        pytest.fail(f"row {row!r} failed on ranks {sorted(failures)}:\n{text}", pytrace=False)


def slug(name: str) -> str:
    """A row name as a pytest id (no spaces)."""
    return name.replace(" ", "-")
