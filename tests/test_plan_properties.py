"""Issue 11: property-based checks of the placements' geometry and the per-layout plans (no DeepSpeed, no processes).

Random parameter shapes, group splits, world sizes and, per group, one of the three placements — ragged ZeRO-1/2
(back to back, optional ``parameter_alignment`` padding, round-robin order, the tail padded to ``2·ws`` and maybe
further), chunked ZeRO-3 (``torch.chunk`` chunks of ``ceil(numel/ws)``, any order, maybe a padded tail) and
replicated (the whole buffer on every rank) — are laid out as DeepSpeed does. N ranks' partitions are simulated in
one process from a single-process reference: every element of every parameter is a distinct integer (exact in
float64) and padding holds a sentinel, so a wrong, missing or repeated element cannot go unnoticed. Invariants:

- ``plan_for(layout).groups[i].local`` tiles each rank's partition; cutting a partition with it
  (``split_with_sizes``) gives every parameter the exact elements ``rank_range`` says that rank holds (the
  reference slices the full flattened parameter), at ``local_offset``; every gap piece is padding;
- ``gathered`` and ``param_order`` reassemble every full parameter from the N partitions: concatenated (ragged),
  the partition itself (replicated), or stacked into ``(N, P)`` rows and reordered by one
  ``torch.split_with_sizes_copy(rows, gathered.sizes, dim=1, out=...)`` into a buffer laid out by
  ``param_order.sizes``, each parameter then the first ``numel`` elements of its flattened ``(N, chunk)`` block
  (chunked);
- ZeRO-3's peer rows (``peer_rows``: this rank's partition and the other ranks', back to back) reassemble the same
  parameter-order buffer as the whole rows;
- the plan is cached per layout, and its lookups (``where``, ``fragments``, ``positions``, ``has_local``) agree
  with the tilings.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_dtensor.layout.flat import (ChunkShard, FlatLayout, GroupLayout, Packing, ParamLayout, RaggedShard,
                                      Replicated, placement_of)
from zero_dtensor.materialize.placements import assembly_of
from zero_dtensor.layout.plan import plan_for

PAD = -1.0  # every parameter element is a non-negative id: the sentinel marks padding

shapes = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 40)),
        st.tuples(st.integers(1, 9), st.integers(1, 9)),
        st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=10,
)


@st.composite
def cases(draw):
    """``(world, [FlatLayout per rank], {name: full reference tensor})``."""
    world = draw(st.integers(1, 5))
    param_shapes = draw(shapes)
    n_groups = draw(st.integers(1, min(3, len(param_shapes))))
    assignment = list(range(n_groups)) + draw(st.lists(st.integers(0, n_groups - 1),
                                                       min_size=len(param_shapes) - n_groups,
                                                       max_size=len(param_shapes) - n_groups))
    assignment = draw(st.permutations(assignment))
    flat_order = draw(st.permutations(list(range(len(param_shapes)))))  # round_robin / sub-group reordering
    entries: list[ParamLayout] = []
    groups: list[tuple[int, Packing, bool]] = []  # (partition_numel, packing, replicated)
    for g in range(n_groups):
        kind = draw(st.sampled_from(["ragged", "chunked", "replicated"]))
        align = draw(st.sampled_from([1, 2, 4, 8])) if kind != "chunked" else 1
        extra = draw(st.integers(0, 3))  # more tail padding than the minimum (any adapter may have it)
        offset = 0
        for i in (i for i in flat_order if assignment[i] == g):
            shape = torch.Size(param_shapes[i])
            numel = shape.numel()
            if kind == "chunked":
                chunk = math.ceil(numel / world)
                entries.append(ParamLayout(f"p{i}", shape, g, offset, chunk_numel=chunk))
                offset += chunk
            else:
                entries.append(ParamLayout(f"p{i}", shape, g, offset))
                offset += numel + (-numel) % align
        if kind == "chunked":
            groups.append((offset + extra, Packing.CHUNKED, False))
        elif kind == "replicated":
            groups.append((offset + (-offset) % (2 * world) + extra, Packing.CONTIGUOUS, True))
        else:
            flat = offset + (-offset) % (2 * world) + extra * world
            groups.append((flat // world, Packing.CONTIGUOUS, False))
    params = tuple(sorted(entries, key=lambda p: int(p.name[1:])))  # model order
    per_rank = [
        FlatLayout(groups=tuple(GroupLayout(g, world, r, numel, packing, replicated=replicated)
                                for g, (numel, packing, replicated) in enumerate(groups)),
                   params=params)
        for r in range(world)
    ]
    full, next_id = {}, 0
    for p in params:
        full[p.name] = torch.arange(next_id, next_id + p.numel, dtype=torch.float64).view(p.shape)
        next_id += p.numel
    return world, per_rank, full


def partitions(per_rank: list[FlatLayout], full: dict[str, torch.Tensor], group: int) -> list[torch.Tensor]:
    """Each rank's partition of ``group``, built from the full parameters without the placement code."""
    layout = per_rank[0]
    g = layout.groups[group]
    world, P = g.world_size, g.partition_numel
    members = layout.params_of(group)
    if g.packing is Packing.CHUNKED:
        parts = [torch.full((P,), PAD, dtype=torch.float64) for _ in range(world)]
        for p in members:
            for r, chunk in enumerate(full[p.name].reshape(-1).chunk(world)):
                parts[r][p.offset : p.offset + chunk.numel()] = chunk
        return parts
    flat = torch.full((P if g.replicated else world * P,), PAD, dtype=torch.float64)
    for p in members:
        flat[p.offset : p.offset + p.numel] = full[p.name].reshape(-1)
    return [flat.clone() for _ in range(world)] if g.replicated else list(flat.split(P))


