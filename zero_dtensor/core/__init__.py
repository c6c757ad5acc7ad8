"""One family's memory and the state every call reads it through.

- :mod:`.storage`: :class:`~.storage.FlatStorage`, what an adapter (:mod:`zero_dtensor._deepspeed`) hands over: a
  layout plus live handles on one family's partitions, its process groups and devices;
- :mod:`.state`: :class:`~.state.FlatState`, the storage with its plan, cached fragments, selections and the
  staleness check;
- :mod:`.param_values`: per-parameter results (read-only mappings backed by one vector).
"""
