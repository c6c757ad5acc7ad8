"""Operations on a family's local shards, batched per flat group.

- :mod:`.transforms` (with :mod:`.operands`, :mod:`.noise`): elementwise writes, no communication;
- :mod:`.reductions` (with :mod:`.overflow`, and :mod:`.partials`: the pieces a selection reduces and their
  reduction across ranks): norms, dots, statistics, clipping, one collective each;
- :mod:`.writes`: ``set_full_``, full tensors written into each rank's fragments, no communication.
- :mod:`.direct_write`: ``set_full_``'s per-parameter path, each value copied into a cached view of its fragment.

Reads of full tensors are :mod:`zero_dtensor.materialize`'s, redistributions :mod:`zero_dtensor.redistribute`'s.
"""
