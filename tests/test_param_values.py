"""Issue 11: the per-parameter result mappings of reductions (``norms``, ``dots``, ``clip_per_param_``, ``stats``)
behave as read-only dicts and make their entries only when read (no processes)."""

from __future__ import annotations

import pickle

import pytest
import torch

from zero_dtensor import GradStats, ParamValues
from zero_dtensor.core import param_values as pv
from zero_dtensor.core.param_values import ParamStatsMap

NAMES = tuple(f"layers.{i}.weight" for i in range(40))


def values() -> tuple[ParamValues, dict[str, torch.Tensor]]:
    vector = torch.arange(len(NAMES), dtype=torch.float32) * 0.5
    return ParamValues(NAMES, vector), dict(zip(NAMES, vector.unbind(0)))


def test_behaves_as_a_read_only_dict() -> None:
    got, expected = values()
    assert len(got) == len(expected) and list(got) == list(expected) and list(got.keys()) == list(expected)
    assert all(torch.equal(got[n], expected[n]) for n in NAMES)
    assert got == expected and expected == got and got == values()[0]
    assert got != {**expected, NAMES[0]: torch.tensor(99.0)}
    assert NAMES[3] in got and "nope" not in got and 3 not in got
    assert got.get("nope") is None and torch.equal(got.get(NAMES[1]), expected[NAMES[1]])
    assert [n for n, _ in got.items()] == list(NAMES) and len(list(got.values())) == len(NAMES)
    plain = dict(got)
    assert type(plain) is dict and plain == expected
    assert type(got.copy()) is dict and type(got | {"x": 1}) is dict
    again = pickle.loads(pickle.dumps(got))
    assert type(again) is dict and again == expected
    assert repr(got) == repr(dict(expected))
    with pytest.raises(TypeError):
        got[NAMES[0]] = torch.tensor(1.0)  # type: ignore[index]
    with pytest.raises(KeyError):
        got["nope"]
    with pytest.raises(TypeError):
        hash(got)
    assert got.vector.shape == (len(NAMES),) and got.names == NAMES


def test_entries_made_on_read() -> None:
    got, expected = values()
    for n in NAMES[: pv.FEW]:
        assert torch.equal(got[n], expected[n])
    assert got._entries is None, "a few reads must not make every entry"
    assert torch.equal(got[NAMES[-1]], expected[NAMES[-1]])  # one more: every entry, once
    assert got._entries is not None and got[NAMES[5]] is got[NAMES[5]]
    fresh, _ = values()
    list(fresh.items())
    assert fresh._entries is not None
    # entries are views of the vector: the result is one snapshot
    assert got[NAMES[2]].data_ptr() == got.vector[2].data_ptr()


def test_stats_map() -> None:
    columns = ([1.0, 2.0], [0.5, float("nan")], [0.1, 0.2], [0, 1], [0, 0], [4, 8])
    names = ("a", "b")
    made: list[str] = []

    def one(i: int) -> GradStats:
        made.append("one")
        return GradStats(*(c[i] for c in columns))

    def every() -> list[GradStats]:
        made.append("all")
        return [GradStats(*(c[i] for c in columns)) for i in range(2)]

    got = ParamStatsMap(names, one, every)
    assert got["a"] == GradStats(1.0, 0.5, 0.1, 0, 0, 4) and made == ["one"]
    assert dict(got.items())["b"].nan_count == 1 and made == ["one", "all"]
    assert list(got) == ["a", "b"] and got == {"a": got["a"], "b": got["b"]}
