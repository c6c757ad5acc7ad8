"""Property-based checks of :mod:`zero_dtensor.layout.segments` (no DeepSpeed, no processes).

Random tilings — zero-length pieces, pieces shorter and longer than the row width, totals that are not a multiple of
it, empty buffers, a single piece — with several row widths (64 and small ones, which make tiny buffers exercise the
row pass), random values in float32, bfloat16, float16 and float64 (for the max also with nan/inf): every per-piece
function agrees with a per-piece float64 reference (sums within a few float32 roundings of 64-element rows, the max
exactly, element counts exactly). Plus: precision on a long piece, device/dtype of results, the parameter lookup,
and the fast ``GradStats`` constructor of :mod:`zero_dtensor.ops.reductions`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_dtensor.layout.tiling import Tiling
from zero_dtensor.ops.reductions import GradStats, _grad_stats
from zero_dtensor.layout.segments import (BLOCK, param_index, piece_dots, piece_max_abs, piece_pow_sums, piece_stats,
                                          piece_sums, segment_plan, sizes_plan)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
RTOL = {torch.float64: 1e-12}  # else float32 row accumulation: a few roundings of 64-element sums
DEFAULT_RTOL = 2e-5

#: the host recipe (``cpu``: numpy's segment reductions, exact counts) and the accelerator one (``cpu:1``, the
#: tests' stand-in for an accelerator: torch's joint ``segment_reduce``); both must meet every property
DEVICES = st.sampled_from((torch.device("cpu"), torch.device("cpu", 1)))

piece_size = st.one_of(st.just(0), st.integers(1, 10), st.integers(1, 70), st.integers(60, 300))


@st.composite
def tilings(draw) -> tuple[Tiling, int]:
    """``(tiling, block)``: random piece sizes, a random subset of the pieces as the parameters."""
    sizes = draw(st.lists(piece_size, min_size=0, max_size=12))
    if draw(st.booleans()) and sizes:
        sizes[draw(st.integers(0, len(sizes) - 1))] = draw(st.integers(300, 2000))  # one long piece
    chosen = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    piece = tuple(i for i, c in enumerate(chosen) if c)
    gaps = tuple(i for i, c in enumerate(chosen) if not c)
    block = draw(st.sampled_from((BLOCK, BLOCK, 1, 3, 8)))
    return Tiling(tuple(sizes), piece, gaps), block


def values(n: int, dtype: torch.dtype, seed: int, specials: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = float(2.0 ** (seed % 7 - 3))
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    if specials and n:
        where = torch.randint(0, n, (1 + seed % 4,), generator=g)
        kinds = torch.tensor([math.nan, math.inf, -math.inf, 0.0], dtype=dtype)
        x[where] = kinds[torch.randint(0, 4, (where.numel(),), generator=g)]
    return x


def pieces64(x: torch.Tensor, tiling: Tiling) -> list[torch.Tensor]:
    return list(x.to(torch.float64).split(list(tiling.sizes)))


def assert_close_sums(got: torch.Tensor, ref: list[torch.Tensor], bound: list[torch.Tensor], rtol: float) -> None:
    """``|got - ref| <= rtol · bound`` per piece (``bound``: the sum of the absolute terms)."""
    assert got.dtype == torch.float64 and got.shape == (len(ref),)
    for i, (r, b) in enumerate(zip(ref, bound)):
        assert abs(float(got[i]) - float(r)) <= rtol * float(b) + 1e-300, (i, float(got[i]), float(r), float(b))


@settings(max_examples=300, deadline=None)
@given(tilings(), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1), DEVICES)
def test_sums_and_pow_sums_match_float64_reference(case, dtype, seed, device) -> None:
    tiling, block = case
    seg = segment_plan(tiling, block)
    x = values(seg.numel, dtype, seed)
    ref = pieces64(x, tiling)
    rtol = RTOL.get(dtype, DEFAULT_RTOL)
    assert_close_sums(piece_sums(x, seg, device), [r.sum() for r in ref], [r.abs().sum() for r in ref], rtol)
    for p in (2.0, 1.0, 3.0, 0.5):
        powered = [r.abs().pow(p) for r in ref]
        sums = [t.sum() for t in powered]
        assert_close_sums(piece_pow_sums(x, seg, p, device), sums, sums, rtol)


@settings(max_examples=300, deadline=None)
@given(tilings(), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1), st.booleans(), DEVICES)
def test_max_abs_is_exact_and_propagates_nan(case, dtype, seed, specials, device) -> None:
    tiling, block = case
    seg = segment_plan(tiling, block)
    x = values(seg.numel, dtype, seed, specials)
    got = piece_max_abs(x, seg, device)
    assert got.dtype == torch.float64 and got.shape == (len(tiling.sizes),)
    ref = torch.stack([r.abs().amax() if r.numel() else torch.zeros((), dtype=torch.float64)
                       for r in pieces64(x, tiling)]) if tiling.sizes else torch.zeros(0, dtype=torch.float64)
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    keep = ~torch.isnan(ref)
    assert torch.equal(got[keep], ref[keep])


@settings(max_examples=300, deadline=None)
@given(tilings(), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1), st.booleans(), DEVICES)
def test_stats_columns_match_the_single_functions(case, dtype, seed, specials, device) -> None:
    tiling, block = case
    seg = segment_plan(tiling, block)
    x = values(seg.numel, dtype, seed, specials)
    got = piece_stats(x, seg, device)
    assert got.dtype == torch.float64 and got.shape == (len(tiling.sizes), 3)
    singles = (piece_pow_sums(x, seg, 2.0, device), piece_sums(x, seg, device), piece_max_abs(x, seg, device))
    for column, single in zip(got.unbind(1), singles):
        assert torch.equal(torch.isnan(column), torch.isnan(single))
        keep = ~torch.isnan(single)
        assert torch.equal(column[keep], single[keep])
    if not specials:
        ref = pieces64(x, tiling)
        rtol = RTOL.get(dtype, DEFAULT_RTOL)
        assert_close_sums(got[:, 0], [r.square().sum() for r in ref], [r.square().sum() for r in ref], rtol)
        assert_close_sums(got[:, 1], [r.sum() for r in ref], [r.abs().sum() for r in ref], rtol)


@settings(max_examples=200, deadline=None)
@given(tilings(), st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.integers(0, 2**31 - 1), DEVICES)
def test_dots_match_float64_reference(case, dtype_a, dtype_b, seed, device) -> None:
    tiling, block = case
    seg = segment_plan(tiling, block)
    a, b = values(seg.numel, dtype_a, seed), values(seg.numel, dtype_b, seed + 1)
    products = [x * y for x, y in zip(pieces64(a, tiling), pieces64(b, tiling))]
    rtol = 1e-12 if torch.float64 in (dtype_a, dtype_b) and dtype_a == dtype_b else DEFAULT_RTOL
    assert_close_sums(piece_dots(a, b, seg, device), [t.sum() for t in products], [t.abs().sum() for t in products], rtol)


@settings(max_examples=300, deadline=None)
@given(tilings(), st.integers(0, 2**31 - 1))
def test_every_element_counted_once_in_its_piece(case, seed) -> None:
    tiling, block = case
    seg = segment_plan(tiling, block)
    assert seg.numel == tiling.numel and seg.pieces == len(tiling.sizes)
    expected = torch.tensor(tiling.sizes, dtype=torch.float64)
    assert torch.equal(piece_sums(torch.ones(seg.numel), seg), expected)
    assert torch.equal(piece_sums(torch.ones(seg.numel, dtype=torch.bool), seg), expected)  # counts of a mask
    x = values(seg.numel, torch.float32, seed, specials=True)
    nans = [int(torch.isnan(r).sum()) for r in pieces64(x, tiling)]
    assert piece_sums(torch.isnan(x), seg).tolist() == nans
    # the geometry: bodies are whole rows inside their piece, the rest is bits
    assert sum(seg.row_lengths) == seg.row_end <= seg.numel // block
    assert seg.body_rows * block + sum(seg.bit_lengths) == seg.numel
    assert sum(seg.bit_spans) == sum(seg.bit_lengths)


@given(tilings(), st.data())
@settings(max_examples=100, deadline=None)
def test_param_index_maps_parameters_to_their_pieces(case, data) -> None:
    tiling, block = case
    seg = segment_plan(tiling, block)
    params = data.draw(st.permutations(list(range(len(tiling.piece)))))
    index = param_index(seg, params, torch.device("cpu"))
    assert index.dtype == torch.int64 and index.tolist() == [tiling.piece[k] for k in params]
    assert param_index(seg, params, torch.device("cpu")) is index  # cached


def test_plans_are_cached_and_sizes_plans_number_pieces_as_parameters() -> None:
    t = Tiling((3, 100, 0, 5), (1, 2), (0, 3))
    assert segment_plan(t) is segment_plan(Tiling((3, 100, 0, 5), (1, 2), (0, 3)))
    seg = sizes_plan([4, 0, 70])
    assert seg.param_piece == (0, 1, 2) and seg.numel == 74 and sizes_plan((4, 0, 70)) is seg


def test_empty_buffers_and_wrong_buffers() -> None:
    for seg in (sizes_plan([]), sizes_plan([0, 0]), segment_plan(Tiling((0,), (0,), ()))):
        x = torch.zeros(0)
        for fn in (piece_sums, piece_max_abs, piece_pow_sums):
            out = fn(x, seg)
            assert out.tolist() == [0.0] * seg.pieces and out.dtype == torch.float64
        assert piece_stats(x, seg).tolist() == [[0.0] * 3] * seg.pieces
        assert piece_dots(x, x, seg).tolist() == [0.0] * seg.pieces
    with pytest.raises(ValueError, match="1-D buffer of 5"):
        piece_sums(torch.zeros(6), sizes_plan([5]))
    with pytest.raises(ValueError):
        piece_sums(torch.zeros(1, 5), sizes_plan([5]))


def test_long_piece_is_far_more_precise_than_one_float32_reduction() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1 << 22, generator=g) + 0.5  # same-sign values: a long float32 sum drifts
    seg = sizes_plan([17, (1 << 22) - 17 - 5, 5])
    ref = [r.to(torch.float64) for r in x.split([17, (1 << 22) - 22, 5])]
    sq = piece_pow_sums(x, seg)
    s = piece_sums(x, seg)
    for i, r in enumerate(ref):
        assert abs(float(sq[i]) / float(r.square().sum()) - 1) < 1e-9
        assert abs(float(s[i]) / float(r.sum()) - 1) < 1e-9


def test_non_contiguous_rows_of_a_partition_slice() -> None:
    """A partition is often a view into a larger flat buffer: offsets not aligned to the row width."""
    base = torch.randn(1000, dtype=torch.float64).to(torch.float32)
    buf = base[13:13 + 900]
    seg = sizes_plan([100, 700, 100])
    ref = [r.to(torch.float64) for r in buf.split([100, 700, 100])]
    got = piece_pow_sums(buf, seg)
    for i, r in enumerate(ref):
        assert abs(float(got[i]) - float(r.square().sum())) <= 1e-6 * float(r.square().sum())


def test_grad_stats_fast_constructor_is_a_normal_frozen_dataclass() -> None:
    rows = [(1.5, 2.0, -0.25, 1, 2, 10), (math.nan, math.nan, 0.0, 3, 0, 0), (0.0, 0.0, 0.0, 0, 0, 7)]
    built = _grad_stats(["a", "b", "c"], *map(list, zip(*rows)))
    assert list(built) == ["a", "b", "c"] and _grad_stats([], [], [], [], [], [], []) == {}
    for fast, args in zip(built.values(), rows):
        slow = GradStats(*args)
        assert type(fast) is GradStats and repr(fast) == repr(slow) and vars(fast) == vars(slow)
        assert dataclasses.astuple(fast) == dataclasses.astuple(slow) or math.isnan(args[0])
        assert dataclasses.asdict(fast).keys() == dataclasses.asdict(slow).keys()
        assert dataclasses.replace(fast, numel=3) == dataclasses.replace(slow, numel=3) or math.isnan(args[0])
        assert pickle.loads(pickle.dumps(fast)).numel == slow.numel and copy.deepcopy(fast).mean == slow.mean
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.norm = 0.0  # type: ignore[misc]
    fast, slow = built["a"], GradStats(*rows[0])
    assert fast == slow and hash(fast) == hash(slow)
    assert [f.name for f in dataclasses.fields(GradStats)] == list(vars(fast))  # the builder names every field


# --- reductions over a layout, in one process ------------------------------------------------------------------------
# Single-rank groups communicate nothing, so the public reductions run here; for a rank of a 2-rank layout only the
# local partials are checked (no process group). Padding holds a sentinel (huge, or nan): it must never count.
from zero_dtensor.ops import partials, reductions  # noqa: E402
from zero_dtensor.layout.flat import FlatLayout, GroupLayout, Packing, ParamLayout  # noqa: E402
from zero_dtensor.core.state import FlatState  # noqa: E402
from zero_dtensor.core.storage import FlatStorage  # noqa: E402


@st.composite
def layouts(draw) -> tuple[FlatLayout, list[ParamLayout]]:
    """A ragged layout of 1-3 groups for rank ``rank`` of ``world``; params in model order."""
    world = draw(st.sampled_from((1, 1, 2)))
    rank = draw(st.integers(0, world - 1))
    n = draw(st.integers(1, 14))
    sizes = draw(st.lists(st.one_of(st.just(0), st.integers(1, 40), st.integers(40, 400)), min_size=n, max_size=n))
    n_groups = draw(st.integers(1, min(3, n)))
    assignment = draw(st.lists(st.integers(0, n_groups - 1), min_size=n, max_size=n))
    align = draw(st.sampled_from((1, 4, 16)))
    offsets = [0] * n_groups
    params = []
    for i, size in enumerate(sizes):
        g = assignment[i]
        params.append(ParamLayout(f"p{i}", torch.Size([size]), g, offsets[g]))
        offsets[g] += size + (-size) % align
    groups = []
    for g in range(n_groups):
        flat = offsets[g] + (-offsets[g]) % world + world * draw(st.integers(0, 20))
        groups.append(GroupLayout(g, world, rank, flat // world, Packing.CONTIGUOUS))
    return FlatLayout(groups=tuple(groups), params=tuple(params)), params


def make_state(layout: FlatLayout, dtype: torch.dtype, seed: int, pad: float, scale: float = 1.0,
               specials: bool = False) -> FlatState:
    parts = [torch.full((g.partition_numel,), pad, dtype=torch.float64) for g in layout.groups]
    storage = FlatStorage(layout=layout, partitions=tuple(parts), process_groups=(None,) * len(parts),
                          loss_scale=scale, device=torch.device("cpu"), is_current=lambda: True)
    state = FlatState(storage)
    for p in layout.params:  # fill every parameter's fragment, leave the padding
        frag = state.fragment(p)
        frag.copy_(values(frag.numel(), torch.float64, seed + p.offset, specials))
    final = tuple(part.to(dtype) for part in parts)
    return FlatState(FlatStorage(layout=layout, partitions=final, process_groups=storage.process_groups,
                                 loss_scale=scale, device=storage.device, is_current=storage.is_current))


def ref_norm(x: torch.Tensor, p: float) -> float:
    if not x.numel():
        return 0.0
    return float(x.abs().amax()) if math.isinf(p) else float(x.abs().pow(p).sum() ** (1 / p))


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from((torch.float32, torch.bfloat16, torch.float64)), st.integers(0, 2**31 - 1),
       st.sampled_from((1e30, math.nan, -7.0)), st.data())
def test_local_partials_take_each_selected_fragment_in_selection_order(case, dtype, seed, pad, data) -> None:
    layout, params = case
    state = make_state(layout, dtype, seed, pad)
    chosen = data.draw(st.lists(st.sampled_from(params), unique_by=lambda p: p.name, max_size=len(params)))
    sel = state.selection(chosen)  # any order, any subset: dense and sparse groups, interleaved groups
    frags = [state.fragment(p).to(torch.float64) for p in chosen]
    for p_norm in (2.0, 1.0, 3.0, math.inf):
        got = reductions._partials(state, sel, p_norm)
        assert got.shape == (len(chosen),) and got.dtype == torch.float32
        for j, f in enumerate(frags):
            want = ref_norm(f, p_norm) if math.isinf(p_norm) else float(f.abs().pow(p_norm).sum())
            assert math.isclose(float(got[j]), want, rel_tol=2e-5, abs_tol=1e-30), (p_norm, j, float(got[j]), want)
    cols = partials.per_param(state, partials.parts_of((state,), sel), reductions._stat_columns, torch.float64,
                                 (5,))
    assert cols.shape == (len(chosen), 5)
    for j, f in enumerate(frags):
        assert math.isclose(float(cols[j, 0]), float(f.square().sum()), rel_tol=2e-5, abs_tol=1e-30)
        assert abs(float(cols[j, 1]) - float(f.sum())) <= 2e-5 * float(f.abs().sum()) + 1e-30
        assert float(cols[j, 4]) == ref_norm(f, math.inf)
        assert float(cols[j, 2]) == float(cols[j, 3]) == 0.0  # padding nan is not counted


@settings(max_examples=100, deadline=None)
@given(layouts().filter(lambda c: all(g.world_size == 1 for g in c[0].groups)), st.integers(0, 2**31 - 1),
       st.sampled_from((1.0, 8.0)), st.booleans(), st.data())
def test_public_reductions_on_a_single_rank_layout(case, seed, scale, specials, data) -> None:
    layout, params = case
    state = make_state(layout, torch.float32, seed, math.nan, scale, specials)
    other = make_state(layout, torch.float32, seed + 1, 1e30, scale)
    chosen = data.draw(st.lists(st.sampled_from(params), unique_by=lambda p: p.name, max_size=len(params)))
    sel = state.selection(chosen)
    names = [p.name for p in chosen]
    true = {p.name: state.fragment(p).to(torch.float64) / scale for p in chosen}
    theirs = {p.name: other.fragment(p).to(torch.float64) / scale for p in chosen}
    norms = reductions.norms(state, sel, 2.0)
    assert list(norms) == names
    stats = reductions.stats(state, sel)
    assert list(stats) == names
    for n in names:
        t = true[n]
        finite = bool(torch.isfinite(t).all())
        s = stats[n]
        assert s.numel == t.numel() and s.nan_count == int(torch.isnan(t).sum())
        assert s.inf_count == int(torch.isinf(t).sum())
        if finite:
            assert math.isclose(float(norms[n]), ref_norm(t, 2), rel_tol=2e-6, abs_tol=1e-30)
            assert math.isclose(s.norm, ref_norm(t, 2), rel_tol=1e-6, abs_tol=1e-30)
            assert s.max_abs == ref_norm(t, math.inf)
            assert abs(s.mean - (float(t.mean()) if t.numel() else 0.0)) <= 1e-6 * float(t.abs().mean() if t.numel()
                                                                                          else 0) + 1e-30
        elif s.nan_count:
            assert math.isnan(s.max_abs) and math.isnan(s.norm)
        else:
            assert s.max_abs == math.inf and s.norm == math.inf
    if all(bool(torch.isfinite(true[n]).all()) for n in names):
        every = torch.cat([true[n] for n in names]) if names else torch.zeros(0, dtype=torch.float64)
        assert math.isclose(float(reductions.global_norm(state, sel, 2.0)), ref_norm(every, 2), rel_tol=2e-6,
                            abs_tol=1e-30)
        dots, mine, their_norms = reductions.dots(state, other, sel, True)
        assert list(dots) == names
        for n in names:
            prod = true[n] * theirs[n]
            assert abs(float(dots[n]) - float(prod.sum())) <= 2e-5 * float(prod.abs().sum()) + 1e-30
            assert math.isclose(float(mine[n]), ref_norm(true[n], 2), rel_tol=2e-6, abs_tol=1e-30)
            assert math.isclose(float(their_norms[n]), ref_norm(theirs[n], 2), rel_tol=2e-6, abs_tol=1e-30)


@pytest.mark.parametrize("device", [torch.device("cpu", 1), torch.device("cpu")], ids=["accelerator", "host"])
def test_stats_count_nonfinite_rows_on_the_device_and_flag_what_they_miss(device: torch.device) -> None:
    """issue 42: piece_stats(counts=True) counts nan/inf without a host branch on an accelerator (``cpu:1``, the
    tests' stand-in for one): exact with up to max(COUNT_ROWS, rows/COUNT_SHARE) non-finite rows (bits and rows
    straddling pieces included), the 'missed' flag set beyond; max |x| by vector_norm(inf) propagates nan as aminmax
    did. In host memory (issue 55: a branch costs no device sync there) every count is exact and nothing is
    flagged."""
    from zero_dtensor.layout import segments

    sizes = [700, 64 * 40 + 5, 3, 64 * 200, 130]
    seg = segments.sizes_plan(sizes, 64)
    for bad_rows, missed in ((5, False), (segments.COUNT_ROWS + 3, device.index is not None)):
        x = torch.randn(seg.numel, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(bad_rows))
        at = torch.randperm(seg.numel - 64, generator=torch.Generator().manual_seed(1))[: bad_rows * 3]
        where = torch.unique(at // 64)[:bad_rows] * 64 + 7  # one special in each of `bad_rows` distinct rows
        x[where[::2]] = math.nan
        x[where[1::2]] = -math.inf
        x[3], x[701] = math.inf, math.nan  # bits
        got = piece_stats(x, seg, device, counts=True)
        assert got.shape == (len(sizes), 6)
        plain = piece_stats(x, seg, device)
        assert torch.equal(torch.isnan(got[:, :3]), torch.isnan(plain))
        assert torch.equal(got[:, :3][~torch.isnan(plain)], plain[~torch.isnan(plain)])
        pieces = x.split(sizes)
        want_nan = torch.tensor([float(torch.isnan(p).sum()) for p in pieces], dtype=torch.float64)
        want_inf = torch.tensor([float(torch.isinf(p).sum()) for p in pieces], dtype=torch.float64)
        assert bool(got[:, 5].eq(1.0).all()) is missed and bool(got[:, 5].eq(0.0).all()) is not missed
        if not missed:
            assert torch.equal(got[:, 3], want_nan) and torch.equal(got[:, 4], want_inf)
        else:
            assert bool((got[:, 3] <= want_nan).all() and (got[:, 4] <= want_inf).all())
        assert torch.equal(torch.isnan(got[:, 2]), want_nan > 0)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                    (torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_dot_rows_accelerator_recipe_is_bitwise_the_cpu_one_and_makes_no_upcast_copy(dtypes) -> None:
    """The accelerator recipe of the per-row dots (one ``addcmul`` casting inside its kernel, then ``sum``) gives
    bitwise the CPU recipe's values, nan and inf included, and stores nothing but the float32 products and the row
    sums: no float32 copy of an operand (``_to_copy``), 12 bytes of traffic per bf16 pair instead of 20."""
    from workers.dispatch_probe import DispatchProbe
    from zero_dtensor.layout.segments import _dot_rows

    gen = torch.Generator().manual_seed(7)
    rows, width = 96, 64
    x = (torch.randn(rows, width, generator=gen) * 100).to(dtypes[0])
    y = torch.randn(rows, width, generator=gen).to(dtypes[1])
    x[3, 5], y[7, 1], x[9, 2], y[9, 3] = math.nan, math.inf, -math.inf, math.inf
    cpu_recipe = _dot_rows(x, y, in_kernel_cast=False)
    with DispatchProbe() as probe:
        accelerator_recipe = _dot_rows(x, y, in_kernel_cast=True)
    assert accelerator_recipe.dtype == torch.float32
    assert torch.equal(accelerator_recipe.isnan(), cpu_recipe.isnan())
    assert torch.equal(accelerator_recipe.nan_to_num(), cpu_recipe.nan_to_num())
    assert "aten._to_copy.default" not in probe.by_op, probe.by_op
    products, sums = rows * width * 4, rows * 4
    assert probe.written + probe.produced <= products + sums + 4, (probe.written, probe.produced)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(0), st.integers(1, 40)), min_size=1, max_size=30), st.integers(0, 2**31 - 1),
       st.sampled_from(("sum", "max")), st.integers(1, 2), st.booleans(), st.integers(0, 5))
def test_host_segment_reduce_is_torchs(lengths, seed, how, width, specials, unused) -> None:
    """issue 55: the host recipe's segment reduction (numpy's ``reduceat``) gives torch's ``segment_reduce`` values
    (``initial=0`` for max): empty segments anywhere (leading, trailing, every one), values past the last offset
    (``unused`` of them), nan and inf, 1-D and 2-D values; sums to a float64 rounding or two (pairwise there)."""
    from zero_dtensor.layout.cpu_rows import host_segments, segment_reduce

    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    n = int(offsets[-1]) + unused
    values = torch.randn((n, width), generator=g, dtype=torch.float64)
    values = values[:, 0] if width == 1 else values
    if how == "max":
        values = values.abs()
    if specials and n:
        values.view(-1)[torch.randint(0, values.numel(), (3,), generator=g)] = torch.tensor([math.nan, math.inf, 0.0],
                                                                                             dtype=torch.float64)
    want = torch.segment_reduce(values[: int(offsets[-1])], how, offsets=offsets, unsafe=True,
                                initial=0.0 if how == "max" else None)
    got = segment_reduce(values, offsets, how)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    if how == "max":
        assert torch.equal(got[keep], want[keep])
    else:
        assert torch.allclose(got[keep], want[keep], rtol=1e-14, atol=1e-14)
    planned = host_segments(offsets)  # derived once with a plan: the same values, call after call
    for _ in range(2):
        again = segment_reduce(values, planned, how)
        assert again.shape == got.shape and torch.equal(again.nan_to_num(7.0), got.nan_to_num(7.0))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=0.0, allow_infinity=True), st.just(math.nan)), min_size=0, max_size=50),
       st.integers(0, 2**31 - 1))
def test_stats_norms_are_correctly_rounded_square_roots(values, seed) -> None:
    """``stats``' norms: ``math.sqrt`` of each float64 sum of squares, bit for bit (torch's vectorized ``sqrt`` is
    not correctly rounded), from a column view as ``stats`` takes them, over values of every magnitude."""
    from zero_dtensor.ops.reductions import _sqrt_list

    wide = torch.rand(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    wide = wide * torch.exp(torch.randn(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 40)
    column = torch.stack([torch.cat([torch.tensor(values, dtype=torch.float64), wide])] * 2, dim=1)[:, 1]
    got, want = _sqrt_list(column), list(map(math.sqrt, column.tolist()))
    assert len(got) == len(want)
    assert all(g == w or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want))
