"""Device check of issue 42 item 3 (branch cudaops), prepared, not yet run: the segment reductions at W=2048 on
a 1.03B-element bf16 buffer in 198 pieces (the gpu_check model) against the flat floors, their values against float64
references, no host sync (set_sync_debug_mode error), and the CUDA scale path bitwise equal to mul_/div_ by a 0-d
fp32 tensor. Run from the repository root: PYTHONPATH=$PWD timeout 220 python scripts/cudaops_gpu_probe.py
(about 1-2 minutes; needs torch with CUDA, no DeepSpeed)."""
import math, time, torch, json, os
from zero_dtensor import segments as S
from zero_dtensor.tiling import Tiling
from zero_dtensor.transforms import _scale_op
dev = "cuda"; torch.manual_seed(0)
h, L = 2304, 16
blk = [h, h, 3*h*h, 3*h, h*h, h, h, h, 4*h*h, 4*h, 4*h*h, h]
sizes = [h*h, h] + blk * L + [h, h, h*h, h]
N = sum(sizes)
flat = (torch.randn(N, device=dev) * 1e-3).to(torch.bfloat16)
t0 = time.time(); seg = S.segment_plan(Tiling(tuple(sizes), tuple(range(len(sizes))), ()), S.block_for(flat.device))
S.piece_pow_sums(flat, seg); torch.cuda.synchronize(); r = {"plan_build_s": time.time() - t0, "W": seg.block}
def tm(fn, n=10):
    for _ in range(2): fn()
    torch.cuda.synchronize(); ev = []
    for _ in range(n):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record(); fn(); e.record(); ev.append((s, e))
    torch.cuda.synchronize(); return sorted(s.elapsed_time(e) for s, e in ev)[n // 2]
r["floor_norm"] = tm(lambda: torch.linalg.vector_norm(flat, dtype=torch.float32))
r["floor_mul"] = tm(lambda: flat.mul_(1.0))
r["piece_pow_sums"] = tm(lambda: S.piece_pow_sums(flat, seg))
r["piece_pow_sums_p1"] = tm(lambda: S.piece_pow_sums(flat, seg, 1.0))
r["piece_max_abs"] = tm(lambda: S.piece_max_abs(flat, seg))
r["piece_stats"] = tm(lambda: S.piece_stats(flat, seg))
r["piece_dots"] = tm(lambda: S.piece_dots(flat, flat, seg), 5)
c = torch.tensor(1.0, device=dev); whole = _scale_op("mul")
r["mul_0d_fp32"] = tm(lambda: flat.mul_(c)); r["scale_op"] = tm(lambda: whole(flat, c))
ref = torch.stack([v.double().square().sum() for v in flat.split(sizes)])
r["pow2_max_rel_err"] = float(((S.piece_pow_sums(flat, seg) - ref).abs() / ref).max())
ref1 = torch.stack([v.double().abs().sum() for v in flat.split(sizes)])
r["pow1_max_rel_err"] = float(((S.piece_pow_sums(flat, seg, 1.0) - ref1).abs() / ref1).max())
refm = torch.stack([v.double().abs().max() for v in flat.split(sizes)])
r["maxabs_equal"] = bool(torch.equal(S.piece_max_abs(flat, seg), refm))
st = S.piece_stats(flat, seg); refs = torch.stack([v.double().sum() for v in flat.split(sizes)])
r["stats_rel_err"] = [float(((st[:, 0] - ref).abs() / ref).max()), float((st[:, 1] - refs).abs().max() / ref1.max()), bool(torch.equal(st[:, 2], refm))]
r["dots_rel_err"] = float(((S.piece_dots(flat, flat, seg) - ref).abs() / ref).max())
bit = {}
for dt in (torch.bfloat16, torch.float16, torch.float32):
    x = (torch.randn(1 << 22, device=dev) * 3).to(dt); bad = 0
    for i in range(20):
        cc = torch.rand((), device=dev) * 2; a = x.clone().mul_(cc); b = x.clone(); whole(b, cc); bad += int(not torch.equal(a, b))
        a = x.clone().div_(cc); b = x.clone(); _scale_op("div")(b, cc); bad += int(not torch.equal(a, b))
    bit[str(dt)] = bad
r["scale_op_mismatches"] = bit
torch.cuda.set_sync_debug_mode("error")
try:
    S.piece_pow_sums(flat, seg); S.piece_pow_sums(flat, seg, 1.0); S.piece_max_abs(flat, seg); S.piece_stats(flat, seg); S.piece_dots(flat, flat, seg); whole(flat, c)
    r["no_sync"] = True
except RuntimeError as e:
    r["no_sync"] = str(e)[:300]
finally:
    torch.cuda.set_sync_debug_mode(0)
print(json.dumps(r, indent=1))
