"""Process set-up shared by the parent and every spawned rank: DeepSpeed's accelerator, the world-1 group, the
device, error text, and the environment recorded in the JSON."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import platform
import socket
import sys
import traceback
import warnings
from typing import Any


def setup_runtime(device_type: str) -> None:
    """Select DeepSpeed's accelerator before it is imported, and quiet its logging. Idempotent."""
    os.environ.setdefault("DS_ACCELERATOR", device_type)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    importlib.import_module("deepspeed")  # first imported here, after DS_ACCELERATOR is set

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if device_type == "cpu":
        # DeepSpeed's CPU accelerator refuses fp16; its loss-scaling path does not depend on the device (the test
        # suite does the same, tests/workers/common.py). On CUDA fp16 is real and nothing is patched.
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_of(device_type: str) -> Any:
    """The one device of this run: ``cuda:<current>`` or ``cpu``."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_world_one(device_type: str) -> str:
    """Initialize a world-1 process group (NCCL on CUDA, gloo on CPU) unless one exists; return its backend."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise SystemExit("init_world_one: a world-1 group in one process; under torchrun gpu_check uses "
                             "gpucheck.world.init_world")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo",
                                       auto_mpi_discovery=False, verbose=False)
    if dist.get_world_size() != 1:
        raise SystemExit("gpu_check needs a world-1 process group in its own process")
    return str(dist.get_backend())


def pick_device(requested: str | None) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def error_text(exc: BaseException) -> str:
    """``Type: message [file:line]`` of the innermost frame, at most ~600 characters."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" [{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}]" if frames else ""
    text = f"{type(exc).__name__}: {exc}".strip()
    return (text[:600] + " ...") if len(text) > 600 else text + where


def environment(device_type: str, backend: str) -> dict[str, Any]:
    import deepspeed
    import torch

    import zero_dtensor as zd

    env: dict[str, Any] = {
        "device_type": device_type, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "zero_dtensor": zd.__version__,
        "backend_world_1": backend, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        env.update(device_name=props.name, device_memory_bytes=int(props.total_memory), cuda=torch.version.cuda,
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                   capability=f"{props.major}.{props.minor}", device_count=torch.cuda.device_count())
    else:
        env.update(device_name=platform.processor() or platform.machine() or "cpu")
    return env
