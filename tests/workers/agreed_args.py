"""Issue 51, items 1 and 5, worker side.

1. ``clip_grad_norm_`` / ``clip_per_param_`` agree on ``max_norm`` (bit for bit) and ``error_if_nonfinite``: one rank's
   ``max_norm`` one ulp above the others', or ``error_if_nonfinite=True`` on one rank only, raises
   ``RankDisagreementError`` on every rank and nothing is written; the agreeing call then clips as torch's formula
   does on the full tensors DeepSpeed returns.
5. ``set_full_`` with a value that is a view of the family's own partition at another offset (partly overlapping
   the fragment it is written into) stages the value and writes it, on every rank: the parameter then holds the
   value (as DeepSpeed's ``safe_get_full_*`` reads it), nothing else changed.

Outcomes that may differ between ranks are exchanged with one ``all_gather_object`` so that a rank raising alone
fails the row instead of hanging its peers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

import zero_dtensor as zd

from .common import EngineCase, build_engine, forward_backward
from .rows import Rows


def _last() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def _snapshot(*families: Any) -> list[torch.Tensor]:
    """Copies of every family's local partitions (DeepSpeed's memory: the views alias it)."""
    return [p.clone() for fam in families for p in fam.local_partitions]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def _outcomes(call: Callable[[], Any]) -> list[str | None]:
    """Every rank's outcome of ``call()``: ``None`` where it returned, else the exception's class and message."""
    try:
        call()
        mine: str | None = None
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        mine = f"{type(exc).__name__}: {exc}"
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _raises_everywhere(call: Callable[[], Any], families: tuple[Any, ...], argument: str) -> None:
    """``call()`` raises ``RankDisagreementError`` on every rank, its message listing each rank's ``argument``, and
    nothing is written."""
    before = _snapshot(*families)
    every = _outcomes(call)
    assert all(o is not None and o.startswith("RankDisagreementError") for o in every), every
    assert all(o.count(f"{argument}=") >= dist.get_world_size() for o in every), every
    assert _same(before, _snapshot(*families)), "something was written"


def _reference(engine: Any) -> dict[str, torch.Tensor]:
    return {n: safe_get_full_grad(p).float() for n, p in engine.module.named_parameters() if p.requires_grad}


def _clip_max_norm(grads: Any, engine: Any) -> None:
    full = _reference(engine)
    total = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in full.values()])))
    max_norm = total / 3  # clips: the coefficient is about 1/3
    mine = math.nextafter(max_norm, math.inf) if _last() else max_norm  # one ulp apart
    _raises_everywhere(lambda: grads.clip_grad_norm_(mine), (grads,), "max_norm")
    returned = grads.clip_grad_norm_(max_norm)  # the agreeing call: torch's formula on DeepSpeed's full gradients
    assert math.isclose(float(returned), total, rel_tol=1e-5), (float(returned), total)
    coef = min(max_norm / (float(returned) + 1e-6), 1.0)
    after = _reference(engine)
    for n, g in full.items():
        torch.testing.assert_close(after[n], g * coef, rtol=1e-5, atol=1e-7)


def _clip_error_flag(grads: Any, engine: Any) -> None:
    del engine
    flag = _last()  # True on one rank only
    _raises_everywhere(lambda: grads.clip_grad_norm_(1e9, error_if_nonfinite=flag), (grads,),
                       "error_if_nonfinite")


def _clip_per_param(grads: Any, engine: Any) -> None:
    full = _reference(engine)
    norms = {n: float(torch.linalg.vector_norm(g)) for n, g in full.items()}
    max_norm = min(v for v in norms.values() if v > 0) * 2  # clips some parameters, not all
    mine = math.nextafter(max_norm, -math.inf) if _last() else max_norm
    _raises_everywhere(lambda: grads.clip_per_param_(mine), (grads,), "max_norm")
    returned = grads.clip_per_param_(max_norm)
    after = _reference(engine)
    for n, g in full.items():
        assert math.isclose(float(returned[n]), norms[n], rel_tol=1e-5, abs_tol=1e-7), n
        coef = min(max_norm / (float(returned[n]) + 1e-6), 1.0)
        torch.testing.assert_close(after[n], g * coef, rtol=1e-5, atol=1e-7)


def _aliasing_candidate(fam: Any) -> tuple[str, int, int] | None:
    """On this rank: ``(name, group, start)`` of a parameter whose fragment here has 2 or more elements, such that
    the partition slice ``[start, start + numel)`` taken as the parameter's value puts the fragment's source one
    element after its destination (a partial overlap) and fits in the partition. ``None`` if no parameter does."""
    for name in fam.names:
        view = fam[name]
        lo, hi = view.local_range
        if hi - lo < 2:
            continue
        part = fam.local_partitions[view.group]
        offset = (view.to_local().data_ptr() - part.data_ptr()) // part.element_size()
        start = offset + 1 - lo
        if start >= 0 and start + view.numel <= part.numel():
            return name, view.group, start
    return None


def _set_full_aliasing(fam: Any, engine: Any, truth: Callable[[Any], torch.Tensor]) -> None:
    candidates: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(candidates, _aliasing_candidate(fam))
    holder = next(r for r, c in enumerate(candidates) if c is not None)
    name, group, start = candidates[holder]
    shape = fam[name].shape
    before = fam.full_tensors(dtype=torch.float32)
    if dist.get_rank() == holder:
        value = fam.local_partitions[group][start:start + fam[name].numel].view(shape)  # the partition itself
        content = value.clone()
    else:
        content = value = torch.empty(shape, dtype=fam[name].dtype)
    dist.broadcast(content, holder)  # every rank passes the same values; only the holder's alias the partition
    every = _outcomes(lambda: fam.set_full_({name: value}))
    assert every == [None] * len(every), every
    after = fam.full_tensors(dtype=torch.float32)
    assert torch.equal(after[name], content.float()), name
    assert all(torch.equal(after[n], before[n]) for n in fam.names if n != name)
    params = dict(engine.module.named_parameters())
    assert torch.equal(truth(params[name]).float().cpu(), content.float()), "DeepSpeed reads another value"


def _set_full_masters(grads: Any, engine: Any) -> None:
    del grads
    _set_full_aliasing(zd.sharded_master_params(engine), engine, safe_get_full_fp32_param)


def _set_full_grads(grads: Any, engine: Any) -> None:
    _set_full_aliasing(grads, engine, safe_get_full_grad)


CHECKS: dict[str, Callable[[Any, Any], None]] = {
    "clip_grad_norm_ max_norm one ulp apart": _clip_max_norm,
    "clip_grad_norm_ error_if_nonfinite on one rank": _clip_error_flag,
    "clip_per_param_ max_norm one ulp apart": _clip_per_param,
    "set_full_ masters aliasing its partition": _set_full_masters,
    "set_full_ grads aliasing its partition": _set_full_grads,
}
ROWS = list(CHECKS)


def agreed_args(case: EngineCase) -> dict[str, Any]:
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    rows = Rows(ROWS)
    for name, check in CHECKS.items():
        rows.run(name, check, grads, engine)
    return rows.report()