def held(full: torch.Tensor, part: torch.Tensor) -> tuple[int, int]:
    """``(start, stop)`` of the elements of ``full`` (ids) present in ``part``: the reference of ``rank_range``."""
    flat = full.reshape(-1)
    present = torch.isin(flat, part).nonzero().reshape(-1)
    if present.numel() == 0:
        return 0, 0
    start, stop = int(present[0]), int(present[-1]) + 1
    assert stop - start == present.numel(), "a rank holds a non-contiguous part of a parameter"
    return start, stop


def check_tiling(tiling, n_params: int, total: int) -> None:
    assert tiling.numel == sum(tiling.sizes) == total
    assert all(s >= 0 for s in tiling.sizes)
    assert len(tiling.piece) == n_params
    assert sorted(tiling.piece + tiling.gaps) == list(range(len(tiling.sizes))), "every piece is a param or a gap"
    assert all(tiling.sizes[k] > 0 for k in tiling.gaps), "empty gap piece"


@settings(max_examples=100, deadline=None)
@given(cases())
def test_local_tiling_holds_each_ranks_fragments(case) -> None:
    world, per_rank, full = case
    for gi in range(len(per_rank[0].groups)):
        parts = partitions(per_rank, full, gi)
        for rank, layout in enumerate(per_rank):
            plan = plan_for(layout)
            assert plan_for(layout) is plan  # built once per layout
            gp = plan.groups[gi]
            g = layout.groups[gi]
            assert gp.index == gi and gp.group is g
            assert {p.name for p in gp.params} == {p.name for p in layout.params_of(gi)}
            assert [p.offset for p in gp.params] == sorted(p.offset for p in gp.params)  # buffer order
            check_tiling(gp.local, len(gp.params), g.partition_numel)
            pieces = torch.split_with_sizes(parts[rank], list(gp.local.sizes))
            for k, p in enumerate(gp.params):
                start, stop = p.rank_range(g, rank)
                expected = held(full[p.name], parts[rank])
                if expected[1] > expected[0]:
                    assert (start, stop) == expected, (p, rank)
                else:
                    assert 0 <= start == stop <= p.numel, (p, rank)
                ref = full[p.name].reshape(-1)[start:stop]
                got = pieces[gp.local.piece[k]]
                assert torch.equal(got, ref), (p.name, rank, got, ref)
                assert gp.frag_start[k] == start and gp.frag_len[k] == stop - start
                if stop > start:
                    off = p.local_offset(g, rank)
                    assert gp.frag_offset[k] == off
                    assert torch.equal(parts[rank][off : off + stop - start], ref)
                    assert plan.fragments[p.name] == (start, stop, off)
                assert plan.where[p.name] == (gi, k) and gp.positions[p.name] == k
            assert gp.has_local == tuple(k for k in range(len(gp.params)) if gp.frag_len[k])
            assert gp.numels == tuple(p.numel for p in gp.params)
            for k in gp.local.gaps:
                assert bool((pieces[k] == PAD).all()), (rank, k, pieces[k])
        # over all ranks, each parameter's elements are held exactly once (replicated: once per rank)
        for p in per_rank[0].params_of(gi):
            ranges = [p.rank_range(layout.groups[gi], r) for r, layout in enumerate(per_rank)]
            if per_rank[0].groups[gi].replicated:
                assert ranges == [(0, p.numel)] * world
            else:
                assert sum(b - a for a, b in ranges) == p.numel
                nonempty = [r for r in ranges if r[1] > r[0]]
                assert nonempty[0][0] == 0 and nonempty[-1][1] == p.numel
                assert all(a[1] == b[0] for a, b in zip(nonempty, nonempty[1:]))


