"""Issue 4 checks, run on every rank: sharded transforms against the same transform on full gradients.

Reference semantics: each op of ``ShardedGrads`` is compared with the same torch op applied to the full gradient
tensors (from ``full_tensors()``, itself checked against DeepSpeed by the foundation tests) in the stored dtype.
Elementwise ops are the same IEEE operation per element, so they must agree *exactly*. Reductions sum partials in a
different order (per rank, then across ranks) than a single-process ``vector_norm``, so they are compared with a
tight relative tolerance (``RTOL``); clipping is then checked exactly given the norm our call returned.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

import zero_dtensor as zd
from zero_dtensor.ops.noise import counter_normal

from .common import EngineCase, build_engine, count_comms, forward_backward, params_snapshot
from .rows import Rows

RTOL = 1e-5  # fp32 sums of a few thousand terms in a different order: observed differences ~1e-7 relative
NOISE_SEED = 99
SUBSET = ["fc1.weight", "tiny.bias", "fc3.bias"]


def weights(name: str) -> bool:
    return name.endswith("weight")


def full(grads: zd.ShardedGrads) -> dict[str, torch.Tensor]:
    """Full gradients in the stored dtype (true values), as fresh tensors."""
    return {n: t.clone() for n, t in grads.full_tensors(dtype=None).items()}


def assert_equal(ours: dict, ref: dict, what: str) -> None:
    assert ours.keys() == ref.keys()
    for name in ours:
        if not torch.equal(ours[name], ref[name]):
            diff = (ours[name].float() - ref[name].float()).abs().max().item()
            raise AssertionError(f"{what}: {name} differs (max abs diff {diff:g})")


def close(a, b, what: str, rtol: float = RTOL) -> None:
    a, b = float(a), float(b)
    assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12), f"{what}: {a!r} vs {b!r}"


def expected_comms(grads: zd.ShardedGrads) -> int:
    """Sharded reductions: one collective per process group and the rank agreement; none for replicated or
    single-rank groups."""
    group = grads.layout.groups[0]
    return 0 if group.replicated or group.world_size == 1 else 2


def ref_norm(t: torch.Tensor, p: float) -> float:
    return float(torch.linalg.vector_norm(t.double().reshape(-1), p))


def elementwise_ops(snap_full: dict[str, torch.Tensor], names: list[str]) -> list:
    """(label, ours(grads, snap), ref(name, full tensor) -> new tensor) for the exact elementwise ops."""
    factors = {n: 1.0 + 0.25 * i for i, n in enumerate(names)}
    alphas = {n: 0.1 * (i + 1) for i, n in enumerate(names) if weights(n)}

    def noise(name, t):
        n = counter_normal(7, name, t.numel()).view(t.shape)
        return t.add_(n, alpha=0.01)

    def in_place(x):
        x.mul_(2.0)  # returns None below: apply_ keeps the in-place result

    def in_place_fn(x):
        in_place(x)

    return [
        ("mul_ all", lambda g, s: g.mul_(0.5), lambda n, t: t.mul_(0.5)),
        ("mul_ predicate", lambda g, s: g.mul_(3.0, params=weights),
         lambda n, t: t.mul_(3.0) if weights(n) else t),
        ("div_ per-param mapping", lambda g, s: g.div_(factors), lambda n, t: t.div_(factors[n])),
        ("add_ scalar subset", lambda g, s: g.add_(0.001, params=SUBSET),
         lambda n, t: t.add_(0.001) if n in SUBSET else t),
        ("add_ other all", lambda g, s: g.add_(s, alpha=-0.25), lambda n, t: t.add_(snap_full[n].float() * -0.25)),
        # (documented semantics: alpha·other formed in float32, then added)
        ("add_ other per-param alpha", lambda g, s: g.add_(s, alpha=alphas, params=weights),
         lambda n, t: t.add_(snap_full[n].float() * alphas[n]) if weights(n) else t),
        ("clamp_ all", lambda g, s: g.clamp_(-0.02, 0.03), lambda n, t: t.clamp_(-0.02, 0.03)),
        ("clamp_ min subset", lambda g, s: g.clamp_(min=-0.01, params=SUBSET),
         lambda n, t: t.clamp_(min=-0.01) if n in SUBSET else t),
        ("lerp_ other all", lambda g, s: g.lerp_(s, 0.3), lambda n, t: t.lerp_(snap_full[n], 0.3)),
        ("lerp_ scalar predicate", lambda g, s: g.lerp_(0.0, 0.5, params=weights),
         lambda n, t: t.lerp_(torch.zeros_like(t), 0.5) if weights(n) else t),
        ("apply_ returning", lambda g, s: g.apply_(lambda x: torch.sign(x) * x.abs().sqrt()),
         lambda n, t: torch.sign(t) * t.abs().sqrt()),
        ("apply_ in place", lambda g, s: g.apply_(in_place_fn, params=["fc2.bias"]),
         lambda n, t: t.mul_(2.0) if n == "fc2.bias" else t),
        ("zero_ subset", lambda g, s: g.zero_(params=["tiny.bias"]), lambda n, t: t.zero_() if n == "tiny.bias" else t),
        ("copy_ subset", lambda g, s: g.copy_(s, params=["fc2.bias"]),
         lambda n, t: t.copy_(snap_full[n]) if n == "fc2.bias" else t),
        ("add_noise_", lambda g, s: g.add_noise_(0.01, 7), noise),
    ]


# The rows of check_transforms, in order: each operation's own test (tests/test_transforms.py). Elementwise rows
# chain (each starts from the gradient the previous one left); after a row fails on every rank the reference is
# re-read from the gradient, so the rows after it are still judged on their own.
ELEMENTWISE_ROWS = [label for label, _, _ in elementwise_ops({}, [])]
REDUCTION_ROWS = [f"{what} p={p}" for p in ("2", "inf", "1") for what in ("norms", "global_norm")] + [
    "norms predicate", "dots", "dots with_norms", "stats", "stats nonfinite", "clip_grad_norm_ vs torch"]
CLIP_ROWS = ["clip_per_param_", "clip_grad_norm_"]
REJECTED = {  # row -> (exception, match, the rejected call)
    "rejects unknown name": (KeyError, "nope", lambda g, s: g.mul_(2.0, params=["fc1.weight", "nope"])),
    "rejects mapping without a selected name": (
        KeyError, "fc2.bias", lambda g, s: g.mul_({"fc1.weight": 2.0}, params=["fc1.weight", "fc2.bias"])),
    "rejects unknown alpha name": (KeyError, "ghost", lambda g, s: g.add_(s, alpha={"ghost": 1.0})),
    "rejects string params": (TypeError, None, lambda g, s: g.mul_(2.0, params="fc1.weight")),
    "rejects plain tensor operand": (ValueError, None, lambda g, s: g.add_(torch.ones(3))),
}
STEP_ROWS = ["stale after step", "clone outlives step", "step matches DeepSpeed", "lerp_ previous step clone"]
TRANSFORM_ROWS = ["clone", *ELEMENTWISE_ROWS, *REDUCTION_ROWS, *CLIP_ROWS, *REJECTED, *STEP_ROWS, "noise"]


def transform_rows(case: EngineCase) -> list[str]:
    """The rows check_transforms runs for ``case``: the sharding-invariant noise row in fp32 only."""
    return [r for r in TRANSFORM_ROWS if r != "noise" or case.dtype == "fp32"]


class _State:
    """What the rows of one check_transforms share."""

    def __init__(self, case: EngineCase) -> None:
        self.case = case
        self.ours = build_engine(case)
        forward_backward(self.ours)
        self.grads = zd.sharded_grads(self.ours)
        self.one = expected_comms(self.grads)
        self.replicated = self.grads.layout.groups[0].replicated
        assert self.replicated == case.bf16_optimizer
        self.ref = full(self.grads)  # the reference: full tensors with every row's transform applied
        self.initial = {n: t.clone() for n, t in self.ref.items()}
        self.snap: zd.ShardedGrads | None = None
        self.applied: list = []  # the reference transforms in order, replayed on DeepSpeed's engine
        self.stepped = False
        self.noise: dict[str, torch.Tensor] | None = None

    def resync(self) -> None:
        """After a failed row: judge the next rows from the gradient as it now is."""
        if not self.stepped:
            self.ref = full(self.grads)

    def ref64(self) -> dict[str, torch.Tensor]:
        return {n: t.double() for n, t in self.ref.items()}


def check_transforms(case: EngineCase) -> dict:
    """Every op on a live engine against the reference, one row each; then step() against DeepSpeed's get ->
    modify -> set."""
    st = _State(case)
    rows = Rows(transform_rows(case), on_failure=st.resync)
    rows.run("clone", _row_clone, st)

    # --- elementwise: 0 collectives, exact -------------------------------------------------------------------
    for label, mine, theirs in elementwise_ops(st.initial, list(st.grads.names)):
        rows.run(label, _row_elementwise, st, label, mine, theirs)

    # --- reductions: one collective, true values ---------------------------------------------------------------
    for p in (2.0, math.inf, 1.0):
        key = {2.0: "2", math.inf: "inf", 1.0: "1"}[p]
        rows.run(f"norms p={key}", _row_norms, st, p)
        rows.run(f"global_norm p={key}", _row_global_norm, st, p)
    rows.run("norms predicate", _row_norms_predicate, st)
    rows.run("dots", _row_dots, st)
    rows.run("dots with_norms", _row_dots_with_norms, st)
    rows.run("stats", check_stats, st.grads, st.ref, st.one)
    rows.run("stats nonfinite", check_stats_nonfinite, st.grads, st.ref, st.one)
    rows.run("clip_grad_norm_ vs torch", lambda: check_torch_clip_agreement(st.grads, st.ref))

    # --- clipping: one collective; exact given the returned norm -----------------------------------------------
    rows.run("clip_per_param_", _row_clip_per_param, st)
    rows.run("clip_grad_norm_", _row_clip_grad_norm, st)

    # --- validation: nothing is written on bad input -----------------------------------------------------------
    for label, (error, match, call) in REJECTED.items():
        rows.run(label, _row_rejected, st, error, match, call)

    # --- step(): same parameters as DeepSpeed's get -> same transform -> set -----------------------------------
    rows.run("stale after step", _row_stale_after_step, st)
    rows.run("clone outlives step", lambda: assert_equal(full(st.snap), st.initial, "clone after step"))
    rows.run("step matches DeepSpeed", _row_step_matches_deepspeed, st, rows.failed)

    # --- the snapshot as an EMA / previous-step operand on the next step's gradients ---------------------------
    rows.run("lerp_ previous step clone", _row_lerp_previous_clone, st)
    if "noise" in rows.names:  # sharding-invariant noise, returned to the test process
        rows.run("noise", _row_noise, st)
    return rows.report(noise=st.noise, loss_scale=st.grads.loss_scale)


def _row_clone(st: _State) -> None:
    with count_comms() as mode:
        st.snap = st.grads.clone()
    assert mode.get_total_counts() == 0
    assert isinstance(st.snap, zd.ShardedGrads)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(st.snap.local_partitions, st.grads.local_partitions))


def _row_elementwise(st: _State, label: str, mine, theirs) -> None:
    with count_comms() as mode:
        result = mine(st.grads, st.snap)
    assert result is st.grads, label
    assert mode.get_total_counts() == 0, (label, mode.get_comm_counts())
    st.ref = {n: theirs(n, t) for n, t in st.ref.items()}
    st.applied.append(theirs)
    assert_equal(full(st.grads), st.ref, label)
    assert_padding_zero(st.grads, label)


def _row_norms(st: _State, p: float) -> None:
    ref64 = st.ref64()
    with count_comms() as mode:
        norms = st.grads.norms(p)
    assert mode.get_total_counts() == st.one, (p, mode.get_comm_counts())
    for n, v in norms.items():
        assert v.dtype == torch.float32 and v.dim() == 0
        close(v, ref_norm(ref64[n], p), f"norms({p}) {n}")


def _row_global_norm(st: _State, p: float) -> None:
    ref64 = st.ref64()
    with count_comms() as mode:
        total = st.grads.global_norm(p)
    assert mode.get_total_counts() == st.one
    close(total, ref_norm(torch.cat([t.reshape(-1) for t in ref64.values()]), p), f"global_norm({p})")


def _row_norms_predicate(st: _State) -> None:
    sub = st.grads.norms(params=weights)
    assert list(sub) == [n for n in st.grads.names if weights(n)]


def _row_dots(st: _State) -> None:
    ref64, snap_ref = st.ref64(), {n: t.double() for n, t in st.initial.items()}
    with count_comms() as mode:
        dots = st.grads.dots(st.snap)
    assert mode.get_total_counts() == st.one
    for n, v in dots.items():
        close(v, float((ref64[n] * snap_ref[n]).sum()), f"dots {n}", rtol=1e-4)


def _row_dots_with_norms(st: _State) -> None:
    ref64, snap_ref = st.ref64(), {n: t.double() for n, t in st.initial.items()}
    dots = st.grads.dots(st.snap)
    with count_comms() as mode:
        d2, mine_n, snap_n = st.grads.dots(st.snap, with_norms=True, params=SUBSET)
    assert mode.get_total_counts() == st.one and list(d2) == [n for n in st.grads.names if n in SUBSET]
    for n in d2:
        close(d2[n], dots[n], f"dots with_norms {n}", rtol=1e-6)
        close(mine_n[n], ref_norm(ref64[n], 2), f"dots self norm {n}")
        close(snap_n[n], ref_norm(snap_ref[n], 2), f"dots other norm {n}")


def _row_clip_per_param(st: _State) -> None:
    ref64 = st.ref64()
    with count_comms() as mode:
        per_norms = st.grads.clip_per_param_(0.05)
    assert mode.get_total_counts() == st.one
    for n, v in per_norms.items():
        close(v, ref_norm(ref64[n], 2), f"clip_per_param_ norm {n}")
    per_coef = {n: torch.clamp(0.05 / (v + 1e-6), max=1.0) for n, v in per_norms.items()}
    assert any(float(c) < 1.0 for c in per_coef.values()) and any(float(c) == 1.0 for c in per_coef.values())

    def clip_per(n, t, per_coef=per_coef):
        return t.mul_(per_coef[n])

    st.ref = {n: clip_per(n, t) for n, t in st.ref.items()}
    st.applied.append(clip_per)
    assert_equal(full(st.grads), st.ref, "clip_per_param_")


def _row_clip_grad_norm(st: _State) -> None:
    ref_total = ref_norm(torch.cat([t.double().reshape(-1) for t in st.ref.values()]), 2)
    with count_comms() as mode:
        total = st.grads.clip_grad_norm_(0.5 * ref_total)
    assert mode.get_total_counts() == st.one
    close(total, ref_total, "clip_grad_norm_ total")
    coef = torch.clamp(0.5 * ref_total / (total + 1e-6), max=1.0)

    def clip_all(n, t, coef=coef):
        return t.mul_(coef)

    st.ref = {n: clip_all(n, t) for n, t in st.ref.items()}
    st.applied.append(clip_all)
    assert_equal(full(st.grads), st.ref, "clip_grad_norm_")
    assert_padding_zero(st.grads, "clip")


def _row_rejected(st: _State, error: type[Exception], match: str | None, call) -> None:
    before = full(st.grads)
    with pytest.raises(error, match=match):
        call(st.grads, st.snap)
    assert_equal(full(st.grads), before, "after rejected calls")


def _row_stale_after_step(st: _State) -> None:
    st.stepped = True
    st.ours.step()
    with pytest.raises(zd.StaleGradientsError):
        st.grads.mul_(2.0)


def _row_step_matches_deepspeed(st: _State, failed_before: list[str]) -> None:
    ws = dist.get_world_size()
    theirs = build_engine(st.case)
    forward_backward(theirs)
    stored = st.grads._state.storage.partitions[0].dtype  # the stored dtype (the view is stale after the step)
    for name, p in theirs.module.named_parameters():
        value = safe_get_full_grad(p).to(stored)
        assert torch.equal(value, st.initial[name]), name
        for transform in st.applied:
            value = transform(name, value)
        write_full_grad_like_deepspeed(theirs, p, value, st.case.stage, ws, st.replicated)
    theirs.step()
    what = "parameters after step" + (f" (after failed rows {failed_before})" if failed_before else "")
    assert_equal(params_snapshot(st.ours), params_snapshot(theirs), what)


def _row_lerp_previous_clone(st: _State) -> None:
    forward_backward(st.ours, step=1)
    nxt = zd.sharded_grads(st.ours)
    expected = {n: t.lerp_(st.initial[n], 0.5) for n, t in full(nxt).items()}
    nxt.lerp_(st.snap, 0.5)
    assert_equal(full(nxt), expected, "lerp_ against last step's clone")


def _row_noise(st: _State) -> None:
    c = zd.sharded_grads(st.ours).clone()
    with count_comms() as mode:
        c.zero_().add_noise_(1.0, NOISE_SEED)
    assert mode.get_total_counts() == 0
    st.noise = full(c)


def assert_padding_zero(grads: zd.ShardedGrads, what: str) -> None:
    for i, partition in enumerate(grads.local_partitions):
        group = grads.layout.groups[i]
        covered = torch.zeros(partition.numel(), dtype=torch.bool)
        for p in grads.layout.params_of(i):
            start, stop = p.rank_range(group, group.rank)
            off = p.local_offset(group, group.rank)
            covered[off : off + stop - start] = True
        assert torch.all(partition[~covered] == 0), f"{what}: padding of group {i} is not zero"


def write_full_grad_like_deepspeed(engine, p, value, stage: int, world: int, replicated: bool) -> None:
    if replicated:  # DeepSpeed's safe_set_full_grad is a no-op for BF16_Optimizer (notes §6 bug 4)
        p._hp_grad.copy_(value.reshape(p._hp_grad.shape))  # DeepSpeed's own per-parameter view of its fp32 buffer
        return
    if stage == 3:  # DeepSpeed's stage-3 set narrows past the end unless the value is padded (notes §6 bug 2)
        pn = p.partition_numel()
        value = torch.cat([value.reshape(-1), value.new_zeros(pn * world - value.numel())])
    safe_set_full_grad(p, value)


def stats_comms(grads: zd.ShardedGrads, one: int) -> int:
    """stats(): the agreement and, per process group, one all_gather (gloo) or two all_reduces."""
    from zero_dtensor.comm.collectives import gathers_sum_max_rows

    return one and one + int(not gathers_sum_max_rows(grads._storage.process_groups[0]))


def check_stats(grads: zd.ShardedGrads, ref: dict, one: int) -> None:
    """stats() against the reference, its collectives counted."""
    with count_comms() as mode:
        stats = grads.stats()
    assert mode.get_total_counts() == stats_comms(grads, one), mode.get_comm_counts()
    for n, s in stats.items():
        t = ref[n].double()
        close(s.norm, ref_norm(t, 2), f"stats norm {n}")
        assert s.max_abs == float(t.abs().max()), n
        close(s.mean, float(t.mean()), f"stats mean {n}", rtol=1e-4)
        assert s.nan_count == 0 and s.inf_count == 0 and s.numel == t.numel()


def check_stats_nonfinite(grads: zd.ShardedGrads, ref: dict, one: int) -> None:
    """stats() counts injected nan/inf, its collectives counted."""
    bad = grads.clone()
    name = "fc2.weight"
    value = ref[name].clone().reshape(-1)
    value[[0, 3, 500]] = float("nan")
    value[[7, 801]] = float("inf")
    value[9] = -float("inf")
    bad.set_full_({name: value.view(ref[name].shape)})
    with count_comms() as mode:
        stats = bad.stats()
    assert mode.get_total_counts() == stats_comms(bad, one), mode.get_comm_counts()
    s = stats[name]
    assert (s.nan_count, s.inf_count) == (3, 3), s
    assert math.isnan(s.max_abs) and math.isnan(s.norm)
    assert stats["fc1.weight"].nan_count == 0 and stats["fc1.weight"].max_abs == float(ref["fc1.weight"].abs().max())


def check_torch_clip_agreement(grads: zd.ShardedGrads, ref: dict) -> None:
    """Our clip_grad_norm_ agrees with torch.nn.utils.clip_grad_norm_ over holders whose .grad are grads.groups."""
    is_fp32 = grads[grads.names[0]].dtype == torch.float32
    rtol = 1e-5 if is_fp32 else 2e-2  # torch takes bf16 norms in bf16
    mine, theirs = grads.clone(), grads.clone()
    total_ref = ref_norm(torch.cat([t.double().reshape(-1) for t in ref.values()]), 2)
    max_norm = 0.3 * total_ref
    total = mine.clip_grad_norm_(max_norm)

    holders = []
    for group in theirs.groups:
        holder = torch.nn.Parameter(torch.zeros_like(group))
        holder.grad = group
        holders.append(holder)
    total_torch = torch.nn.utils.clip_grad_norm_(holders, max_norm)
    if hasattr(total_torch, "full_tensor"):
        total_torch = total_torch.full_tensor()
    torch_total = torch.nn.utils.get_total_norm(list(grads.groups))  # the group DTensors, padding included (zero)
    close(grads.global_norm(), torch_total.full_tensor(), "global_norm vs torch get_total_norm", rtol=rtol)
    close(total, total_torch, "clip_grad_norm_ total vs torch", rtol=rtol)
    close(total, total_ref, "clip_grad_norm_ total vs reference", rtol=RTOL)
    a, b = full(mine), full(theirs)
    for n in a:
        torch.testing.assert_close(a[n].float(), b[n].float(), rtol=rtol, atol=1e-7 if is_fp32 else 1e-3)
    assert float(mine.global_norm()) <= max_norm * (1 + 1e-4)


# ---------------------------------------------------------------------------------------------------------------
def reduction_counts(grads: zd.ShardedGrads) -> dict[str, int]:
    snap = grads.clone()
    calls = {
        "norms2": lambda: grads.norms(),
        "norms_inf": lambda: grads.norms(math.inf),
        "global_norm": lambda: grads.global_norm(),
        "dots": lambda: grads.dots(snap),
        "dots_with_norms": lambda: grads.dots(snap, with_norms=True),
        "stats": lambda: grads.stats(),
        "clip_grad_norm_": lambda: grads.clip_grad_norm_(1e3),
        "clip_per_param_": lambda: grads.clip_per_param_(1e3),
        "elementwise": lambda: grads.mul_(1.0).add_(snap, alpha=0.0).clamp_(-1e3, 1e3).lerp_(snap, 0.0),
    }
    counts = {}
    for label, call in calls.items():
        with count_comms() as mode:
            call()
        counts[label] = mode.get_total_counts()
    return counts


def check_scaling(stage: int) -> dict:
    """Collective counts do not depend on the number of parameters; layout mismatches are refused."""
    small = build_engine(EngineCase(stage))
    big = build_engine(EngineCase(stage, model="deep"))
    forward_backward(small)
    forward_backward(big)
    gs, gb = zd.sharded_grads(small), zd.sharded_grads(big)
    assert len(gb) == 34 and len(gs) == 8
    counts_small, counts_big = reduction_counts(gs), reduction_counts(gb)
    assert counts_small == counts_big, (counts_small, counts_big)

    before = full(gb)
    for call in (lambda: gb.add_(gs), lambda: gb.lerp_(gs, 0.5), lambda: gb.copy_(gs), lambda: gb.dots(gs)):
        with pytest.raises(ValueError, match="layout"):
            call()
    assert_equal(full(gb), before, "after layout mismatch")
    check_two_groups(stage, counts_small)
    return counts_small


def check_two_groups(stage: int, counts_one_group: dict) -> None:
    """Two optimizer param groups (two flat groups) on one process group: still one collective per reduction;
    a group selected entirely takes the whole-partition path, the other fragment by fragment."""
    engine = build_engine(EngineCase(stage, groups=2, frozen=False))  # weights / biases, nothing frozen
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    assert len(grads.groups) == 2
    assert reduction_counts(grads.clone()) == counts_one_group
    ref = full(grads)
    grads.mul_(0.5, params=weights).add_(0.01, params=["fc1.bias", "fc3.bias"]).lerp_(0.0, 0.25)
    ref = {n: t.mul_(0.5) if weights(n) else t for n, t in ref.items()}
    ref = {n: t.add_(0.01) if n in ("fc1.bias", "fc3.bias") else t for n, t in ref.items()}
    ref = {n: t.lerp_(torch.zeros_like(t), 0.25) for n, t in ref.items()}
    assert_equal(full(grads), ref, "two groups")
    assert_padding_zero(grads, "two groups")
    for n, v in grads.norms().items():
        close(v, ref_norm(ref[n], 2), f"two groups norm {n}")
    close(grads.global_norm(), ref_norm(torch.cat([t.reshape(-1) for t in ref.values()]), 2), "two groups total")


# ---------------------------------------------------------------------------------------------------------------
def check_fp16(case: EngineCase) -> dict:
    """fp16 loss scaling: reductions give true-gradient values, operands are converted to stored units."""
    assert case.dtype == "fp16"
    stage = case.stage
    ours = build_engine(case)
    forward_backward(ours)
    grads = zd.sharded_grads(ours)
    scale = grads.loss_scale
    assert scale == 1024.0
    one = expected_comms(grads)
    true = {n: t.clone() for n, t in grads.full_tensors().items()}  # fp32, unscaled
    stored = {n: (t * scale).half() for n, t in true.items()}  # exact: scale is a power of two
    initial_stored = {n: t.clone() for n, t in stored.items()}

    for n, v in grads.norms().items():
        close(v, ref_norm(true[n], 2), f"fp16 norms {n}")
    for n, v in grads.norms(math.inf).items():
        assert float(v) == float(true[n].abs().max()), n
    close(grads.global_norm(), ref_norm(torch.cat([t.reshape(-1) for t in true.values()]), 2), "fp16 global_norm")
    snap = grads.clone()
    assert snap.loss_scale == scale
    for n, v in grads.dots(snap).items():
        close(v, float((true[n].double() ** 2).sum()), f"fp16 dots {n}", rtol=1e-4)
    for n, s in grads.stats().items():
        close(s.norm, ref_norm(true[n], 2), f"fp16 stats norm {n}")
        assert s.max_abs == float(true[n].abs().max())

    # elementwise, in stored units on the reference side: x + 0.01 -> stored + 0.01·scale, etc.
    ops = [
        (lambda g: g.add_(0.01), lambda n, t: t.add_(0.01 * scale)),
        (lambda g: g.clamp_(-0.004, 0.005), lambda n, t: t.clamp_(-0.004 * scale, 0.005 * scale)),
        (lambda g: g.lerp_(snap, 0.25), lambda n, t: t.lerp_(initial_stored[n], 0.25)),
        (lambda g: g.lerp_(0.002, 0.5, params=SUBSET),
         lambda n, t: t.lerp_(torch.full_like(t, 0.002 * scale), 0.5) if n in SUBSET else t),
        (lambda g: g.mul_(0.5), lambda n, t: t.mul_(0.5)),
        (lambda g: g.apply_(lambda x: x * 2.0, params=weights),
         lambda n, t: t.copy_(t.float() / scale * 2.0 * scale) if weights(n) else t),
        (lambda g: g.add_noise_(0.001, 3),
         lambda n, t: t.add_(counter_normal(3, n, t.numel()).view(t.shape), alpha=0.001 * scale)),
    ]
    applied = []
    for mine, theirs in ops:
        with count_comms() as mode:
            mine(grads)
        assert mode.get_total_counts() == 0
        stored = {n: theirs(n, t) for n, t in stored.items()}
        applied.append(theirs)
        assert_equal(full(grads), {n: t.float() / scale for n, t in stored.items()}, "fp16 elementwise")
    # a clone stored in fp32 with the same scale: add_ converts between dtypes, not scales
    fp32_snap = snap.clone(dtype=torch.float32)
    assert fp32_snap.local_partitions[0].dtype == torch.float32 and fp32_snap.loss_scale == scale
    assert fp32_snap.layout is snap.layout  # geometry only: the clone shares the layout and its plan
    grads.add_(fp32_snap, alpha=0.3)
    stored = {n: t.add_(initial_stored[n].float() * 0.3) for n, t in stored.items()}
    applied.append(lambda n, t: t.add_(initial_stored[n].float() * 0.3))
    assert_equal(full(grads), {n: t.float() / scale for n, t in stored.items()}, "fp16 add_ of an fp32 clone")
    with count_comms() as mode:
        norms = grads.norms()
    assert mode.get_total_counts() == one
    for n, v in norms.items():
        close(v, ref_norm(stored[n].double() / scale, 2), f"fp16 norms after ops {n}")

    ours.step()
    theirs = build_engine(case)
    forward_backward(theirs)
    ws = dist.get_world_size()
    for name, p in theirs.module.named_parameters():
        value = safe_get_full_grad(p).half()  # DeepSpeed reads stored (scaled) values (notes §6 trap 6)
        assert torch.equal(value, initial_stored[name]), name
        for transform in applied:
            value = transform(name, value)
        write_full_grad_like_deepspeed(theirs, p, value, stage, ws, False)
    theirs.step()
    assert_equal(params_snapshot(ours), params_snapshot(theirs), "fp16 parameters after step")
    return {"loss_scale": scale}


def check_offload_after_write(stage: int) -> dict:
    """With CPU offload DeepSpeed clips with norms it precomputed in backward: our writes must refresh them."""
    engine = build_engine(EngineCase(stage, offload=True, extra={"gradient_clipping": 0.5}))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    before = float(grads.global_norm())
    grads.mul_(0.25, params=weights)
    grads.add_noise_(0.002, 5, params=SUBSET)
    grads.clip_per_param_(0.01, params=lambda n: n.endswith("bias"))
    expected = float(grads.global_norm())
    assert abs(expected - before) > 0.1 * before  # the ops changed the norm a lot
    engine.step()
    reported = float(engine.get_global_grad_norm())
    close(reported, expected, "DeepSpeed's global norm after our writes (offload)", rtol=1e-4)
    return {"before": before, "after": expected, "reported": reported}


def check_pcgrad_example(mode: str) -> list[str]:
    """examples/pcgrad.py: its projection equals PCGrad on full tensors; its training loop runs."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "pcgrad.py"
    spec = importlib.util.spec_from_file_location("zd_example_pcgrad", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    engine = build_engine(EngineCase(2))
    forward_backward(engine)
    grads = zd.sharded_grads(engine)
    snap = grads.clone().mul_(-1.0, params=weights).add_noise_(1e-3, 11)  # weights conflict, biases agree
    g, s = full(grads), full(snap)
    g64, s64 = {n: t.double() for n, t in g.items()}, {n: t.double() for n, t in s.items()}
    with count_comms() as mode_:
        example.project_conflicts(grads, snap, mode)
    assert mode_.get_total_counts() == expected_comms(grads)
    if mode == "per_param":
        expected = {}
        for n in g64:
            d = float((g64[n] * s64[n]).sum())
            expected[n] = g64[n] - (d / float((s64[n] ** 2).sum())) * s64[n] if d < 0 else g64[n]
    else:
        d = sum(float((g64[n] * s64[n]).sum()) for n in g64)
        ss = sum(float((s64[n] ** 2).sum()) for n in g64)
        expected = {n: g64[n] - (d / ss) * s64[n] if d < 0 else g64[n] for n in g64}
    after = full(grads)
    for n in after:
        torch.testing.assert_close(after[n].double(), expected[n], rtol=1e-5, atol=1e-7)
    return example.train(steps=3, stage=1, mode=mode)


__all__ = ["check_fp16", "check_offload_after_write", "check_pcgrad_example", "check_scaling", "check_transforms"]
