"""One command for the CUDA path (issue 13): zero_dtensor checked against DeepSpeed and timed, on one device.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--tiny] [--quick] [--json PATH] [--skip-timing]

The device defaults to ``cuda`` when torch sees a GPU, else ``cpu``. Three parts, one table, one JSON file:

1. **Checks** (small models, every case a fresh pair of DeepSpeed engines with the same seed). The matrix is ZeRO
   stages 1-3 x fp32/bf16/fp16 x four variants: ``overlap_comm`` off, ``overlap_comm`` on, ``offload_optimizer: cpu``
   (``pin_memory`` on CUDA) and gradient accumulation 2; first at world 1 (NCCL on CUDA, gloo on CPU), then on 2
   ranks sharing the one device (gloo; on CUDA over CUDA tensors). Each case trains two optimizer steps and checks:

   - ``reads``: ``full_tensors()`` (every strategy), ``iter_full`` and every ``ParamGrad.full_tensor()`` equal
     DeepSpeed's ``safe_get_full_grad`` for every parameter. Exactly (``torch.equal`` after casting to fp32)
     when the loss scale is 1; under fp16 loss scaling DeepSpeed's values are scaled and ours are not, so they are
     compared after dividing by the scale with the test suite's tolerance (rtol 1e-6, atol 1e-7,
     ``tests/workers/configs.py``);
   - ``transforms``: ``stats()``, ``mul_(0.5)`` and ``clip_grad_norm_`` against the same operation on the full
     tensors in stored units (elementwise results exactly, norms to rtol 1e-5, means to 1e-4, as
     ``tests/workers/transforms.py``);
   - ``set+step``: ``set_full_`` then ``engine.step()`` gives bit-identical parameters to DeepSpeed's own
     ``safe_set_full_grad`` loop then ``step()`` on the twin engine (as ``tests/workers/foundation.py``);
   - ``hook``: a ``zd.on_grads`` hook fires exactly once per accumulation boundary, with the step's gradients.

   A case that raises is recorded as failed with its message; the others still run. On 2 ranks, a case the stack
   cannot run (gloo without some collective on CUDA tensors: probed first with bare collectives) is reported as
   ``not run: <reason>`` instead of failed.
2. **Timings** at world 1, per ZeRO stage, of a transformer-like bf16 model (``zero_dtensor.bench.model``:
   hidden 2304, 16 blocks: 1.03B parameters in 198 tensors; ``--tiny``: hidden 72, 1.02M parameters, the same 198
   tensors): DeepSpeed's ``safe_get_full_grad`` and ``safe_set_full_grad`` loops, ``full_tensors()``,
   ``set_full_()``, ``clip_grad_norm_()``, ``stats()``, and the first ``sharded_grads(engine)`` of a step (a fresh
   backward before each of its repetitions). Times are synchronized (``torch.cuda.synchronize``); the peak extra CUDA
   memory of each call is ``max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus the memory allocated
   before it (n/a on CPU), for the first (warm-up) call and as the maximum over the timed repetitions.
3. A rich table on stdout; ``--json PATH`` writes the checks, timings and environment (torch, DeepSpeed and
   zero_dtensor versions, device name, CUDA/NCCL versions). Exit code 1 if any check failed or a timing raised.

``--quick`` runs a covering subset for CI (the full world-1 matrix, and at 2 ranks one case per stage and dtype
with the variants rotated); the default runs the whole matrix at both world sizes.

Running it on the GPU machine (torch 2.11 + CUDA there, no DeepSpeed, no network). Prepare the wheels here, in an
environment that already has the CPU torch (``--no-build-isolation`` keeps pip from fetching a multi-GB torch to
build DeepSpeed; ``DS_BUILD_OPS=0`` builds no ops: DeepSpeed JIT-builds what it needs, and these checks need none,
since they use ``torch_adam: true``). DeepSpeed 0.19.8 requires einops, hjson, msgpack, ninja, numpy, packaging,
psutil, py-cpuinfo, pydantic, torch, tqdm; the GPU image has all but hjson and pydantic (which needs pydantic-core,
annotated-types, typing-inspection and typing-extensions; the last is carried only for its version floor)::

    echo /.whl/ >> .git/info/exclude
    DS_BUILD_OPS=0 python -m pip wheel --no-deps --no-build-isolation --no-cache-dir deepspeed==0.19.8 -w .whl
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \\
        typing-extensions==4.16.0

(7 wheels, 4.7 MB.) Then, on the device machine, from the repository root (carrying ``.whl``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
    python3 benchmarks/gpu_check.py --json $OUT/gpu.json 2>&1 | tee $OUT/gpu.log
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import logging
import math
import os
import platform
import queue as queue_mod
import socket
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

DTYPES = ("fp32", "bf16", "fp16")
STAGES = (1, 2, 3)
VARIANTS = ("overlap off", "overlap on", "offload", "gas 2")
STEPS = 2  # optimizer steps (accumulation boundaries) per check case
CHECKS = ("reads", "transforms", "set+step", "hook")
SIZES = {"full": (2304, 16), "tiny": (72, 16)}  # (hidden, blocks) of the timing model
MULTI_RANK = 2
READ_RTOL, READ_ATOL = 1e-6, 1e-7  # fp16 reads vs DeepSpeed's scaled values (tests/workers/configs.py)
NORM_RTOL, MEAN_RTOL = 1e-5, 1e-4  # reductions in another summation order (tests/workers/transforms.py)


# --- the check matrix -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One check case: a world size, a ZeRO stage, a dtype and one variant of the configuration."""

    world: int
    stage: int
    dtype: str
    variant: str

    @property
    def name(self) -> str:
        return f"ws{self.world}-z{self.stage}-{self.dtype}-{self.variant.replace(' ', '_')}"

    @property
    def overlap_comm(self) -> bool | None:
        """``None``: DeepSpeed's default (off for ZeRO-1/2, on for ZeRO-3)."""
        return {"overlap off": False, "overlap on": True}.get(self.variant)

    @property
    def offload(self) -> bool:
        return self.variant == "offload"

    @property
    def gas(self) -> int:
        return 2 if self.variant == "gas 2" else 1