@settings(max_examples=100, deadline=None)
@given(cases())
def test_gathered_and_param_order_tilings_reassemble_every_parameter(case) -> None:
    world, per_rank, full = case
    for gi in range(len(per_rank[0].groups)):
        parts = partitions(per_rank, full, gi)
        for rank, layout in enumerate(per_rank):  # the plan of every rank cuts the same assembled buffer
            gp = plan_for(layout).groups[gi]
            g = layout.groups[gi]
            placement = placement_of(g)
            assert g.placement is placement
            n = len(gp.params)
            assert placement.dtensor_placement() == (Replicate() if g.replicated else Shard(0))
            if g.replicated:
                assert isinstance(placement, Replicated) and not placement.is_sharded
                assembled = parts[rank]  # every rank holds the whole buffer
            elif g.packing is Packing.CONTIGUOUS:
                assert isinstance(placement, RaggedShard) and placement.is_sharded
                assembled = torch.cat(parts)
            else:
                assert isinstance(placement, ChunkShard) and not placement.param_order_gather
                assembled = None
            if assembled is not None:
                assert placement.param_order_gather and gp.param_order == gp.gathered
                check_tiling(gp.gathered, n, placement.gathered_numel(g))
                assert assembled.numel() == placement.gathered_numel(g) == (g.flat_numel)
                pieces = torch.split_with_sizes(assembled, list(gp.gathered.sizes))
                for k, p in enumerate(gp.params):
                    assert torch.equal(pieces[gp.gathered.piece[k]].view(p.shape), full[p.name]), p.name
                for k in gp.gathered.gaps:
                    assert bool((pieces[k] == PAD).all())
                continue
            # chunked: (N, P) rows -> one split_with_sizes_copy along dim 1 into a parameter-order buffer
            rows = torch.stack(parts)
            check_tiling(gp.gathered, n, g.partition_numel)
            check_tiling(gp.param_order, n, world * g.partition_numel)
            assert gp.param_order.sizes == tuple(world * s for s in gp.gathered.sizes)
            buf = torch.empty(gp.param_order.numel, dtype=rows.dtype)
            blocks = [b.view(world, s) for b, s in
                      zip(torch.split_with_sizes(buf, list(gp.param_order.sizes)), gp.gathered.sizes)]
            torch.split_with_sizes_copy(rows, list(gp.gathered.sizes), dim=1, out=blocks)
            for k, p in enumerate(gp.params):
                assert gp.param_order.piece[k] == gp.gathered.piece[k]
                block = blocks[gp.param_order.piece[k]]
                assert block.shape == (world, p.chunk_numel)
                assert torch.equal(block.reshape(-1)[: p.numel].view(p.shape), full[p.name]), p.name
                assert bool((block.reshape(-1)[p.numel :] == PAD).all())  # torch.chunk's zero padding
            for k in gp.gathered.gaps:
                assert bool((blocks[k] == PAD).all())


