"""The family objects users hold: one object per family of a ZeRO engine's flat tensors.

- :mod:`.tensors`: :class:`~.tensors.ShardedTensors`, the mapping every family shares (reads, writes), with its
  mixins :mod:`.tensor_math` (transforms), :mod:`.tensor_reductions` (reductions) and :mod:`.tensor_owners`
  (redistribution), and
  :mod:`.param_view` (one parameter);
- :mod:`.sharded`: the gradients (``ShardedGrads``); :mod:`.master`: the fp32 master weights and the optimizer
  state; :mod:`.replicate`: ``keep_full_grads``.

They hold a :class:`~zero_dtensor.core.state.FlatState` and call down into :mod:`zero_dtensor.ops`,
:mod:`zero_dtensor.materialize` and :mod:`zero_dtensor.redistribute`.
"""
