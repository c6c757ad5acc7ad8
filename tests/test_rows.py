"""Issue 11: row copies (``zero_dtensor.layout.rows``) and the ZeRO-3 reorder built on them, against per-run references
(hypothesis, no processes).

- ``row_map(...).copy`` equals copying every run on its own, for random disjoint runs, with and without tiling the
  destination, across dtypes, by index and by run families (strided copies), and declines rows narrower than
  ``MIN_ROW_BYTES``; run families cover every run once, and a stack of equal layers makes one family per tensor;
- a chunked (ZeRO-3) group's ``to_param_order`` (all_gather rows to parameter order) and ``fill_for_reduce`` (each
  rank's partition into its rows, summed over ranks as the all_reduce does) give the same buffer as the reference
  ``split_with_sizes_copy`` on the row path and on the per-piece fallback, for parameters whose chunks share a
  wide common width (the row path) and for any shapes (mostly the fallback);
- ``piece_copy``: a list of pieces (views of one buffer in any order, 2-D ones among them, plus tensors of their
  own) is written into a flat buffer exactly as ``torch.cat`` of the pieces, by rows, by runs or piece by piece, and
  ``piece_key`` refuses pieces that are not runs of memory (non-contiguous, another dtype).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_dtensor.layout import rows as rows_mod
from zero_dtensor.layout.flat import FlatLayout, GroupLayout, Packing, ParamLayout
from zero_dtensor.materialize.placements import assembly_of
from zero_dtensor.layout.plan import plan_for
from zero_dtensor.layout.rows import MIN_ROW_BYTES, piece_copy, piece_key, row_map, run_families

#: how a RowMap moves its runs: by strided copies of run families (the default where they are few) or by index
ROW_PATHS = ["families", "indices"]


@contextlib.contextmanager
def row_path(path: str):
    """Row maps built inside copy by families (as by default) or, with ``"indices"``, never by families."""
    kept = rows_mod.MAX_FAMILIES
    rows_mod.MAX_FAMILIES = kept if path == "families" else 0
    try:
        yield
    finally:
        rows_mod.MAX_FAMILIES = kept


@st.composite
def runs(draw):
    """``(width, runs, src_numel, dst_numel, tiles)``: disjoint runs in both buffers, multiples of ``width``."""
    width = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = draw(st.integers(1, 12))
    lengths = [width * draw(st.integers(0, 4)) for _ in range(n)]
    src_order = draw(st.permutations(list(range(n))))
    dst_order = draw(st.permutations(list(range(n))))
    tiles = draw(st.booleans())
    src, dst = [0] * n, [0] * n
    at = 0
    for i in src_order:
        at += width * draw(st.integers(0, 2))
        src[i] = at
        at += lengths[i]
    src_numel = at + width * draw(st.integers(0, 2))
    at = 0
    for i in dst_order:
        at += 0 if tiles else width * draw(st.integers(0, 2))
        dst[i] = at
        at += lengths[i]
    dst_numel = at + (0 if tiles else width * draw(st.integers(0, 2)))
    return width, list(zip(src, dst, lengths)), max(src_numel, width), max(dst_numel, width), tiles


@st.composite
def scatters(draw):
    """``(width, runs, src_numel, dst_numel)``: runs that read the whole source in its order and land, in that
    order, at gaps of the destination (a partition into its rows of a parameter-order buffer)."""
    width = draw(st.sampled_from([1, 2, 4, 8, 16]))
    lengths = [width * draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 12)))]
    src, dst = [], []
    at = dst_at = 0
    for n in lengths:
        dst_at += width * draw(st.integers(0, 3))
        src.append(at)
        dst.append(dst_at)
        at += n
        dst_at += n
    dst_numel = dst_at + width * draw(st.integers(1, 2))  # never tiled
    return width, list(zip(src, dst, lengths)), at, dst_numel


def _buffers(spans, src_numel: int, dst_numel: int, src_dtype: torch.dtype, dst_dtype: torch.dtype):
    """Random source and destination buffers, the destination expected after copying every run on its own, and the
    destination's element size."""
    src = torch.randn(src_numel).to(src_dtype)
    dst = torch.randn(dst_numel).to(dst_dtype)
    expected = dst.clone()
    for s, d, n in spans:
        expected[d : d + n] = src[s : s + n]
    return src, dst, expected, torch.empty((), dtype=dst_dtype).element_size()


