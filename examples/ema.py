"""An exponential moving average (EMA) of the fp32 master weights under ZeRO-3, kept sharded, swapped into the model
for evaluation and swapped back.

``master = zd.sharded_master_params(engine)`` is DeepSpeed's fp32 master weights as stored (each rank its 1/N);
``ema = master.clone()`` is a sharded copy in this rank's own memory, and ``ema.lerp_(master, 1 - decay)`` after
every step updates it with **no communication** (each rank its own elements). To evaluate with the EMA weights:
keep the current masters (``saved = master.clone()``), write the EMA into the masters (``master.copy_(ema)``), make
the model's working weights follow (``zd.sync_model_params(engine)``: ZeRO-3 copies each rank's master partition
into its working partition, then regathers DeepSpeed's persistent parameters), evaluate, then restore
(``master.copy_(saved)`` and sync again). A forward between a master write and the sync raises
``zd.ModelParamsNotSyncedError`` instead of silently using the old weights.

The run checks that the EMA equals a single-process EMA of the gathered masters, that evaluation used the EMA
weights, and that the masters and the model's working weights are restored exactly.

Run (2 ranks: NCCL with one GPU each where the machine has them, else gloo on the CPU):
``python examples/ema.py`` (starts its ranks itself), or ``torchrun --nproc_per_node 2 examples/ema.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import zero_dtensor as zd
from zero_dtensor.launch import init_distributed

STEPS = 12
DECAY = 0.8
BATCH = 8


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 45), torch.nn.Tanh(), torch.nn.Linear(45, 31), torch.nn.Tanh(),
                               torch.nn.Linear(31, 4))  # odd sizes: ZeRO-3 pads the last rank's chunks


def batch(rank: int, step: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 16, generator=g).to(device)
    return x, torch.sin(x[:, :4] * 2)


def working_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The model's full working weights (ZeRO-3 gathers them for the copy)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def evaluate(engine: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((engine(x) - y).pow(2).mean())


def train() -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():  # under torchrun; zero_dtensor.launch has already done this
        init_distributed()  # NCCL with a GPU per rank, else gloo (zero_dtensor.launch.backend_for)
    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    master = zd.sharded_master_params(engine)  # no communication
    ema = master.clone()  # sharded, this rank's own memory
    reference = zd.get_full_fp32_params(engine)  # the single-process EMA, kept on the side for the check
    for step in range(STEPS):
        x, y = batch(rank, step, engine.device)
        engine.backward((engine(x) - y).pow(2).mean())
        engine.step()
        ema.lerp_(master, 1 - DECAY)  # no communication
        for name, value in zd.get_full_fp32_params(engine).items():
            reference[name].lerp_(value, 1 - DECAY)
    full_ema = ema.full_tensors()
    worst = max(float((full_ema[n] - reference[n]).abs().max()) for n in reference)
    assert worst < 1e-6, f"the sharded EMA differs from the single-process EMA by {worst:.2e}"

    x, y = batch(0, 10**6, engine.device)  # an evaluation batch, the same on every rank
    masters_before, weights_before = zd.get_full_fp32_params(engine), working_weights(engine)
    loss_train = evaluate(engine, x, y)

    saved = master.clone()
    master.copy_(ema)  # the EMA into DeepSpeed's masters: the model does not see it yet
    try:
        evaluate(engine, x, y)
    except zd.ModelParamsNotSyncedError:
        pass
    else:
        raise AssertionError("a forward after a master write without sync_model_params must raise")
    zd.sync_model_params(engine)
    loss_ema = evaluate(engine, x, y)
    ema_weights = working_weights(engine)
    assert all(torch.equal(ema_weights[n], full_ema[n]) for n in full_ema), "evaluation did not use the EMA"

    master.copy_(saved)  # restore, and let the model follow
    zd.sync_model_params(engine)
    masters_after, weights_after = zd.get_full_fp32_params(engine), working_weights(engine)
    assert all(torch.equal(masters_after[n], masters_before[n]) for n in masters_before), "masters not restored"
    assert all(torch.equal(weights_after[n], weights_before[n]) for n in weights_before), "weights not restored"
    assert evaluate(engine, x, y) == loss_train
    x, y = batch(rank, STEPS, engine.device)
    engine.backward((engine(x) - y).pow(2).mean())  # training goes on from the restored weights
    engine.step()
    return {"rank": rank, "loss_train": loss_train, "loss_ema": loss_ema, "ema_vs_reference": worst}


def main() -> None:
    if "RANK" in os.environ:  # torchrun: this process is one rank
        import torch.distributed as dist

        result = train()
        if dist.get_rank() == 0:
            report(result)
        return
    report(zd.launch(train, nprocs=2))


def report(result: dict[str, Any]) -> None:
    print(f"ZeRO-3, 2 ranks, {STEPS} steps, decay {DECAY}: eval loss {result['loss_train']:.5f} (trained weights), "
          f"{result['loss_ema']:.5f} (EMA weights); EMA vs single-process EMA max abs diff "
          f"{result['ema_vs_reference']:.1e}; masters and working weights restored exactly")


if __name__ == "__main__":
    main()
