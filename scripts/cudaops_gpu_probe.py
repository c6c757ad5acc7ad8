"""Device check of issue 42 (branch cudaops2), to run right after benchmarks/gpu_check.py (which times the public
calls on engines): the per-group kernels those calls run, on a 1.03B-element bf16 buffer in 198 pieces (the
gpu_check model) at the accelerator row width, against the flat floors; values against float64 references; nan/inf
counts on the device; the per-fragment clip multiply; ``dots`` at four chunk sizes; ``set_full_``'s two ways of writing
198 values into one run (``_foreach_copy_``, one ``cat``); and no host sync (``torch.cuda.set_sync_debug_mode("error")``).
One line per figure: ``name value [xN floor]``. About 1 minute on an H200; torch with CUDA, no DeepSpeed:

    PYTHONPATH=$PWD timeout 200 python scripts/cudaops_gpu_probe.py

(``PROBE_H=256`` shrinks the model: a CPU smoke run, no sync check.)"""
import math
import os

import torch

from zero_dtensor.layout import segments as S
from zero_dtensor.layout.segment_plan import joint_plan
from zero_dtensor.layout.tiling import Tiling
from zero_dtensor.ops.transforms import _cast_on_cuda, _scale_op

dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
h, L = int(os.environ.get("PROBE_H", 2304)), 16
blk = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
sizes = [h * h, h] + blk * L + [h, h, h * h, h]
flat = (torch.randn(sum(sizes), device=dev) * 1e-3).to(torch.bfloat16)
other = (torch.randn(sum(sizes), device=dev) * 1e-3).to(torch.bfloat16)
seg = S.segment_plan(Tiling(tuple(sizes), tuple(range(len(sizes))), ()), S.block_for(flat.device))
views = list(flat.split(sizes))