@settings(max_examples=100, deadline=None)
@given(cases())
def test_pipelined_column_pieces_reassemble_every_parameter(case) -> None:
    """ZeRO-3's pipelined all_gather: each of ``column_pieces`` gathered as ``(N, hi - lo)`` rows of its own (the
    columns ``[lo, hi)`` of every rank's partition) and reordered by ``to_param_order(..., piece=)`` into its part
    of the parameter-order buffer gives the same buffer as the whole ``(N, P)`` rows reordered at once; the pieces
    tile the columns, cut at a parameter boundary, and are two wherever one lies inside."""
    world, _, full = case
    for g, gp, placement, _, rows in _chunked_groups(case, lambda placement, gp: placement.pipeline_pieces(gp, 8) == ()):
        pieces = placement.pipeline_pieces(gp, 8)
        P = g.partition_numel
        bounds = set(itertools.accumulate(gp.gathered.sizes))
        inside = {b for b in bounds if 0 < b < P}
        assert len(pieces) == (2 if inside else 1)
        assert pieces[0].lo == 0 and pieces[-1].hi == P
        assert all(a.hi == b.lo for a, b in zip(pieces, pieces[1:]))
        assert all(p.hi in bounds for p in pieces) and sum(p.width for p in pieces) == P
        whole = torch.full((world * P,), -2.0, dtype=torch.float64)
        placement.to_param_order(rows.reshape(-1).clone(), g, gp, whole)
        by_pieces = torch.full((world * P,), -3.0, dtype=torch.float64)
        for piece in pieces:
            gathered = rows[:, piece.lo : piece.hi].contiguous().reshape(-1)  # what its all_gather lands
            target = by_pieces.narrow(0, world * piece.lo, world * piece.width)
            placement.to_param_order(gathered, g, gp, target, piece=piece)
        assert torch.equal(whole, by_pieces)
        blocks = torch.split_with_sizes(by_pieces, list(gp.param_order.sizes))
        for k, p in enumerate(gp.params):
            assert torch.equal(blocks[gp.param_order.piece[k]][: p.numel].view(p.shape), full[p.name]), p.name


def _chunked_groups(case, absent):
    """``(group, plan, placement, every rank's partition, their (N, P) rows)`` for every rank's layout of each
    chunked group of ``case``; for every other group ``absent(placement, plan)`` must hold."""
    _, per_rank, full = case
    for gi in range(len(per_rank[0].groups)):
        g0 = per_rank[0].groups[gi]
        if g0.packing is not Packing.CHUNKED or g0.replicated:
            assert absent(assembly_of(g0), plan_for(per_rank[0]).groups[gi])
            continue
        parts = partitions(per_rank, full, gi)
        rows = torch.stack(parts)
        for layout in per_rank:
            g = layout.groups[gi]
            yield g, plan_for(layout).groups[gi], assembly_of(g), parts, rows


@settings(max_examples=100, deadline=None)
@given(cases())
def test_peer_rows_reassemble_every_parameter(case) -> None:
    """ZeRO-3 by all_to_all: this rank's partition through ``own`` and the other ranks' partitions, back to back in
    rank order (what ``peer_partitions_by_all_to_all`` receives), through ``peers`` (``peer_rows``) fill the whole
    parameter-order buffer exactly as the ``(N, P)`` rows reordered at once; other placements have no peer rows."""
    world = case[0]
    for g, gp, placement, parts, rows in _chunked_groups(case, lambda placement, gp: placement.peer_rows(gp, 8) is None):
        found = placement.peer_rows(gp, 8)
        if found is None:  # rows do not pay: the gather falls back to the rank-major rows
            assert gp.own_column_rows(8) is None or gp.peer_column_rows(8) is None
            continue
        own, peers = found
        P = g.partition_numel
        whole = torch.full((world * P,), -2.0, dtype=torch.float64)
        placement.to_param_order(rows.reshape(-1).clone(), g, gp, whole)
        by_rows = torch.full((world * P,), -3.0, dtype=torch.float64)
        own.copy(parts[g.rank].clone(), by_rows)
        others = [parts[r] for r in range(world) if r != g.rank]
        if others:
            peers.copy(torch.cat(others), by_rows)
        assert torch.equal(whole, by_rows)