@pytest.mark.parametrize("path", ROW_PATHS)
@settings(max_examples=100, deadline=None)
@given(case=scatters(), dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]))
def test_row_copy_reading_the_source_in_order(path, case, dtypes) -> None:
    """The runs read the source whole and in order: one ``index_copy_`` of the source itself (same dtype), or the
    run families' strided copies, equal to copying every run; the rest of the destination untouched."""
    width, spans, src_numel, dst_numel = case
    src, dst, expected, esize = _buffers(spans, src_numel, dst_numel, *dtypes)
    with row_path(path):
        m = row_map(*zip(*spans), src_numel, dst_numel, esize)
    if m is not None and path == "indices":
        assert m.families is None
    if m is None:
        assert math.gcd(src_numel, dst_numel, *(v for run in spans for v in run)) * esize < MIN_ROW_BYTES
        return
    assert m.reads_src_in_order and not m.tiles_dst
    m.copy(src, dst)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("path", ROW_PATHS)
@settings(max_examples=200, deadline=None)
@given(case=runs(), dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                            (torch.float64, torch.float64), (torch.bfloat16, torch.float32)]))
def test_row_copy_equals_copying_each_run(path, case, dtypes) -> None:
    width, spans, src_numel, dst_numel, _ = case
    src, dst, expected, esize = _buffers(spans, src_numel, dst_numel, *dtypes)
    with row_path(path):
        m = row_map(*zip(*spans), src_numel, dst_numel, esize) if spans else None
    if m is not None and path == "indices":
        assert m.families is None
    if not any(n for _, _, n in spans):
        assert m is None
        return
    common = math.gcd(src_numel, dst_numel, *(v for run in spans for v in run if run[2]))  # before merging
    if m is None:
        assert common * esize < MIN_ROW_BYTES, "declined although the runs share a wide enough width"
        return
    assert m.width * esize >= MIN_ROW_BYTES and m.width % common == 0  # merging adjacent runs only widens rows
    covered = sum(n for _, _, n in spans)
    assert m.rows * m.width == covered
    m.copy(src, dst)
    assert torch.equal(dst, expected)


def chunked_layouts(world: int, shapes: list[tuple[int, ...]], extra: int) -> list[FlatLayout]:
    """One chunked (ZeRO-3) group of ``shapes`` as each of ``world`` ranks sees it."""
    entries, offset = [], 0
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        chunk = math.ceil(numel / world)
        entries.append(ParamLayout(f"p{i}", torch.Size(shape), 0, offset, chunk_numel=chunk))
        offset += chunk
    return [FlatLayout(groups=(GroupLayout(0, world, r, offset + extra, Packing.CHUNKED),),
                       params=tuple(entries)) for r in range(world)]


def reference_order(layout: FlatLayout, gathered_rows: torch.Tensor) -> torch.Tensor:
    gp = plan_for(layout).groups[0]
    world = layout.groups[0].world_size
    out = torch.empty(gp.param_order.numel)
    blocks = [b.view(world, s) for b, s in zip(out.split_with_sizes(list(gp.param_order.sizes)), gp.gathered.sizes)]
    torch.split_with_sizes_copy(gathered_rows, list(gp.gathered.sizes), dim=1, out=blocks)
    return out


