"""Worker side of ``tests/test_convert.py``: DeepSpeed engines save with ``engine.save_checkpoint``; the offline
converter (``zero_dtensor.convert``) turns those folders into DCP / safetensors, which load here into new engines
(``zd.load``), into engines through DeepSpeed's own ``load_checkpoint``, and into FSDP2."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from workers.checkpoint import check_loaded, diff, same, snapshot, train
from workers.common import EngineCase, build_engine

CLIENT = {"epoch": 3, "note": "client"}


def _full_reference(engine: Any) -> dict[str, Any]:
    """DeepSpeed's own full values of every trainable parameter (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, Any] = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out["fp32"][n] = safe_get_full_fp32_param(p).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            try:
                value = safe_get_full_optimizer_state(p, key)
            except Exception:  # noqa: BLE001 - pitfall: not linked after load in some versions
                value = None
            out[key][n] = None if value is None else value.clone()
    return out


def _check_against_deepspeed(engine: Any, expected: dict[str, Any], name: str) -> None:
    """The snapshot's masters and moments equal DeepSpeed's ``safe_get_full_fp32_param`` /
    ``safe_get_full_optimizer_state`` bit for bit (so the loads below are compared with DeepSpeed's own values)."""
    ref = _full_reference(engine)
    assert ref["fp32"] and all(same(v, expected["master"][n]) for n, v in ref["fp32"].items()), name
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(v is not None and same(v, expected["state"][key][n]) for n, v in ref[key].items()), (name, key)


def ds_saves(root: str, cases: list[tuple[str, EngineCase, int]]) -> None:
    """Per ``(name, case, steps)``: build, train, ``engine.save_checkpoint(root/name)`` with a client state; rank 0
    writes the snapshot (``name.expected.pt``: masters, state, steps, hyperparameters, counters, scheduler, scaler,
    and DeepSpeed's ``safe_get_full_*`` values)."""
    for name, case, steps in cases:
        engine = build_engine(case, seed=1)
        train(engine, range(steps))
        expected = snapshot(engine) if case.stage else {}  # stage 0: only saved (the converter refuses it)
        if case.stage == 2 and case.model == "odd":  # the snapshot is DeepSpeed's own safe_get_full_* values
            _check_against_deepspeed(engine, expected, name)  # (it aborts a gloo rank on ZeRO-1 and 2-group tied cases)
        engine.save_checkpoint(os.path.join(root, name), client_state=dict(CLIENT))
        if dist.get_rank() == 0:
            torch.save(expected, os.path.join(root, f"{name}.expected.pt"))
        dist.barrier()


def _losses(engine: Any, steps: range) -> list[float]:
    """The loss of each of ``steps`` (trained as ``train`` trains)."""
    from workers.common import batch

    out = []
    for step in steps:
        loss = engine(batch(engine, step)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


def same_shape(root: str, name: str, case: EngineCase) -> None:
    """The converted DCP checkpoint ``name.dcp`` loaded with ``zd.load`` into a new engine of the saving shape equals
    DeepSpeed's own ``load_checkpoint`` of the original bit for bit (masters, every state key, steps,
    hyperparameters, working weights, counters, scheduler, loss scaler, client state); both then train 2 more steps
    with equal losses and equal state."""
    from zero_dtensor import load

    expected = torch.load(os.path.join(root, f"{name}.expected.pt"), weights_only=False)
    ours = build_engine(case, seed=2)
    train(ours, range(7, 8))  # a stepped engine with other values: the load replaces everything
    client = load(ours, os.path.join(root, f"{name}.dcp"))
    assert client == CLIENT, client
    check_loaded(ours, expected, f"{name}.dcp -> {case.id}")
    theirs = build_engine(case, seed=3)
    _, client_ds = theirs.load_checkpoint(os.path.join(root, name))
    assert client_ds["epoch"] == CLIENT["epoch"]
    a, b = snapshot(ours), snapshot(theirs)
    assert same(a, b), f"{name}: zd.load of the conversion and load_checkpoint differ in {diff(a, b)}"
    la, lb = _losses(ours, range(2, 4)), _losses(theirs, range(2, 4))
    assert la == lb, (la, lb)
    a, b = snapshot(ours), snapshot(theirs)
    assert same(a, b), f"{name}: after 2 more steps, {diff(a, b)}"


def reshaped(root: str, loads: list[tuple[str, EngineCase]]) -> None:
    """Each converted checkpoint loads with ``zd.load`` into an engine of another world size or stage: every master,
    state key, step, hyperparameter, counter equals the saving engine's (bitwise), and the engine trains on."""
    from zero_dtensor import load

    for name, case in loads:
        expected = torch.load(os.path.join(root, f"{name}.expected.pt"), weights_only=False)
        engine = build_engine(case, seed=2)
        assert load(engine, os.path.join(root, f"{name}.dcp")) == CLIENT
        check_loaded(engine, expected, f"{name}.dcp -> {case.id}")
        got = snapshot(engine)
        assert got["scheduler"] == expected["scheduler"], (got["scheduler"], expected["scheduler"])
        train(engine, range(5, 6))
        dist.barrier()


def fsdp2_loads(root: str, name: str) -> None:
    """The converted checkpoint of a one-group model loads into FSDP2 (``fully_shard`` per Linear) + torch AdamW
    with torch's own ``get_state_dict`` / ``dcp.load`` / ``set_state_dict``: equal bit for bit, and trains on
    (``workers.checkpoint.fsdp_loads``)."""
    from workers.checkpoint import fsdp_loads

    fsdp_loads(root, f"{name}.dcp", kind="odd")


class Stack(torch.nn.Module):
    """``layers`` square bias-free Linears of ``width``: the checkpoint grows with ``layers``, the largest parameter
    stays ``width * width``."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def ds_save_stack(root: str, name: str, stage: int, layers: int, width: int) -> None:
    """A :class:`Stack` engine (Adam, fp32) trains one step and saves with ``engine.save_checkpoint``."""
    import deepspeed

    torch.manual_seed(0)
    model = Stack(layers, width)
    config = EngineCase(stage=stage, world=dist.get_world_size()).config()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), width)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.save_checkpoint(os.path.join(root, name))
    dist.barrier()


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def memory_probe(src: str, dst: str, to: str) -> dict[str, int]:
    """Run in a fresh process: ``zd.convert(src, dst, to=to)`` while a thread samples ``RssAnon`` every 0.5 ms (and
    the progress callback after each tensor); the peak's growth over the value just before the call."""
    import threading
    import time

    import zero_dtensor as zd

    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.0005)

    base = _rss_anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    zd.convert(src, dst, to=to, progress=lambda done, total: peak.__setitem__(0, max(peak[0], _rss_anon())))
    stop.set()
    thread.join()
    return {"base": base, "peak": peak[0], "growth": peak[0] - base}
