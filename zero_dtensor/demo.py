"""A one-minute tour on 2 CPU ranks: ZeRO-2, read / modify / write the gradient, and what each call communicated.

Run: ``python -m zero_dtensor.demo`` (``--nproc 3`` for more ranks, ``--stage 1|2|3``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch


def _count(fn: Any) -> tuple[Any, int]:
    """Run ``fn`` under CommDebugMode; return its result and the number of collectives it issued (a batch of
    point-to-point ops, which CommDebugMode does not see, counted as one)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from .comm.point_to_point import counting_p2p

    with CommDebugMode() as mode, counting_p2p() as p2p:
        result = fn()
    return result, mode.get_total_counts() + p2p.batches


def _rank_main(stage: int) -> list[tuple[str, int, str]]:
    import warnings

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    import zero_dtensor as zd

    warnings.filterwarnings("ignore", category=FutureWarning)  # DeepSpeed's own deprecated torch calls
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 129), torch.nn.GELU(), torch.nn.Linear(129, 65),
                                torch.nn.GELU(), torch.nn.Linear(65, 3))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(dist.get_rank())
    engine.backward(engine(torch.randn(8, 64)).pow(2).mean())

    rows = []
    grads, n = _count(lambda: zd.sharded_grads(engine))
    rows.append(("zd.sharded_grads(engine)", n, f"{len(grads)} params, {len(grads.groups)} flat group(s)"))
    name = grads.names[0]
    local = grads[name].to_local()
    rows.append((f"grads[{name!r}].to_local()", 0, f"this rank's {local.numel()} of {grads[name].numel} elements"))
    full, n = _count(lambda: grads.full_tensors())
    rows.append(("grads.full_tensors()", n, f"{sum(t.numel() for t in full.values())} elements, one gather"))
    theirs, n = _count(lambda: {k: safe_get_full_grad(p) for k, p in engine.module.named_parameters()})
    rows.append(("DeepSpeed safe_get_full_grad loop", n, "one fp32 all_reduce per parameter"))
    same = all(torch.equal(full[k], theirs[k].to(full[k].dtype)) for k in full)
    rows.append(("  equal to DeepSpeed's values", 0, str(same)))
    if not same:
        raise AssertionError("zero_dtensor and DeepSpeed disagree")
    doubled = {k: 2 * v for k, v in full.items()}
    _, n = _count(lambda: grads.set_full_(doubled))
    rows.append(("grads.set_full_({name: 2 * g})", n, "each rank writes its own fragment"))
    again = grads.full_tensors()
    rows.append(("  read back equals 2 * g", 0, str(all(torch.equal(again[k], doubled[k]) for k in full))))
    engine.step()
    rows.append(("engine.step()", 0, "consumed the doubled gradient"))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_dtensor.demo", description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from .launch import launch

    console = Console()
    with console.status(f"starting {args.nproc} CPU ranks (gloo) and a ZeRO-{args.stage} engine"):
        rows = launch(_rank_main, args.stage, nprocs=args.nproc, start_method="spawn")
    table = Table(title=f"zero_dtensor demo: ZeRO-{args.stage}, {args.nproc} ranks, what each call communicated")
    table.add_column("call")
    table.add_column("collectives", justify="right")
    table.add_column("result")
    for call, count, note in rows:
        table.add_row(call, str(count), note)
    console.print(table)


if __name__ == "__main__":
    main()
