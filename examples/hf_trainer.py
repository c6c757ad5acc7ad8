"""The Hugging Face Trainer with DeepSpeed ZeRO-2: edit and log the reduced gradients through ``zd.on_grads``.

Run on 2 ranks (NCCL with one GPU each where the machine has them, else gloo on the CPU) with either of:

    torchrun --nproc_per_node 2 examples/hf_trainer.py
    python examples/hf_trainer.py                 # forks 2 local ranks itself (zero_dtensor.launch)

A tiny GPT-2 built from a config (no download) trains on random tokens for a few steps.

Why a hook and not a ``TrainerCallback``: under DeepSpeed the Trainer calls ``accelerator.backward(loss)``, which runs
``engine.backward(loss)`` and then ``engine.step()`` (``accelerate.utils.deepspeed.DeepSpeedEngineWrapper.backward``);
``on_pre_optimizer_step`` fires afterwards, when the optimizer has already consumed (and DeepSpeed freed) the gradients.
``zd.on_grads_in_trainer(trainer, fn)`` adds a small callback that registers ``fn`` with ``zd.on_grads`` on the
DeepSpeed engine when training begins (``trainer.model_wrapped``) and removes it when training ends.

CPU caveat (accelerate 1.15, see examples/accelerate_loop.py): without a GPU, Accelerate (and so the Trainer)
counts one process per rank (``args.world_size == 1``), while DeepSpeed trains on all ranks. The Trainer's
dataloader is then not sharded, so this example gives every rank its own random data. Keep ``train_batch_size`` out
of the DeepSpeed config: the Trainer would fill it for one process and DeepSpeed would refuse the mismatch.
"""

from __future__ import annotations

import os
import tempfile

import torch

import zero_dtensor as zd

STEPS = 3
GAS = 2


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> dict:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    out_dir = tempfile.mkdtemp(prefix="zd_hf_trainer_")
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=GAS, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], deepspeed=ds_config,
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16,
                                             bos_token_id=0, eos_token_id=0))
    rank = dist.get_rank()
    data = RandomTokens(4 * GAS * STEPS, 16, 128, seed=rank)  # per-rank data: see the CPU caveat above
    trainer = Trainer(model=model, args=args, train_dataset=data)
    if rank == 0:  # the CPU caveat above: 1 vs 2
        print(f"Trainer world_size {args.world_size}, DeepSpeed world size {dist.get_world_size()}")

    seen: list[int] = []
    late: list[str] = []

    def edit(grads: zd.ShardedGrads) -> None:
        # the reduced gradients, before DeepSpeed's optimizer: freeze the embeddings this step, clip the rest to 0.5
        seen.append(trainer.state.global_step)
        grads.zero_(params=lambda name: "wte" in name or "wpe" in name)
        total = grads.clip_grad_norm_(0.5)  # DeepSpeed then reports grad_norm 0.5: it uses our edit
        if rank == 0:
            print(f"step {trainer.state.global_step + 1}: total grad norm {float(total):.4f} (embeddings zeroed)")

    class TooLate(TrainerCallback):
        """What a plain callback sees: on_pre_optimizer_step runs after DeepSpeed's step already used the grads."""

        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            try:
                zd.sharded_grads(trainer.model_wrapped)
            except zd.GradientsNotReadyError as exc:
                late.append(type(exc).__name__)

    hook = zd.on_grads_in_trainer(trainer, edit)

    def report(metrics: dict[str, float], step: int) -> None:  # rank 0 only; e.g. wandb.log(metrics, step=step)
        print(f"  logged step {step}: wte norm {metrics['grad/transformer.wte.weight/norm']:.3g}, "
              f"global {metrics['grad/global_norm']:.4f}")

    logger_cb = zd.attach_to_trainer(trainer, lambda engine: zd.GradStatsLogger(engine, callback=report))
    checked: list[float] = []

    class OptimizerSawTheEdit(TrainerCallback):
        """After each step: the norm DeepSpeed's optimizer computed equals the logged norm of the edited gradients."""

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            logged = logger_cb.attached.latest["grad/global_norm"]
            assert abs(trainer.model_wrapped.get_global_grad_norm() - logged) < 1e-4 * max(1.0, logged)
            checked.append(logged)

    trainer.add_callback(TooLate())
    trainer.add_callback(OptimizerSawTheEdit())
    trainer.train()
    assert seen == list(range(STEPS)), seen
    assert not hook.active and not logger_cb.active  # removed at on_train_end
    assert len(late) == STEPS, late
    assert len(checked) == STEPS and max(checked) <= 0.5 + 1e-4, checked
    return {"steps": trainer.state.global_step, "hook_calls": len(seen), "too_late": late[0]}


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        print(zd.launch(main, nprocs=2))
