"""Models, engines and data shared by the worker-side test functions (run inside the rank processes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def agreement_op(grads: Any) -> str:
    """CommDebugMode's short name of the collective an agreement (without payload) issues on ``grads``' first
    process group: ``allreduce`` or ``allgather_base`` (``zero_dtensor.comm.collectives.prefers_all_reduce``)."""
    from zero_dtensor.comm.collectives import prefers_all_reduce

    return "allreduce" if prefers_all_reduce(grads._storage.process_groups[0]) else "allgather_base"


def rank_checks(grads: Any, names: Any = None) -> int:
    """Collectives the always-on rank-agreement check of one ``full_tensors`` / ``iter_full`` call issues: one
    small collective per distinct process group of the multi-rank sharded groups it reads (``zero_dtensor.debug``;
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


class TiedModel(torch.nn.Module):
    """``mid2.weight`` is ``mid.weight``: one tied parameter, listed once (as ``mid.weight``) in the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(33, 17)
        self.mid = torch.nn.Linear(17, 17)
        self.mid2 = torch.nn.Linear(17, 17)
        self.mid2.weight = self.mid.weight
        self.fc3 = torch.nn.Linear(17, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc3(torch.tanh(self.mid2(torch.tanh(self.mid(h)))))


class DeepModel(torch.nn.Module):
    """A larger model (34 parameter tensors) to show that reductions cost the same number of collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(33, 13)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(13, 13) for _ in range(15))
        self.out = torch.nn.Linear(13, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


class WideModel(torch.nn.Module):
    """Every size a multiple of 96, so that fragments share a wide common width (16 elements: 32 bytes even in fp16)
    on 2 and 3 ranks: the row-copy paths (``zero_dtensor.layout.rows``) apply."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(33, 96)
        self.fc2 = torch.nn.Linear(96, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


MODELS = {"odd": OddModel, "tied": TiedModel, "deep": DeepModel, "wide": WideModel}
FROZEN = ("fc1.bias", "tiny.bias")  # two-group cases freeze these by default (absent from the gradient dict)
OPTIMIZERS = ("adam", "sgd", "client_adam")


def allow_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator refuses fp16; its loss-scaling path does not depend on the device."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def ds_config(stage: int, dtype: str = "fp32", *, gas: int = 1, micro_batch: int = 4, **zero: Any) -> dict:
    """The base DeepSpeed config (Adam lr 1e-2). Tests build engines from an :class:`EngineCase`; this stays for
    hand-made configs."""
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


def _pairs(value: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(value.items()) if isinstance(value, Mapping) else tuple(value)


@dataclass(frozen=True)
class EngineCase:
    """One engine of the test matrix: what :func:`build_engine` builds, and (``id``) what pytest calls it.

    ``optimizer``: ``adam`` (the config's Adam, lr 1e-2), ``sgd`` (lr 1: a parameter moves by exactly its gradient,
    so a lost write shows as a wrong parameter) or ``client_adam`` (``torch.optim.Adam``, lr 1e-2, passed to
    ``deepspeed.initialize``; no "optimizer" in the config). ``zero`` (extra ``zero_optimization`` options) and
    ``extra`` (top-level config entries, e.g. ``gradient_clipping``) may be given as dicts; they are stored as
    tuples of pairs.
    """

    stage: int
    dtype: str = "fp32"  # the stored gradient dtype: fp32 | bf16 | fp16
    world: int = 2  # ranks the test runs the case on: ranks(case.world)
    gas: int = 1  # gradient accumulation steps
    offload: bool = False  # offload_optimizer to the CPU
    groups: int = 1  # 1: one optimizer param group; 2: weights / the rest (see ``frozen``)
    frozen: bool = True  # groups=2: FROZEN parameters do not train (absent from the gradients); weight decay split
    bf16_optimizer: bool = False  # stage 1 + bf16 + fp32 accumulation: DeepSpeed's BF16_Optimizer (replicated)
    optimizer: str = "adam"  # adam | sgd | client_adam
    zero: tuple[tuple[str, Any], ...] = ()
    extra: tuple[tuple[str, Any], ...] = ()
    model: str = "odd"  # a key of MODELS
    micro_batch: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", _pairs(self.zero))
        object.__setattr__(self, "extra", _pairs(self.extra))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: one of {sorted(DTYPES)}")
        if self.bf16_optimizer and (self.stage, self.dtype) != (1, "bf16"):
            raise ValueError("bf16_optimizer needs stage 1 and dtype bf16")
        if self.groups not in (1, 2) or self.model not in MODELS or self.optimizer not in OPTIMIZERS:
            raise ValueError(f"bad case {self!r}")

    @property
    def id(self) -> str:
        parts = [f"ws{self.world}", f"z{self.stage}", self.dtype]
        parts += [f"gas{self.gas}"] if self.gas != 1 else []
        parts += ["offload"] if self.offload else []
        parts += [f"{self.groups}g" + ("" if self.frozen else "-nofrozen")] if self.groups != 1 else []
        parts += ["bf16opt"] if self.bf16_optimizer else []
        parts += [self.optimizer] if self.optimizer != "adam" else []
        parts += [self.model] if self.model != "odd" else []
        parts += [k if v is True else f"{k}={v}" for k, v in self.zero + self.extra]
        return "-".join(parts)

    def config(self) -> dict:
        """The DeepSpeed config of this case."""
        zero = dict(self.zero)
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = ds_config(self.stage, self.dtype, gas=self.gas, micro_batch=self.micro_batch, **zero)
        if self.bf16_optimizer:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        if self.optimizer == "sgd":
            config["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
            config["zero_allow_untested_optimizer"] = True
        elif self.optimizer == "client_adam":
            del config["optimizer"]
        config.update(self.extra)
        return config


def build_model(groups: int = 1, seed: int = 0, model: str = "odd", frozen: bool = True
                ) -> tuple[torch.nn.Module, Any]:
    """The model and ``model_parameters`` of a case: one group (``None``), or two groups, weights (weight decay 0.1)
    and the rest (0.0), with the FROZEN parameters not trained unless ``frozen`` is False."""
    torch.manual_seed(seed)
    module = MODELS[model]()
    if groups == 1:
        return module, None
    if frozen:
        for name, p in module.named_parameters():
            if name in FROZEN:
                p.requires_grad_(False)
    decay = [p for n, p in module.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in module.named_parameters() if p.requires_grad and not n.endswith("weight")]
    return module, [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def build_engine(case: EngineCase, seed: int = 0, *, mpu: Any = None) -> Any:
    """The one engine builder of the tests: ``case``'s model (seeded), param groups and config, initialized."""
    if dist.is_initialized() and dist.get_world_size() != case.world:
        raise ValueError(f"case {case.id} runs on {case.world} ranks, not {dist.get_world_size()}")
    model, groups = build_model(case.groups, seed=seed, model=case.model, frozen=case.frozen)
    params = groups if groups is not None else [p for p in model.parameters() if p.requires_grad]
    kwargs: dict[str, Any] = {"mpu": mpu} if mpu is not None else {}
    if case.optimizer == "client_adam":
        kwargs["optimizer"] = torch.optim.Adam(params, lr=1e-2)
    else:
        kwargs["model_parameters"] = params
    engine, *_ = deepspeed.initialize(model=model, config=case.config(), **kwargs)
    return engine


def make_engine(config: dict, model: torch.nn.Module | None = None, seed: int = 0,
                model_parameters: Any = None) -> Any:
    """An engine of a hand-made config (the tests use :func:`build_engine`; kept for code that builds its own)."""
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


class CommCounts:
    """The collectives ``CommDebugMode`` counts, plus the point-to-point batches it does not see (the ``send_recv``
    strategy's: :func:`zero_dtensor.comm.point_to_point.counting_p2p`), each batch counted as one transfer."""

    def __init__(self, mode: CommDebugMode, p2p: Any) -> None:
        self.mode, self.p2p = mode, p2p

    def get_total_counts(self) -> int:
        return self.mode.get_total_counts() + self.p2p.batches

    def get_comm_counts(self) -> dict[Any, int]:
        counts = dict(self.mode.get_comm_counts())
        if self.p2p.batches:
            counts["p2p batches"] = self.p2p.batches
            counts["p2p ops"] = self.p2p.ops
        return counts

    @property
    def p2p_ops(self) -> int:
        return self.p2p.ops


@contextlib.contextmanager
def count_comms() -> Iterator[CommCounts]:
    from zero_dtensor.comm.point_to_point import counting_p2p

    with CommDebugMode() as mode, counting_p2p() as p2p:
        yield CommCounts(mode, p2p)


@contextlib.contextmanager
def patient_recycling(seconds: float = 10.0) -> Iterator[None]:
    """A recycled buffer that only gloo's worker thread still refers to after a synchronous collective is waited
    for up to ``seconds`` (50 ms in the library, then a new buffer): what a call allocates, counted inside the
    block, does not depend on how busy the machine is."""
    try:
        from zero_dtensor.materialize import buffers
    except ImportError:  # a version without the shared allocator (the benchmark's old-code runs)
        yield
        return
    previous, buffers.SETTLE_S = buffers.SETTLE_S, seconds
    try:
        yield
    finally:
        buffers.SETTLE_S = previous


@contextlib.contextmanager
def pipelining(on: bool = True) -> Iterator[None]:
    """ZeRO-3 all_gathers pipelined whatever their size (``on``; else as the library decides): the test models are
    far below ``PIPELINE_MIN_BYTES``."""
    from zero_dtensor.materialize import strategy

    previous = strategy.PIPELINE_MIN_BYTES
    if on:
        strategy.PIPELINE_MIN_BYTES = 0
    try:
        yield
    finally:
        strategy.PIPELINE_MIN_BYTES = previous


def params_snapshot(engine: Any) -> dict[str, torch.Tensor]:
    """Full fp32 parameters (gathered under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}


def raises_everywhere(what: str, call: Any, error: type[BaseException]) -> str:
    """``call()`` must raise ``error`` on this rank (every rank runs this, so: on every rank); returns its message."""
    try:
        call()
    except error as exc:
        return str(exc)
    raise AssertionError(f"{what}: returned on rank {dist.get_rank()} (expected {error.__name__} on every rank)")
