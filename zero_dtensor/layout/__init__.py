"""Where every element of a family lives: pure local geometry, shared by every family, with no communication.

The bottom layer: it imports nothing else of zero_dtensor but the process-wide settings (:mod:`.fused_rows`
reads one), and no ``torch.distributed`` call is made here.

- :mod:`.flat`: the frozen layouts (:class:`~.flat.FlatLayout`, :class:`~.flat.GroupLayout`,
  :class:`~.flat.ParamLayout`) and the placement kinds that say which rank holds what (``RaggedShard``: ZeRO-1/2,
  ``ChunkShard``: ZeRO-3, ``Replicated``);
- :mod:`.plan`: per-layout plans (split sizes, offsets, fragments), built once per layout;
- :mod:`.tiling`, :mod:`.rows`, :mod:`.segments` (planned by :mod:`.segment_plan`): how a 1-D buffer is cut into
  pieces, copied by rows, reduced per piece; :mod:`.fused_rows`: the optional fused row pass of ``stats`` and
  ``dots`` (``torch.compile``; off unless :func:`~zero_dtensor.settings.set_fused_reductions` turns it on);
  :mod:`.cpu_rows`: the row passes' CPU recipe (offloaded partitions: chunks through one scratch, no full-size
  float32 copy or product);
- :mod:`.views`: views kept across steps; :mod:`.devices`: storage and communication devices, the one seam for
  device moves.
"""
