"""Issue 4: transforms of sharded gradients without gathering, at world sizes 1-4 and ZeRO stages 1-3."""

from __future__ import annotations

import pytest
import torch

from workers import transforms
from workers.common import EngineCase, OddModel
from workers.rows import RowResults, assert_row, slug
from zero_dtensor.ops.noise import counter_normal

FP32_CASES = [EngineCase(stage, world=ws) for ws in (1, 2, 3, 4) for stage in (1, 2, 3)]
BF16_CASES = [EngineCase(1, "bf16"), EngineCase(2, "bf16"), EngineCase(3, "bf16", world=3)]
REPLICATED_CASES = [EngineCase(1, "bf16", world=ws, bf16_optimizer=True) for ws in (1, 2, 3)]  # BF16_Optimizer
CASES = FP32_CASES + BF16_CASES + REPLICATED_CASES
# one test per (case, operation); one worker call per case runs every row (tests/workers/rows.py)
ROW_TESTS = [pytest.param(case, row, id=f"{case.id}-{slug(row)}")
             for case in CASES for row in transforms.transform_rows(case)]
_RESULTS = RowResults()
_NOISE: dict[str, dict[str, torch.Tensor]] = {}


@pytest.mark.parametrize("case,row", ROW_TESTS)
def test_transform(ranks, case: EngineCase, row: str) -> None:
    results = _RESULTS.get(ranks, case.world, transforms.check_transforms, case)
    assert_row(results, row)
    if row == "noise":  # fp32
        noise = results[0]["noise"]
        for r in results[1:]:  # every rank gathered the same noise
            assert all(torch.equal(noise[n], r["noise"][n]) for n in noise)
        _NOISE[case.id] = noise
        reference = noise_reference()
        for name, value in noise.items():
            assert torch.equal(value, reference[name]), (case.id, name)


@pytest.mark.parametrize("case", [EngineCase(1, "fp16"), EngineCase(3, "fp16")], ids=lambda c: c.id)
def test_transforms_fp16_loss_scale(ranks, case: EngineCase) -> None:
    results = ranks(case.world).run(transforms.check_fp16, case)
    assert results[0]["loss_scale"] == 1024.0


@pytest.mark.parametrize("stage", [1, 3])
def test_collective_counts_do_not_grow_with_model(ranks, stage: int) -> None:
    counts = ranks(2).run(transforms.check_scaling, stage)[0]
    for op in ("norms2", "norms_inf", "global_norm", "dots", "dots_with_norms", "clip_grad_norm_", "clip_per_param_"):
        assert counts[op] == 2, (op, counts)  # the data all_reduce + the rank agreement
    assert 2 <= counts["stats"] <= 3
    assert counts["elementwise"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_norms_refreshed_after_writes(ranks, stage: int) -> None:
    ranks(2).run(transforms.check_offload_after_write, stage)


@pytest.mark.parametrize("mode", ["per_param", "global"])
def test_pcgrad_example(ranks, mode: str) -> None:
    lines = ranks(2).run(transforms.check_pcgrad_example, mode)[0]
    assert len(lines) == 3 and "projected" in lines[1]


def test_noise_identical_across_world_sizes_and_stages() -> None:
    if len(_NOISE) < 2:
        pytest.skip("needs the fp32 noise rows of this module to have run")
    first, *others = _NOISE.values()
    for other in others:
        assert all(torch.equal(first[n], other[n]) for n in first)


def noise_reference() -> dict[str, torch.Tensor]:
    """Single-process reference: the counter-based generator over each full flattened parameter."""
    model = OddModel()
    return {
        name: counter_normal(transforms.NOISE_SEED, name, p.numel()).view(p.shape)
        for name, p in model.named_parameters()
    }


# --- issue 42: devices. The communication device (cpu:1, standing for CUDA under NCCL) and the storage device made
# different on CPU ranks (tests/workers/dispatch_probe.py); every transform and reduction must keep each operation on
# one device and return reductions on the communication device. Per stage: two dtypes offloaded (partitions on the
# host), one not (partitions on the device: a host index or factor meeting them is refused).
DEVICE_CASES = {1: (("fp32", True), ("bf16", True), ("fp16", False)),
                2: (("bf16", True), ("fp16", True), ("fp32", False)),
                3: (("fp16", True), ("fp32", True), ("bf16", False))}


@pytest.mark.parametrize("stage", sorted(DEVICE_CASES))
def test_devices_storage_and_communication_apart(ranks, stage: int) -> None:
    from workers import device_ops

    results = ranks(2).run(device_ops.check_devices, stage, DEVICE_CASES[stage])
    problems = []
    for rank, per_case in enumerate(results):
        for case, calls in per_case.items():
            for name, r in calls.items():
                if r["refused"]:
                    problems.append(f"rank {rank} {case} {name}: {r['refused'].splitlines()[-1][:300]}")
                elif name in device_ops.REDUCTIONS and name != "found_inf":
                    if r["where"] not in ("dev", None) or r["equal"] is not True:
                        problems.append(f"rank {rank} {case} {name}: result on {r['where']}, equal {r['equal']}")
                elif name.startswith("clip") and r["where"] != "dev":
                    problems.append(f"rank {rank} {case} {name}: result on {r['where']}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:60])