def case_matrix(worlds: tuple[int, ...] = (1, MULTI_RANK), quick: bool = False) -> list[Case]:
    """Every case the run will report, world by world. ``quick``: the multi-rank part is one case per (stage, dtype),
    with the variant rotated, so that each stage meets three of the four variants (9 cases instead of 36)."""
    cases = []
    for world in worlds:
        for stage in STAGES:
            for d, dtype in enumerate(DTYPES):
                for v, variant in enumerate(VARIANTS):
                    if quick and world > 1 and v != (stage + d) % len(VARIANTS):
                        continue
                    cases.append(Case(world, stage, dtype, variant))
    return cases


# --- runtime set-up (every process) -------------------------------------------------------------------------------
def setup_runtime(device_type: str) -> None:
    """Select DeepSpeed's accelerator before it is imported, and quiet its logging. Idempotent."""
    os.environ.setdefault("DS_ACCELERATOR", device_type)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    importlib.import_module("deepspeed")  # first imported here, after DS_ACCELERATOR is set

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if device_type == "cpu":
        # DeepSpeed's CPU accelerator refuses fp16; its loss-scaling path does not depend on the device (the test
        # suite does the same, tests/workers/common.py). On CUDA fp16 is real and nothing is patched.
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world_one(device_type: str) -> str:
    """Initialize a world-1 process group (NCCL on CUDA, gloo on CPU) unless one exists; return its backend."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise SystemExit("gpu_check runs as one process (it starts its own ranks); do not launch it with torchrun")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo",
                                       auto_mpi_discovery=False, verbose=False)
    if dist.get_world_size() != 1:
        raise SystemExit("gpu_check needs a world-1 process group in its own process")
    return str(dist.get_backend())


# --- check cases (run on every rank) -----------------------------------------------------------------------------
def small_model() -> Any:
    """The check model: odd sizes so that parameters straddle ZeRO partitions, and a bias of 1 element (smaller
    than the world size); the shapes of the test suite's ``OddModel``."""
    import torch

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(33, 50)
            self.fc2 = torch.nn.Linear(50, 17)
            self.tiny = torch.nn.Linear(17, 1)
            self.fc3 = torch.nn.Linear(17, 9)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
            return self.fc3(h) + self.tiny(h)

    return Odd()


def ds_config(case: Case, device_type: str) -> dict[str, Any]:
    """The DeepSpeed configuration of a case (torch Adam: no fused or CPU Adam op to JIT-build)."""
    zero: dict[str, Any] = {"stage": case.stage}
    if case.overlap_comm is not None:
        zero["overlap_comm"] = case.overlap_comm
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device_type == "cuda"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case.gas,
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if case.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif case.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 10}
    return config


def build_engine(case: Case, device_type: str, seed: int = 0) -> Any:
    import deepspeed
    import torch

    torch.manual_seed(seed)
    model = small_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config(case, device_type))
    return engine


def forward_backward(engine: Any, micro_step: int) -> None:
    """Rank- and step-dependent inputs, so that the averaged gradient differs from any local one."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * micro_step + dist.get_rank())
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 33, generator=g).to(device=engine.device, dtype=dtype)
    engine.backward(engine(x).float().pow(2).mean())


def fill_values(shapes: dict[str, tuple[int, ...]], boundary: int, device: Any) -> dict[str, Any]:
    """Deterministic full gradients to write, the same on every rank (realistic magnitudes: fp16 x 1024 is safe)."""
    import torch

    out = {}
    for name, shape in shapes.items():
        seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) + 7919 * boundary
        out[name] = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e-2).to(device)
    return out


def deepspeed_set_loop(engine: Any, values: dict[str, Any], case: Case) -> None:
    """DeepSpeed's own write of the same values: ``safe_set_full_grad`` per parameter, in stored (scaled) units."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_set_full_grad

    scale = float(getattr(engine.optimizer, "loss_scale", 1.0)) if case.dtype == "fp16" else 1.0
    world = dist.get_world_size()
    for name, p in engine.module.named_parameters():
        value = values[name] * scale
        if case.stage == 3:  # DeepSpeed's stage-3 set narrows past the end unless the value is padded (its bug)
            pn = p.partition_numel()
            value = torch.cat([value.reshape(-1), value.new_zeros(pn * world - value.numel())])
        safe_set_full_grad(p, value)


