"""Issue 51: agreement by construction. The generated test (every argument of every collective call, different on
one rank, raises ``RankDisagreementError`` on every rank with nothing written; 2 ranks, ZeRO-2 and ZeRO-3, one rank
pool run per stage), the exclusion table as reviewed, and the encoding the agreement compares."""

from __future__ import annotations

import inspect
import math
import os

import numpy as np
import pytest
import torch

from workers import signature
from workers.common import EngineCase
from workers.rows import RowResults, assert_row
from zero_dtensor.comm import agreement
from zero_dtensor.comm.signature import COLLECTIVE_CALLS, NOT_BY_VALUE, encode

CASES = [EngineCase(2), EngineCase(3)]
_RESULTS = RowResults()


@pytest.mark.parametrize("case,row", [pytest.param(c, r, id=f"{c.id}-{r}") for c in CASES for r in signature.ROWS])
def test_every_argument_is_agreed(ranks, case: EngineCase, row: str) -> None:
    # a missing agreement may hang (another dst=, strategy= on one rank): fail after two minutes
    assert_row(_RESULTS.get(ranks, case.world, signature.generated, case, timeout=120.0), row)


def test_the_exclusions_are_the_reviewed_ones() -> None:
    """Leaving an argument out of the agreement is a reviewed decision: the table's exclusions are those the test
    accepts, and every entry names a marked call (or ``*``) and one of its arguments, with a reason."""
    left_out = {key for key, (_, encoder) in NOT_BY_VALUE.items() if encoder is None}
    assert left_out == signature.REVIEWED_EXCLUSIONS, (
        "an argument left out of the agreement (or put back): review it, then update REVIEWED_EXCLUSIONS in "
        f"tests/workers/signature.py; table {sorted(left_out)}")
    for (call, arg), (reason, _) in NOT_BY_VALUE.items():
        assert len(reason) > 20, (call, arg)
        calls = COLLECTIVE_CALLS if call == "*" else {call: COLLECTIVE_CALLS[call]}
        assert any(arg in inspect.signature(fn).parameters for fn in calls.values()), (call, arg)


def test_the_cases_cover_the_public_calls() -> None:
    """The registry holds the public communicating calls (a smoke check of the marks: these existed before the
    registry), and each has its arguments varied on every family."""
    for name in ("ShardedTensors.full_tensors", "TensorReductions.clip_grad_norm_", "TensorReductions.clip_per_param_",
                 "TensorOwners.map_full_", "ParamView.full_tensor", "get_full_fp32_params", "save", "load"):
        assert name in COLLECTIVE_CALLS
    rows = set(signature.ROWS)
    for arg in ("max_norm", "norm_type", "error_if_nonfinite", "params"):
        assert {f"TensorReductions.clip_grad_norm_.{arg}@{f}" for f in signature.FAMILIES} <= rows
    assert "TensorOwners.map_full_.names@grads" in rows and "TensorOwners.map_full_.fn@grads" not in rows


def test_an_agreement_outside_a_marked_call_raises() -> None:
    with pytest.raises(RuntimeError, match="outside any call marked"):
        agreement.agree("unmarked", (), [], torch.device("cpu"))


def test_the_encoding() -> None:
    x = 0.32
    assert encode(x) != encode(math.nextafter(x, 1.0))  # the last bit
    assert encode(0.0) != encode(-0.0)
    assert encode(np.float32(0.5)) == encode(0.5) and encode(np.int64(3)) == encode(3)
    assert encode(True) != encode(1)
    assert encode(torch.device("cpu")) == encode(torch.device("cpu", 0))  # the device type only
    assert encode(torch.zeros(2, 3)) == encode(torch.ones(2, 3))  # tensors by metadata, not values
    assert encode(torch.zeros(2, 3)) != encode(torch.zeros(3, 2))
    assert encode(torch.zeros(2)) != encode(torch.zeros(2, dtype=torch.float64))
    assert encode({"a": 1, "b": 2}) == encode({"b": 2, "a": 1})
    assert encode(["a", "b"]) != encode(["b", "a"])
    many = {f"p{i}": torch.zeros(i + 1) for i in range(5)}
    assert encode(many) == encode(dict(reversed(many.items())))
    assert encode(many) != encode({**many, "p0": torch.zeros(1, dtype=torch.bfloat16)})
    assert encode(lambda n: True) == encode(lambda n: False)  # predicates: agreed as resolved by the call
    assert encode(os.path.join("a", "b")) == repr(os.path.join("a", "b"))
