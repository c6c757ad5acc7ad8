"""One command for the CUDA path (issues 13, 42, 52): zero_dtensor checked against DeepSpeed and timed against
bare-op floors, on one device or, under ``torchrun``, on N (one GPU per rank, NCCL). The parts live in
``benchmarks/gpucheck/`` (one module per role); this file is the entry.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--tiny] [--quick] [--json PATH] [--skip-timing]
                                   [--budget-s S] [--profile DIR] [--checkpoint-stages 1,2,3]
                                   [--force-collectives auto|on|off] [--skip-world-one]
    torchrun --nproc_per_node=N benchmarks/gpu_check.py [same options]

Under ``torchrun`` every part below runs at N ranks (``gpucheck/world.py``): the check matrix at N ranks, the
timings at N ranks beside the bare ``all_gather_into_tensor`` / ``all_reduce`` / ``all_to_all_single`` of the same
bytes (with bus bandwidth), no spawned ranks. On one GPU the world-1 part runs with
``ZERO_DTENSOR_FORCE_COLLECTIVES=1`` (``--force-collectives auto``): every NCCL call of the library, over one rank.

The device defaults to ``cuda`` when torch sees a GPU, else ``cpu``. Three parts, in this order, one table, one
JSON file (written after every part):

1. **Checks at world 1** (NCCL on CUDA, gloo on CPU; small models, every case a fresh pair of DeepSpeed engines with
   the same seed). The matrix is ZeRO stages 1-3 x fp32/bf16/fp16 x four variants: ``overlap_comm`` off, on,
   ``offload_optimizer: cpu`` (``pin_memory`` on CUDA) and gradient accumulation 2. Each case trains two optimizer
   steps and checks (``gpucheck/grad_checks.py``, ``gpucheck/family_checks.py``):

   - ``reads``: ``full_tensors()`` (every strategy), ``iter_full`` and every ``ParamGrad.full_tensor()`` equal
     DeepSpeed's ``safe_get_full_grad`` (exactly; under fp16 loss scaling after unscaling, rtol 1e-6, atol 1e-7);
   - ``transforms``: ``stats()``, ``norms()``, ``global_norm()``, ``clone`` + ``dots()``, ``mul_(0.5)`` and
     ``clip_grad_norm_`` against the same operation on the full tensors;
   - ``redistribute``: ``to_dtensors`` and ``owned`` against ``full_tensors``, ``map_full_`` and ``set_dtensors_``
     seen by ``full_tensors``;
   - ``set+step``: ``set_full_`` then ``engine.step()`` gives bit-identical parameters to DeepSpeed's own
     ``safe_set_full_grad`` loop then ``step()`` on the twin engine;
   - ``hook``: a ``zd.on_grads`` hook fires exactly once per accumulation boundary, with the step's gradients;
   - ``masters``: fp32 masters and ``exp_avg`` / ``exp_avg_sq`` (``full_tensors`` and the ``get_full_*``
     drop-ins) equal ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` exactly;
   - ``save/load``: ``zd.save``; the twin steps away, ``zd.load`` makes its masters, state and working weights
     equal exactly; then both take the same step and stay equal;
   - ``master writes``: ``set_full_fp32_params`` is seen by DeepSpeed, the working weights are the cast values, and a
     forward gives a plain model's output with them;
   - ``ema``: ``clone`` + ``lerp_`` on the masters equals ``torch.lerp`` exactly, and leaves the masters alone.

   A check that raises is recorded as failed with its message; the others still run.
2. **Timings** at world 1, per ZeRO stage, of a transformer-like bf16 model (``zero_dtensor.bench.model``: hidden
   2304, 16 blocks: 1.03B parameters in 198 tensors; ``--tiny``: 1.02M, the same 198 tensors): DeepSpeed's loops,
   ``full_tensors()``, ``set_full_()``, ``mul_``, ``clip_grad_norm_()``, ``stats()``, ``norms()``,
   ``global_norm()``, ``dots()``, the first ``sharded_grads`` of a step, the masters' and ``exp_avg``'s
   ``full_tensors()``, the masters' ``set_full_()``; each beside its floor timed in the same process
   (``gpucheck/floors.py``), with the ratio, and the peak extra CUDA memory of each call. On
   ``--checkpoint-stages``: ``zd.save`` / ``zd.load`` against DeepSpeed's ``save_checkpoint`` /
   ``load_checkpoint``. ``--profile DIR``: one more call of each row under ``torch.profiler`` (kernels, device
   time, host syncs) into ``DIR/profile.json`` and ``DIR/profile.txt``.
3. **Checks on 2 ranks** sharing the one device (gloo; on CUDA over CUDA tensors). The bare collectives are probed
   first in throwaway processes (on gloo over CUDA some kill their process); a rank that dies in a case is reported
   with its signal, what it was doing and its last stderr lines (``gpucheck/ranks.py``).

``--budget-s`` (default 290) skips whatever would end past it, estimated from the time the same kind of work took
so far, reported ``skipped: budget``. Exit code 1 if any check failed or a timing raised.
``--quick`` runs a covering subset for CI (the full world-1 matrix, and at 2 ranks one case per stage and dtype
with the variants rotated).

Running it on the GPU machine (torch 2.11 + CUDA there, no DeepSpeed, no network). Prepare the wheels here, in an
environment that already has the CPU torch (``--no-build-isolation`` keeps pip from fetching a multi-GB torch to
build DeepSpeed; ``DS_BUILD_OPS=0`` builds no ops: DeepSpeed JIT-builds what it needs, and these checks need none,
since they use ``torch_adam: true``). DeepSpeed 0.19.8 requires einops, hjson, msgpack, ninja, numpy, packaging,
psutil, py-cpuinfo, pydantic, torch, tqdm; the GPU image has all but hjson and pydantic (which needs pydantic-core,
annotated-types, typing-inspection and typing-extensions; the last is carried only for its version floor)::

    echo /.whl/ >> .git/info/exclude
    DS_BUILD_OPS=0 python -m pip wheel --no-deps --no-build-isolation --no-cache-dir deepspeed==0.19.8 -w .whl
    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \\
        hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \\
        typing-extensions==4.16.0

(7 wheels, 4.7 MB.) Then, on the device machine, from the repository root (carrying ``.whl``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
    python3 benchmarks/gpu_check.py --json $OUT/gpu.json 2>&1 | tee $OUT/gpu.log
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the gpucheck package beside this file

from gpucheck.cli import main  # noqa: E402 - after the path it needs

if __name__ == "__main__":
    sys.exit(main())
