"""Models, engines and data shared by the worker-side test functions (run inside the rank processes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



def rank_checks(grads: Any, names: Any = None) -> int:
    """Collectives the always-on rank-agreement check of one ``full_tensors`` / ``iter_full`` call issues: one
    small all_gather per distinct process group of the multi-rank sharded groups it reads (``zero_dtensor.debug``;
    none for replicated groups or at world size 1)."""
    wanted = set(grads.names if names is None else names)
    groups = {grads[n].group for n in wanted}
    pgs = []
    for i in groups:
        g = grads.layout.groups[i]
        pg = grads._storage.process_groups[i]
        if not g.replicated and g.world_size > 1 and not any(pg is q for q in pgs):
            pgs.append(pg)
    return len(pgs)


class OddModel(torch.nn.Module):
    """Odd sizes so that parameters straddle ZeRO partitions; some tensors are smaller than the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(33, 50)
        self.fc2 = torch.nn.Linear(50, 17)
        self.tiny = torch.nn.Linear(17, 1)  # weight 17, bias 1 element (< world size)
        self.fc3 = torch.nn.Linear(17, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.fc3(h) + self.tiny(h)


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator refuses fp16; its loss-scaling path does not depend on the device."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def ds_config(stage: int, dtype: str = "fp32", *, gas: int = 1, micro_batch: int = 4, **zero: Any) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, **zero},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        allow_fp16_on_cpu()
        config["fp16"] = {"enabled": True, "initial_scale_power": 10}
    return config


def make_engine(config: dict, model: torch.nn.Module | None = None, seed: int = 0,
                model_parameters: Any = None) -> Any:
    torch.manual_seed(seed)
    model = OddModel() if model is None else model
    params = model_parameters if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def batch(engine: Any, step: int = 0, in_features: int = 33) -> torch.Tensor:
    """Rank- and step-dependent inputs, so that the averaged gradient differs from any local one."""
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    micro = engine.train_micro_batch_size_per_gpu()
    dtype = next(p for p in engine.module.parameters()).dtype
    return torch.randn(micro, in_features, generator=g).to(dtype)


def forward_backward(engine: Any, step: int = 0) -> None:
    loss = engine(batch(engine, step)).float().pow(2).mean()
    engine.backward(loss)


def fill_value(name: str, shape: torch.Size) -> torch.Tensor:
    """A deterministic full-size value per parameter name, the same on every rank."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(name))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def count_comms() -> Iterator[CommDebugMode]:
    with CommDebugMode() as mode:
        yield mode


def params_snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (gathered under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
