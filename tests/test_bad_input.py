"""Issue 3: bad input is refused with a clear error before anything is written; disagreeing ranks raise, not hang."""

from __future__ import annotations

import pytest

from workers import bad_input

WRITE_CASES = [
    (1, "fp32", False, False),
    (2, "fp16", False, False),
    (3, "fp32", False, False),
    (2, "fp32", True, False),
    (3, "bf16", True, False),
    (1, "bf16", False, True),  # BF16_Optimizer
]


@pytest.mark.parametrize("stage,dtype,offload,bf16_optimizer", WRITE_CASES,
                         ids=[f"z{s}-{d}{'-offload' if o else ''}{'-bf16opt' if b else ''}" for s, d, o, b in WRITE_CASES])
def test_bad_writes_change_nothing(ranks, stage: int, dtype: str, offload: bool, bf16_optimizer: bool) -> None:
    assert ranks(2).run(bad_input.bad_writes, stage, dtype, offload, bf16_optimizer)[0] == 8


@pytest.mark.parametrize("stage", [2, 3])
def test_disagreeing_ranks_raise_in_debug_mode(ranks, stage: int) -> None:
    messages = ranks(2).run(bad_input.disagreeing_collectives, stage)
    assert "rank 0" in messages[0][0] and "rank 1" in messages[0][0]
