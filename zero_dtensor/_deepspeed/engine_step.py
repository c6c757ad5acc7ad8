"""What the gradient hooks (:mod:`zero_dtensor.integrations.hooks`) rely on inside ``DeepSpeedEngine.step()``.

DeepSpeed 0.18.9 / 0.19.x, ``deepspeed/runtime/engine.py``: with ``managed_gradient_accumulation`` off,
``step()`` finalizes the accumulation (stage 2/3: ``optimizer.finalize_gradient_accumulation_boundary()``; stage
0/1: ``allreduce_gradients()``), sets ``_running_engine_step``, starts the step timers and calls
``self._take_model_step(lr_kwargs)``, which runs the optimizer: :data:`MODEL_STEP` names that method, the one place
a hook can run after the finalize and before ``optimizer.step()``. :func:`abandon_step` undoes what ``step()`` had
begun when a hook raises there. ``PipelineEngine.train_batch()`` runs the optimizer through ``_take_model_step``
without ``step()`` (:func:`is_pipeline_engine`). No communication anywhere here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_STEP", "abandon_step", "is_pipeline_engine"]

#: the engine method ``step()`` calls to run the optimizer (instance-wrapped by the hooks)
MODEL_STEP = "_take_model_step"


def abandon_step(engine: Any) -> None:
    """A hook raised inside :data:`MODEL_STEP`: clear ``_running_engine_step`` and stop the step timers that
    ``step()`` started (best effort: the timers are diagnostics only)."""
    if hasattr(engine, "_running_engine_step"):
        engine._running_engine_step = False
    try:
        engine._stop_timers(engine.engine_timers.step_timers)
    except Exception:  # noqa: BLE001 - best effort; timers are diagnostics only
        pass


def is_pipeline_engine(engine: Any) -> bool:
    """Whether ``engine`` is DeepSpeed's ``PipelineEngine`` (False where pipeline support is not installed)."""
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except Exception:  # noqa: BLE001 - no pipeline support installed: nothing to refuse
        return False
    return isinstance(engine, PipelineEngine)
