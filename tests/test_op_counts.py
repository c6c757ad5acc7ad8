"""Issue 11: every bulk call dispatches a number of tensor operations that does not grow with the number of
parameters: the same count (views aside, see ``workers/op_counts.py``) and the same collectives for a model of 8
parameters and one of 64 in one param group, on 2 ranks, ZeRO-1/2/3 and BF16_Optimizer. One test per (call,
configuration), so a failure names the call; its message lists the operations whose counts differ."""

from __future__ import annotations

import pytest

from workers import op_counts

CASES = [(variant, name) for variant in op_counts.VARIANTS for name in op_counts.ROWS]


@pytest.fixture(scope="module", autouse=True)
def _release_engines(ranks):
    yield
    try:
        ranks(2).run(op_counts.release)
    except Exception:  # noqa: BLE001 - a broken pool is restarted by the next user anyway
        pass


def _diff(small: dict, big: dict) -> str:
    keys = sorted(set(small) | set(big))
    return ", ".join(f"{k}: {small.get(k, 0)} -> {big.get(k, 0)}" for k in keys if small.get(k, 0) != big.get(k, 0))


_MEASURED: dict[str, list] = {}


def _measured(ranks, variant: str) -> list:
    """Every row of ``variant`` measured in one run on the ranks (cached for the module's tests)."""
    if variant not in _MEASURED:
        _MEASURED[variant] = ranks(2).run(op_counts.count_variant, variant)
    return _MEASURED[variant]


@pytest.mark.parametrize("variant,name", CASES, ids=[f"{v}-{n}" for v, n in CASES])
def test_op_count_does_not_grow_with_parameters(ranks, variant: str, name: str) -> None:
    results = [per_rank[name] for per_rank in _measured(ranks, variant)]
    problems = []
    for rank, counts in enumerate(results):
        small, big = counts[8], counts[64]
        errors = [f"{n} parameters: {c['error']}" for n, c in ((8, small), (64, big)) if "error" in c]
        if errors:
            problems.append(f"rank {rank} raised: " + "\n".join(errors))
            continue
        if small["ops"] != big["ops"]:
            problems.append(f"rank {rank}: {small['ops']} ops for 8 parameters, {big['ops']} for 64 "
                            f"({_diff(small['by_op'], big['by_op'])})")
        if small["comms"] != big["comms"]:
            problems.append(f"rank {rank}: {small['comms']} collectives for 8 parameters, {big['comms']} for 64 "
                            f"({_diff(small['comm_ops'], big['comm_ops'])})")
    assert not problems, f"{name} on {variant}: " + "; ".join(problems)
