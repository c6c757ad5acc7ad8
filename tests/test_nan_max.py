"""A nan on one rank survives every maximum over the ranks: the backends' ``MAX`` need not keep one (gloo's
``std::max`` drops a nan that arrives as its second operand), and from 4 gloo ranks on the reductions use it."""

from __future__ import annotations

import pytest

from workers import nan_max
from workers.common import EngineCase


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_small_max_keeps_a_nan_from_every_rank(ranks, world: int) -> None:
    for rank, flags in enumerate(ranks(world).run(nan_max.check_max_keeps_nan)):
        assert flags[:world] == [True] * world, (rank, flags)


@pytest.mark.parametrize("stage,victim", [(2, 1), (3, 2)])
def test_inf_norms_and_clip_see_a_nan_on_any_rank(ranks, stage: int, victim: int) -> None:
    """4 ranks (the all_reduce path on gloo), the nan on a middle rank (where gloo's MAX dropped it): on every rank
    ``norms(inf)`` and ``global_norm(inf)`` are nan and ``clip_grad_norm_(..., inf, error_if_nonfinite=True)``
    raises before scaling anything."""
    results = ranks(4).run(nan_max.check_inf_norms_keep_a_nan, EngineCase(stage, world=4), victim)
    for rank, r in enumerate(results):
        assert r["norm"] != r["norm"] and r["global"] != r["global"], (rank, r)  # nan
        assert r["clip"] == "raised" and r["unchanged"], (rank, r)
