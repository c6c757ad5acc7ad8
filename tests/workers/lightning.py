"""Worker side of ``tests/test_lightning.py``: a real ``lightning.Trainer`` with ``DeepSpeedStrategy`` on the gloo
ranks of the test harness, and the single-process reference it is compared with (plain torch, no DeepSpeed).

How Lightning runs inside the harness: each harness rank is a process that already joined a gloo process group
(``deepspeed.init_distributed``) with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` set. Lightning's
``LightningEnvironment`` sees ``LOCAL_RANK`` and so does not start processes itself (``creates_processes_externally``);
``Trainer(devices=2)`` then makes each process the rank it already is, and ``deepspeed.init_distributed`` finds the
process group initialized and keeps it. Lightning's ``DeepSpeedStrategy`` refuses non-CUDA accelerators in
``setup_environment``, and needs indexed devices (DeepSpeed reads ``root_device.index``): :class:`CPUDeepSpeedStrategy`
skips that check and passes ``cpu:0``, ``cpu:1``, nothing else (DeepSpeed itself runs on its CPU accelerator, as in
every other test). Launching with ``torchrun --nproc_per_node 2`` works too (``examples/lightning_clip.py``): there
Lightning's ``deepspeed.init_distributed`` creates the gloo group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import grad_norm

WORLD = 2
GAS = 2  # accumulate_grad_batches: DeepSpeed's gradient_accumulation_steps
MICRO = 2  # per-rank micro-batch
STEPS = 4  # optimizer steps (accumulation boundaries): one epoch of STEPS * GAS batches per rank
N = WORLD * GAS * MICRO * STEPS
IN, OUT = 7, 3
LR = 0.5  # plain SGD: a clipped gradient moves the weights by exactly lr * the clipped value
MAX_NORM = 0.05  # below every step's gradient norm (the test checks): every step is clipped


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """The harness' rank processes are shared with the rest of the suite: put back what a Lightning run changes in
    the process (its ``LightningEnvironment`` deletes ``WORLD_SIZE`` at teardown, it sets ``OMP_NUM_THREADS`` and adds
    warning filters)."""
    environ, filters = dict(os.environ), list(warnings.filters)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        warnings.filters[:] = filters


def _kept(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with process_state_kept():
            return fn(*args, **kwargs)

    return run


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` on CPU ranks: ``setup_environment`` without its CUDA-only accelerator check;
    the devices are ``cpu:0``, ``cpu:1``, ... (DeepSpeed reads the rank's device index, and Lightning checks that the
    indices are the local ranks). The rest is Lightning's own."""

    def __init__(self, world: int = WORLD, **kwargs: Any) -> None:
        super().__init__(parallel_devices=[torch.device("cpu", i) for i in range(world)], **kwargs)

    def setup_environment(self) -> None:
        pl.strategies.DDPStrategy.setup_environment(self)


