"""The demo (a README command) runs end to end and checks its own values against DeepSpeed. It starts at collection
and runs in the background (tests/background.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import background


def _demo(params: dict[str, Any], workdir: Path) -> background.Run:
    return background.Run([sys.executable, "-m", "zero_dtensor.demo"], timeout=300)


@background.job(_demo)
def test_demo_runs(background_run: Callable[[], background.Done]) -> None:
    result = background_run().proc
    assert result.returncode == 0, result.stderr[-4000:]
    assert "equal to DeepSpeed's values" in result.stdout and "False" not in result.stdout, result.stdout
