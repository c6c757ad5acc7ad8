"""Every tutorial notebook runs top to bottom; each asserts what it claims in a visible cell.

Each runs in a process of its own, started at collection and run in the background while the multi-rank tests run
(tests/background.py)."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import pytest

import background

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
EXECUTE = """import sys
import nbformat
from nbclient import NotebookClient
path = sys.argv[1]
notebook = nbformat.read(path, as_version=4)
NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}}).execute()
"""


def _execute(params: dict[str, Any], workdir: pathlib.Path) -> background.Run:
    path = params["path"]
    return background.Run([sys.executable, "-c", EXECUTE, str(path), str(path.parent)], timeout=900,
                          env=dict(os.environ))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
@background.job(_execute)
def test_notebook_runs(path: pathlib.Path, background_run: Callable[[], background.Done]) -> None:
    proc = background_run().proc
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-8000:]}"
