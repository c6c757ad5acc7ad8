"""The offline converter (``zd.convert`` / ``python -m zero_dtensor.convert``): DeepSpeed engines on CPU gloo ranks
train 2 steps and ``engine.save_checkpoint``; the folders are converted in this (one) process, with no engine and
no process group, then loaded back (``zd.load``: same shape against DeepSpeed's own ``load_checkpoint``, other world
sizes and stages, FSDP2) and compared bit for bit, with DeepSpeed's ``safe_get_full_*`` getters of the saving and of
the loading engine, and (same stage, other world size) with DeepSpeed's universal checkpoint (``ds_to_universal`` +
``load_universal``); safetensors against DeepSpeed's ``zero_to_fp32``; bad folders refused with nothing written;
peak anonymous memory bounded while the checkpoint grows 8x.

The saves run once per world size (one pool run each); engine builds dominate the cost.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil

import pytest
import torch

import zero_dtensor as zd
from workers import convert as wc
from workers.checkpoint import WARMUP
from workers.common import EngineCase

TIED2 = {"groups": 2, "model": "tied"}  # two param groups, a frozen (fc1.bias) and a tied (mid2.weight) parameter
SAVES_2 = [
    ("w2-z1-fp32", EngineCase(stage=1, world=2, extra=WARMUP, **TIED2), 2),
    ("w2-z2-bf16", EngineCase(stage=2, dtype="bf16", world=2, **TIED2), 2),
    ("w2-z3-fp16", EngineCase(stage=3, dtype="fp16", world=2, zero={"sub_group_size": 300}, **TIED2), 2),
    ("w2-bf16opt", EngineCase(stage=1, dtype="bf16", bf16_optimizer=True, world=2, **TIED2), 2),
    ("w2-z2-odd", EngineCase(stage=2, world=2), 2),  # one group, no tie: zero_to_fp32 writes safetensors; FSDP2
]
SAVES_3 = [("w3-z3-bf16", EngineCase(stage=3, dtype="bf16", world=3, **TIED2), 2)]
SAVES_1 = [("w1-z2-fp32", EngineCase(stage=2, world=1, **TIED2), 2), ("w1-z0", EngineCase(stage=0, world=1), 1)]
CASES = {name: case for name, case, _ in SAVES_1 + SAVES_2 + SAVES_3 if case.stage}
UNIVERSAL = ["w2-z1-fp32", "w2-z2-bf16", "w2-z3-fp16", "w2-bf16opt", "w3-z3-bf16", "w1-z2-fp32"]  # ds_to_universal'd
EQUAL, REFUSED = wc.UNIVERSAL_EQUAL, wc.UNIVERSAL_REFUSED


def _convert_all(root: str, names: list[str]) -> None:
    for name in names:
        zd.convert(os.path.join(root, name), os.path.join(root, f"{name}.dcp"))
        shutil.copy(os.path.join(root, f"{name}.expected.pt"), os.path.join(root, f"{name}.dcp.expected.pt"))
        zd.convert(os.path.join(root, name), os.path.join(root, f"{name}.st"), to="safetensors",
                   max_shard_size="4KB")


def _to_universal(root: str, name: str) -> None:
    """DeepSpeed's own ``python -m deepspeed.checkpoint.ds_to_universal --input_folder root/name/global_step2
    --output_folder root/name.universal/global_step2 --inject_missing_state --num_extract_workers 1
    --num_merge_workers 1``, run in this process (one worker each: no process pool); it writes
    ``root/name.universal/latest_universal``. ``--inject_missing_state``: ZeRO-1/2 files of an engine without
    Megatron's ``universal_checkpoint_info`` are refused without it."""
    from unittest import mock

    from deepspeed.checkpoint import ds_to_universal

    argv = ["ds_to_universal", "--input_folder", os.path.join(root, name, "global_step2"),
            "--output_folder", os.path.join(root, f"{name}.universal", "global_step2"), "--inject_missing_state",
            "--num_extract_workers", "1", "--num_merge_workers", "1"]
    with (mock.patch("sys.argv", argv), contextlib.redirect_stdout(io.StringIO()),
          contextlib.redirect_stderr(io.StringIO())):
        ds_to_universal.main(ds_to_universal.parse_arguments())


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("ds"))
    ranks(2).run(wc.ds_saves, root, SAVES_2)
    ranks(3).run(wc.ds_saves, root, SAVES_3)
    ranks(1).run(wc.ds_saves, root, SAVES_1)
    _convert_all(root, list(CASES))
    for name in UNIVERSAL:
        _to_universal(root, name)
    return root


