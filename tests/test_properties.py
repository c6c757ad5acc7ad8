"""Issue 3: property-based checks of the neutral layout (no DeepSpeed, no processes).

Random parameter shapes, group splits and world sizes are laid out the way DeepSpeed does (ZeRO-1/2: back to back,
optional alignment padding, the tail padded to ``2·ws``; ZeRO-3: ``ceil(numel/ws)`` chunks per parameter; replicated
groups: the whole buffer on every rank). N ranks' partitions are simulated in one process. Invariants:

- every rank's per-parameter fragments are disjoint, lie inside its partition and, with the padding, tile it exactly;
- over all ranks, each parameter's fragments cover its elements exactly once, in order (``rank_range``);
- ZeRO-3 fragments are ``torch.chunk`` pieces; contiguous fragments sit at the global offset;
- set-then-get is the identity: writing full values through ``ShardedGrads.set_full_`` on every simulated rank and
  reading them back from the partitions via ``rank_range``/``local_offset`` returns the values, padding stays zero,
  and writing what was read changes no byte.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero_dtensor.layout.flat import FlatLayout, GroupLayout, Packing, ParamLayout
from zero_dtensor.families.sharded import ShardedGrads
from zero_dtensor.core.storage import FlatStorage

shapes = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 40)),
        st.tuples(st.integers(1, 9), st.integers(1, 9)),
        st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=9,
)


@st.composite
def layouts(draw):
    """(world_size, [FlatLayout per rank]) for a random model, group split and packing."""
    world = draw(st.integers(1, 5))
    param_shapes = draw(shapes)
    n_groups = draw(st.integers(1, min(3, len(param_shapes))))
    # every group gets at least one parameter
    assignment = list(range(n_groups)) + draw(
        st.lists(st.integers(0, n_groups - 1), min_size=len(param_shapes) - n_groups, max_size=len(param_shapes) - n_groups)
    )
    assignment = draw(st.permutations(assignment))
    kind = draw(st.sampled_from(["zero12", "zero12_aligned", "zero3", "replicated"]))
    flat_order = draw(st.permutations(list(range(len(param_shapes)))))  # e.g. round_robin reordering

    params_per_group: dict[int, list[ParamLayout]] = {}
    group_sizes: dict[int, int] = {}
    for g in range(n_groups):
        members = [i for i in flat_order if assignment[i] == g]
        offset, entries = 0, []
        for i in members:
            shape = torch.Size(param_shapes[i])
            numel = shape.numel()
            if kind == "zero3":
                chunk = math.ceil(numel / world)
                entries.append(ParamLayout(f"p{i}", shape, g, offset, chunk_numel=chunk))
                offset += chunk
            else:
                entries.append(ParamLayout(f"p{i}", shape, g, offset))
                pad = (-numel) % 4 if kind == "zero12_aligned" else 0  # parameter_alignment for fp32
                offset += numel + pad
        params_per_group[g] = entries
        if kind == "zero3":
            group_sizes[g] = offset
        elif kind == "replicated":
            group_sizes[g] = offset + (-offset) % (2 * world)
        else:
            flat = offset + (-offset) % (2 * world)
            group_sizes[g] = flat // world
    packing = Packing.CHUNKED if kind == "zero3" else Packing.CONTIGUOUS
    params = sorted((p for ps in params_per_group.values() for p in ps), key=lambda p: int(p.name[1:]))
    per_rank = [
        FlatLayout(
            groups=tuple(
                GroupLayout(g, world, r, group_sizes[g], packing, replicated=kind == "replicated")
                for g in range(n_groups)
            ),
            params=tuple(params),
        )
        for r in range(world)
    ]
    return world, per_rank


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_fragments_tile_partitions_and_cover_params(case) -> None:
    world, per_rank = case
    layout = per_rank[0]
    for group in layout.groups:
        members = layout.params_of(group.index)
        covered_elements = {p.name: [] for p in members}
        for rank in range(world):
            g = per_rank[rank].groups[group.index]
            used = torch.zeros(g.partition_numel, dtype=torch.int64)
            for p in members:
                start, stop = p.rank_range(g, rank)
                assert 0 <= start <= stop <= p.numel
                off = p.local_offset(g, rank)
                assert 0 <= off and off + (stop - start) <= g.partition_numel
                used[off : off + stop - start] += 1
                covered_elements[p.name].append((start, stop))
                if g.packing is Packing.CONTIGUOUS and not g.replicated and stop > start:
                    assert g.local_start + off == p.offset + start  # the fragment sits at its global position
                if g.packing is Packing.CHUNKED:
                    chunk = torch.arange(p.numel).chunk(world)
                    expected = chunk[rank] if rank < len(chunk) else torch.arange(0)
                    assert torch.equal(torch.arange(start, stop), expected)
            assert used.numel() == 0 or int(used.max()) <= 1, "fragments overlap"
        for p in members:
            ranges = covered_elements[p.name]
            if group.replicated:
                assert all(r == (0, p.numel) for r in ranges)
                continue
            nonempty = [r for r in ranges if r[1] > r[0]]
            assert nonempty[0][0] == 0 and nonempty[-1][1] == p.numel
            assert all(a[1] == b[0] for a, b in zip(nonempty, nonempty[1:])), ranges  # contiguous, in rank order
        # the partitions hold exactly the parameters' elements plus padding
        if not group.replicated:
            total_padding = group.partition_numel * world - sum(p.numel for p in members)
            assert total_padding >= 0


def _storage(layout: FlatLayout, partitions: tuple[torch.Tensor, ...]) -> FlatStorage:
    return FlatStorage(layout=layout, partitions=partitions, process_groups=(None,) * len(partitions),
                       loss_scale=1.0, device=torch.device("cpu"), is_current=lambda: True, describe="simulated")


def _read(per_rank: list[FlatLayout], parts: list[tuple[torch.Tensor, ...]], name: str) -> torch.Tensor:
    """Reassemble one full parameter from every simulated rank's fragment (what a gather does)."""
    p = per_rank[0].by_name[name]
    full = torch.full((p.numel,), float("nan"))
    for rank, layout in enumerate(per_rank):
        g = layout.groups[p.group]
        start, stop = p.rank_range(g, rank)
        full[start:stop] = parts[rank][p.group].narrow(0, p.local_offset(g, rank), stop - start)
    return full.view(p.shape)


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1))
def test_set_then_get_is_identity(case, seed: int) -> None:
    world, per_rank = case
    gen = torch.Generator().manual_seed(seed)
    values = {p.name: torch.randn(p.shape, generator=gen) for p in per_rank[0].params}
    parts = [tuple(torch.zeros(g.partition_numel) for g in layout.groups) for layout in per_rank]
    for rank, layout in enumerate(per_rank):
        ShardedGrads(_storage(layout, parts[rank])).set_full_(values)
    for name, value in values.items():
        assert torch.equal(_read(per_rank, parts, name), value), name
    # padding untouched: the partitions' sum of squares is exactly the values' (replicated: once per rank)
    for rank, layout in enumerate(per_rank):
        for g in layout.groups:
            used = torch.zeros(g.partition_numel, dtype=torch.bool)
            for p in layout.params_of(g.index):
                start, stop = p.rank_range(g, rank)
                off = p.local_offset(g, rank)
                used[off : off + stop - start] = True
            assert torch.all(parts[rank][g.index][~used] == 0)
    # get-then-set: writing back what was read changes no byte
    before = [tuple(t.clone() for t in ps) for ps in parts]
    read = {name: _read(per_rank, parts, name) for name in values}
    for rank, layout in enumerate(per_rank):
        ShardedGrads(_storage(layout, parts[rank])).set_full_(read)
    assert all(torch.equal(a, b) for pa, pb in zip(before, parts) for a, b in zip(pa, pb))
