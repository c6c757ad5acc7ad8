"""Training-loop integrations: gradient code at the accumulation boundary.

- :mod:`.hooks`: ``on_grads`` (and the Hugging Face ``Trainer`` callback), run after the reduction and before the
  optimizer step;
- :mod:`.stats_logger`: ``GradStatsLogger``, per-parameter gradient statistics at every n-th step.

The Lightning callback is :mod:`zero_dtensor.lightning` (a top-level entry point: Lightning is an optional
dependency, and only that module imports it).
"""
