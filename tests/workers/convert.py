"""Worker side of ``tests/test_convert.py``: DeepSpeed engines save with ``engine.save_checkpoint``; the offline
converter (``zero_dtensor.convert``) turns those folders into DCP / safetensors, which load here into new engines
(``zd.load``), into engines through DeepSpeed's own ``load_checkpoint``, and into FSDP2."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from workers.checkpoint import check_loaded, diff, same, snapshot, train
from workers.common import EngineCase, build_engine

CLIENT = {"epoch": 3, "note": "client"}


def _link_optimizer_state(engine: Any) -> None:
    """Let DeepSpeed's ``safe_get_full_optimizer_state`` read the current state: ZeRO-1/2 and ``BF16_Optimizer``
    link each parameter's optimizer-state fragment only inside ``step()`` (``_lazy_init_hp_params_optimizer_state``,
    once), so after a load into an engine that never stepped every fragment is ``None`` (``TypeError`` on the ranks
    that hold a piece while the others wait in the getter's all_reduce: a gloo abort), and ZeRO-1/2 with several
    param groups link after the *first* group's step, before the later groups have state (DeepSpeed 0.19.8
    ``stage_1_and_2.py`` ``_optimizer_step``: ``exp_avg not found in optimizer state fragment`` for their parameters,
    forever). So the comparison calls DeepSpeed's own linking again, as its next step would; the values then read
    are still DeepSpeed's, through its own fragment mapping. ZeRO-3's getters read the state directly."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _linked_everywhere(engine: Any, keys: tuple[str, ...]) -> bool:
    """Whether every rank holds, for each of its ZeRO-1/2 fragments, the ``keys`` (checked without communication,
    then agreed with one all_reduce: a getter that raises on some ranks only would leave the others in a collective)."""
    ok = True
    for p in engine.module.parameters():
        mapping = getattr(p, "_hp_mapping", None)
        if p.requires_grad and mapping is not None:
            ok = ok and all(k in (mapping.optim_fragment or {}) for k in keys)
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _full_reference(engine: Any) -> dict[str, Any]:
    """DeepSpeed's own full values of every trainable parameter (``safe_get_full_fp32_param`` /
    ``safe_get_full_optimizer_state``; one collective each)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    keys = ("exp_avg", "exp_avg_sq")
    _link_optimizer_state(engine)
    assert _linked_everywhere(engine, keys), "DeepSpeed's optimizer-state fragments are not linked on every rank"
    out: dict[str, Any] = {"fp32": {}, **{k: {} for k in keys}}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out["fp32"][n] = safe_get_full_fp32_param(p).clone()
        for key in keys:
            out[key][n] = safe_get_full_optimizer_state(p, key).clone()
    return out


def _check_against_deepspeed(engine: Any, expected: dict[str, Any], name: str) -> None:
    """The masters and moments of ``expected`` (a snapshot) equal DeepSpeed's ``safe_get_full_fp32_param`` /
    ``safe_get_full_optimizer_state`` of ``engine`` bit for bit, for every trainable parameter."""
    ref = _full_reference(engine)
    assert set(ref["fp32"]) == set(expected["master"]), (name, sorted(ref["fp32"]), sorted(expected["master"]))
    for n, v in ref["fp32"].items():
        assert same(v, expected["master"][n]), f"{name}: safe_get_full_fp32_param({n})"
    for key in ("exp_avg", "exp_avg_sq"):
        for n, v in ref[key].items():
            assert same(v, expected["state"][key][n]), f"{name}: safe_get_full_optimizer_state({n}, {key})"


def ds_saves(root: str, cases: list[tuple[str, EngineCase, int]]) -> None:
    """Per ``(name, case, steps)``: build, train, ``engine.save_checkpoint(root/name)`` with a client state; rank 0
    writes the snapshot (``name.expected.pt``: masters, state, steps, hyperparameters, counters, scheduler, scaler),
    whose masters and moments equal the engine's own ``safe_get_full_*`` values."""
    for name, case, steps in cases:
        engine = build_engine(case, seed=1)
        train(engine, range(steps))
        expected = snapshot(engine) if case.stage else {}  # stage 0: only saved (the converter refuses it)
        if case.stage:  # the snapshot is the saving engine's own safe_get_full_* values
            _check_against_deepspeed(engine, expected, name)
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
    _check_against_deepspeed(ours, expected, f"{name}.dcp -> {case.id}")
    theirs = build_engine(case, seed=3)
    _, client_ds = theirs.load_checkpoint(os.path.join(root, name))
    assert client_ds["epoch"] == CLIENT["epoch"]
    a, b = snapshot(ours), snapshot(theirs)
    assert same(a, b), f"{name}: zd.load of the conversion and load_checkpoint differ in {diff(a, b)}"
    la, lb = _losses(ours, range(2, 4)), _losses(theirs, range(2, 4))
    assert la == lb, (la, lb)
    a, b = snapshot(ours), snapshot(theirs)
    assert same(a, b), f"{name}: after 2 more steps, {diff(a, b)}"


