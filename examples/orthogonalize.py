"""Muon-style orthogonalized updates under ZeRO-1/2/3: every matrix gradient replaced by its Newton–Schulz
orthogonalization, computed once in the job, on one owner rank per matrix; DeepSpeed's optimizer (torch SGD) steps.

Muon (Jordan et al., 2024) updates each weight matrix ``W`` with ``orth(G) = U Vᵀ`` of its gradient's SVD ``G = U S
Vᵀ``, approximated by a few Newton–Schulz iterations. That needs each matrix's *whole* gradient, which ZeRO keeps in
pieces. Inside a ``zd.on_grads`` hook, ``grads.map_full_(fn, matrices)`` sends each matrix's pieces to its owner
(one ``all_to_all_single``, about ``S/N`` bytes per rank instead of the ``(N-1)/N·S`` of gathering everything
everywhere), runs ``fn`` there, and sends the result back into DeepSpeed's storage (one more ``all_to_all_single``).
Vectors (biases) keep their plain gradient. SGD without momentum then applies ``W -= lr · scale · orth(G)``, with
Muon's shape factor ``scale = sqrt(max(1, rows/cols))``.

The result is checked against a single-process replay: the same model and data in plain PyTorch, the gradient
averaged over the ranks' batches, the same orthogonalization and SGD step.

Run (2 ranks: NCCL with one GPU each where the machine has them, else gloo on the CPU):
``python examples/orthogonalize.py`` (forks its ranks itself), or ``torchrun --nproc_per_node 2 examples/orthogonalize.py --stage 3``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

import zero_dtensor as zd
from zero_dtensor.launch import init_distributed
from zero_dtensor.redistribute import newton_schulz, traffic

LR = 0.05
STEPS = 6
BATCH = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 45), torch.nn.Tanh(), torch.nn.Linear(45, 31), torch.nn.Tanh(),
                               torch.nn.Linear(31, 4))  # odd sizes: ZeRO's cuts fall inside rows


def orthogonalized(name: str, grad: torch.Tensor) -> torch.Tensor:
    """Muon's update direction for one matrix (float32)."""
    rows, cols = grad.shape
    return newton_schulz(grad) * max(1.0, rows / cols) ** 0.5


def batch(rank: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s data (the same every step: each rank has its own shard of a tiny data set)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, 16, generator=g).to(device)
    return x, torch.sin(x[:, :4] * 2)  # a smooth target the model can fit


def train(stage: int, steps: int = STEPS) -> dict[str, Any]:
    """Train on every rank; returns the final parameters, the losses and what the hook moved (rank 0's view)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    if not dist.is_initialized():  # under torchrun; zero_dtensor.launch has already done this
        init_distributed()  # NCCL with a GPU per rank, else gloo (zero_dtensor.launch.backend_for)
    rank = dist.get_rank()
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # an orthogonalized update has norm ~sqrt(rank) per matrix: do not clip it away
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    info: dict[str, Any] = {}

    def orthogonalize(grads: zd.ShardedGrads) -> None:
        matrices = [n for n in grads.names if len(grads[n].shape) == 2]
        grads.map_full_(orthogonalized, matrices)  # each matrix on one owner, computed once in the job
        if not info:
            info["owners"] = grads.owners(matrices)
            info["moved"] = traffic(grads, matrices, target="owners")  # bytes this rank sent/received
            world = dist.get_world_size()  # what an all_gather of the matrices would receive per rank:
            info["full_tensors"] = (world - 1) * sum(grads[n].numel * grads[n].dtype.itemsize
                                                     for n in matrices) // world

    losses = []
    with zd.on_grads(engine, orthogonalize):
        x, y = batch(rank, engine.device)
        for _ in range(steps):
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()  # at the boundary: orthogonalize(grads), then SGD
            losses.append(float(loss.detach()))
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    return {"rank": rank, "params": params, "losses": losses, **info}


def replay(world: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The same training in one process: the gradient averaged over the ranks' batches, then the same update."""
    model = make_model()
    for _ in range(steps):
        model.zero_grad()
        for rank in range(world):
            x, y = batch(rank)
            ((model(x) - y).pow(2).mean() / world).backward()
        with torch.no_grad():
            for p in model.parameters():
                update = orthogonalized("", p.grad) if p.ndim == 2 else p.grad
                p.sub_(LR * update)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check(results: dict[str, Any], world: int) -> float:
    """Largest relative difference of any parameter from the single-process replay (asserted small)."""
    reference = replay(world)
    worst = 0.0
    for name, value in results["params"].items():
        err = float((value - reference[name]).norm() / reference[name].norm())
        worst = max(worst, err)
    assert worst < 1e-4, f"ZeRO run differs from the single-process replay by {worst:.2e}"
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), action="append", help="ZeRO stage(s). Default 1,2,3")
    args = parser.parse_args()
    stages = args.stage or [1, 2, 3]
    if "RANK" in os.environ:  # torchrun: this process is one rank
        import torch.distributed as dist

        for stage in stages:
            results = train(stage)
            if dist.get_rank() == 0:
                print(f"ZeRO-{stage}: final loss {results['losses'][-1]:.4f}, "
                      f"max rel. diff vs replay {check(results, dist.get_world_size()):.1e}")
        return
    for stage in stages:
        first = zd.launch(train, stage, nprocs=2)  # rank 0's result
        moved = first["moved"]
        print(f"ZeRO-{stage}: losses {' '.join(f'{v:.4f}' for v in first['losses'])}; owners "
              f"{first['owners']}; rank 0 sent {moved['read_sent']} B and received {moved['read_received']} B per "
              f"exchange (an all_gather of the matrices: {first['full_tensors']} B received per rank); "
              f"max rel. diff vs single-process replay {check(first, 2):.1e}")


if __name__ == "__main__":
    main()