def sync() -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def tm(fn, n: int = 10) -> float:
    """Median milliseconds of ``fn`` (CUDA events; wall clock on the CPU)."""
    import time
    for _ in range(2):
        fn()
    sync()
    out = []
    for _ in range(n):
        if dev == "cuda":
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); fn(); e.record(); torch.cuda.synchronize(); out.append(s.elapsed_time(e))
        else:
            t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)[n // 2]


def line(name: str, value, floor: float | None = None) -> None:
    ratio = f"  x{value / floor:.2f} floor" if floor and isinstance(value, float) else ""
    print(f"{name:34s} {value:.3f}{ratio}" if isinstance(value, float) else f"{name:34s} {value}", flush=True)


norm_f = tm(lambda: torch.linalg.vector_norm(flat, dtype=torch.float32))
mul_f = tm(lambda: flat.mul_(1.0))
line("W (row width)", seg.block)
line("floor_norm_ms", norm_f)
line("floor_mul_ms", mul_f)
line("piece_pow_sums_ms (norms)", tm(lambda: S.piece_pow_sums(flat, seg)), norm_f)
line("piece_max_abs_ms (vector_norm inf)", tm(lambda: S.piece_max_abs(flat, seg)), norm_f)
line("piece_stats_counts_ms (stats)", tm(lambda: S.piece_stats(flat, seg, counts=True)), norm_f)
line("target stats <= 3x floor", "")
line("piece_dots_ms (dots)", tm(lambda: S.piece_dots(flat, other, seg), 5), 2 * norm_f)
rows_a, rows_b = S._rows(flat, seg), S._rows(other, seg)
try:  # a candidate for dots at the floor: cuBLAS batched dot products, float32 output (CUDA only)
    line("alt_bmm_out_fp32_dots_ms", tm(lambda: torch.bmm(rows_a.unsqueeze(1), rows_b.unsqueeze(2),
                                                          out_dtype=torch.float32), 5), 2 * norm_f)
except Exception as e:  # noqa: BLE001
    line("alt_bmm_out_fp32_dots_ms", f"n/a {type(e).__name__}")
# dots' eager chunk size: products of a chunk small enough for L2 are re-read from it (more chunks, more launches)
chunk_kept, parts_kept = S.DOT_CHUNK, S.DOT_PARTS
for log2 in (21, 22, 23, 24):
    S.DOT_CHUNK, S.DOT_PARTS = 1 << log2, 1 << 30  # exactly 2**log2 elements per chunk
    line(f"piece_dots_ms (chunks of 2^{log2} elements)", tm(lambda: S.piece_dots(flat, other, seg), 5), 2 * norm_f)
S.DOT_CHUNK, S.DOT_PARTS = chunk_kept, parts_kept
# set_full_'s write of 198 values into one run: _foreach_copy_ into views (the CPU's) against one cat (accelerators)
values = [torch.empty_like(v).copy_(v) for v in views]
copy_f = tm(lambda: flat.copy_(other))
line("floor_copy_ms", copy_f)
line("write_foreach_copy_ms (198 values)", tm(lambda: torch._foreach_copy_(views, values)), copy_f)
line("write_cat_out_ms (198 values)", tm(lambda: torch.cat(values, out=flat)), copy_f)
del values
coef = torch.full((), 0.999, device=dev)
line("clip_whole_ms (norm + scale_op)", tm(lambda: (S.piece_pow_sums(flat, seg), _scale_op("mul")(flat, coef))),
     norm_f + mul_f)
factors = list(torch.full((len(views),), 0.999, device=dev).unbind(0))
line("clip_per_param_mul_ms (198 fp32 0-d)", tm(lambda: torch._foreach_mul_(views, factors)), mul_f)
line("clip_per_param_mul_ms (cast, lib)", tm(lambda: torch._foreach_mul_(views, _cast_on_cuda(views, factors))),
     mul_f)

# values
ref2 = torch.stack([v.double().square().sum() for v in views])
line("pow2_max_rel_err", float(((S.piece_pow_sums(flat, seg) - ref2).abs() / ref2).max()))
refm = torch.stack([v.double().abs().max() for v in views])
line("max_abs_equal", bool(torch.equal(S.piece_max_abs(flat, seg), refm)))
refd = torch.stack([(v.double() * w.double()).sum() for v, w in zip(views, other.split(sizes))])
refa = torch.stack([(v.double() * w.double()).abs().sum() for v, w in zip(views, other.split(sizes))])
line("dots_max_err_rel_to_sum_abs", float(((S.piece_dots(flat, other, seg) - refd).abs() / refa).max()))
bad = flat.clone()
hit = torch.randint(0, bad.numel(), (40,), device=dev)  # (repeats possible: counts come from bad itself)
bad[hit[:25]] = math.nan
bad[hit[25:]] = -math.inf
st = S.piece_stats(bad, seg, counts=True)
want_nan = torch.stack([torch.isnan(v).sum() for v in bad.split(sizes)]).double()
want_inf = torch.stack([torch.isinf(v).sum() for v in bad.split(sizes)]).double()
line("counts_exact (40 specials)", bool(torch.equal(st[:, 3], want_nan) and torch.equal(st[:, 4], want_inf)
                                        and not bool(st[:, 5].any())))
line("max_abs_nan_propagates", bool(torch.equal(torch.isnan(st[:, 2]), want_nan > 0)))
c = torch.rand((), device=dev) * 2
a, b = flat.clone().mul_(c), flat.clone()
_scale_op("mul")(b, c)
fa = [v.clone() for v in views[:8]]
fb = [v.clone() for v in views[:8]]
fs = list((torch.rand(8, device=dev) * 2).unbind(0))
torch._foreach_mul_(fa, fs)
torch._foreach_mul_(fb, _cast_on_cuda(fb, fs))
line("scale_bitwise (whole, per-param)", (bool(torch.equal(a, b)), all(map(torch.equal, fa, fb))))

if dev == "cuda":
    joint_plan((seg, seg), torch.device(dev))  # two groups' cached joint index (filled once)
    torch.cuda.set_sync_debug_mode("error")
    try:
        S.piece_pow_sums(flat, seg); S.piece_pow_sums(flat, seg, 1.0); S.piece_max_abs(flat, seg)
        S.piece_stats(bad, seg, counts=True); S.piece_dots(flat, other, seg)
        _scale_op("mul")(flat, coef); torch._foreach_mul_(views, _cast_on_cuda(views, factors))
        joint_plan((seg, seg), torch.device(dev)); S.joint_pow_sums((flat, flat), (seg, seg))
        line("no_sync", True)
    except RuntimeError as e:
        line("no_sync", str(e)[:300])
    finally:
        torch.cuda.set_sync_debug_mode(0)
