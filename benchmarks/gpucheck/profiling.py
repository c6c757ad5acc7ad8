"""``--profile DIR``: one call of each timing row under ``torch.profiler``, summarized (kernels, their device
time, host syncs, the top ops) and written as ``profile.json`` and ``profile.txt``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from .runtime import synchronize

# host syncs: the runtime's waits, and the ops that copy a device value to the host
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "aten::_local_scalar_dense", "aten::item", "aten::nonzero")
TOP = 8


def _device_time_us(event: Any) -> float:
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) or 0.0)


def profile_call(fn: Callable[[], Any], device: Any) -> tuple[dict[str, Any], str]:
    """``(summary, table text)`` of one call of ``fn``: ``kernels`` (device kernels launched), ``device_ms`` (their
    time), ``host_syncs`` ({name: count}, the profiler's own final wait not counted), ``top_ops``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        result = fn()
        synchronize(device)  # one cudaDeviceSynchronize, subtracted below
    del result
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    syncs: dict[str, int] = {}
    for e in events:
        if e.name in SYNC_NAMES:
            syncs[e.name] = syncs.get(e.name, 0) + 1
    if cuda and syncs.get("cudaDeviceSynchronize"):
        syncs["cudaDeviceSynchronize"] -= 1
        if not syncs["cudaDeviceSynchronize"]:
            del syncs["cudaDeviceSynchronize"]
    averages = prof.key_averages()
    key = _device_time_us if cuda else (lambda e: float(e.self_cpu_time_total))
    top = sorted(averages, key=key, reverse=True)[:TOP]
    summary = {
        "kernels": len(kernels),
        "device_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3 if cuda else None,
        "host_syncs": syncs,
        "top_ops": [{"op": e.key, "count": int(e.count), "self_ms": key(e) / 1e3} for e in top],
        "time": "device" if cuda else "cpu",
    }
    try:
        table = averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=15)
    except Exception:  # noqa: BLE001 - an older profiler's sort key
        table = averages.table(sort_by="self_cpu_time_total", row_limit=15)
    return summary, table


class Profiles:
    """The profiles of one run, by row; ``directory`` None: nothing is profiled."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.rows: list[dict[str, Any]] = []
        self.tables: list[str] = []

    def __bool__(self) -> bool:
        return self.directory is not None

    def add(self, row: dict[str, Any], fn: Callable[[], Any], device: Any) -> None:
        """Profile one more call of ``fn``; the summary goes into ``row["profile"]`` and the files."""
        summary, table = profile_call(fn, device)
        row["profile"] = summary
        self.rows.append({"stage": row["stage"], "row": row["row"], **summary})
        self.tables.append(f"== ZeRO-{row['stage']} {row['row']}: {summary['kernels']} kernels, device "
                           f"{summary['device_ms']} ms, host syncs {summary['host_syncs']}\n{table}\n")

    def write(self) -> list[str]:
        """Write ``profile.json`` and ``profile.txt`` into the directory; return their paths."""
        if self.directory is None:
            return []
        os.makedirs(self.directory, exist_ok=True)
        paths = [os.path.join(self.directory, "profile.json"), os.path.join(self.directory, "profile.txt")]
        with open(paths[0], "w") as f:
            json.dump(self.rows, f, indent=2)
        with open(paths[1], "w") as f:
            f.write("\n".join(self.tables))
        return paths