def params_snapshot(engine: Any) -> dict[str, Any]:
    """Full fp32 parameters (gathered under ZeRO-3), on the CPU."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().cpu().clone()
            for n, p in engine.module.named_parameters() if p.requires_grad}


def train(engine: Any, case: Case, at_boundary: Callable[[Any, int], None]) -> list[dict[str, Any]]:
    """``STEPS`` optimizer steps of ``case.gas`` micro-steps each (``step()`` after every micro-step, as a plain
    DeepSpeed loop does); ``at_boundary(engine, k)`` runs after the k-th boundary's backward. Returns the parameters
    after each boundary's step."""
    snapshots = []
    for micro in range(STEPS * case.gas):
        forward_backward(engine, micro)
        if engine.is_gradient_accumulation_boundary():
            at_boundary(engine, micro // case.gas)
            engine.step()
            snapshots.append(params_snapshot(engine))
        else:
            engine.step()
    return snapshots


def _error_text(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" [{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}]" if frames else ""
    text = f"{type(exc).__name__}: {exc}".strip()
    return (text[:600] + " ...") if len(text) > 600 else text + where


def attempt(checks: dict[str, dict[str, Any]], name: str, fn: Callable[[], dict[str, Any] | None]) -> None:
    """Run one check; record ``{"passed": bool, ...}`` under ``name`` (the message if it raised)."""
    try:
        checks[name] = {"passed": True, **(fn() or {})}
    except Exception as exc:  # noqa: BLE001 - one bad check must not hide the others
        checks[name] = {"passed": False, "error": _error_text(exc)}


def _full32(grads: Any, **kwargs: Any) -> dict[str, Any]:
    import torch

    return {n: t.clone() for n, t in grads.full_tensors(dtype=torch.float32, **kwargs).items()}


def check_reads(engine: Any, grads: Any) -> dict[str, Any]:
    """Every full read of ours equals DeepSpeed's ``safe_get_full_grad`` (cast to the stored dtype, then fp32)."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    assert list(grads.names) == list(params), (grads.names, list(params))
    scale = float(grads.loss_scale)
    exact = scale == 1.0
    refs = {n: safe_get_full_grad(p) for n, p in params.items()}
    reads = {"full_tensors": _full32(grads)}
    for strategy in ("all_gather", "all_to_all", "all_reduce"):
        reads[f"full_tensors[{strategy}]"] = _full32(grads, strategy=strategy)
    reads["iter_full"] = {n: t.to(torch.float32).clone() for n, t in grads.iter_full(bucket_bytes=4096)}
    reads["ParamGrad.full_tensor"] = {n: grads[n].full_tensor(dtype=torch.float32) for n in grads.names}
    worst = 0.0
    for name in grads.names:
        theirs = refs[name].to(grads[name].dtype).to(torch.float32) / scale
        for what, values in reads.items():
            ours = values[name]
            assert ours.shape == theirs.shape, (what, name, ours.shape, theirs.shape)
            ours = ours.to(theirs.device)
            diff = float((ours - theirs).abs().max()) if ours.numel() else 0.0
            worst = max(worst, diff)
            same = torch.equal(ours, theirs) if exact else torch.allclose(ours, theirs, rtol=READ_RTOL,
                                                                          atol=READ_ATOL)
            assert same, f"{what}: {name} differs from safe_get_full_grad (max abs diff {diff:g})"
    return {"params": len(grads.names), "reads": sorted(reads), "loss_scale": scale,
            "tolerance": "exact" if exact else f"rtol {READ_RTOL:g}, atol {READ_ATOL:g} after unscaling",
            "max_abs_diff": worst}


def _close(a: float, b: float, rtol: float, what: str) -> None:
    assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12), f"{what}: {a!r} vs {b!r}"


def check_transforms(grads: Any) -> dict[str, Any]:
    """``stats``, ``mul_`` and ``clip_grad_norm_`` against the same ops on the full tensors, in stored units."""
    import torch

    scale = float(grads.loss_scale)
    true = _full32(grads)
    # the reference in stored units: exact, because the scale is a power of two and the values came from storage
    stored = {n: (t * scale).to(grads[n].dtype) for n, t in true.items()}

    def as_true() -> dict[str, torch.Tensor]:
        return {n: t.to(torch.float32) / scale for n, t in stored.items()}

    def assert_equal(what: str) -> None:
        ours, ref = _full32(grads), as_true()
        for n in ref:
            if not torch.equal(ours[n].to(ref[n].device), ref[n]):
                diff = float((ours[n].to(ref[n].device) - ref[n]).abs().max())
                raise AssertionError(f"{what}: {n} differs from the reference (max abs diff {diff:g})")

    for n, s in grads.stats().items():
        t = true[n].double()
        _close(s.norm, float(torch.linalg.vector_norm(t)), NORM_RTOL, f"stats norm {n}")
        assert s.max_abs == float(t.abs().max()), (n, s.max_abs, float(t.abs().max()))
        _close(s.mean, float(t.mean()), MEAN_RTOL, f"stats mean {n}")
        assert s.nan_count == 0 and s.inf_count == 0 and s.numel == t.numel(), (n, s)

    grads.mul_(0.5)
    stored = {n: t.mul_(0.5) for n, t in stored.items()}
    assert_equal("mul_(0.5)")

    ref_total = float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in as_true().values()])))
    max_norm = 0.5 * ref_total
    total = grads.clip_grad_norm_(max_norm)
    _close(float(total), ref_total, NORM_RTOL, "clip_grad_norm_ total")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    stored = {n: t.mul_(coef.to(t.device)) for n, t in stored.items()}
    assert_equal("clip_grad_norm_")
    return {"ops": ["stats", "mul_(0.5)", "clip_grad_norm_"], "total_norm": ref_total}


def run_case(case: Case, device_type: str) -> dict[str, Any]:
    """One case on this rank: ``{"checks": {name: {...}}, "optimizer": str, "error": str | None, "seconds": float}``."""
    t0 = time.perf_counter()
    checks: dict[str, dict[str, Any]] = {}
    info: dict[str, Any] = {"checks": checks, "optimizer": None, "error": None}
    try:
        setup_runtime(device_type)
        import torch

        import zero_dtensor as zd

        ours = build_engine(case, device_type)
        info["optimizer"] = type(ours.optimizer).__name__
        written: dict[int, dict[str, torch.Tensor]] = {}
        current: dict[str, Any] = {}
        fired: list[tuple[int, bool]] = []

        def edit(engine: Any, boundary: int) -> None:
            grads = zd.sharded_grads(engine)
            if boundary == 0:
                attempt(checks, "reads", lambda: check_reads(engine, grads))
                attempt(checks, "transforms", lambda: check_transforms(grads))
            written[boundary] = fill_values({n: tuple(grads[n].shape) for n in grads.names}, boundary, engine.device)
            grads.set_full_(written[boundary])
            current["grads"] = grads

        def hook(grads: Any) -> None:
            fired.append((ours.micro_steps, grads is current.get("grads")))

        with zd.on_grads(ours, hook):
            mine = train(ours, case, edit)

        twin = build_engine(case, device_type)
        theirs = train(twin, case, lambda engine, boundary: deepspeed_set_loop(engine, written[boundary], case))

        def same_params() -> dict[str, Any]:
            for k, (a, b) in enumerate(zip(mine, theirs)):
                for name in a:
                    if not torch.equal(a[name], b[name]):
                        diff = float((a[name] - b[name]).abs().max())
                        raise AssertionError(f"after step {k + 1}: {name} differs from DeepSpeed's set loop + step "
                                             f"(max abs diff {diff:g})")
            assert len(mine) == len(theirs) == STEPS, (len(mine), len(theirs))
            moved = any(not torch.equal(mine[0][n], mine[1][n]) for n in mine[0])
            assert moved, "the parameters did not change between the steps"
            return {"steps": STEPS, "tolerance": "exact"}

        def hook_fired() -> dict[str, Any]:
            expected = [((k + 1) * case.gas - 1, True) for k in range(STEPS)]
            assert fired == expected, f"hook calls (micro step, same grads object) {fired}, expected {expected}"
            return {"fired": len(fired), "boundaries": STEPS}

        attempt(checks, "set+step", same_params)
        attempt(checks, "hook", hook_fired)
    except Exception as exc:  # noqa: BLE001 - recorded; the next case still runs
        info["error"] = _error_text(exc)
    finally:
        gc.collect()
    info["seconds"] = time.perf_counter() - t0
    return info


def merge_ranks(case: Case, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for a case from every rank's answer: passed only if every check passed on every rank."""
    checks: dict[str, dict[str, Any]] = {}
    errors = [f"rank {r}: {a['error']}" for r, a in enumerate(per_rank) if a.get("error")]
    for name in CHECKS:
        answers = [a["checks"].get(name) for a in per_rank]
        if any(x is None for x in answers):
            checks[name] = {"passed": False, "error": "not reached"}
            continue
        failed = [f"rank {r}: {x.get('error')}" for r, x in enumerate(answers) if not x["passed"]]
        checks[name] = dict(answers[0], passed=not failed, **({"error": "; ".join(failed)} if failed else {}))
    passed = not errors and all(c["passed"] for c in checks.values())
    return {
        "case": case.name, **dataclasses.asdict(case), "overlap_comm": case.overlap_comm, "offload": case.offload,
        "gas": case.gas, "status": "passed" if passed else "failed", "reason": "; ".join(errors) or None,
        "optimizer": per_rank[0].get("optimizer"), "checks": checks,
        "seconds": max(a.get("seconds", 0.0) for a in per_rank),
    }


def not_run(case: Case, reason: str) -> dict[str, Any]:
    return {"case": case.name, **dataclasses.asdict(case), "overlap_comm": case.overlap_comm,
            "offload": case.offload, "gas": case.gas, "status": "not run", "reason": reason, "optimizer": None,
            "checks": {}, "seconds": 0.0}


# --- several ranks on the one device ------------------------------------------------------------------------------
# probed collectives the checks do not use (zero_dtensor's dst= reads): their absence stops nothing
OPTIONAL_COLLECTIVES = ("reduce", "gather")
STACK_LIMITS = ("not supported", "unsupported", "not implemented", "no backend type associated", "does not support")


def is_stack_limitation(message: str) -> bool:
    """An error that says the backend cannot do something on this device (not a wrong result)."""
    low = message.lower()
    return any(s in low for s in STACK_LIMITS) and ("gloo" in low or "backend" in low or "cuda" in low)


def probe_collectives(device: Any) -> dict[str, str]:
    """The bare collectives DeepSpeed and zero_dtensor use, on ``device`` tensors: ``{op: "ok" | error}``."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((8 * world,), float(rank + 1), device=device)
    out = torch.empty(8 * world * world, device=device)

    def coalesced_all_gather() -> None:
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(out, x, async_op=True)
        cm.wait()

    ops: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_reduce max": lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX),
        "broadcast": lambda: dist.broadcast(x.clone(), src=0),
        "all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)], x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "coalesced all_gather_into_tensor": coalesced_all_gather,
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8, device=device), x),
        "reduce": lambda: dist.reduce(x.clone(), dst=0),
        "gather": lambda: dist.gather(x.clone(), [torch.empty_like(x) for _ in range(world)] if rank == 0 else None,
                                      dst=0),
        "barrier": lambda: dist.barrier(),
    }
    results = {}
    for name, op in ops.items():
        try:
            op()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, decides what can run
            results[name] = _error_text(exc)
    return results


def rank_main(rank: int, world: int, port: int, device_type: str, cases: list[Case], answers: Any) -> None:
    """A spawned rank: a gloo process group on the shared device, the probe, then every case in order."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      LOCAL_RANK="0")  # every rank on device 0: DeepSpeed picks its device from LOCAL_RANK
    try:
        setup_runtime(device_type)
        import datetime

        import deepspeed
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if device_type == "cuda":
            torch.cuda.set_device(0)
        # gloo, initialized here rather than by DeepSpeed, which would bind the group to cuda:LOCAL_RANK
        # a collective one rank never joins raises after a minute instead of hanging the run
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        probe = probe_collectives(device)
        answers.put((rank, "ready", probe))
    except BaseException:  # noqa: BLE001 - reported to the parent
        answers.put((rank, "start failed", traceback.format_exc()[-1500:]))
        return
    for case in cases:
        answers.put((rank, "case", (case.name, run_case(case, device_type))))
    answers.put((rank, "done", None))
    dist.destroy_process_group()


class RankGroup:
    """``world`` spawned processes running :func:`rank_main` on a list of cases; answers read with deadlines."""

    def __init__(self, world: int, device_type: str, cases: list[Case]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # CUDA cannot be forked; spawn works everywhere
        port = free_port()
        self.world = world
        self.answers = ctx.Queue()
        self.backlog: list[tuple[int, str, Any]] = []  # answers read ahead, for later collect() calls
        self.later: list[tuple[int, str, Any]] = []
        self.procs = [ctx.Process(target=rank_main, args=(r, world, port, device_type, cases, self.answers),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def collect(self, kind: str, timeout: float, key: str | None = None) -> dict[int, tuple[str, Any]]:
        """Each rank's next answer (of ``kind``; for ``"case"``, the one for case ``key``), or what it sent
        instead. Ranks that say nothing within ``timeout`` seconds, or died, are missing from the result."""
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world and time.monotonic() < deadline:
            try:
                rank, what, payload = self.backlog.pop(0) if self.backlog else self.answers.get(timeout=1.0)
            except queue_mod.Empty:
                if any(not p.is_alive() for r, p in enumerate(self.procs) if r not in got):
                    deadline = min(deadline, time.monotonic() + 5.0)  # a rank died: give the others a moment
                continue
            if rank in got:  # this rank is ahead of the others: keep its answer for the next call
                self.later.append((rank, what, payload))
                continue
            if what == "case" and key is not None and payload[0] != key:
                continue  # a late answer for an earlier case
            got[rank] = (what, payload)
            if what != kind:
                deadline = min(deadline, time.monotonic() + 5.0)
        self.backlog, self.later = self.later + self.backlog, []
        return got

    def close(self, finished: bool) -> None:
        """Join the ranks (they exit by themselves after the last case), killing any still alive."""
        for p in self.procs:
            p.join(timeout=10.0 if finished else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)


def run_multi_rank(cases: list[Case], world: int, device_type: str, case_timeout: float, start_timeout: float,
                   progress: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run ``cases`` on ``world`` spawned ranks sharing the device. A hung or crashed case fails alone: the ranks
    are restarted for the rest. Returns the case records and what the probe found."""
    records: dict[str, dict[str, Any]] = {}
    probe_info: dict[str, Any] = {"world": world, "backend": "gloo", "tensors": device_type}
    remaining = list(cases)
    degraded = ""  # what the probe found missing, once it did
    while remaining:
        progress(f"starting {world} gloo ranks on the {device_type} device")
        group = RankGroup(world, device_type, remaining)
        try:
            ready = group.collect("ready", start_timeout)
            failed = {r: p for r, (w, p) in ready.items() if w != "ready"}
            if failed or len(ready) < world:
                why = "; ".join(f"rank {r}: {str(p).strip().splitlines()[-1]}" for r, p in failed.items()) \
                    or f"ranks did not start within {start_timeout:.0f} s"
                probe_info["start_error"] = why
                for case in remaining:
                    records[case.name] = not_run(case, f"{world} gloo ranks on one {device_type} device did not "
                                                       f"start: {why}")
                return [records[c.name] for c in cases], probe_info
            probe_info["collectives"] = probe = ready[0][1]
            missing = {op: err for op, err in probe.items() if err != "ok" and op not in OPTIONAL_COLLECTIVES}
            if missing and not degraded:
                # the stack lacks collectives the engines need: try one case per stage, report the rest as not run
                degraded = "; ".join(f"{op}: {err}" for op, err in missing.items())
                probe_info["degraded"] = degraded
                sample = [next(c for c in remaining if c.stage == stage) for stage in STAGES
                          if any(c.stage == stage for c in remaining)]
                for case in remaining:
                    if case not in sample:
                        records[case.name] = not_run(case, f"gloo on {device_type} tensors lacks a collective: "
                                                           f"{degraded}")
                remaining = sample
                case_timeout = min(case_timeout, 60.0)
                continue  # restart the ranks on the sample only (finally: closes these)
            while remaining:
                case = remaining.pop(0)
                progress(case.name)
                got = group.collect("case", case_timeout, key=case.name)
                if len(got) == world and all(w == "case" for w, _ in got.values()):
                    record = classify(case, merge_ranks(case, [got[r][1][1] for r in range(world)]))
                    if degraded and record["status"] == "failed":
                        record = dict(not_run(case, f"{record['reason'] or 'a check failed'}; the probe had found "
                                                    f"gloo on {device_type} tensors lacking: {degraded}"),
                                      checks=record["checks"])
                    records[case.name] = record
                    continue
                silent = sorted(set(range(world)) - set(got))
                other = {r: w for r, (w, _) in got.items() if w != "case"}
                why = (f"ranks {silent} gave no answer within {case_timeout:g} s (a hang in a collective, or a "
                       "crash)" if silent else f"ranks answered {other} instead of a result")
                records[case.name] = (not_run(case, f"{why}; the probe had found gloo on {device_type} tensors "
                                                    f"lacking: {degraded}") if degraded
                                      else dict(not_run(case, ""), status="failed", reason=why + "; ranks restarted"))
                break  # restart the ranks for the rest
        finally:
            group.close(finished=not remaining)
    return [records[c.name] for c in cases], probe_info


def classify(case: Case, record: dict[str, Any]) -> dict[str, Any]:
    """A failed multi-rank case whose errors say the backend cannot do it becomes ``not run``, keeping the checks."""
    if record["status"] != "failed":
        return record
    reasons = " ".join([record["reason"] or ""] + [c.get("error", "") for c in record["checks"].values()]).strip()
    if not is_stack_limitation(reasons):
        return record
    return dict(not_run(case, f"the stack cannot run it: {reasons[:500]}"), checks=record["checks"])


# --- timings (world 1) --------------------------------------------------------------------------------------------
def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample(fn: Callable[[], Any], device: Any) -> tuple[float, int | None]:
    """``(seconds, peak extra bytes)`` of one synchronized call; the bytes are None off CUDA."""
    import torch

    cuda = device.type == "cuda"
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = int(torch.cuda.max_memory_allocated(device) - base) if cuda else None
    del result
    return seconds, peak


def summarize(row: str, stage: int, first: tuple[float, int | None], rest: list[tuple[float, int | None]],
              collectives: int | None = None) -> dict[str, Any]:
    times = [t for t, _ in rest]
    peaks = [m for _, m in rest if m is not None]
    return {
        "stage": stage, "row": row, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times), "first_ms": 1e3 * first[0], "repeat": len(times),
        "peak_first_bytes": first[1], "peak_bytes": max(peaks) if peaks else None, "collectives": collectives,
    }


def measure(row: str, stage: int, fn: Callable[[], Any], repeat: int, device: Any) -> dict[str, Any]:
    """One warm-up call (reported as ``first``), then ``repeat`` timed calls; collectives counted in a separate call."""
    from torch.distributed.tensor.debug import CommDebugMode

    first = sample(fn, device)
    with CommDebugMode() as mode:
        fn()
    rest = [sample(fn, device) for _ in range(repeat)]
    return summarize(row, stage, first, rest, int(mode.get_total_counts()))


def timing_model(hidden: int, layers: int, device: Any) -> Any:
    import torch

    from zero_dtensor.bench.model import TransformerLike

    torch.manual_seed(0)
    with torch.device(device):
        return TransformerLike(hidden, layers)


def time_stage(stage: int, hidden: int, layers: int, repeat: int, ds_repeat: int, device_type: str,
               progress: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The timing rows of one ZeRO stage on the bf16 transformer-like model, and facts about the engine."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    import zero_dtensor as zd

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-6, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    model = timing_model(hidden, layers, device)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    x = torch.randn(2, 8, hidden, generator=torch.Generator().manual_seed(0)).to(device=engine.device,
                                                                                  dtype=torch.bfloat16)

    def backward() -> None:
        engine.backward(engine(x).float().pow(2).mean())

    rows = []
    progress(f"timing ZeRO-{stage}: first sharded_grads of a step")
    firsts = []
    for _ in range(repeat + 1):  # a fresh backward (and a step after) around every call
        backward()
        firsts.append(sample(lambda: zd.sharded_grads(engine), device))
        engine.step()
    rows.append(summarize("first sharded_grads() of a step", stage, firsts[0], firsts[1:], 0))

    backward()
    grads = zd.sharded_grads(engine)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    world = dist.get_world_size()
    progress(f"timing ZeRO-{stage}: DeepSpeed get loop")
    rows.append(measure("ds safe_get_full_grad loop", stage, lambda: {n: safe_get_full_grad(p) for n, p in named},
                        ds_repeat, device))
    progress(f"timing ZeRO-{stage}: full_tensors")
    rows.append(measure("full_tensors()", stage, lambda: grads.full_tensors(), repeat, device))
    values = {n: t.clone() for n, t in grads.full_tensors().items()}  # writing them back changes nothing
    ds_values = {}
    for n, p in named:
        v = values[n]
        if stage == 3:
            pad = p.partition_numel() * world - v.numel()
            v = torch.cat([v.reshape(-1), v.new_zeros(pad)]) if pad else v
        ds_values[n] = v

    def ds_set() -> None:
        for n, p in named:
            safe_set_full_grad(p, ds_values[n])

    progress(f"timing ZeRO-{stage}: set loops, clip, stats")
    rows.append(measure("ds safe_set_full_grad loop", stage, ds_set, ds_repeat, device))
    rows.append(measure("set_full_()", stage, lambda: grads.set_full_(values), repeat, device))
    rows.append(measure("clip_grad_norm_()", stage, lambda: grads.clip_grad_norm_(1e30), repeat, device))
    rows.append(measure("stats()", stage, lambda: grads.stats(), repeat, device))
    facts = {
        "optimizer": type(engine.optimizer).__name__, "params": sum(p.numel for p in grads.layout.params),
        "tensors": len(grads.layout.params), "stored_dtype": str(grads.local_partitions[0].dtype),
        "stored_bytes": sum(t.numel() * t.element_size() for t in grads.local_partitions),
    }
    by = {r["row"]: r for r in rows}
    base = {"full_tensors()": "ds safe_get_full_grad loop", "set_full_()": "ds safe_set_full_grad loop"}
    for r in rows:
        if r["row"] in base:
            r["speedup_vs_deepspeed"] = by[base[r["row"]]]["median_ms"] / r["median_ms"]
        elif r["row"] == "clip_grad_norm_()":  # DeepSpeed's way to clip: get every gradient, then set it back
            r["speedup_vs_deepspeed"] = (by["ds safe_get_full_grad loop"]["median_ms"]
                                         + by["ds safe_set_full_grad loop"]["median_ms"]) / r["median_ms"]
        else:
            r["speedup_vs_deepspeed"] = None
    engine.step()
    return rows, facts  # the engine goes with this frame: the caller frees the memory


# --- environment, presentation ------------------------------------------------------------------------------------
def environment(device_type: str, backend: str) -> dict[str, Any]:
    import deepspeed
    import torch

    import zero_dtensor as zd

    env: dict[str, Any] = {
        "device_type": device_type, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "zero_dtensor": zd.__version__,
        "backend_world_1": backend, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        env.update(device_name=props.name, device_memory_bytes=int(props.total_memory), cuda=torch.version.cuda,
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                   capability=f"{props.major}.{props.minor}", device_count=torch.cuda.device_count())
    else:
        env.update(device_name=platform.processor() or platform.machine() or "cpu")
    return env


def fmt_bytes(n: float | None) -> str:
    from zero_dtensor.bench.common import fmt_bytes

    return "n/a" if n is None else fmt_bytes(n)


def render(results: dict[str, Any], console: Any) -> None:
    """One table: a section of check results (stages as columns), a section of timings (stages as columns)."""
    from rich.markup import escape
    from rich.table import Table

    env = results["environment"]
    table = Table(title=escape(f"gpu_check on {env['device_name']} ({env['device_type']}): torch {env['torch']}, "
                               f"DeepSpeed {env['deepspeed']}"), title_justify="left")
    table.add_column("part")
    table.add_column("case / call")
    for stage in STAGES:
        table.add_column(f"ZeRO-{stage}", justify="right")
    by_case = {(c["world"], c["stage"], c["dtype"], c["variant"]): c for c in results["checks"]}
    for world in sorted({c["world"] for c in results["checks"]}):
        for dtype in DTYPES:
            for variant in VARIANTS:
                cells = []
                for stage in STAGES:
                    c = by_case.get((world, stage, dtype, variant))
                    if c is None:
                        cells.append("[dim]-[/dim]")
                    elif c["status"] == "passed":
                        cells.append("[green]pass[/green]")
                    elif c["status"] == "not run":
                        cells.append("[yellow]not run[/yellow]")
                    else:
                        bad = (["error"] if c["reason"] else []) + [
                            k for k, v in c["checks"].items()
                            if not v.get("passed") and v.get("error") != "not reached"]
                        cells.append(f"[red]FAIL {escape(','.join(bad))}[/red]")
                if any(cell != "[dim]-[/dim]" for cell in cells):
                    table.add_row(f"checks, {world} rank{'s' if world > 1 else ''}", f"{dtype}, {variant}", *cells)
    if results["timings"]:
        table.add_section()
        model = results["timing_model"]
        label = f"timing, 1 rank, {model['params'] / 1e6:.1f}M bf16 / {model['tensors']} tensors"
        rows = list(dict.fromkeys(r["row"] for r in results["timings"]))
        by_row = {(r["row"], r["stage"]): r for r in results["timings"]}
        for i, row in enumerate(rows):
            cells = []
            for stage in STAGES:
                r = by_row.get((row, stage))
                if r is None:
                    cells.append("-")
                elif "error" in r:
                    cells.append("[red]error[/red]")
                else:
                    speed = f" {r['speedup_vs_deepspeed']:.1f}x" if r.get("speedup_vs_deepspeed") else ""
                    cells.append(f"{r['median_ms']:.2f} ms{speed} · {fmt_bytes(r['peak_bytes'])}")
            table.add_row(label if i == 0 else "", escape(row), *cells)
    console.print(table)
    s = results["summary"]
    console.print(f"checks: {s['passed']} passed, {s['failed']} failed, {s['not_run']} not run"
                  + (f"; timing errors: {s['timing_errors']}" if s["timing_errors"] else ""))
    console.print("[dim]timing cells: median ms over the repetitions, speed-up over DeepSpeed's loop (clip: over its "
                  "get + set loops), peak extra CUDA memory of a call after the first (n/a on CPU); the JSON also "
                  "has min/max, the first call, and collectives counted with CommDebugMode.[/dim]")
    for c in results["checks"]:
        if c["status"] != "passed":
            details = [f"{k}: {v['error']}" for k, v in c["checks"].items() if not v.get("passed")]
            text = "; ".join(([c["reason"]] if c["reason"] else []) + details)
            console.print(f"[{'yellow' if c['status'] == 'not run' else 'red'}]{c['case']} {c['status']}[/]: "
                          f"{escape(text)}")
    for r in results["timings"]:
        if "error" in r:
            console.print(f"[red]timing ZeRO-{r['stage']} failed[/red]: {escape(r['error'])}")


# --- command line -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py",
        description="Check zero_dtensor against DeepSpeed on one device (world 1, then 2 ranks sharing it) and time "
                    "it on a ~1B-parameter bf16 model. Exit code 1 if a check fails.")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--tiny", action="store_true", help="a ~1M-parameter timing model (same 198 tensors): CI smoke")
    p.add_argument("--quick", action="store_true", help="the 2-rank part as a 9-case covering subset (CI)")
    p.add_argument("--json", metavar="PATH", help="write checks, timings and environment as JSON")
    p.add_argument("--skip-timing", action="store_true", help="checks only")
    p.add_argument("--skip-checks", action="store_true", help="timings only")
    p.add_argument("--ranks", type=int, default=MULTI_RANK,
                   help=f"ranks sharing the device for the multi-rank checks (0: none). Default {MULTI_RANK}")
    p.add_argument("--timing-stages", default="1,2,3", help="ZeRO stages to time. Default 1,2,3")
    p.add_argument("--hidden", type=int, help="timing model hidden size (default 2304; --tiny 72)")
    p.add_argument("--layers", type=int, help="timing model blocks, 12 tensors each (default 16)")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per row after a warm-up. Default 5")
    p.add_argument("--ds-repeat", type=int, default=3, help="repetitions of DeepSpeed's loops. Default 3")
    p.add_argument("--case-timeout", type=float, default=120.0,
                   help="seconds a multi-rank case may take before its ranks are killed. Default 120")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    hidden, layers = SIZES["tiny" if args.tiny else "full"]
    args.hidden, args.layers = args.hidden or hidden, args.layers or layers
    args.timing_stages = [int(s) for s in str(args.timing_stages).split(",") if s.strip()]
    if any(s not in STAGES for s in args.timing_stages):
        p.error("--timing-stages takes 1, 2 and/or 3")
    return args


def pick_device(requested: str | None) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    device_type = pick_device(args.device)
    console = Console(width=None if sys.stdout.isatty() else 160)
    errors = Console(stderr=True)
    started = time.perf_counter()

    def progress(what: str) -> None:
        if not args.quiet:
            errors.print(f"[dim]{time.perf_counter() - started:7.1f}s  {escape_text(what)}[/dim]", highlight=False)

    setup_runtime(device_type)
    backend = init_world_one(device_type)
    results: dict[str, Any] = {
        "command": " ".join(["python benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "environment": environment(device_type, backend),
        "config": {"tiny": args.tiny, "quick": args.quick, "ranks": args.ranks, "steps_per_case": STEPS,
                   "hidden": args.hidden, "layers": args.layers, "repeat": args.repeat, "ds_repeat": args.ds_repeat,
                   "timing_stages": args.timing_stages},
        "checks": [], "multi_rank": None, "timings": [], "timing_model": None, "summary": None, "partial": True,
    }

    def dump() -> None:
        """Write the JSON after every part, so that a run killed at its time limit still leaves what it did."""
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2, default=str)
    if not args.skip_checks:
        worlds = (1,) + ((args.ranks,) if args.ranks > 1 else ())
        cases = case_matrix(worlds, quick=args.quick)
        for case in (c for c in cases if c.world == 1):
            progress(case.name)
            results["checks"].append(merge_ranks(case, [run_case(case, device_type)]))
        dump()
        multi = [c for c in cases if c.world > 1]
        if multi:
            records, probe = run_multi_rank(multi, args.ranks, device_type, args.case_timeout, 180.0, progress)
            results["checks"] += records
            results["multi_rank"] = probe
            dump()
    if not args.skip_timing:
        import torch

        from zero_dtensor.bench.model import count

        params, tensors = count(args.hidden, args.layers)
        results["timing_model"] = {"hidden": args.hidden, "layers": args.layers, "params": params,
                                   "tensors": tensors, "dtype": "bf16", "world": 1, "backend": backend}
        for stage in args.timing_stages:
            try:
                rows, facts = time_stage(stage, args.hidden, args.layers, args.repeat, args.ds_repeat, device_type,
                                         progress)
                results["timings"] += rows
                results["timing_model"][f"zero{stage}"] = facts
            except Exception as exc:  # noqa: BLE001 - recorded; the other stages still run
                results["timings"].append({"stage": stage, "row": "(stage failed)", "error": _error_text(exc)})
            gc.collect()  # the stage's engine and buffers, before the next stage builds its own
            if device_type == "cuda":
                torch.cuda.empty_cache()
            dump()
    statuses = [c["status"] for c in results["checks"]]
    results["summary"] = {
        "passed": statuses.count("passed"), "failed": statuses.count("failed"),
        "not_run": statuses.count("not run"), "timing_errors": sum("error" in r for r in results["timings"]),
        "elapsed_s": time.perf_counter() - started,
    }
    results["summary"]["ok"] = not results["summary"]["failed"] and not results["summary"]["timing_errors"]
    results["partial"] = False
    render(results, console)
    dump()
    return 0 if results["summary"]["ok"] else 1


def escape_text(text: str) -> str:
    from rich.markup import escape

    return escape(text)


if __name__ == "__main__":
    sys.exit(main())
