"""Lightning with DeepSpeed ZeRO-2: clip the reduced gradients by norm and log per-layer gradient norms, once per
optimizer step, with ``zero_dtensor.lightning.ZeroGradCallback``.

Run on 2 ranks (NCCL with one GPU each where the machine has them, else gloo on the CPU) with either of:

    torchrun --nproc_per_node 2 examples/lightning_clip.py
    python examples/lightning_clip.py            # forks 2 local ranks itself (zero_dtensor.launch)

Needs ``pip install 'zero_dtensor[lightning]'``. A small regression model trains for a few steps with
``accumulate_grad_batches=2``; the norms go to Lightning's ``CSVLogger`` under the names of Lightning's ``grad_norm``
utility (``grad_2.0_norm/<parameter>``, ``grad_2.0_norm_total``), and rank 0 prints them from its ``metrics.csv``.

Why a callback on the engine: under ``DeepSpeedStrategy`` the gradients live in DeepSpeed's ZeRO partitions (``p.grad``
is ``None``: ``grad_norm(self, 2)`` finds nothing) and ``on_before_optimizer_step`` fires on every micro-batch, before
the reduction. ``ZeroGradCallback`` registers ``zero_dtensor.on_grads`` on the DeepSpeed engine, which runs at each
accumulation boundary after the reduction, inside the ``engine.step()`` Lightning calls, before the optimizer.

On GPUs use ``Trainer(accelerator="gpu", strategy=DeepSpeedStrategy(stage=2))``; ``CPUDeepSpeedStrategy`` below only
lifts Lightning's CUDA-only check so that the example runs on CPU ranks.
"""

from __future__ import annotations

import csv
import os
import tempfile

import torch

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

import zero_dtensor as zd
from zero_dtensor.lightning import ZeroGradCallback

STEPS = 3  # optimizer steps
GAS = 2  # micro-batches per optimizer step
MICRO = 4
MAX_NORM = 0.05


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` on CPU ranks: indexed CPU devices (DeepSpeed reads the index), no CUDA check."""

    def __init__(self, world_size: int, **kwargs) -> None:  # noqa: ANN003
        super().__init__(parallel_devices=[torch.device("cpu", i) for i in range(world_size)], **kwargs)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:  # noqa: ANN001
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> dict:
    world = int(os.environ.get("WORLD_SIZE", "2"))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(world * GAS * MICRO * STEPS, 8, generator=g),
                                          torch.randn(world * GAS * MICRO * STEPS, 2, generator=g))
    torch.manual_seed(0)
    model = Regressor()
    calls: list[int] = []

    def fn(grads: zd.ShardedGrads) -> None:
        # your own code on the reduced, sharded gradients (runs first, before the norms and the clip)
        calls.append(len(grads.names))

    deepspeed_saw: list[float] = []

    class DeepSpeedNorm(pl.Callback):
        """DeepSpeed's own norm of the gradients its optimizer used, after each optimizer step."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if (batch_idx + 1) % GAS == 0:
                deepspeed_saw.append(float(trainer.strategy.deepspeed_engine.get_global_grad_norm()))

    callback = ZeroGradCallback(fn, clip_grad_norm=MAX_NORM, log_grad_norms=True)
    log_dir = tempfile.mkdtemp(prefix="zd_lightning_")
    strategy = (DeepSpeedStrategy(stage=2) if torch.cuda.is_available()
                else CPUDeepSpeedStrategy(world, stage=2, process_group_backend="gloo"))
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=world, strategy=strategy, max_epochs=1,
        accumulate_grad_batches=GAS, log_every_n_steps=1, logger=CSVLogger(log_dir, name="run"),
        callbacks=[callback, DeepSpeedNorm()], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=MICRO))

    assert len(calls) == STEPS and not callback.active, (calls, callback.active)
    # DeepSpeed's optimizer used the clipped gradients: its own norm is MAX_NORM at every step
    assert len(deepspeed_saw) == STEPS and all(abs(n - MAX_NORM) < 1e-4 for n in deepspeed_saw), deepspeed_saw
    rows: list[dict] = []
    if trainer.is_global_zero:
        with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
            rows = [r for r in csv.DictReader(f) if r.get("grad_2.0_norm_total")]
        assert len(rows) == STEPS, rows
        for row, seen in zip(rows, deepspeed_saw):
            print(f"step {row['step']}: grad_2.0_norm_total {float(row['grad_2.0_norm_total']):.4f} "
                  f"(net.0.weight {float(row['grad_2.0_norm/net.0.weight']):.4f}), "
                  f"clipped to {MAX_NORM}: DeepSpeed's optimizer saw {seen:.4f}")
    return {"steps": len(deepspeed_saw), "hook_calls": len(calls), "csv_rows": len(rows)}


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        print(zd.launch(main, nprocs=2))
