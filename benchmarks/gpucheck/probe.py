"""The bare collectives DeepSpeed and zero_dtensor use, probed on the shared device in throwaway processes: an op
that kills its process (gloo over CUDA: a coalesced all_gather segfaults, point-to-point aborts) is reported with
the signal, and never runs inside the ranks that run the checks."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from .rank_deaths import describe_death, redirect_stderr
from .runtime import error_text
from .spawned import Spawned, announce

# needed by DeepSpeed's engines: a missing one stops the cases that use it
REQUIRED = ("all_reduce", "all_reduce max", "broadcast", "all_gather", "all_gather_into_tensor",
            "reduce_scatter_tensor", "barrier")
# zero_dtensor's dst= reads, and what only zero_dtensor's strategy choice may use: their absence stops nothing, but
# names what a rank that dies in a case was likely doing
OPTIONAL = ("reduce", "gather", "all_to_all_single", "isend/irecv", "coalesced all_gather_into_tensor")
OPS = REQUIRED + OPTIONAL
KILLED = "killed the process: "


def _ops(device: Any) -> dict[str, Callable[[], Any]]:
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((8 * world,), float(rank + 1), device=device)
    out = torch.empty(8 * world * world, device=device)

    def coalesced_all_gather() -> None:
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(out, x, async_op=True)
        cm.wait()

    def isend_irecv() -> None:
        peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
        got = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, peer_to), dist.P2POp(dist.irecv, got, peer_from)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_reduce max": lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX),
        "broadcast": lambda: dist.broadcast(x.clone(), src=0),
        "all_gather": lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)], x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(8, device=device), x),
        "barrier": lambda: dist.barrier(),
        "reduce": lambda: dist.reduce(x.clone(), dst=0),
        "gather": lambda: dist.gather(x.clone(), [torch.empty_like(x) for _ in range(world)] if rank == 0 else None,
                                      dst=0),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "isend/irecv": isend_irecv,
        "coalesced all_gather_into_tensor": coalesced_all_gather,
    }


def probe_main(rank: int, world: int, port: int, answers: Any, stderr_path: str, device_type: str,
               ops: list[str]) -> None:
    """A throwaway process: a gloo group on the shared device, then each op in ``ops``, announced first."""
    redirect_stderr(stderr_path)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    table = _ops(device)
    for name in ops:
        announce(answers, rank, f"probe {name}")
        try:
            table[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, decides what can run
            result = error_text(exc)
        answers.put((rank, "probe", (name, result)))
    dist.destroy_process_group()


def probe_collectives(world: int, device_type: str, start_timeout: float = 120.0,
                      op_timeout: float = 40.0) -> dict[str, Any]:
    """``{"collectives": {op: "ok" | error | "killed the process: ..."}, "deaths": [...]}``: each op of ``OPS`` on
    ``world`` throwaway gloo processes; after an op kills them, new ones probe the ops left."""
    results: dict[str, str] = {}
    deaths: list[dict[str, Any]] = []
    remaining = list(OPS)
    while remaining:
        group = Spawned(world, probe_main, (device_type, remaining))
        try:
            for i, op in enumerate(list(remaining)):
                got = group.collect("probe", start_timeout if i == 0 else op_timeout, key=op)
                remaining.remove(op)
                if len(got) == world and all(w == "probe" for w, _ in got.values()):
                    bad = [p[1] for _, p in got.values() if p[1] != "ok"]
                    results[op] = bad[0] if bad else "ok"
                    continue
                lost = group.reports(sorted(set(range(world)) - set(got)))
                deaths += lost
                words = "; ".join(describe_death(r) for r in lost)
                if not any(r.get("doing") for r in lost):  # they never reached an op: no new processes
                    for name in [op, *remaining]:
                        results[name] = f"not probed: the probe processes did not start: {words}"
                    remaining.clear()
                    break
                results[op] = KILLED + words
                break  # new processes for the ops left
        finally:
            group.close(finished=not remaining)
    return {"collectives": results, "deaths": deaths}


def missing_required(collectives: dict[str, str]) -> dict[str, str]:
    """The required collectives the probe found broken."""
    return {op: err for op, err in collectives.items() if err != "ok" and op in REQUIRED}


def killers(collectives: dict[str, str]) -> dict[str, str]:
    """The ops that killed their process (these must never run in a rank that matters)."""
    return {op: err for op, err in collectives.items() if err.startswith(KILLED)}