def _chunked_case(world: int, shapes: list[tuple[int, ...]], extra: int = 0):
    """One chunked group of ``shapes`` in model order, as :func:`cases` lays it out."""
    entries, offset = [], 0
    for i, shape in enumerate(shapes):
        size = torch.Size(shape)
        chunk = math.ceil(size.numel() / world)
        entries.append(ParamLayout(f"p{i}", size, 0, offset, chunk_numel=chunk))
        offset += chunk
    per_rank = [FlatLayout(groups=(GroupLayout(0, world, r, offset + extra, Packing.CHUNKED),),
                           params=tuple(entries)) for r in range(world)]
    full, next_id = {}, 0
    for p in entries:
        full[p.name] = torch.arange(next_id, next_id + p.numel, dtype=torch.float64).view(p.shape)
        next_id += p.numel
    return world, per_rank, full


@pytest.mark.parametrize("world,shapes,extra,paths", [
    (2, [(32, 32), (32,)] * 12, 0, ("families", "families")),  # a stack of equal layers: a strided copy per family
    (3, [(24, 16), (48,), (12, 8), (36,)], 4, ("index", "index")),  # no period: one index_select of rows each
    (3, [(24, 16), (48,), (12, 8)] * 2 + [(36,), (20, 4)], 4, ("index", "split")),  # rows too narrow in the second
    (2, [(5000,), (3, 3)], 0, ("split", "index")),  # long runs: split_with_sizes_copy
])
def test_pipelined_column_pieces_take_each_copy_path(world, shapes, extra, paths) -> None:
    """The same as above on layouts whose pieces take each reorder path (:mod:`zero_dtensor.layout.rows`): strided copies
    per run family, an ``index_select`` of rows, ``split_with_sizes_copy``."""
    case = _chunked_case(world, shapes, extra)
    for layout in case[1]:
        pieces = plan_for(layout).groups[0].column_pieces(8)  # float64
        kinds = tuple("split" if p.rows is None else ("families" if p.rows.families else "index") for p in pieces)
        assert kinds == paths
    test_pipelined_column_pieces_reassemble_every_parameter.hypothesis.inner_test(case)


@pytest.mark.parametrize("world,shapes,extra", [
    (2, [(32, 32), (32,)] * 12, 0),  # a stack of equal layers: strided copies per run family
    (3, [(24, 16), (48,), (12, 8), (36,)], 4),  # no period: indexed rows
    (4, [(32, 32), (32,)] * 6 + [(64, 16)], 8),
])
def test_peer_rows_take_the_row_paths(world, shapes, extra) -> None:
    """The same as ``test_peer_rows_reassemble_every_parameter`` on layouts whose peer rows exist on every rank (the
    random ones mostly have rows too narrow to pay)."""
    case = _chunked_case(world, shapes, extra)
    for layout in case[1]:
        assert assembly_of(layout.groups[0]).peer_rows(plan_for(layout).groups[0], 8) is not None  # float64
    test_peer_rows_reassemble_every_parameter.hypothesis.inner_test(case)


@settings(max_examples=100, deadline=None)
@given(cases(), st.integers(1, 64))
def test_windows_by_own_and_peer_columns_reassemble_every_parameter(case, max_width) -> None:
    """Issue 55, the synchronous ``send_recv`` / ``all_to_all`` windows: per column window, this rank's columns
    straight from its partition (``rank_to_param_order`` with the piece) and the other ranks' columns, back to back
    in rank order (what ``peer_partitions_by_send_recv`` receives), through ``peers_to_param_order`` fill the whole
    parameter-order buffer exactly as the ``(N, P)`` rows reordered at once, by row copies or by
    ``split_with_sizes_copy`` alike."""
    world = case[0]
    for g, gp, placement, parts, rows in _chunked_groups(case, lambda placement, gp: not placement.reorder_area(gp.group)):
        if world == 1:
            continue
        P = g.partition_numel
        whole = torch.full((world * P,), -2.0, dtype=torch.float64)
        placement.to_param_order(rows.reshape(-1).clone(), g, gp, whole)
        by_windows = torch.full((world * P,), -3.0, dtype=torch.float64)
        for piece in placement.window_pieces(gp, 8, max_width):
            target = by_windows.narrow(0, world * piece.lo, world * piece.width)
            placement.rank_to_param_order(parts[g.rank][piece.lo:piece.hi].clone(), g.rank, g, gp, target,
                                          piece=piece)
            others = [parts[r][piece.lo:piece.hi] for r in range(world) if r != g.rank]
            placement.peers_to_param_order(torch.cat(others), g, gp, target, piece=piece)
        assert torch.equal(whole, by_windows)