def check_reorder(layouts: list[FlatLayout]) -> bool:
    """``to_param_order`` and the ranks' ``fill_for_reduce`` summed equal the reference; returns whether the row
    path was taken."""
    g0 = layouts[0].groups[0]
    world, P = g0.world_size, g0.partition_numel
    parts = [torch.randn(P) for _ in range(world)]
    rows = torch.stack(parts)
    expected = reference_order(layouts[0], rows)
    gp = plan_for(layouts[0]).groups[0]
    area = torch.full((world * P,), float("nan"))
    got = assembly_of(g0).to_param_order(rows.reshape(-1), g0, gp, area)
    assert torch.equal(got, expected)
    total = torch.zeros(world * P)
    for r, layout in enumerate(layouts):
        g = layout.groups[0]
        plan = plan_for(layout).groups[0]
        region = torch.full((world * P,), float("nan"))
        assembly_of(g).fill_for_reduce(region, g, plan, parts[r], None)
        total += region
    # every element of a parameter has exactly one contributor; the blocks' padding and gaps may differ
    for k, p in enumerate(gp.params):
        start = sum(gp.param_order.sizes[: gp.param_order.piece[k]])
        assert torch.equal(total[start : start + p.numel], expected[start : start + p.numel]), p.name
    return gp.column_rows(4) is not None  # float32 layouts


wide_shapes = st.lists(st.one_of(st.tuples(st.integers(1, 6).map(lambda n: 64 * n)),
                                 st.tuples(st.integers(1, 4).map(lambda n: 16 * n), st.sampled_from([8, 16]))),
                       min_size=1, max_size=12)
any_shapes = st.lists(st.one_of(st.tuples(st.integers(1, 40)), st.tuples(st.integers(1, 9), st.integers(1, 9))),
                      min_size=1, max_size=10)


@pytest.mark.parametrize("path", ROW_PATHS)
@settings(max_examples=60, deadline=None)
@given(world=st.sampled_from([1, 2, 4]), shapes=wide_shapes, extra=st.sampled_from([0, 64]))
def test_chunked_reorder_by_rows(path, world, shapes, extra) -> None:
    with row_path(path):
        took_rows = check_reorder(chunked_layouts(world, shapes, extra))
    if world > 1:  # one rank: the whole group is one run, copied as such (rows.LONG_RUN)
        assert took_rows, "wide chunks must take the row path"


@settings(max_examples=40, deadline=None)
@given(world=st.sampled_from([2, 4]), layer=st.lists(st.sampled_from([(64, 32), (32,), (16, 8), (128,)]),
                                                       min_size=1, max_size=4, unique=True),
       layers=st.integers(4, 9), extra=st.sampled_from([0, 64]))
def test_repeated_layers_reorder_by_a_few_strided_copies(world, layer, layers, extra) -> None:
    """A stack of equal layers (ZeRO-3): the all_gather reorder and each rank's fill are at most one strided copy
    per tensor of a layer and one for the partition's padding (the ranks' rows of a tensor are one family), the
    same number whatever the number of layers, and equal the reference."""
    counts = set()
    for n in (layers, 4 * layers):
        layouts = chunked_layouts(world, layer * n, extra)
        assert check_reorder(layouts)
        gp = plan_for(layouts[0]).groups[0]
        assert gp.column_rows(4).families is not None and gp.own_column_rows(4).families is not None
        counts.add((len(gp.column_rows(4).families), len(gp.own_column_rows(4).families)))
    assert len(counts) == 1
    gathered, own = counts.pop()
    assert gathered <= len(layer) + 1 and own <= len(layer) + 1


@st.composite
def repeated_runs(draw):
    """``(runs, src_numel, dst_numel)``: a pattern of up to 3 runs (multiples of 16 elements) repeated 4-12 times,
    each repeat one step further in both buffers (the source's pattern in any order)."""
    lengths = [16 * draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3)))]
    order = draw(st.permutations(list(range(len(lengths)))))
    src_pos, at = {}, 0
    for i in order:
        at += 16 * draw(st.integers(0, 2))
        src_pos[i] = at
        at += lengths[i]
    src_step = at + 16 * draw(st.integers(0, 2))
    dst_pos, at = [], 0
    for n in lengths:
        at += 16 * draw(st.integers(0, 2))
        dst_pos.append(at)
        at += n
    dst_step = at + 16 * draw(st.integers(1, 2))  # a gap after each repeat: repeats never merge into one run
    repeats = draw(st.integers(4, 12))
    spans = [(r * src_step + src_pos[i], r * dst_step + dst_pos[i], n)
             for r in range(repeats) for i, n in enumerate(lengths)]
    return spans, repeats * src_step, repeats * dst_step


