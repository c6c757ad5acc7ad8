#!/usr/bin/env bash
# The prepared device run of issue 52, on one H100/H200 (torch 2.11+cu130, no DeepSpeed installed: it travels as
# the wheels in .whl/, see docs/gpu.md "A machine without network access"), within 10 minutes:
#   1. forced-collective world-1 checks of stream discipline: every family's calls under
#      ZERO_DTENSOR_FORCE_COLLECTIVES=1 with CUDA_LAUNCH_BLOCKING=0 and =1, compared bit for bit; the calls that
#      promise no host sync under torch.cuda.set_sync_debug_mode (scripts/gpu_streams_check.py);
#   2. gpu_check at world 1 with forced collectives (every NCCL call of the library, over the one rank): the 36-case
#      matrix against DeepSpeed, then the timing rows on the 1.03B model beside the device copy and the bare
#      collectives, the fused reductions' rows beside the eager ones (fused on and off);
#   3. the 36-case 2-rank matrix (2 gloo ranks sharing the GPU);
#   4. meanwhile, on CPU cores the GPU parts leave free (taskset), the 4-rank CPU rows of zero_dtensor.bench
#      (redistribution against its bare all_to_all_single, ZeRO-3 gathers against the cheapest primitive).
# Everything lands in $OUT (JSON and logs); copy the JSON under docs/gpu/ with the date and the device.
#
#   run:  bash scripts/gpu_run.sh            (from the repository root, carrying .whl)
set -u
OUT=${OUT:-/tmp/gpu_run}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - START) )); }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
CORES=$(nproc)
HALF=$(( CORES / 2 ))
GPU_CORES="0-$(( HALF - 1 ))"
CPU_CORES="$HALF-$(( CORES - 1 ))"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git rev-parse HEAD; date -u; } \
  > "$OUT/machine.txt" 2>&1

# 4. the CPU rows, in the background on the other half of the cores (no GPU visible to them)
( CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu timeout 480 taskset -c "$CPU_CORES" \
    python3 -m zero_dtensor.bench --nproc 4 --stages 1,2,3 --repeat 5 --no-progress --json "$OUT/cpu-4rank.json" \
    > "$OUT/cpu-4rank.log" 2>&1; echo "rc=$?" >> "$OUT/cpu-4rank.log" ) &
CPU_PID=$!

# 1. streams: the same calls with and without CUDA_LAUNCH_BLOCKING, bit for bit
for LB in 0 1; do
  CUDA_LAUNCH_BLOCKING=$LB timeout 150 taskset -c "$GPU_CORES" python3 scripts/gpu_streams_check.py run \
    --out "$OUT" --tag "lb$LB" > "$OUT/streams-lb$LB.log" 2>&1
  echo "streams lb$LB rc=$?" | tee -a "$OUT/summary.txt"
done
python3 scripts/gpu_streams_check.py compare "$OUT/streams-lb0.pt" "$OUT/streams-lb1.pt" \
  > "$OUT/streams-compare.json" 2>"$OUT/streams-compare.log"
echo "streams compare rc=$?" | tee -a "$OUT/summary.txt"
rm -f "$OUT"/streams-lb*.pt   # large; the JSON keeps the verdicts

# 2. world 1, forced collectives: the 36 cases, then the timings (fused on and off), no checkpoint rows
B=$(( $(left) - 170 )); [ "$B" -lt 60 ] && B=60
timeout $(( B + 30 )) taskset -c "$GPU_CORES" python3 benchmarks/gpu_check.py --force-collectives on --ranks 0 \
  --checkpoint-stages '' --ds-repeat 1 --budget-s "$B" --json "$OUT/gpu-world1-forced.json" \
  > "$OUT/gpu-world1-forced.log" 2>&1
echo "gpu_check world 1 forced rc=$?" | tee -a "$OUT/summary.txt"

# 3. the 36-case 2-rank matrix (gloo ranks sharing the GPU)
B=$(( $(left) - 20 )); [ "$B" -lt 30 ] && B=30
timeout $(( B + 15 )) taskset -c "$GPU_CORES" python3 benchmarks/gpu_check.py --skip-timing --skip-world-one \
  --ranks 2 --budget-s "$B" --json "$OUT/gpu-2rank-matrix.json" > "$OUT/gpu-2rank-matrix.log" 2>&1
echo "gpu_check 2-rank matrix rc=$?" | tee -a "$OUT/summary.txt"

wait "$CPU_PID"
echo "cpu 4-rank: $(tail -1 "$OUT/cpu-4rank.log")" | tee -a "$OUT/summary.txt"
echo "elapsed $(( $(date +%s) - START )) s" | tee -a "$OUT/summary.txt"
