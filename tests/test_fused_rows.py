"""Issue 42: the optional fused row pass (:mod:`zero_dtensor.layout.fused_rows`, ``zd.set_fused_reductions``).

Forced onto CPU tensors (Inductor's C++ backend; the first compile of this module costs about 20-30 s on 2 cores,
later shapes about 10 ms): ``joint_stats`` (with and without counts, any column order) and ``joint_dots`` through the
fused path equal the eager path on two plans reduced jointly (several pieces, padding, nan and inf in rows, bits and
padding; bf16 and fp32), within two float32 roundings of 64-element rows, counts and non-finite propagation exactly;
its counts stay exact where the eager path's ``missed`` flag is set; a second row count compiles nothing; the eager
path keeps every case the fused one must not take; the setting's bad input raises. No processes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zero_dtensor as zd
from zero_dtensor import settings
from zero_dtensor.layout import fused_rows
from zero_dtensor.layout.segments import COUNT_ROWS, joint_dots, joint_stats, sizes_plan

#: two buffers' pieces (row width 64): parameters and padding (zero-length, shorter than a row, many rows,
#: a total that is not a multiple of 64)
SIZES = ([700, 5, 64 * 40 + 5, 3, 64 * 20, 0, 130, 64 * 3], [64 * 5 + 1, 90, 64 * 7, 11])
PADDING = ({1, 5}, {3})
TOL = 8e-6  # two float32 roundings of a 64-element row sum, relative to the piece's sum of absolute terms


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch):
    """The setting on, and allowed on CPU tensors; yields the row views each compiled row function was given."""
    monkeypatch.setattr(fused_rows, "_FORCE_CPU", True)
    seen: dict[str, list[torch.Size]] = {"row_moments": [], "row_dots": []}
    for name in seen:
        fn = getattr(fused_rows, name)
        monkeypatch.setattr(fused_rows, name, lambda *rows, _n=name, _fn=fn: seen[_n].append(rows[0].shape)
                            or _fn(*rows))
    settings.set_fused_reductions(True)
    yield seen
    settings.set_fused_reductions(False)


def _buffers(dtype: torch.dtype, seed: int, bad_rows: int = 0) -> list[torch.Tensor]:
    """One buffer per plan: random values, nan in the padding, nan/inf in body rows and in bits."""
    g = torch.Generator().manual_seed(seed)
    bufs = []
    for sizes, padding in zip(SIZES, PADDING):
        x = torch.randn(sum(sizes), generator=g, dtype=torch.float64).to(dtype)
        for i, piece in enumerate(x.split(sizes)):
            if i in padding:
                piece.fill_(math.nan)
        bufs.append(x)
    x = bufs[0]
    x[[3, 650, 800]] = math.nan  # body rows of the first and third pieces, a bit (the first piece's tail)
    x[[900, 710, 64 * 60 + 9]] = torch.tensor([math.inf, -math.inf, math.inf], dtype=dtype)  # 710: a head bit
    bufs[1][[64 * 5, 64 * 6 + 3]] = torch.tensor([-math.inf, math.nan], dtype=dtype)  # a bit, a body row
    if bad_rows:  # one inf in each of `bad_rows` rows of the long piece
        start = 768  # the third piece's first full row
        x[torch.arange(bad_rows) * 64 + start + 7] = math.inf
    return bufs


def _plans() -> list:
    return [sizes_plan(sizes, 64) for sizes in SIZES]


def _eager(fn, *args, **kwargs) -> torch.Tensor:
    settings.set_fused_reductions(False)
    try:
        return fn(*args, **kwargs)
    finally:
        settings.set_fused_reductions(True)


def _counts(bufs: list[torch.Tensor]) -> torch.Tensor:
    pieces = [p for x, sizes in zip(bufs, SIZES) for p in x.split(sizes)]
    return torch.tensor([[float(torch.isnan(p).sum()), float(torch.isinf(p).sum())] for p in pieces],
                        dtype=torch.float64)


def _abs_sums(bufs: list[torch.Tensor], square: bool) -> torch.Tensor:
    pieces = [p.double() for x, sizes in zip(bufs, SIZES) for p in x.split(sizes)]
    return torch.stack([(p.square() if square else p.abs()).nan_to_num(posinf=0.0).sum() for p in pieces])


def _assert_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """Same non-finite entries; finite ones within ``TOL · bound``."""
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    fin = torch.isfinite(want)
    assert bool(((got[fin] - want[fin]).abs() <= TOL * bound[fin] + 1e-300).all()), (got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_stats_equal_eager(fused, dtype: torch.dtype) -> None:
    bufs, segs = _buffers(dtype, 1), _plans()
    want = _eager(joint_stats, bufs, segs, counts=True)
    assert not bool(want[:, 5].any())  # few non-finite rows: the eager counts are complete
    got = joint_stats(bufs, segs, counts=True)
    assert fused["row_moments"] == [(sum(SIZES[0]) // 64, 64), (sum(SIZES[1]) // 64, 64)]  # each buffer's rows once
    assert got.shape == want.shape == (sum(map(len, SIZES)), 6) and got.dtype == torch.float64
    _assert_close(got[:, 0], want[:, 0], _abs_sums(bufs, True))
    _assert_close(got[:, 1], want[:, 1], _abs_sums(bufs, False))
    assert torch.equal(got[:, 2].nan_to_num(-1.0), want[:, 2].nan_to_num(-1.0))  # max |x|: exact, nan propagated
    assert torch.equal(got[:, 3:5], _counts(bufs)) and torch.equal(got[:, 3:], want[:, 3:])
    assert bool(got[:, 3:5].sum() > 0) and bool(torch.isnan(got[:, 0]).any() and got[:, 0].isinf().any())
    plain = joint_stats(bufs, segs)
    assert torch.equal(plain.nan_to_num(), got[:, :3].nan_to_num())
    assert torch.equal(joint_stats(bufs, segs, counts=True, order=(4, 0, 3)).nan_to_num(),
                       got[:, [4, 0, 3]].nan_to_num())


def test_fused_counts_are_exact_where_eager_misses_some(fused) -> None:
    bufs, segs = _buffers(torch.bfloat16, 2, bad_rows=COUNT_ROWS + 3), _plans()
    want = _eager(joint_stats, bufs, segs, torch.device("cpu", 1), counts=True)  # cpu:1 stands for an accelerator
    assert bool(want[:, 5].eq(1.0).all())  # the eager path flags incomplete counts there
    got = joint_stats(bufs, segs, counts=True)
    assert torch.equal(got[:, 3:5], _counts(bufs)) and not bool(got[:, 5].any())


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a view starting one element past an aligned address (a partition at an odd offset)."""
    out = torch.empty(x.numel() + 1, dtype=x.dtype)[1:]
    assert out.data_ptr() % fused_rows.ALIGN
    return out.copy_(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_dots_equal_eager(fused, dtype: torch.dtype) -> None:
    """The second pair's ``b`` starts misaligned: a compiled function of its own (no copy on a GPU)."""
    a, b, segs = _buffers(dtype, 3), [x.flip(0) for x in _buffers(dtype, 4)], _plans()
    b[1] = _misaligned(b[1])
    want = _eager(joint_dots, a, b, segs)
    got = joint_dots(a, b, segs)
    assert len(fused["row_dots"]) == 2 and not fused["row_moments"]  # one fused pass per pair of row views
    assert {(fused_rows._dots, (True, True)), (fused_rows._dots, (True, False))} <= set(fused_rows._COMPILED)
    pieces = [(p.double() * q.double()).abs().nan_to_num(posinf=0.0).sum() for x, y, sizes in zip(a, b, SIZES)
              for p, q in zip(x.split(sizes), y.split(sizes))]
    assert got.dtype == torch.float64 and bool(torch.isnan(got).any())
    _assert_close(got, want, torch.stack(pieces))


def test_a_second_row_count_compiles_nothing(fused) -> None:
    """One graph per dtype and row width: the row count is dynamic."""
    rows = torch.randn(64 * 50, dtype=torch.float64).to(torch.bfloat16).view(50, 64)
    fused_rows.row_moments(rows[:37])  # compiles, unless an earlier test did
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = fused_rows.row_moments(rows)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    x = rows.float()
    want = torch.stack([x.square().sum(1), x.sum(1), x.abs().amax(1), x.isnan().sum(1), x.isinf().sum(1)], 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return func(*args, **(kwargs or {}))


def test_eager_path_where_the_fused_one_must_not_run(fused, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [torch.zeros(4, 64)]
    assert fused_rows.applies(rows)
    assert not fused_rows.applies([])
    with _Passthrough():  # the tests' op counters, device tags, FakeTensorMode
        assert not fused_rows.applies(rows)
    assert not fused_rows.applies([torch.empty(4, 64, device="meta")])
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not fused_rows.applies(rows)
    with monkeypatch.context() as m:
        m.setattr(fused_rows, "_FORCE_CPU", False)  # offloaded (CPU) buffers keep the CPU recipe
        assert not fused_rows.applies(rows)
    settings.set_fused_reductions(False)
    assert not fused_rows.applies(rows)


def test_setting_bad_input_fingerprint_and_missing_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    assert zd.set_fused_reductions is settings.set_fused_reductions and not settings.fused_reductions()
    for bad in ("1", 1, None):
        with pytest.raises(TypeError, match="True or False"):
            settings.set_fused_reductions(bad)  # type: ignore[arg-type]
    assert "fused=0" in settings.fingerprint()
    settings.set_fused_reductions(True)
    try:
        assert "fused=1" in settings.fingerprint()
    finally:
        settings.set_fused_reductions(False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(settings.importlib.util, "find_spec", lambda name: None)
    settings.fused_unavailable.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="pip install triton"):
            settings.set_fused_reductions(True)
        assert not settings.fused_reductions()
    finally:
        settings.fused_unavailable.cache_clear()
    monkeypatch.setenv(settings.ENV_FUSED, "1")
    assert settings._env_flag(settings.ENV_FUSED, False)