@settings(max_examples=100, deadline=None)
@given(case=repeated_runs(), dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                     (torch.bfloat16, torch.float32)]))
def test_repeated_runs_copy_by_families(case, dtypes) -> None:
    """Runs that repeat with a period take the family path (one strided copy per run of the pattern at most,
    casting) and equal copying every run."""
    spans, src_numel, dst_numel = case
    src, dst, expected, esize = _buffers(spans, src_numel, dst_numel, *dtypes)
    m = row_map(*zip(*spans), src_numel, dst_numel, esize)
    assert m is not None and m.families is not None
    assert len(m.families) <= len(spans) // 4
    m.copy(src, dst)
    assert torch.equal(dst, expected)


@settings(max_examples=200, deadline=None)
@given(case=runs())
def test_run_families_cover_the_runs(case) -> None:
    """Every run is moved by exactly one family's copy: their elements add up, and copying by families equals
    copying run by run."""
    _, spans, src_numel, dst_numel, _ = case
    merged = rows_mod._merged_runs(*zip(*spans))
    families = run_families(merged, limit=len(merged), min_runs=1)
    if not merged:
        assert families is None
        return
    assert families is not None  # at most one family per run
    assert sum(f.outer * f.count * f.length for f in families) == sum(n for _, _, n in merged)
    src, dst, expected, _ = _buffers(spans, src_numel, dst_numel, torch.float32, torch.float32)
    for f in families:
        f.copy(src, dst)
    assert torch.equal(dst, expected)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), any_shapes, st.integers(0, 3))
def test_chunked_reorder_any_shapes(world, shapes, extra) -> None:
    check_reorder(chunked_layouts(world, shapes, extra))


def test_chunked_reorder_fallback_matches(monkeypatch) -> None:
    """The per-piece path (rows declined) gives the same buffers as the row path for the same layout."""
    shapes = [(128,), (32, 16), (64,), (16, 8)]
    assert check_reorder(chunked_layouts(2, shapes, 0))
    monkeypatch.setattr(rows_mod, "MIN_ROW_BYTES", 1 << 30)
    layouts = chunked_layouts(2, shapes, 0)  # new layouts: plans (and their row maps) are cached per layout
    assert not check_reorder(layouts)


