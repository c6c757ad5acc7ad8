"""The demo (a README command) runs end to end and checks its own values against DeepSpeed."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "zero_dtensor.demo"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "equal to DeepSpeed's values" in result.stdout and "False" not in result.stdout, result.stdout
