"""Issue 26, worker side: settings that differ between ranks raise on every rank (no wrong value, no hang, no
abort), and the rough edges of the redistribution calls.

Each row changes one setting on the last rank only, calls collectives that the setting would change, expects
``RankDisagreementError`` on every rank, restores the setting and checks that an agreeing call then returns the
right values (the process group is still in step).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

import zero_dtensor as zd
from zero_dtensor import settings
from zero_dtensor.errors import RankDisagreementError, RankFailedError
from zero_dtensor.materialize import strategy

from .bad_input import _same_bytes, deepspeed_storage
from .common import EngineCase, agreement_op, build_engine, count_comms, forward_backward
from .rows import Rows


def _last() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


@contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextmanager
def _on_last_rank(apply: Callable[[], Any], undo: Callable[[], Any]) -> Iterator[None]:
    if _last():
        apply()
    try:
        yield
    finally:
        if _last():
            undo()


def _env_on_last(value: str) -> Any:
    @contextmanager
    def ctx() -> Iterator[None]:
        with _env(settings.ENV_STRATEGY, value if _last() else None):
            yield
    return ctx()


def _pin_on_last(value: str) -> Any:
    return _on_last_rank(lambda: settings.set_gather_strategy(value), lambda: settings.set_gather_strategy(None))


def _debug_on_last() -> Any:
    return _on_last_rank(lambda: settings.set_debug(True), lambda: settings.set_debug(False))


@contextmanager
def _cleared_on_last() -> Iterator[None]:
    if _last():
        strategy.clear_calibration()
    yield
    strategy.clear_calibration()  # every rank again: the next auto call calibrates everywhere


SETTINGS: dict[str, Callable[[], Any]] = {
    "env all_gather": lambda: _env_on_last("all_gather"),
    "env all_reduce": lambda: _env_on_last("all_reduce"),
    "env all_to_all": lambda: _env_on_last("all_to_all"),
    "env invalid": lambda: _env_on_last("nonsense"),
    "set_gather_strategy all_gather": lambda: _pin_on_last("all_gather"),
    "set_gather_strategy all_reduce": lambda: _pin_on_last("all_reduce"),
    "set_gather_strategy all_to_all": lambda: _pin_on_last("all_to_all"),
    "clear_calibration": _cleared_on_last,
    "set_debug": _debug_on_last,
    "set_fused_reductions": lambda: _on_last_rank(lambda: settings.set_fused_reductions(True),
                                                  lambda: settings.set_fused_reductions(False)),
}
SETTING_ROWS = list(SETTINGS)

def _reference(engine: Any) -> dict[str, torch.Tensor]:
    return {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters() if p.requires_grad}


def _row(grads: Any, engine: Any, name: str) -> None:
    before = deepspeed_storage(engine)
    truth = _reference(engine)
    prev = grads.full_tensors(dtype=torch.float32)
    kept = {n: t.clone() for n, t in prev.items()}
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("full_tensors", lambda: grads.full_tensors()),
        ("full_tensors out=", lambda: grads.full_tensors(out=prev, dtype=torch.float32)),
        ("iter_full", lambda: list(grads.iter_full())),
        ("to_dtensors", lambda: grads.to_dtensors()),
        ("owned", lambda: grads.owned()),
        ("norms", lambda: grads.norms()),
        ("set_owned_", lambda: grads.set_owned_({})),
    ]
    invalid = name == "env invalid"  # full_tensors resolves it: the last rank refuses, every rank raises ValueError
    expected = (RankDisagreementError, ValueError) if invalid else RankDisagreementError
    with SETTINGS[name]():
        for what, call in calls:
            if name == "clear_calibration" and not what.startswith("full_tensors"):
                call()  # only full_tensors calibrates: the other calls do the same on every rank, and work
                continue
            try:
                call()
            except expected as exc:
                message = str(exc)
            else:
                raise AssertionError(f"{name}: {what} did not raise")
            assert re.search("settings|ZERO_DTENSOR_GATHER_STRATEGY", message), (what, message)
            assert invalid or f"rank {dist.get_world_size() - 1}" in message, (what, message)
    # nothing was written, no out= entry changed, and the group is still in step: agreeing calls are right
    assert _same_bytes(before, deepspeed_storage(engine)), name
    assert all(torch.equal(prev[n], kept[n]) for n in prev), name
    full = grads.full_tensors(dtype=torch.float32)
    assert all(torch.equal(full[n], truth[n]) for n in truth), name


def mismatched_settings(case: EngineCase) -> dict[str, Any]:
    """Every row of :data:`SETTINGS` on one engine; the gloo transfers are made large enough to calibrate."""
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    minimum = strategy.CALIBRATION_MIN_BYTES
    strategy.CALIBRATION_MIN_BYTES = 0  # the test models are far below 1 MiB: let auto calibrate
    rows = Rows(SETTING_ROWS)
    try:
        grads.full_tensors()  # calibrates on every rank (the clear_calibration row needs a decision to forget)
        assert strategy.strategy_decisions() or case.bf16_optimizer
        for name in SETTING_ROWS:
            rows.run(name, _row, grads, engine, name)
    finally:
        strategy.CALIBRATION_MIN_BYTES = minimum
    return rows.report()


# --- rough edges of the redistribution calls --------------------------------------------------------------------------
def _owner_forms(grads: Any) -> None:
    """``owners=`` takes NumPy integers and 0-d integer tensors as ranks, with the same result as ints; a float or
    bool rank is refused on every rank."""
    owners = grads.owners()
    plain = grads.owned(owners=owners)
    as_numpy = grads.owned(owners={n: np.int64(r) for n, r in owners.items()})
    as_tensor = grads.owned(owners={n: torch.tensor(r) for n, r in owners.items()})
    for other in (as_numpy, as_tensor):
        assert list(other) == list(plain) and all(torch.equal(other[n], plain[n]) for n in plain)
    for bad in (1.0, True, torch.tensor(1.0)):
        with pytest.raises(TypeError, match="global rank"):
            grads.owned(owners={n: bad for n in owners})


def _predicates(grads: Any) -> None:
    """``names=`` of full_tensors / to_dtensors / owned / map_full_ take a predicate, as the transforms' ``params=``
    do: the parameters it accepts, in model order."""
    def pick(n: str) -> bool:
        return n.endswith("weight")

    chosen = [n for n in grads.names if pick(n)]
    assert chosen and len(chosen) < len(grads.names)
    assert list(grads.full_tensors(pick)) == chosen
    assert list(grads.to_dtensors(pick)) == chosen
    mine = grads.owned(pick)
    assert set(mine) <= set(chosen)
    assert set(grads.owners(pick)) == set(chosen)
    before = grads.full_tensors(dtype=torch.float32)
    grads.map_full_(lambda name, g: g * 2, pick)
    after = grads.full_tensors(dtype=torch.float32)
    for n in grads.names:
        assert torch.equal(after[n], before[n] * 2 if n in chosen else before[n]), n
    grads.map_full_(lambda name, g: g / 2, pick)


def _collective_in_map_fn(grads: Any, engine: Any) -> None:
    """A zero_dtensor collective inside map_full_'s fn (which runs on owners only) raises a clear error there and
    RankFailedError elsewhere; nothing is written and the group stays in step."""
    before = deepspeed_storage(engine)
    owners = grads.owners()
    holder = dist.get_world_size() - 1
    given = {n: holder for n in owners}

    def fn(name: str, g: torch.Tensor) -> torch.Tensor:
        grads.norms()  # would wait for ranks that never call it
        return g

    if dist.get_rank() == holder:
        with pytest.raises(RuntimeError, match="must not|runs on some ranks only"):
            grads.map_full_(fn, owners=given)
    else:
        with pytest.raises(RankFailedError) as info:
            grads.map_full_(fn, owners=given)
        assert info.value.failed_ranks == [holder]
    assert _same_bytes(before, deepspeed_storage(engine))
    assert sorted(grads.full_tensors()) == sorted(grads.names)


def _counts(grads: Any) -> None:
    """Each redistribution call: its data collectives plus exactly one agreement (one process group here)."""
    dts = grads.to_dtensors()
    mine = grads.owned()
    calls = {
        "to_dtensors": lambda: grads.to_dtensors(),
        "set_dtensors_": lambda: grads.set_dtensors_(dts),
        "owned": lambda: grads.owned(),
        "set_owned_": lambda: grads.set_owned_(mine),
        "map_full_": lambda: grads.map_full_(lambda n, g: g),
        "full_tensors": lambda: grads.full_tensors(),
    }
    for what, call in calls.items():
        with count_comms() as mode:
            call()
        counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
        # the agreement: on gloo an all_gather below 4 ranks, an all_reduce from 4 on (set_owned_'s always gathers:
        # it carries every rank's payload)
        assert agreement_op(grads) == ("allreduce" if dist.get_world_size() >= 4 else "allgather_base")
        op = "_allgather_base_" if what == "set_owned_" or agreement_op(grads) == "allgather_base" else "allreduce_"
        agreements = counts.pop(op, 0) - (what == "full_tensors" and op == "_allgather_base_")
        assert agreements == 1, (what, counts)


EDGE_ROWS = ["owners= integer forms", "names= predicates", "collective inside map_full_'s fn",
             "one agreement per call"]


def rough_edges(case: EngineCase) -> dict[str, Any]:
    engine = build_engine(case)
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    rows = Rows(EDGE_ROWS)
    rows.run("owners= integer forms", _owner_forms, grads)
    rows.run("names= predicates", _predicates, grads)
    rows.run("collective inside map_full_'s fn", _collective_in_map_fn, grads, engine)
    rows.run("one agreement per call", _counts, grads)
    return rows.report()
