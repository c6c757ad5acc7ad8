"""An Accelerate training loop with its DeepSpeed plugin (ZeRO-2), editing reduced gradients through ``zd.on_grads``.

Run on 2 ranks (NCCL with one GPU each where the machine has them, else gloo on the CPU) with either of:

    torchrun --nproc_per_node 2 examples/accelerate_loop.py
    python examples/accelerate_loop.py            # forks 2 local ranks itself (zero_dtensor.launch)

Under DeepSpeed, ``accelerator.backward(loss)`` runs ``engine.backward(loss)`` *and* ``engine.step()``
(``accelerate.utils.deepspeed.DeepSpeedEngineWrapper.backward``); ``optimizer.step()`` in the loop is a no-op. Code
placed between ``accelerator.backward`` and ``optimizer.step()`` therefore sees gradients already consumed. The hook
registered on the engine runs inside ``accelerator.backward``, after the reduction and before DeepSpeed's optimizer.

CPU caveat (accelerate 1.15): ``PartialState._prepare_backend`` assigns a backend to a multi-process run only for a
GPU-class device (cuda, xpu, npu, ...) or, for CPU, only with ``cpu=True``, and ``cpu=True`` disables the DeepSpeed
plugin (``state.py``: ``if not cpu ...`` / ``... and not cpu``). Without a GPU, Accelerate therefore reports
``num_processes == 1`` and ``process_index == 0`` on every rank, although DeepSpeed itself (initialized by Accelerate
through ``deepspeed.init_distributed``) trains on all ranks. So this example shards its data by
``torch.distributed.get_rank()`` instead of ``accelerator.prepare(dataloader)`` and prints on rank 0 itself. On GPUs
the usual ``accelerate launch --use_deepspeed`` / ``prepare(dataloader)`` path applies unchanged.
"""

from __future__ import annotations

import os

import torch

import zero_dtensor as zd

GAS = 2
STEPS = 3


def main() -> int:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    ds_config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), gradient_accumulation_steps=GAS)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.Tanh(), torch.nn.Linear(64, 9))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, optimizer = accelerator.prepare(model, optimizer)  # engine: a DeepSpeedEngine
    rank, world = dist.get_rank(), dist.get_world_size()  # see the CPU caveat above; on GPUs: prepare(loader)
    inputs = torch.randn(8 * world * GAS * STEPS, 33, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(inputs)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=torch.utils.data.DistributedSampler(
        data, num_replicas=world, rank=rank, shuffle=False))

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    fired: list[int] = []

    def edit(grads: zd.ShardedGrads) -> None:
        fired.append(engine.global_steps)
        total = grads.clip_grad_norm_(0.05)  # a clip *we* control, on the reduced gradient; returns the total norm
        grads.zero_(params=lambda name: name.endswith("bias"))  # e.g. freeze biases for this step
        say(f"step {engine.global_steps + 1}: grad norm before clip {float(total):.4f}; biases frozen")

    with zd.on_grads(engine, edit), zd.GradStatsLogger(engine, callback=lambda m, s: say(
            f"  logged at step {s}: 0.bias norm {m['grad/0.bias/norm']:.1f}, global {m['grad/global_norm']:.4f}")):
        for (x,) in loader:
            with accelerator.accumulate(engine):
                loss = engine(x.to(engine.device)).pow(2).mean()
                accelerator.backward(loss)  # at a boundary: engine.backward, then the hooks, then engine.step
                optimizer.step()  # no-op under DeepSpeed
                optimizer.zero_grad()
    assert fired == list(range(STEPS)), fired
    return engine.global_steps


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        print("optimizer steps:", zd.launch(main, nprocs=2))
