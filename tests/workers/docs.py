"""The README's Python blocks, run on a ZeRO-2 engine whose model has the names they use (``fc1``).

Each block is marked in the README by the loop it belongs to (``<!-- readme-block: KIND -->``); each kind runs as
that loop would run it: ``plain`` between ``engine.backward`` and ``engine.step`` (the block calls both), ``hook``
registered before a backward and step the worker runs, ``checkpoint`` between steps, ``lightning`` as the callbacks
of a real Lightning fit (``tests/workers/lightning.py``)."""

from __future__ import annotations

import os
from typing import Any

import torch
from deepspeed.utils import safe_get_full_grad

from .common import EngineCase, build_engine, batch


def _engine_recording_its_step() -> tuple[Any, torch.Tensor, dict[str, torch.Tensor]]:
    """A ZeRO-2 engine, a loss (forward only), and the dict its ``step`` fills with what the optimizer step reads,
    read through DeepSpeed's own API."""
    engine = build_engine(EngineCase(2))
    loss = engine(batch(engine)).float().pow(2).mean()
    seen: dict[str, torch.Tensor] = {}
    original_step = engine.step

    def step(*args, **kwargs):
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                seen[name] = safe_get_full_grad(p)
        return original_step(*args, **kwargs)

    engine.step = step
    return engine, loss, seen


def run_readme_block(block: str) -> None:
    """``block`` with ``engine`` and ``loss`` defined, as the README assumes; the gradient it leaves for the step
    equals DeepSpeed's clamped one."""
    engine, loss, seen = _engine_recording_its_step()
    namespace = {"engine": engine, "loss": loss}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert seen, "the block never reached engine.step()"
    full = namespace.get("full")
    if full is not None:  # the clamp example: the step read the clamped gradient
        assert all(torch.equal(seen[n], full[n].clamp(-1, 1)) for n in full)


def run_readme_hook_block(block: str) -> None:
    """``block`` registers a hook on ``engine``; a backward and a step run it once. What it recorded in ``results``
    (``full``, taken after its clip) is what the optimizer step read, and that gradient's norm is the clip's bound."""
    import zero_dtensor as zd

    engine, loss, seen = _engine_recording_its_step()
    namespace: dict[str, Any] = {"engine": engine}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    handles = [v for v in namespace.values() if isinstance(v, zd.GradHookHandle)]
    assert len(handles) == 1, "the block registers one hook"
    engine.backward(loss)
    engine.step()
    assert handles[0].boundaries == 1 and seen, "the hook did not run at the boundary"
    results = namespace["results"]
    assert set(results["norms"]) == set(seen)
    assert all(torch.equal(seen[n], results["full"][n]) for n in seen), "the step did not read the hook's gradient"
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in seen.values()]))
    assert float(total) <= 1.0 + 1e-5, float(total)
    handles[0].remove()


def run_readme_checkpoint_block(block: str, checkpoint_dir: str) -> None:
    """``block`` saves and loads a stepped engine in ``checkpoint_dir``: the checkpoint is finished (DCP's
    ``.metadata``) and the load leaves the fp32 masters as saved."""
    import zero_dtensor as zd

    engine, loss, _ = _engine_recording_its_step()
    engine.backward(loss)
    engine.step()
    before = {n: t.clone() for n, t in zd.get_full_fp32_params(engine).items()}
    exec(compile(block, "README.md", "exec"), {"zd": zd, "engine": engine, "checkpoint_dir": checkpoint_dir})  # noqa: S102
    assert os.path.exists(os.path.join(checkpoint_dir, ".metadata"))
    after = zd.get_full_fp32_params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)


def run_readme_lightning_block(block: str) -> dict[str, int]:
    """``block`` makes ``ZeroGradCallback``s; one Lightning fit (ZeRO-2) with all of them: each ran at every
    accumulation boundary. Returns ``{callback variable: boundaries}``."""
    from zero_dtensor.lightning import ZeroGradCallback

    from . import lightning as lw

    namespace: dict[str, Any] = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    callbacks = {k: v for k, v in namespace.items() if isinstance(v, ZeroGradCallback)}
    assert callbacks, "the block makes no ZeroGradCallback"
    with lw.process_state_kept():
        trainer = lw._trainer(2, list(callbacks.values()), log_every=1)
        trainer.fit(lw.Net(), lw.loader_of_this_rank())
    return {k: v.boundaries for k, v in callbacks.items()}