class Net(pl.LightningModule):
    """Three small layers (odd sizes: parameters straddle ZeRO partitions); MSE loss; SGD."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, 13)
        self.fc2 = torch.nn.Linear(13, 5)
        self.head = torch.nn.Linear(5, OUT)
        self.batches = 0  # training_step calls on this rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.batches += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(torch.randn(N, IN, generator=g), torch.randn(N, OUT, generator=g))


def loader_of_this_rank() -> torch.utils.data.DataLoader:
    """Rank ``r`` reads samples ``r, r + WORLD, ...`` in order (Lightning keeps a given ``DistributedSampler``; the one
    it would inject for training shuffles)."""
    data = dataset()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=WORLD, rank=dist.get_rank(), shuffle=False)
    return torch.utils.data.DataLoader(data, batch_size=MICRO, sampler=sampler)


class RecordingLogger(Logger):
    """Keeps what Lightning writes: ``records[step] = {name: value}`` (every rank keeps its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.setdefault(int(step), {}).update(metrics)


def _trainer(stage: int, callbacks: list, log_every: int, logger: Logger | None = None, **kwargs: Any) -> pl.Trainer:
    strategy = CPUDeepSpeedStrategy(stage=stage, cluster_environment=LightningEnvironment(),
                                    process_group_backend="gloo", logging_batch_size_per_gpu=MICRO)
    return pl.Trainer(
        devices=WORLD, num_nodes=1, strategy=strategy, max_epochs=1,
        accumulate_grad_batches=GAS, logger=logger if logger is not None else False, log_every_n_steps=log_every,
        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=tempfile.mkdtemp(prefix="zd_lightning_"), **kwargs,
    )


def _full_params(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    module = trainer.strategy.deepspeed_engine.module
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in module.named_parameters()}


@_kept
def fit_with_clipping(stage: int, log_every: int, ds_clip: float | None = None) -> dict:
    """Train ``Net`` for one epoch with two callbacks on one engine: ``clip`` (fn + clip to MAX_NORM + 2-norms before
    clipping, logged as Lightning writes them) and ``after`` (inf-norms of the clipped gradients, every 2nd
    boundary). ``ds_clip``: also ``Trainer(gradient_clip_val=ds_clip)`` (DeepSpeed's own clip, after ours). Returns
    the final full fp32 weights, the fn calls, the logger's records, the callbacks' state and the warnings about
    clipping twice."""
    from zero_dtensor.lightning import ZeroGradCallback

    assert dist.is_initialized() and dist.get_world_size() == WORLD
    model = Net()
    calls: list[tuple[int, tuple[str, ...]]] = []

    def fn(grads: Any) -> None:
        calls.append((model.batches, tuple(grads.names)))  # training_step calls so far on this rank

    clip = ZeroGradCallback(fn, clip_grad_norm=MAX_NORM, log_grad_norms=True)
    after = ZeroGradCallback(norm_type="inf", log_grad_norms=True, log_every_n_steps=2)
    logger = RecordingLogger()
    trainer = _trainer(stage, [clip, after], log_every, logger, gradient_clip_val=ds_clip)
    loader = loader_of_this_rank()
    active: list[bool] = []

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            active.append(clip.active and after.active)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            probe["weights"] = _full_params(trainer)

    probe: dict[str, Any] = {}
    trainer.callbacks.append(Probe())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    return {
        "clip_warnings": [str(w.message) for w in caught if "both clip" in str(w.message)],
        "ds_clipping": trainer.strategy.deepspeed_engine.gradient_clipping(),
        "weights": probe["weights"], "calls": calls, "records": logger.records, "global_rank": trainer.global_rank,
        "world_size": trainer.world_size, "zero_stage": trainer.strategy.deepspeed_engine.zero_optimization_stage(),
        "boundaries": (clip.boundaries, after.boundaries), "active_during": active,
        "active_after": (clip.active, after.active), "last_total_norm": clip.last_total_norm,
        "batches": model.batches,
    }


@_kept
def fit_with_failing_fn(stage: int, fail_at: int = 1) -> dict:
    """``fn`` raises on rank 1 at boundary ``fail_at``: ``trainer.fit`` raises on both ranks (rank 1 its own error,
    rank 0 ``GradHookError``), that step is not taken, and the callback detaches (``on_exception``)."""
    from zero_dtensor import GradHookError
    from zero_dtensor.lightning import ZeroGradCallback

    model = Net()
    rank = dist.get_rank()
    seen: list[int] = []

    def fn(grads: Any) -> None:
        seen.append(model.batches)
        if rank == 1 and len(seen) == fail_at + 1:
            raise ValueError("rank 1 refuses this step")

    callback = ZeroGradCallback(fn, clip_grad_norm=MAX_NORM)
    trainer = _trainer(stage, [callback], log_every=1)
    try:
        trainer.fit(model, loader_of_this_rank())
    except (ValueError, GradHookError) as exc:
        raised = type(exc).__name__
    else:
        raised = None
    return {"raised": raised, "seen": seen, "active": callback.active, "weights": _full_params(trainer),
            "stage": trainer.strategy.deepspeed_engine.zero_optimization_stage()}


@_kept
def fit_stage_0() -> str:
    """ZeRO stage 0 (no ZeRO optimizer): refused when fitting starts, on every rank."""
    from zero_dtensor.lightning import ZeroGradCallback

    trainer = _trainer(0, [ZeroGradCallback(clip_grad_norm=1.0)], log_every=1)
    try:
        trainer.fit(Net(), loader_of_this_rank())
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        return type(exc).__name__
    return "nothing raised"


@_kept
def run_example(path: str) -> dict:
    """``main()`` of an example script, loaded from its file (``examples/`` is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("zd_example_lightning_clip", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main()


# ----------------------------------------------------------------------------------------------------------------------
def reference(steps: int = STEPS, clip: bool = True) -> dict:
    """The same training in one process, no DeepSpeed: each step's gradient is that of the mean loss over the step's
    global batch (WORLD ranks x GAS micro-batches of MICRO samples; rank ``r`` reads samples ``r, r + WORLD, ...``,
    so step ``s`` covers samples ``[s*B, (s+1)*B)``, B = WORLD*GAS*MICRO) divided by GAS, clipped (``clip``) with
    ``torch.nn.utils.clip_grad_norm_``; Lightning's ``grad_norm`` before (2-norm) and after (inf-norm) clipping.

    Why ``/ GAS``: Lightning 2.5 divides the training_step loss by ``accumulate_grad_batches`` and DeepSpeed's
    ``engine.backward`` (``scale_wrt_gas=True``, as Lightning calls it) divides it again, so the gradient DeepSpeed
    reduces (and its optimizer uses) is the mean gradient / GAS."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = dataset().tensors
    per_step = WORLD * GAS * MICRO
    before, after, totals = [], [], []
    for s in range(steps):
        opt.zero_grad()
        rows = slice(s * per_step, (s + 1) * per_step)
        (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / GAS).backward()
        before.append({k: float(v) for k, v in grad_norm(model, norm_type=2).items()})
        if clip:
            totals.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=2.0)))
        after.append({k: float(v) for k, v in grad_norm(model, norm_type="inf").items()})
        opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"weights": weights, "before": before, "after": after, "totals": totals}
