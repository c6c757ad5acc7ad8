"""``zero_dtensor.lightning.ZeroGradCallback`` with a real ``lightning.Trainer`` and ``DeepSpeedStrategy`` on 2 CPU gloo
ranks, ZeRO stages 1-3, against a single-process reference (plain torch: ``clip_grad_norm_``, ``grad_norm``).

Lightning runs inside the harness' rank processes (``tests/conftest.py``): they already joined a gloo group and carry
``LOCAL_RANK``, so Lightning's ``LightningEnvironment`` starts no processes and each becomes the rank it is; see
``tests/workers/lightning.py`` for the CPU subclass of ``DeepSpeedStrategy`` (only its CUDA check skipped).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("deepspeed")

from workers import lightning as lw  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "lightning_clip.py")
RTOL, ATOL = 1e-5, 1e-7
TIMEOUT = 180  # seconds per multi-rank call: a hang fails the test instead of waiting 10 minutes


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    assert list(actual) == list(expected), what
    for name in expected:
        torch.testing.assert_close(torch.as_tensor(actual[name]), torch.as_tensor(expected[name]), rtol=RTOL,
                                   atol=ATOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def _logged(record: dict, prefix: str) -> dict:
    return {k: v for k, v in record.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def ref() -> dict:
    return lw.reference()


@pytest.mark.parametrize("stage, log_every, ds_clip", [(1, 1, None), (2, 2, 10.0), (3, 1, None)])
def test_clipping_and_norms_match_a_single_process_reference(ranks, ref: dict, stage: int, log_every: int,
                                                             ds_clip: float | None) -> None:
    """After STEPS optimizer steps (GAS=2 micro-batches each) with ``clip_grad_norm``, the weights equal the
    reference's; ``fn`` ran once per boundary; the logger received ``grad_norm``'s names and values (2-norms before
    clipping from the first callback, inf-norms after it from the second, which runs later on the same engine).
    ZeRO-2 also sets ``Trainer(gradient_clip_val=10)``: DeepSpeed clips again (a no-op after ours), with a warning."""
    results = ranks(lw.WORLD).run(lw.fit_with_clipping, stage, log_every, ds_clip, timeout=TIMEOUT)
    assert all(t > lw.MAX_NORM * 2 for t in ref["totals"]), "every reference step must be clipped"
    unclipped = lw.reference(clip=False)["weights"]
    assert max(float((unclipped[n] - w).abs().max()) for n, w in ref["weights"].items()) > 1e-2

    names = tuple(n for n, p in lw.Net().named_parameters())
    for rank, out in enumerate(results):
        assert (out["global_rank"], out["world_size"], out["zero_stage"], out["batches"]) == (rank, 2, stage, 8)
        _assert_close(out["weights"], ref["weights"], f"rank {rank} weights")
        # fn: once per accumulation boundary, after the 2nd, 4th, ... training_step, with every trainable name
        assert out["calls"] == [(lw.GAS * (s + 1), names) for s in range(lw.STEPS)]
        assert out["boundaries"] == (lw.STEPS, lw.STEPS)
        assert out["active_during"] == [True] and out["active_after"] == (False, False)
        assert out["ds_clipping"] == (ds_clip or 0.0)
        assert len(out["clip_warnings"]) == (1 if ds_clip and rank == 0 else 0), out["clip_warnings"]
        torch.testing.assert_close(out["last_total_norm"], torch.tensor(ref["totals"][-1]), rtol=RTOL, atol=ATOL)

        # what Lightning wrote: at its steps k, 2k, ... (optimizer steps, 0-based s with (s+1) % k == 0)
        written = [s for s in range(lw.STEPS) if (s + 1) % log_every == 0]
        assert sorted(out["records"]) == written
        for s in written:
            record = out["records"][s]
            # first callback, log_every_n_steps=None: computed at exactly Lightning's steps, before clipping
            _assert_close(_logged(record, "grad_2.0_norm"), ref["before"][s], f"rank {rank} step {s} 2-norms")
            # second callback, log_every_n_steps=2: computed at steps 2, 4 (s = 1, 3); Lightning writes the latest
            latest = max((j for j in range(s + 1) if (j + 1) % 2 == 0), default=None)
            expected = {} if latest is None else ref["after"][latest]
            _assert_close(_logged(record, "grad_inf_norm"), expected, f"rank {rank} step {s} inf-norms")
    assert set(ref["before"][0]) == {f"grad_2.0_norm/{n}" for n in names} | {"grad_2.0_norm_total"}
    assert "grad_inf_norm_total" in ref["after"][0]


def test_an_error_in_fn_stops_every_rank_and_skips_the_step(ranks) -> None:
    """``fn`` raises on rank 1 at the 2nd boundary: ``fit`` raises on both ranks, the step is not taken (weights are
    the reference's after one step) and the callback detached."""
    results = ranks(lw.WORLD).run(lw.fit_with_failing_fn, 3, timeout=TIMEOUT)
    one_step = lw.reference(steps=1)["weights"]
    assert [r["raised"] for r in results] == ["GradHookError", "ValueError"]
    for r in results:
        assert r["stage"] == 3 and r["seen"] == [2, 4] and not r["active"]
        _assert_close(r["weights"], one_step, "weights after the failed step")


def test_zero_stage_0_is_refused(ranks) -> None:
    assert ranks(lw.WORLD).run(lw.fit_stage_0, timeout=TIMEOUT) == ["UnsupportedDeepSpeedError"] * lw.WORLD


def test_the_example_runs(ranks) -> None:
    """``examples/lightning_clip.py``'s ``main()`` on the harness' 2 ranks (what ``python examples/lightning_clip.py``
    runs on 2 forked ranks); it asserts its own results."""
    results = ranks(2).run(lw.run_example, EXAMPLE, timeout=TIMEOUT)
    assert results[0]["steps"] == results[1]["steps"] > 0
    assert results[0]["hook_calls"] == results[0]["steps"]


# --- single process: refusals and the optional dependency ---------------------------------------------------------
def test_a_strategy_other_than_deepspeed_is_refused(tmp_path) -> None:
    import lightning.pytorch as pl

    from zero_dtensor.lightning import ZeroGradCallback

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[ZeroGradCallback(clip_grad_norm=1.0)])
    with pytest.raises(TypeError, match="DeepSpeedStrategy.*SingleDeviceStrategy"):
        trainer.fit(lw.Net(), torch.utils.data.DataLoader(lw.dataset(), batch_size=lw.MICRO))


