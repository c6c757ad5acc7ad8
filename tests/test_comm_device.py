"""CPU-offloaded gradients travel through the engine's device when the process group cannot take CPU tensors."""

from __future__ import annotations

import pytest
import torch

from zero_dtensor.comm import collectives


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


def test_gloo_refuses_point_to_point_and_coalescing_on_cuda_only() -> None:
    from zero_dtensor.comm.process_groups import comm_support

    assert comm_support("gloo", "cpu").point_to_point and comm_support("gloo", "cpu").coalescing
    assert not comm_support("gloo", "cuda").point_to_point and not comm_support("gloo", "cuda").coalescing
    assert comm_support("nccl", "cuda").point_to_point and comm_support("nccl", "cuda").coalescing


@pytest.mark.parametrize("stage,groups,world", [(2, 2, 2), (3, 1, 3)])
def test_gloo_over_cuda_tensors_uses_plain_collectives(ranks, stage: int, groups: int, world: int) -> None:
    """Gloo's isend/irecv abort and its coalescing manager segfaults on CUDA tensors (the 2026-12-04 H200 run):
    with tensors faked as CUDA ones, auto (calibrating), iter_full, every other strategy and sync_model_params
    return the CPU path's values without either, and send_recv is refused on every rank."""
    from workers import materialize

    reports = ranks(world).run(materialize.check_gloo_over_cuda, stage, groups, world)
    assert all("send_recv" not in r["decisions"] for r in reports), reports


def test_row_indices_are_made_once_per_rows_and_device(monkeypatch) -> None:
    """Issue 42: ``all_reduce_rows`` / ``sum_max_rows`` of a subset of rows (several process groups) index them with
    a tensor made once per (rows, device), not one per call (on CUDA a small blocking host-to-device copy each)."""
    import torch.distributed as dist

    made = []
    real = torch.tensor

    def counting(*args, **kwargs):
        made.append(args[0] if args else kwargs.get("data"))
        return real(*args, **kwargs)

    if hasattr(collectives, "row_index"):  # a fresh cache: this test makes the first index
        collectives.row_index.cache_clear()
    monkeypatch.setattr(collectives, "all_reduce_small", lambda t, group, op: t.mul_(2.0))  # stands for 2 ranks
    monkeypatch.setattr(collectives, "prefers_all_reduce", lambda group: False)
    monkeypatch.setattr(collectives, "gathers_sum_max_rows", lambda group: True)
    monkeypatch.setattr(collectives, "_stacked_by_rank", lambda t, group: torch.stack([t, t]))
    monkeypatch.setattr(torch, "tensor", counting)
    rows = torch.arange(12.0).view(4, 3)
    for _ in range(3):
        collectives.all_reduce_rows(rows, [1, 3], object(), dist.ReduceOp.SUM)
        collectives.sum_max_rows(rows, [1, 3], object(), 2)
    monkeypatch.setattr(torch, "tensor", real)
    expected = torch.arange(12.0).view(4, 3)
    for _ in range(3):
        expected[[1, 3]] *= 2.0
        expected[[1, 3], :2] *= 2.0
    assert torch.equal(rows, expected)
    assert [list(m) for m in made] == [[1, 3]], f"index tensors made per call: {made}"