UNIVERSAL_EQUAL, UNIVERSAL_REFUSED = "universal equal", "universal refused"


def _universal_load(root: str, name: str, case: EngineCase) -> Any:
    """A new engine of ``case`` with ``"checkpoint": {"load_universal": true}`` that loads (``load_checkpoint``)
    ``root/name.universal`` (DeepSpeed's ``ds_to_universal`` of the original folder, ``latest_universal`` inside)."""
    theirs = build_engine(dataclasses.replace(case, extra=case.extra + (("checkpoint", {"load_universal": True}),)),
                          seed=3)
    theirs.load_checkpoint(os.path.join(root, f"{name}.universal"))
    return theirs


def _check_universal(root: str, name: str, case: EngineCase, ours: dict[str, Any]) -> None:
    """DeepSpeed's universal load of the same checkpoint into the same shape equals ``ours`` (the snapshot of the
    engine that ``zd.load`` loaded) bit for bit: masters, every optimizer-state key, steps, counters, lr scheduler,
    loss scaler, and the working weights of the trained parameters. Two things DeepSpeed 0.19.8's universal load does not
    restore, so they are compared only where it does: frozen parameters keep the new engine's initial values (no
    optimizer state, and the module weights are not read); ZeRO-3 copies the first param group's hyperparameters into
    every group (``stage3.py`` ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``: ``param_groups[0]`` for each
    group, so the second group's ``weight_decay`` 0.0 becomes 0.1): there only the first group's are compared."""
    theirs = snapshot(_universal_load(root, name, case))
    for key in ("master", "state", "steps", "counters", "scheduler", "scaler"):
        assert same(ours[key], theirs[key]), f"{name} -> {case.id}: zd.load and DeepSpeed's universal load: {key}"
    for n in ours["master"]:
        assert same(ours["working"][n], theirs["working"][n]), f"{name} -> {case.id}: working weights of {n}"
    groups = 1 if case.stage == 3 else len(ours["hps"])
    assert same(ours["hps"][:groups], theirs["hps"][:groups]), (name, case.id, ours["hps"], theirs["hps"])


def _check_universal_refused(root: str, name: str, case: EngineCase) -> None:
    """DeepSpeed's universal load refuses another ZeRO stage (1/2 <-> 3): the engine looks for model-states files
    named as its own stage writes them (ZeRO-3 ``zero_pp_rank_*_mp_rank_00_model_states.pt``, ZeRO-1/2
    ``mp_rank_00_model_states.pt``), finds none, and raises ``AssertionError`` (``state_dict_factory.py``
    ``check_ckpt_list``: ``assert len(self.ckpt_list) > 0``) before any collective. If this starts to pass, make the
    pair a ``UNIVERSAL_EQUAL`` one."""
    try:
        _universal_load(root, name, case)
    except AssertionError:
        return
    raise AssertionError(f"{name} -> {case.id}: DeepSpeed's universal load of another stage no longer refuses")


def reshaped(root: str, loads: list[tuple[str, EngineCase, str]]) -> None:
    """Each converted checkpoint loads with ``zd.load`` into an engine of another world size or stage: every master,
    state key, step, hyperparameter, counter equals the saving engine's (bitwise), and so do DeepSpeed's own
    ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` of the loaded engine. And
    DeepSpeed's universal checkpoint of the same folder (``ds_to_universal``) loaded into the same shape equals the
    engine that ``zd.load`` loaded (``UNIVERSAL_EQUAL``: same stage, :func:`_check_universal`) or is refused
    (``UNIVERSAL_REFUSED``: another stage, :func:`_check_universal_refused`). Then the engine trains on."""
    from zero_dtensor import load

    for name, case, universal in loads:
        expected = torch.load(os.path.join(root, f"{name}.expected.pt"), weights_only=False)
        engine = build_engine(case, seed=2)
        assert load(engine, os.path.join(root, f"{name}.dcp")) == CLIENT
        check_loaded(engine, expected, f"{name}.dcp -> {case.id}")
        got = snapshot(engine)
        assert got["scheduler"] == expected["scheduler"], (got["scheduler"], expected["scheduler"])
        _check_against_deepspeed(engine, expected, f"{name}.dcp -> {case.id}")
        if universal == UNIVERSAL_EQUAL:
            _check_universal(root, name, case, got)
        else:
            assert universal == UNIVERSAL_REFUSED, universal
            _check_universal_refused(root, name, case)
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
