"""Workers of tests/test_nan_max.py: a nan on one rank's shard survives every maximum over the ranks."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import zero_dtensor as zd
from zero_dtensor.comm import collectives

from .common import EngineCase, build_engine, forward_backward


def check_max_keeps_nan() -> list[bool]:
    """``all_reduce_small(MAX)`` of a 4-vector where rank ``r`` holds a nan at position ``r`` (``r`` < 4), the rest
    ``1 + r``: per position whether it came back nan (every one must), then the maximum of a nan-free vector."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), 1.0 + rank, dtype=torch.float64)
    if rank < 4:
        t[rank] = math.nan
    collectives.all_reduce_small(t, dist.group.WORLD, dist.ReduceOp.MAX)
    clean = torch.tensor([1.0 + rank, -float(rank), 0.5], dtype=torch.float32)
    collectives.all_reduce_small(clean, dist.group.WORLD, dist.ReduceOp.MAX)
    assert clean.tolist() == [float(world), 0.0, 0.5], clean
    return [bool(v) for v in torch.isnan(t)]


def check_inf_norms_keep_a_nan(case: EngineCase, victim: int) -> dict:
    """A nan written into ``fc1.weight``'s shard on rank ``victim`` only: ``norms(inf)``, ``global_norm(inf)``
    and ``clip_per_param_`` / ``clip_grad_norm_(norm_type=inf, error_if_nonfinite=True)`` see it on every rank
    (the clip raises, nothing is scaled)."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    name = "fc1.weight"
    if dist.get_rank() == victim:
        local = grads[name].to_local()
        assert local.numel(), "the victim rank must hold part of the parameter"
        local.view(-1)[-1] = math.nan
    before = grads.full_tensors()
    out = {"norm": float(grads.norms(math.inf)[name]), "global": float(grads.global_norm(math.inf))}
    try:
        grads.clip_grad_norm_(1e-3, math.inf, error_if_nonfinite=True)
        out["clip"] = "returned"
    except RuntimeError as exc:
        out["clip"] = "raised" if "non-finite" in str(exc) else str(exc)
    after = grads.full_tensors()
    out["unchanged"] = all(torch.equal(before[n].nan_to_num(), after[n].nan_to_num()) for n in before)
    return out
