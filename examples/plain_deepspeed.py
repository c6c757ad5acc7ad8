"""A plain DeepSpeed ZeRO-2 loop with gradient accumulation, editing the reduced gradients through ``zd.on_grads``.

Run on 2 ranks (NCCL with one GPU each where the machine has them, else gloo on the CPU) with either of:

    torchrun --nproc_per_node 2 examples/plain_deepspeed.py
    python examples/plain_deepspeed.py            # forks 2 local ranks itself (zero_dtensor.launch)

The hook runs once per optimizer step, after DeepSpeed reduced the gradients and before its optimizer uses them: here
it clips each parameter's gradient to norm 0.1 (DeepSpeed has only a global clip) and adds a little Gaussian noise.
``GradStatsLogger`` reports per-parameter statistics of what the optimizer is about to use.
"""

from __future__ import annotations

import os

import torch

import zero_dtensor as zd
from zero_dtensor.launch import init_distributed

GAS = 2
STEPS = 3


def main() -> dict[str, float]:
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():  # under torchrun; zero_dtensor.launch has already done this
        init_distributed()  # NCCL with a GPU per rank, else gloo (zero_dtensor.launch.backend_for)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.Tanh(), torch.nn.Linear(64, 9))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def edit(grads: zd.ShardedGrads) -> None:
        norms = grads.clip_per_param_(0.1)  # per-parameter clip, one small all_reduce; returns norms before
        grads.add_noise_(1e-4, seed=engine.global_steps)  # same noise whatever the world size
        if rank == 0:
            clipped = sum(float(n) > 0.1 for n in norms.values())
            print(f"step {engine.global_steps + 1}: clipped {clipped} of {len(norms)} parameter gradients")

    def report(metrics: dict[str, float], step: int) -> None:  # e.g. wandb.log(metrics, step=step)
        print(f"step {step}: global grad norm {metrics['grad/global_norm']:.4f}, "
              f"non-finite {metrics['grad/nan_count'] + metrics['grad/inf_count']:.0f}")

    handle = zd.on_grads(engine, edit)
    logger = zd.GradStatsLogger(engine, callback=report)  # registered after `edit`: sees the edited gradients
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS * GAS):
        x = torch.randn(8, 33, generator=generator).to(engine.device)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()  # at a boundary: edit(grads), then the logger, then DeepSpeed's optimizer step
    logger.remove()
    handle.remove()
    assert engine.global_steps == STEPS and logger.boundaries == STEPS
    return logger.latest


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        latest = zd.launch(main, nprocs=2)
        print({k: round(v, 5) for k, v in latest.items() if k.endswith("/norm")})