@pytest.mark.parametrize("name", ["w2-z1-fp32", "w2-z2-bf16", "w2-z3-fp16", "w2-bf16opt"])
def test_dcp_same_shape_equals_load_checkpoint(ranks, saved, name) -> None:
    ranks(2).run(wc.same_shape, saved, name, CASES[name])


def test_dcp_same_shape_world_1_and_3(ranks, saved) -> None:
    ranks(1).run(wc.same_shape, saved, "w1-z2-fp32", CASES["w1-z2-fp32"])
    ranks(3).run(wc.same_shape, saved, "w3-z3-bf16", CASES["w3-z3-bf16"])


def test_dcp_reshaped(ranks, saved) -> None:
    """Another world size and/or stage: equal to the saving engine's values and to DeepSpeed's ``safe_get_full_*``
    of the loaded engine. DeepSpeed's universal checkpoint supports the same-stage pair only: the stage changes are
    refused there (asserted: ``workers.convert._check_universal_refused``)."""
    ranks(3).run(wc.reshaped, saved, [
        ("w2-z1-fp32", EngineCase(stage=3, world=3, extra=WARMUP, **TIED2), REFUSED),  # 2 -> 3, stage 1 -> 3
        ("w2-z2-bf16", EngineCase(stage=2, dtype="bf16", world=3, **TIED2), EQUAL),  # 2 -> 3
    ])
    ranks(1).run(wc.reshaped, saved, [
        ("w3-z3-bf16", EngineCase(stage=1, dtype="bf16", world=1, **TIED2), REFUSED),  # 3 -> 1, stage 3 -> 1
        ("w2-bf16opt", EngineCase(stage=3, dtype="bf16", world=1, **TIED2), REFUSED),  # BF16_Optimizer 2 -> ZeRO-3 at 1
    ])
    ranks(2).run(wc.reshaped, saved, [
        ("w2-z3-fp16", EngineCase(stage=1, dtype="fp16", world=2, **TIED2), REFUSED),  # stage 3 (sub-groups) -> 1
        ("w1-z2-fp32", EngineCase(stage=3, world=2, **TIED2), REFUSED),  # 1 -> 2, stage 2 -> 3
    ])


def test_dcp_reshaped_equals_universal(ranks, saved) -> None:
    """The other world-size changes within one stage, where DeepSpeed's universal checkpoint (``ds_to_universal`` +
    ``load_universal``) works: ``zd.load`` of the conversion equals DeepSpeed's universal load bit for bit
    (``workers.convert._check_universal``: masters, every state key, steps, counters, scheduler, loss scaler,
    trained working weights, hyperparameters where DeepSpeed restores them), the saving engine's values, and
    DeepSpeed's ``safe_get_full_*`` of the loaded engine."""
    ranks(3).run(wc.reshaped, saved, [
        ("w2-z1-fp32", EngineCase(stage=1, world=3, extra=WARMUP, **TIED2), EQUAL),  # ZeRO-1 2 -> 3, WarmupLR
        ("w2-z3-fp16", EngineCase(stage=3, dtype="fp16", world=3, zero={"sub_group_size": 300}, **TIED2),
         EQUAL),  # ZeRO-3 2 -> 3, sub-groups, loss scaler
    ])
    ranks(1).run(wc.reshaped, saved, [
        ("w2-bf16opt", EngineCase(stage=1, dtype="bf16", bf16_optimizer=True, world=1, **TIED2), EQUAL),  # 2 -> 1
        ("w3-z3-bf16", EngineCase(stage=3, dtype="bf16", world=1, **TIED2), EQUAL),  # ZeRO-3 3 -> 1
    ])
    ranks(2).run(wc.reshaped, saved, [
        ("w1-z2-fp32", EngineCase(stage=2, world=2, **TIED2), EQUAL),  # ZeRO-2 1 -> 2
    ])


def test_dcp_into_fsdp2(ranks, saved) -> None:
    ranks(3).run(wc.fsdp2_loads, saved, "w2-z2-odd")


# ---- safetensors ----------------------------------------------------------------------------------------------------

def _zero_to_fp32(src: str, dst: str, **kwargs) -> None:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        convert_zero_checkpoint_to_state_dict(src, dst, **kwargs)