@pytest.mark.parametrize("kwargs, error", [
    ({"fn": 3}, TypeError), ({"clip_grad_norm": 0.0}, ValueError), ({"clip_grad_norm": float("inf")}, ValueError),
    ({"clip_grad_norm": "1"}, TypeError), ({"clip_grad_norm": True}, TypeError), ({"norm_type": 0}, ValueError),
    ({"norm_type": -2}, ValueError), ({"norm_type": "fro"}, ValueError), ({"log_every_n_steps": 0}, ValueError),
    ({"log_every_n_steps": 1.5}, ValueError), ({"log_every_n_steps": True}, ValueError),
])
def test_bad_arguments(kwargs: dict, error: type) -> None:
    from zero_dtensor.lightning import ZeroGradCallback

    with pytest.raises(error):
        ZeroGradCallback(**kwargs)


def test_norm_type_spellings() -> None:
    from zero_dtensor.lightning import ZeroGradCallback

    assert ZeroGradCallback(norm_type="inf").norm_type == float("inf")
    assert ZeroGradCallback(norm_type=1).norm_type == 1.0
    assert not ZeroGradCallback().active


def test_missing_lightning_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "zero_dtensor.lightning", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'zero_dtensor\[lightning\]'"):
        importlib.import_module("zero_dtensor.lightning")


def test_no_other_module_imports_the_integration() -> None:
    """``lightning`` stays optional: only ``zero_dtensor/lightning.py`` imports it, and no module imports that one."""
    import ast
    import pathlib

    package = pathlib.Path(importlib.import_module("zero_dtensor").__file__).parent
    offenders = []
    for path in package.rglob("*.py"):
        if path.name == "lightning.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.split(".")[0] in ("lightning", "pytorch_lightning") or n.endswith("lightning") for n in names):
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert offenders == []
