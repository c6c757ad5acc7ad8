"""The check matrix (world x stage x dtype x variant) and the small DeepSpeed engines each case trains."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

DTYPES = ("fp32", "bf16", "fp16")
STAGES = (1, 2, 3)
VARIANTS = ("overlap off", "overlap on", "offload", "gas 2")
STEPS = 2  # optimizer steps (accumulation boundaries) per check case
CHECKS = ("reads", "transforms", "redistribute", "set+step", "hook", "masters", "save/load", "master writes", "ema")
SIZES = {"full": (2304, 16), "tiny": (72, 16)}  # (hidden, blocks) of the timing model
MULTI_RANK = 2
READ_RTOL, READ_ATOL = 1e-6, 1e-7  # fp16 reads vs DeepSpeed's scaled values (tests/workers/configs.py)
NORM_RTOL, MEAN_RTOL = 1e-5, 1e-4  # reductions in another summation order (tests/workers/transforms.py)
IN_FEATURES = 33


@dataclasses.dataclass(frozen=True)
class Case:
    """One check case: a world size, a ZeRO stage, a dtype and one variant of the configuration."""

    world: int
    stage: int
    dtype: str
    variant: str

    @property
    def name(self) -> str:
        return f"ws{self.world}-z{self.stage}-{self.dtype}-{self.variant.replace(' ', '_')}"

    @property
    def overlap_comm(self) -> bool | None:
        """``None``: DeepSpeed's default (off for ZeRO-1/2, on for ZeRO-3)."""
        return {"overlap off": False, "overlap on": True}.get(self.variant)

    @property
    def offload(self) -> bool:
        return self.variant == "offload"

    @property
    def gas(self) -> int:
        return 2 if self.variant == "gas 2" else 1


def case_matrix(worlds: tuple[int, ...] = (1, MULTI_RANK), quick: bool = False) -> list[Case]:
    """Every case the run will report, world by world. ``quick``: the multi-rank part is one case per (stage, dtype),
    with the variant rotated, so that each stage meets three of the four variants (9 cases instead of 36)."""
    cases = []
    for world in worlds:
        for stage in STAGES:
            for d, dtype in enumerate(DTYPES):
                for v, variant in enumerate(VARIANTS):
                    if quick and world > 1 and v != (stage + d) % len(VARIANTS):
                        continue
                    cases.append(Case(world, stage, dtype, variant))
    return cases


def small_model() -> Any:
    """The check model: odd sizes so that parameters straddle ZeRO partitions, and a bias of 1 element (smaller
    than the world size); the shapes of the test suite's ``OddModel``."""
    import torch

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(IN_FEATURES, 50)
            self.fc2 = torch.nn.Linear(50, 17)
            self.tiny = torch.nn.Linear(17, 1)
            self.fc3 = torch.nn.Linear(17, 9)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
            return self.fc3(h) + self.tiny(h)

    return Odd()


def ds_config(case: Case, device_type: str) -> dict[str, Any]:
    """The DeepSpeed configuration of a case (torch Adam: no fused or CPU Adam op to JIT-build)."""
    zero: dict[str, Any] = {"stage": case.stage}
    if case.overlap_comm is not None:
        zero["overlap_comm"] = case.overlap_comm
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case.gas,
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if case.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif case.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 10}
    return config


def build_engine(case: Case, device_type: str, seed: int = 0) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(seed)
    model = small_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config(case, device_type))
    return engine


def batch(engine: Any, micro_step: int) -> Any:
    """Rank- and step-dependent inputs, so that the averaged gradient differs from any local one."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * micro_step + dist.get_rank())
    dtype = next(engine.module.parameters()).dtype
    return torch.randn(engine.train_micro_batch_size_per_gpu(), IN_FEATURES, generator=g).to(device=engine.device,
                                                                                             dtype=dtype)


def forward_backward(engine: Any, micro_step: int) -> None:
    engine.backward(engine(batch(engine, micro_step)).float().pow(2).mean())


def fill_values(shapes: dict[str, tuple[int, ...]], boundary: int, device: Any) -> dict[str, Any]:
    """Deterministic full gradients to write, the same on every rank (realistic magnitudes: fp16 x 1024 is safe)."""
    import torch

    out = {}
    for name, shape in shapes.items():
        seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) + 7919 * boundary
        out[name] = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e-2).to(device)
    return out


def deepspeed_set_loop(engine: Any, values: dict[str, Any], case: Case) -> None:
    """DeepSpeed's own write of the same values: ``safe_set_full_grad`` per parameter, in stored (scaled) units."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_set_full_grad

    scale = float(getattr(engine.optimizer, "loss_scale", 1.0)) if case.dtype == "fp16" else 1.0
    world = dist.get_world_size()
    for name, p in engine.module.named_parameters():
        value = values[name] * scale
        if case.stage == 3:  # DeepSpeed's stage-3 set narrows past the end unless the value is padded (its bug)
            pn = p.partition_numel()
            value = torch.cat([value.reshape(-1), value.new_zeros(pn * world - value.numel())])
        safe_set_full_grad(p, value)


def params_snapshot(engine: Any) -> dict[str, Any]:
    """Full fp32 parameters (gathered under ZeRO-3), on the CPU."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().cpu().clone()
            for n, p in engine.module.named_parameters() if p.requires_grad}


def train(engine: Any, case: Case, at_boundary: Callable[[Any, int], None], steps: int = STEPS,
          first_micro: int = 0) -> list[dict[str, Any]]:
    """``steps`` optimizer steps of ``case.gas`` micro-steps each (``step()`` after every micro-step, as a plain
    DeepSpeed loop does); ``at_boundary(engine, k)`` runs after the k-th boundary's backward. Returns the parameters
    after each boundary's step."""
    snapshots = []
    for micro in range(first_micro, first_micro + steps * case.gas):
        forward_backward(engine, micro)
        if engine.is_gradient_accumulation_boundary():
            at_boundary(engine, (micro - first_micro) // case.gas)
            engine.step()
            snapshots.append(params_snapshot(engine))
        else:
            engine.step()
    return snapshots
