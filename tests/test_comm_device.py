"""CPU-offloaded gradients travel through the engine's device when the process group cannot take CPU tensors."""

from __future__ import annotations

import torch

from zero_dtensor import collectives


def test_tensor_stays_where_the_group_communicates(monkeypatch) -> None:
    monkeypatch.setattr(collectives, "comm_device_types", lambda group: frozenset({"cpu", "cuda"}))
    t = torch.arange(4.0)
    assert collectives.on_comm_device(t, object(), torch.device("meta")) is t


def test_cpu_tensor_is_copied_to_the_engine_device_for_a_cuda_only_group(monkeypatch) -> None:
    monkeypatch.setattr(collectives, "comm_device_types", lambda group: frozenset({"cuda"}))  # NCCL
    t = torch.arange(4.0)
    moved = collectives.on_comm_device(t, object(), torch.device("meta"))  # meta stands in for cuda here
    assert moved.device.type == "meta" and moved.shape == t.shape
    assert collectives.comm_device(t, object(), torch.device("meta")) == torch.device("meta")


def test_device_types_of_a_real_gloo_group(ranks) -> None:
    from workers import harness

    assert ranks(2).run(harness.world_device_types) == [["cpu", "cuda"], ["cpu", "cuda"]]