def _files(folder: str) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_safetensors_files_equal_zero_to_fp32s(saved, tmp_path, dtype) -> None:
    """Sharded (4 KB files) and whole: the same files, byte for byte, index included."""
    src = os.path.join(saved, "w2-z2-odd")
    for size in ("4KB", "5GB"):
        ours, theirs = str(tmp_path / f"ours-{size}"), str(tmp_path / f"theirs-{size}")
        zd.convert(src, ours, to="safetensors", dtype=dtype, max_shard_size=size)
        _zero_to_fp32(src, theirs, dtype=dtype, max_shard_size=size, safe_serialization=True)
        mine, ref = _files(ours), _files(theirs)
        assert sorted(mine) == sorted(ref) and (size == "5GB") == (len(ref) == 1), (sorted(mine), sorted(ref))
        assert mine == ref


@pytest.mark.parametrize("name", ["w2-z1-fp32", "w2-z2-bf16", "w2-z3-fp16", "w2-bf16opt", "w3-z3-bf16"])
def test_safetensors_values_and_model_load(saved, tmp_path, name) -> None:
    """Every tensor equals zero_to_fp32's (its ``.bin`` output: its safetensors output refuses tied weights, and it
    refuses BF16_Optimizer; ZeRO-1's frozen parameter, which it drops, equals the saved working weights); the files
    load with ``safetensors.torch.load_file`` into the model (strict: tied and frozen names present)."""
    from safetensors.torch import load_file

    from workers.common import MODELS

    folder = os.path.join(saved, f"{name}.st")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))  # 4 KB files: sharded
    loaded = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            loaded.update(load_file(os.path.join(folder, f)))
    expected = torch.load(os.path.join(saved, f"{name}.expected.pt"), weights_only=False)
    for n, value in expected["master"].items():
        assert torch.equal(loaded[n], value) and loaded[n].dtype == torch.float32, n
    assert torch.equal(loaded["fc1.bias"], expected["working"]["fc1.bias"].float())  # frozen, every stage
    assert torch.equal(loaded["mid2.weight"], loaded["mid.weight"])  # tied
    if name != "w2-bf16opt":
        _zero_to_fp32(os.path.join(saved, name), str(tmp_path / "bin"))
        ref = torch.load(str(tmp_path / "bin" / "pytorch_model.bin"))
        assert set(ref) <= set(loaded) and set(loaded) - set(ref) <= {"fc1.bias"}
        assert all(torch.equal(ref[k], loaded[k]) and ref[k].dtype == loaded[k].dtype for k in ref)
    model = MODELS["tied"]()
    model.load_state_dict(loaded, strict=True)
    assert model.mid2.weight is model.mid.weight and torch.equal(model.mid.weight.detach(), loaded["mid.weight"])


def test_command_line(saved, tmp_path) -> None:
    from zero_dtensor.convert.__main__ import main

    src = os.path.join(saved, "w2-z2-bf16")
    assert main([src, str(tmp_path / "cli.dcp"), "--quiet"]) == 0
    assert main([src, str(tmp_path / "cli.st"), "--to", "safetensors", "--dtype", "bf16", "--quiet"]) == 0
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "cli.st" / "model.safetensors"))["mid.weight"].dtype == torch.bfloat16
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "x"), "--quiet"]) == 2
    assert not os.path.exists(tmp_path / "x")


# ---- bad input ------------------------------------------------------------------------------------------------------

def _copy(saved: str, name: str, tmp_path) -> tuple[str, str]:
    """A copy of the saved folder ``name`` and its tag folder."""
    dst = str(tmp_path / f"bad-{name}")
    shutil.copytree(os.path.join(saved, name), dst)
    return dst, os.path.join(dst, "global_step2")


def _rewrite(path: str, change) -> None:
    data = torch.load(path, weights_only=False)
    change(data)
    torch.save(data, path)


