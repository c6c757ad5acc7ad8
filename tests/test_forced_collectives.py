"""Issue 52: ``ZERO_DTENSOR_FORCE_COLLECTIVES=1`` makes a one-rank process group take the collective path of N
ranks. At world 1 on gloo, the main calls of every family (gradients, fp32 masters, ``exp_avg``: every gather
strategy, async, ``iter_full``, ``dst=``, pipelined and windowed ZeRO-3 gathers, a parameter's ``full_tensor``, the
redistribution both ways, the reductions, clipping, ``set_full_``) and ``zd.save`` / ``zd.load`` give the values
of the unforced one-rank path, bit for bit, with the collectives of 2 ranks (``CommDebugMode``).

Two things cannot travel at one rank, and the test says which: the ``send_recv`` strategy's point-to-point batch
(its ops go to the other ranks; one rank has none, so nothing is posted), and the working-weight refresh inside
``zd.load`` where DeepSpeed issues it (its own gathers, which skip one-rank groups; ZeRO-1/2 on gloo: our
point-to-point batch, which has no peer either). ``zd.load`` is therefore compared less its refresh, measured
alone on the same engine.
"""

from __future__ import annotations

from collections import Counter

import pytest

from workers import forced

REFRESH = "working-weight refresh (part of zd.load)"
P2P = ("p2p batches", "p2p ops")


def _without_p2p(comms: dict) -> dict:
    return {k: v for k, v in comms.items() if k not in P2P}


@pytest.fixture(scope="module")
def measured(ranks, tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("forced"))
    out = {}
    for variant in forced.CASES:
        one = ranks(1).run(forced.family_calls, variant, (False, True), root)[0]
        two = ranks(2).run(forced.family_calls, variant, (False,), root)
        out[variant] = (one[False], one[True], [r[False] for r in two])
    return out


@pytest.mark.parametrize("variant", list(forced.CASES))
def test_forced_one_rank_gives_the_one_rank_values(measured, variant: str) -> None:
    plain, forced_, _ = measured[variant]
    assert plain.keys() == forced_.keys()
    differ = [name for name in plain if not forced.same(plain[name]["value"], forced_[name]["value"])]
    assert not differ, f"{variant}: forced values differ from the one-rank path's: {differ}"


@pytest.mark.parametrize("variant", list(forced.CASES))
def test_forced_one_rank_issues_the_collectives_of_two_ranks(measured, variant: str) -> None:
    _, forced_, two = measured[variant]
    problems = []
    for rank, at_two in enumerate(two):
        assert at_two.keys() == forced_.keys()
        for name, found in forced_.items():
            if name == REFRESH:
                continue
            mine, theirs = found["comms"], at_two[name]["comms"]
            if "[send_recv]" in name:  # the point-to-point batch has no peer at one rank: nothing posted
                assert not set(P2P) & set(mine), (name, mine)
                mine, theirs = _without_p2p(mine), _without_p2p(theirs)
            elif name == "zd.load":  # less the refresh (DeepSpeed's own gathers; gloo's peerless batch)
                mine = dict(Counter(mine) - Counter(forced_[REFRESH]["comms"]))
                theirs = dict(Counter(theirs) - Counter(at_two[REFRESH]["comms"]))
            if mine != theirs:
                problems.append(f"rank {rank} {name}: forced one rank {mine}, two ranks {theirs}")
    assert not problems, f"{variant}: " + "; ".join(problems)


def test_setting_is_one_switch_read_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from zero_dtensor import settings
    from zero_dtensor.comm.process_groups import collective_path

    monkeypatch.delenv(settings.ENV_FORCE_COLLECTIVES, raising=False)
    assert settings.ENV_FORCE_COLLECTIVES == "ZERO_DTENSOR_FORCE_COLLECTIVES"  # the contract
    assert not settings.force_collectives() and not collective_path(1) and collective_path(2)
    assert "force_collectives=0" in settings.fingerprint()  # part of every rank agreement
    for value, on in (("1", True), ("true", True), ("on", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv(settings.ENV_FORCE_COLLECTIVES, value)
        assert settings.force_collectives() is on and collective_path(1) is on and collective_path(3), value
        assert f"force_collectives={int(on)}" in settings.fingerprint()
