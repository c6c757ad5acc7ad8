"""PCGrad-style gradient surgery on sharded ZeRO gradients, without gathering any gradient.

Each step alternates between two conflicting objectives. After ``engine.backward()`` the current gradient ``g`` is
compared with a snapshot ``s`` of the previous step's gradient (``grads.clone()``, sharded, kept across ``step()``).
Where they conflict (``<g, s> < 0``), ``g`` is projected off ``s``'s direction:

    g <- g - <g, s> / |s|^2 · s

either per parameter (``mode="per_param"``) or once for the whole model (``mode="global"``). Communication per step:
one all_reduce of a (3k,) float32 vector (``dots(..., with_norms=True)``: all k dot products and both sets of norms);
the projection itself (``add_`` with per-parameter or global coefficients kept as tensors) is local.

Run: ``python examples/pcgrad.py`` (2 ranks: NCCL with one GPU each where the machine has them, else gloo on
the CPU). Prints one line per step from rank 0.
"""

from __future__ import annotations

import sys

import torch

import zero_dtensor as zd
from zero_dtensor.launch import launch


def make_engine(stage: int):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def project_conflicts(grads: zd.ShardedGrads, snapshot: zd.ShardedGrads, mode: str) -> dict:
    """Project ``grads`` off ``snapshot`` where they conflict. One collective in all."""
    dots, _, snap_norms = grads.dots(snapshot, with_norms=True)  # one all_reduce of (3k,) float32
    if mode == "per_param":
        # alpha_i = -<g_i, s_i> / |s_i|^2 where <g_i, s_i> < 0, else 0: kept as tensors (no host sync on GPUs)
        alpha = {
            n: torch.where(d < 0, -d / snap_norms[n].pow(2).clamp_min(1e-30), torch.zeros_like(d))
            for n, d in dots.items()
        }
        grads.add_(snapshot, alpha=alpha)  # local: g_i += alpha_i · s_i
        return {"conflicts": sum(int(d < 0) for d in dots.values()), "of": len(dots)}
    total_dot = torch.stack(list(dots.values())).sum()
    snap_sq = torch.stack([v.pow(2) for v in snap_norms.values()]).sum()
    coef = torch.where(total_dot < 0, -total_dot / snap_sq.clamp_min(1e-30), torch.zeros_like(total_dot))
    grads.add_(snapshot, alpha=coef)  # local
    return {"conflicts": int(total_dot < 0), "of": 1}


def train(steps: int = 6, stage: int = 2, mode: str = "per_param") -> list[str]:
    engine = make_engine(stage)
    rank = torch.distributed.get_rank()
    lines, snapshot = [], None
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=gen).to(engine.device)
        sign = 1.0 if step % 2 == 0 else -1.0  # alternating, conflicting objectives
        target = torch.full((8, 4), sign, device=engine.device)
        loss = (engine(x) - target).pow(2).mean()
        engine.backward(loss)

        grads = zd.sharded_grads(engine)
        raw = grads.clone()  # this step's unprojected gradient: next step's reference
        line = f"step {step}: loss {loss.item():.4f}, |g| {float(grads.global_norm()):.4f}"
        if snapshot is not None:
            info = project_conflicts(grads, snapshot, mode)
            after = grads.dots(snapshot)  # one more all_reduce, only to show the effect
            worst = min(float(v) for v in after.values())
            total = sum(float(v) for v in after.values())
            line += (f", conflicts {info['conflicts']}/{info['of']} projected ({mode}); after: "
                     f"min_i <g_i, s_i> {worst:+.2e}, <g, s> {total:+.2e}")
        lines.append(line)
        engine.step()
        snapshot = raw  # a clone stays valid after step()
    return lines


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "per_param"
    for text in launch(train, nprocs=2, mode=mode):
        print(text)
