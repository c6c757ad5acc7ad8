"""Cost of zero_dtensor.keep_full_grads (opt-in Replicate for ZeRO-1/2): backward time and memory.

    python benchmarks/keep_full_grads_cost.py [--layers 50] [--width 448] [--ranks 2] [--repeats 7]

Runs on CPU/gloo ranks (zero_dtensor.launch). For stage 1 and 2, fp32: median ``engine.backward()`` time without
and with ``keep_full_grads``, the kept buffer's bytes per rank, and the time of reading every full gradient
(``full_tensors()``: one all_gather per group without it, nothing with it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _measure(stage: int, layers: int, width: int, repeats: int, zero: dict | None = None) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    import zero_dtensor as zd
    from zero_dtensor.families.replicate import keep_full_grads

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        config = {
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": stage, **(zero or {})},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return engine

    engines = {False: build(), True: build()}
    handle = keep_full_grads(engines[True])
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = {k: {"back": [], "read": []} for k in engines}
    for i in range(repeats + 1):
        for keep in (False, True) if i % 2 else (True, False):  # alternate, so that load from others hits both
            engine = engines[keep]
            loss = engine(x).pow(2).mean()
            dist.barrier()
            t0 = time.perf_counter()
            engine.backward(loss)
            dist.barrier()
            t1 = time.perf_counter()
            full = zd.sharded_grads(engine).full_tensors()
            dist.barrier()
            t2 = time.perf_counter()
            del full
            engine.step()
            if i:  # skip the warm-up iteration
                times[keep]["back"].append(t1 - t0)
                times[keep]["read"].append(t2 - t1)
    out = {
        keep: {
            "backward_ms": 1e3 * statistics.median(times[keep]["back"]),
            "read_all_ms": 1e3 * statistics.median(times[keep]["read"]),
            "kept_MB": handle.nbytes / 2**20 if keep else 0.0,
        }
        for keep in engines
    }
    engine = engines[False]
    out["params_M"] = sum(p.numel() for p in engine.module.parameters()) / 1e6
    return out


def main() -> None:
    from zero_dtensor.launch import RankPool

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--width", type=int, default=448)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--zero", default="{}", help='extra zero_optimization keys as JSON, e.g. {"reduce_scatter": false}')
    args = parser.parse_args()
    with RankPool(args.ranks) as pool:
        for stage in (1, 2):
            r = pool.run(_measure, stage, args.layers, args.width, args.repeats, json.loads(args.zero), timeout=1800)[0]
            base, kept = r[False], r[True]
            print(
                f"ZeRO-{stage} {args.zero}, {r['params_M']:.1f}M fp32 params, {args.ranks} ranks: backward "
                f"{base['backward_ms']:.1f} -> {kept['backward_ms']:.1f} ms "
                f"({100 * (kept['backward_ms'] / base['backward_ms'] - 1):+.1f}%); kept buffer {kept['kept_MB']:.1f} MB "
                f"per rank; full_tensors() {base['read_all_ms']:.1f} -> {kept['read_all_ms']:.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