def _bad_inputs(saved: str, tmp_path) -> list[tuple[str, str, str]]:
    """``(what, folder, the file the error must name)``."""
    cases = []
    src, tag = _copy(saved, "w2-z2-bf16", tmp_path / "missing")
    os.remove(victim := os.path.join(tag, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    cases.append(("missing optimizer file", src, victim))
    src, tag = _copy(saved, "w2-z3-fp16", tmp_path / "missing3")
    os.remove(victim := os.path.join(tag, "zero_pp_rank_1_mp_rank_00_model_states.pt"))
    cases.append(("missing ZeRO-3 model file", src, victim))
    src, tag = _copy(saved, "w2-z2-bf16", tmp_path / "truncated")
    victim = os.path.join(tag, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.truncate(victim, os.path.getsize(victim) // 2)
    cases.append(("truncated file", src, victim))
    src, tag = _copy(saved, "w2-z2-odd", tmp_path / "version")
    _rewrite(victim := os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
             lambda d: d.update(ds_version="0.18.9"))
    cases.append(("another ds_version", src, victim))
    src, tag = _copy(saved, "w2-z2-bf16", tmp_path / "world")
    shutil.copy(os.path.join(saved, "w3-z3-bf16", "global_step2", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                victim := os.path.join(tag, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    cases.append(("another world size", src, victim))
    src, tag = _copy(saved, "w2-z2-odd", tmp_path / "step")

    def later(d: dict) -> None:
        for state in d["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
            state["step"] = state["step"] + 1

    _rewrite(victim := os.path.join(tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt"), later)
    cases.append(("another step (optimizer file)", src, victim))
    src, tag = _copy(saved, "w2-z3-fp16", tmp_path / "step3")
    _rewrite(victim := os.path.join(tag, "zero_pp_rank_1_mp_rank_00_model_states.pt"),
             lambda d: d.update(global_steps=3))
    cases.append(("another step (ZeRO-3 model file)", src, victim))
    src, tag = _copy(saved, "w2-z2-odd", tmp_path / "moe")
    shutil.copy(os.path.join(tag, "mp_rank_00_model_states.pt"),
                victim := os.path.join(tag, "layer_0_expert_0_mp_rank_00_model_states.pt"))
    cases.append(("MoE", src, victim))
    src, tag = _copy(saved, "w2-z2-odd", tmp_path / "pipe")
    shutil.copy(os.path.join(tag, "mp_rank_00_model_states.pt"),
                victim := os.path.join(tag, "layer_01-model_00-model_states.pt"))
    cases.append(("pipeline", src, victim))
    src = os.path.join(saved, "w1-z0")
    cases.append(("stage 0", src, os.path.join(src, "global_step1")))
    src = str(tmp_path / "unknown")
    os.makedirs(os.path.join(src, "step9"))
    with open(os.path.join(src, "latest"), "w") as f:
        f.write("step9")
    torch.save({"weights": torch.zeros(3)}, victim := os.path.join(src, "step9", "mp_rank_00_model_states.pt"))
    cases.append(("unknown format", src, victim))
    src = str(tmp_path / "empty")
    os.makedirs(src)
    cases.append(("not a checkpoint folder", src, src))
    return cases


def test_bad_input_raises_and_writes_nothing(saved, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for what, src, named in _bad_inputs(saved, tmp_path):
        for to in ("dcp", "safetensors"):
            dst = str(out / f"dst-{to}")
            with pytest.raises(zd.ConversionError) as info:
                zd.convert(src, dst, to=to)
            assert named in str(info.value) and "Nothing was written" in str(info.value), (what, str(info.value))
            assert os.listdir(out) == [], (what, os.listdir(out))  # no dst, no temporary folder
    dst = str(out / "busy")
    os.makedirs(os.path.join(dst, "something"))
    with pytest.raises(zd.ConversionError, match="not an empty folder"):
        zd.convert(os.path.join(saved, "w2-z2-odd"), dst)


@pytest.mark.parametrize("to", ["dcp", "safetensors"])
def test_a_conversion_that_dies_leaves_nothing(saved, tmp_path, to) -> None:
    """Killed after its first tensor (the progress callback raises): nothing at dst, the temporary folder gone."""
    calls = []

    def die(done: int, total: int) -> None:
        calls.append(done)
        raise KeyboardInterrupt

    from torch.distributed.checkpoint.api import CheckpointException  # DCP's wrapper of a failure in its writer

    with pytest.raises((KeyboardInterrupt, CheckpointException)):
        zd.convert(os.path.join(saved, "w2-z2-odd"), str(tmp_path / "dst"), to=to, progress=die)
    assert calls and os.listdir(tmp_path) == []


# ---- memory ---------------------------------------------------------------------------------------------------------

WIDTH = 512  # the largest parameter: 512 x 512 fp32 = 1 MiB


def _probes(cases: list[tuple[str, str, str]]) -> list[int]:
    """The peak ``RssAnon`` growth of a conversion per ``(src, dst, to)``, each in a fresh process of its own (all
    started at once: each process measures its own memory)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from workers.convert import memory_probe; "
            "print(json.dumps(memory_probe(*sys.argv[1:4])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, *case], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for case in cases]
    growths = []
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        growths.append(json.loads(out.strip().splitlines()[-1])["growth"])
    return growths


def test_peak_anonymous_memory_does_not_grow_with_the_checkpoint(ranks, tmp_path) -> None:
    """The converter's peak ``RssAnon`` growth (a fresh process each) stays within the largest parameter x2 (one
    assembled value, one cast or clone) + 8 MiB for a checkpoint of 4 layers and of 32 (8x: about 100 MB of
    masters and Adam state, 8x the bound); ZeRO-3 at 2 ranks,
    where every parameter is assembled from 2 ranks' pieces (ZeRO-1/2 parameters that lie in one partition are
    written straight from the mapped file)."""
    root = str(tmp_path)
    saves = [("z3-l4", 3, 4), ("z3-l32", 3, 32)]
    for name, stage, layers in saves:
        ranks(2).run(wc.ds_save_stack, root, name, stage, layers, WIDTH)
    largest = WIDTH * WIDTH * 4
    bound = 2 * largest + 8 * 2**20
    state = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "z3-l32")) for f in fs)
    assert state > 8 * bound  # holding the state would fail the bound 8 times over
    cases = [("z3-l4", "dcp"), ("z3-l32", "dcp"), ("z3-l32", "safetensors")]
    growth = dict(zip(cases, _probes([(os.path.join(root, name), os.path.join(root, f"{name}.{to}"), to)
                                      for name, to in cases])))
    assert all(g <= bound for g in growth.values()), (growth, bound)


def test_dcp_entries_are_zd_saves(saved) -> None:
    """The converted checkpoint's entries are those ``zd.save`` writes: every parameter under ``model.`` (the tied
    alias and the frozen parameter too), Adam's keys and ``step`` per trainable parameter only, and the
    ``zero_dtensor.*`` extras of ``zero_dtensor.checkpoint.io``."""
    from torch.distributed.checkpoint import FileSystemReader

    from zero_dtensor.checkpoint.binding import entry_name
    from zero_dtensor.checkpoint.io import EXTRAS

    meta = FileSystemReader(os.path.join(saved, "w2-z3-fp16.dcp")).read_metadata().state_dict_metadata
    model = {k[len("model."):] for k in meta if k.startswith("model.")}
    assert model == {"fc1.weight", "fc1.bias", "mid.weight", "mid.bias", "mid2.weight", "mid2.bias", "fc3.weight",
                     "fc3.bias"}
    state = {k[len("optim.state."):] for k in meta if k.startswith("optim.state.")}
    trained = model - {"fc1.bias", "mid2.weight"}
    assert state == {f"{n}.{key}" for n in trained for key in ("exp_avg", "exp_avg_sq", "step")}
    # the extras, and the one data file bound to this checkpoint (zero_dtensor.checkpoint.binding), as zd.save's
    assert {k for k in meta if k.startswith("zero_dtensor.")} == {f"zero_dtensor.{k}" for k in EXTRAS} | {entry_name(0)}
    assert meta["model.fc1.bias"].properties.dtype == torch.float16  # frozen: its working dtype
    assert meta["model.mid.weight"].properties.dtype == torch.float32  # trainable: the fp32 master


def test_join_buffers_are_lent_again_only_once_let_go() -> None:
    """The converter's reused join buffers: a buffer is lent again only when no view of it is left; two at most;
    a value over their size gets ``None`` (a new tensor) and the idle buffers are let go."""
    from zero_dtensor.convert.to_dcp import JoinBuffers

    joins = JoinBuffers(4096)
    a = joins.take(1024, torch.float32)
    assert a is not None and a.dtype == torch.float32 and a.numel() == 1024
    b = joins.take(100, torch.float16)
    assert b is not None and b.data_ptr() != a.data_ptr()
    assert joins.take(10, torch.float32) is None  # both lent
    exact = torch.empty(0).set_(a.untyped_storage()[0:400], 0, (100,), (1,))  # a storage slice holds it too
    address = a.data_ptr()
    del a
    assert joins.take(10, torch.float32) is None
    del exact
    again = joins.take(1000, torch.float32)
    assert again is not None and again.data_ptr() == address
    del again, b
    assert joins.take(1025, torch.float32) is None and joins._buffers == []
