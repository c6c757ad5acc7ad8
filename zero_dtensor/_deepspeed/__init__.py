"""The only place that reads DeepSpeed's private optimizer state.

One module per optimizer kind turns a live engine into a neutral :class:`~zero_dtensor.core.storage.FlatStorage`:

========================================  ==========================  =====================================
optimizer class                           module                      DeepSpeed versions known
========================================  ==========================  =====================================
``DeepSpeedZeroOptimizer`` (ZeRO-1/2)     :mod:`.zero12`              0.18.9, 0.19.x (tested: 0.19.8)
``DeepSpeedZeroOptimizer_Stage3``         :mod:`.zero3`               0.18.9, 0.19.x (tested: 0.19.8)
``BF16_Optimizer`` (ZeRO-1, bf16 + fp32)  :mod:`.bf16`                0.18.9, 0.19.x (tested: 0.19.8)
========================================  ==========================  =====================================

Versions outside ``[0.18.9, 0.20)`` and any other optimizer class (subclasses such as ZenFlow or SuperOffload
included) are refused with :class:`~zero_dtensor.errors.UnsupportedDeepSpeedError`. Within the range, features are
detected (e.g. ``round_robin_bit16_offsets``, the compact fp32 partition buffer) rather than inferred from the version.

Beside the optimizer adapters: :mod:`.capture` (``keep_full_grads``' capture of the ZeRO-1/2 reduction),
:mod:`.grad_order` (ZeRO-1/2's contiguous gradient buffer laid out in flat order, so that it is used in place),
:mod:`.engine_step` (the engine's ``step()`` internals that :mod:`zero_dtensor.integrations.hooks` wraps), :mod:`.version`,
:mod:`.families` (the fp32 master weights and the optimizer state as storages with the gradient's geometry, and the
optimizer's per-group ``step``) and :mod:`.sync` (the working weights refreshed from the masters after a write);
:mod:`.checkpointing` (what a checkpoint needs from an engine beyond masters and optimizer state) and
:mod:`._common` (what the adapters share). Offline, without an engine: :mod:`.checkpoint_files` (the files
``engine.save_checkpoint`` writes, memory-mapped, and where each parameter's elements lie in them) and
:mod:`.checkpoint_layout` (which files a checkpoint folder holds, checked to be one save; the layout built from
them), read by :func:`zero_dtensor.convert`.
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import UnsupportedDeepSpeedError
from ..core.storage import FlatStorage
from .version import MAX_DEEPSPEED_EXCLUSIVE, MIN_DEEPSPEED, SUPPORTED_OPTIMIZERS, check_deepspeed_version

__all__ = ["MIN_DEEPSPEED", "MAX_DEEPSPEED_EXCLUSIVE", "check_deepspeed_version", "check_engine", "grad_storage"]

def check_engine(engine: Any) -> str:
    """The optimizer kind of a supported DeepSpeed ``engine`` (``"zero12"``, ``"zero3"`` or ``"bf16"``), else a
    ``TypeError`` (not a DeepSpeed engine) or :class:`UnsupportedDeepSpeedError` (version, ZeRO stage 0, another
    optimizer class). No communication; needs no gradients. The DeepSpeed classes are imported once per process
    (every ``sharded_*`` call checks its engine)."""
    engine_class, known = _classes()
    if not isinstance(engine, engine_class):
        raise TypeError(
            f"zero_dtensor needs a DeepSpeed engine (the first value deepspeed.initialize returns), got "
            f"{type(engine).__module__}.{type(engine).__qualname__}"
        )
    check_deepspeed_version()
    kind = type(getattr(engine, "optimizer", None))
    found = known.get(kind)
    if found is not None:
        return found
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else "?"
    raise UnsupportedDeepSpeedError(
        f"engine.optimizer is {kind.__module__}.{kind.__qualname__}; zero_dtensor supports exactly "
        f"{', '.join(SUPPORTED_OPTIMIZERS)} (ZeRO stages 1-3 without ZenFlow/SuperOffload). "
        f"This engine has ZeRO stage {stage}: initialize DeepSpeed with \"zero_optimization\": {{\"stage\": 1, 2 or 3}}."
    )


@functools.lru_cache(maxsize=1)
def _classes() -> tuple[type, dict[type, str]]:
    """DeepSpeed's engine class and ``{optimizer class: kind}`` of the optimizers zero_dtensor knows."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedEngine, {DeepSpeedZeroOptimizer: "zero12", DeepSpeedZeroOptimizer_Stage3: "zero3",
                             BF16_Optimizer: "bf16"}


def grad_storage(engine: Any, kind: str | None = None) -> FlatStorage:
    """Describe ``engine``'s reduced gradient memory. No communication. ``kind``: what :func:`check_engine` returned
    for ``engine`` (checked here when not given)."""
    kind = check_engine(engine) if kind is None else kind
    if kind == "zero12":
        from . import zero12

        return zero12.grad_storage(engine, engine.optimizer)
    if kind == "zero3":
        from . import zero3

        return zero3.grad_storage(engine, engine.optimizer)
    from . import bf16

    return bf16.grad_storage(engine, engine.optimizer)
