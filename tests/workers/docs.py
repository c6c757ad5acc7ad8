"""The README's Python blocks, run on a ZeRO-2 engine whose model has the names they use (``fc1``)."""

from __future__ import annotations

import torch
from deepspeed.utils import safe_get_full_grad

from .common import EngineCase, build_engine, batch


def run_readme_block(block: str) -> None:
    """``block`` with ``engine`` and ``loss`` defined, as the README assumes; the gradient it leaves for the step
    equals DeepSpeed's clamped one."""
    engine = build_engine(EngineCase(2))
    loss = engine(batch(engine)).float().pow(2).mean()
    seen: dict[str, torch.Tensor] = {}
    original_step = engine.step

    def step(*args, **kwargs):  # what the optimizer step will read, read through DeepSpeed's own API
        for name, p in engine.module.named_parameters():
            if p.requires_grad:
                seen[name] = safe_get_full_grad(p)
        return original_step(*args, **kwargs)

    engine.step = step
    namespace = {"engine": engine, "loss": loss}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert seen, "the block never reached engine.step()"
    full = namespace.get("full")
    if full is not None:  # the clamp example: the step read the clamped gradient
        assert all(torch.equal(seen[n], full[n].clamp(-1, 1)) for n in full)
