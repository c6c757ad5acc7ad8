"""Issue 52: the examples and notebooks pick their backend from the device (NCCL with a GPU per rank, else gloo on
the CPU) through one helper, ``zero_dtensor.launch.backend_for``: no script hard-codes gloo."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

launch = importlib.import_module("zero_dtensor.launch")  # the module (``zero_dtensor.launch`` the name is a function)

ROOT = Path(__file__).resolve().parent.parent
GLOO = re.compile(r"""["']gloo["']""")


def test_backend_follows_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert launch.backend_for("cuda:1") == "nccl" and launch.backend_for(torch.device("cuda")) == "nccl"
    assert launch.backend_for("cpu") == "gloo" and launch.backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.backend_for() == "nccl" and launch.backend_for(ranks=2) == "nccl"
    assert launch.backend_for(ranks=3) == "gloo"  # not a GPU per rank: CPU ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.backend_for() == "gloo"


def test_init_distributed_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed
    import torch

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: calls.append(("init", kw["dist_backend"])))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("device", d)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert launch.init_distributed() == "nccl"
    assert calls == [("device", 3), ("init", "nccl")]  # the rank's own GPU first
    calls.clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # more ranks than GPUs on this machine: CPU ranks
    assert launch.init_distributed() == "gloo" and calls == [("init", "gloo")]


def _code() -> dict[str, str]:
    out = {p.name: p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))}
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        out[p.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return out


def test_no_example_or_notebook_hard_codes_gloo() -> None:
    found = [f"{name}: {line.strip()}" for name, text in _code().items() for line in text.splitlines()
             if GLOO.search(line) and "CPUDeepSpeedStrategy" not in line]  # Lightning's CPU-only strategy
    assert not found, found
    # and those that start their own process group do it through the one helper
    starts = [name for name, text in _code().items() if "deepspeed.init_distributed(" in text]
    assert not starts, starts