@pytest.mark.parametrize("element_size", [2, 4])
def test_narrow_and_long_rows_declined(element_size) -> None:
    width = MIN_ROW_BYTES // element_size
    assert row_map([0], [width], [width], width, 2 * width, element_size) is not None
    assert row_map([0], [width // 2], [width // 2], width, 2 * width, element_size) is None
    long = rows_mod.LONG_RUN  # a copy per run is cheaper than rows once runs are this long on average
    assert row_map([0, long], [long, 0], [long, long], 2 * long, 2 * long, element_size) is None
    assert row_map([0, long], [long, 0], [long // 2, long // 2], 2 * long, 2 * long, element_size) is not None


@st.composite
def pieces_of_a_block(draw):
    """``(pieces, padding)``: views of one block in a random order (some 2-D), and maybe tensors of their own."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    unit = draw(st.sampled_from([1, 8, 16]))
    n = draw(st.integers(1, 10))
    numels = [unit * draw(st.integers(1, 6)) for _ in range(n)]
    gap = unit * draw(st.integers(0, 2))
    block = torch.randn(sum(numels) + gap * (n + 1)).to(dtype)
    order = draw(st.permutations(list(range(n))))
    starts, at = [0] * n, gap
    for i in order:  # where piece i lies in the block
        starts[i] = at
        at += numels[i] + gap
    pieces = []
    for i, (s0, k) in enumerate(zip(starts, numels)):
        view = block.narrow(0, s0, k)
        pieces.append(view.view(unit, k // unit) if draw(st.booleans()) else view)
    for _ in range(draw(st.integers(0, 2))):  # e.g. DeepSpeed's zero padding: a tensor of its own
        pieces.insert(draw(st.integers(0, len(pieces))), torch.randn(unit * draw(st.integers(1, 3))).to(dtype))
    return pieces, draw(st.integers(0, 2)) * unit


@settings(max_examples=150, deadline=None)
@given(pieces_of_a_block())
def test_piece_copy_equals_cat(case) -> None:
    pieces, tail = case
    expected = torch.cat([p.reshape(-1) for p in pieces])
    flat = torch.full((expected.numel() + tail,), float("nan"), dtype=expected.dtype)
    key = piece_key(pieces)
    assert key is not None
    plan = piece_copy(key, flat.element_size(), flat.numel())
    assert plan is not None  # at most 2 pieces of their own, at most 10 runs
    plan.copy(pieces, flat)
    assert torch.equal(flat[: expected.numel()], expected)
    assert flat[expected.numel():].isnan().all(), "nothing past the pieces is written"
    if pieces[0]._base is not None:  # the block is the first piece's storage: every view of it is read as runs
        assert len(plan.outside) == sum(p._base is None for p in pieces)


def test_piece_plans_by_rows_runs_and_pieces() -> None:
    """ZeRO-1's layout (views in order) is one block copy, ZeRO-2's (reversed) one row copy; a non-contiguous piece
    or one of another dtype refuses the plan."""
    block = torch.randn(96 * 50)  # over rows.LONG_RUN in all: in order, one run copied as such
    in_order = [block.narrow(0, 96 * i, 96).view(8, 12) for i in range(50)]
    reversed_ = in_order[::-1]
    for pieces, by_rows in ((in_order, False), (reversed_, True)):
        key = piece_key(pieces)
        plan = piece_copy(key, 4, block.numel())
        assert (plan.rows is not None) == by_rows and (by_rows or len(plan.runs) == 1) and not plan.outside
        flat = torch.empty(block.numel())
        plan.copy(pieces, flat)
        assert torch.equal(flat, torch.cat([p.reshape(-1) for p in pieces]))
    assert piece_key([block.view(50, 96).t()]) is None  # not contiguous
    assert piece_key([block[:4], block.double()[:4]]) is None  # another dtype
    assert piece_key([block[:4], torch.empty(4, device="meta")]) is None  # another device
    # more than FEW_COPIES extra copies: no plan, the caller copies piece by piece
    separate = [torch.randn(8) for _ in range(rows_mod.FEW_COPIES + 2)]  # contiguous_gradients: false
    assert piece_copy(piece_key(separate), 4, 8 * len(separate)) is None
    odd = torch.randn(7 * 40)
    backwards = [odd.narrow(0, 7 * i, 7) for i in reversed(range(40))]  # rows of 7 elements: too narrow
    assert piece_copy(piece_key(backwards), 4, odd.numel()) is None
    few = backwards[:rows_mod.FEW_COPIES]
    plan = piece_copy(piece_key(few), 4, 7 * len(few))
    assert plan is not None and plan.rows is None and len(plan.runs) == len(few)
    flat = torch.empty(7 * len(few))
    plan.copy(few, flat)
    assert torch.equal(flat, torch.cat(few))


def test_staging_scratch_is_kept_while_free() -> None:
    """``set_full_``'s staging buffer (``BufferPool.scratch``): the kept buffer comes back once nothing holds it,
    a held one is never handed out again, a larger request replaces it, ``release`` frees it."""
    from zero_dtensor.materialize.buffers import BufferPool

    pool = BufferPool()
    cpu = torch.device("cpu")
    first = pool.scratch(("k",), 100, torch.float32, cpu)
    ptr = first.data_ptr()
    held = first
    del first
    again = pool.scratch(("k",), 100, torch.float32, cpu)
    assert again.data_ptr() != ptr, "a buffer still held must not be handed out"
    del held, again
    smaller = pool.scratch(("k",), 60, torch.float32, cpu)  # the kept one (the second), a view of its start
    assert smaller.numel() == 60 and smaller.untyped_storage().nbytes() >= 100 * 4
    kept_ptr = smaller.data_ptr()
    del smaller
    assert pool.scratch(("k",), 80, torch.float32, cpu).data_ptr() == kept_ptr
    assert pool.scratch(("k",), 80, torch.float64, cpu).dtype == torch.float64  # another dtype: another buffer
    larger = pool.scratch(("k",), 500, torch.float32, cpu)
    assert larger.numel() == 500
    del larger
    assert pool.scratch(("k",), 500, torch.float32, cpu).numel() == 500
    pool.release()
    assert not pool._scratch


def test_recycled_buffer_waits_for_a_backend_reference_not_for_a_callers_view(monkeypatch) -> None:
    """``BufferPool.recycled_or_new`` with every slot taken: a kept buffer that only something outside Python's
    view objects still refers to (as gloo's worker thread does a moment after a synchronous collective) is waited
    for and handed out again; one that never settles (a caller keeps a view of its own) is waited for once, then
    passed over at once until it is free."""
    import threading

    from zero_dtensor.materialize import buffers

    monkeypatch.setattr(buffers, "SETTLE_S", 5.0)
    pool = buffers.BufferPool()
    cpu = torch.device("cpu")
    held = pool.recycled_or_new(("k",), 64, torch.float32, cpu)
    backend = pool.recycled_or_new(("k",), 64, torch.float32, cpu)  # both slots taken
    ptr = backend.data_ptr()
    backend_ref = [backend[:]]  # the backend's reference: a tensor on the storage that is none of the pool's views
    del backend
    threading.Timer(0.05, backend_ref.clear).start()
    assert pool.recycled_or_new(("k",), 64, torch.float32, cpu).data_ptr() == ptr  # waited, not a new one

    monkeypatch.setattr(buffers, "SETTLE_S", 0.02)
    sleeps = []
    monkeypatch.setattr(buffers.time, "sleep", lambda s: sleeps.append(s))  # the settle loop's waits, counted
    pool = buffers.BufferPool()
    kept = [pool.recycled_or_new(("k",), 64, torch.float32, cpu) for _ in range(2)]
    mine = kept[1][:8]  # the caller keeps a view of a result it dropped
    del kept[1]
    waited = []
    for _ in range(3):
        sleeps.clear()
        assert pool.recycled_or_new(("k",), 64, torch.float32, cpu).data_ptr() != mine.data_ptr()
        waited.append(bool(sleeps))
    assert waited == [True, False, False]
    del mine
    again = pool.recycled_or_new(("k",), 64, torch.float32, cpu)  # free again: handed out, no wait
    assert not sleeps and again.untyped_storage().data_ptr() in {t.buffer.untyped_storage().data_ptr()
                                                                  for t in pool._recycled[("k",)]}
    del held


def test_transient_buffer_is_reused_whatever_refers_to_it() -> None:
    """``BufferPool.transient`` (an exchange's send and receive buffers, used within one call): the kept buffer is
    handed out again while something else still refers to its memory (a backend thread), grows when asked for
    more, and ``release`` frees it."""
    from zero_dtensor.materialize.buffers import BufferPool

    pool = BufferPool()
    cpu = torch.device("cpu")
    first = pool.transient(("k",), 100, torch.float32, cpu)
    lingering = first[:]  # what a backend thread would hold
    assert pool.transient(("k",), 60, torch.float32, cpu).data_ptr() == first.data_ptr()
    assert pool.transient(("k",), 200, torch.float32, cpu).numel() == 200  # larger: a new one, kept instead
    assert pool.transient(("k",), 100, torch.float32, cpu).data_ptr() != lingering.data_ptr()
    pool.release()
    assert not pool._transient
