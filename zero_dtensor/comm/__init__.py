"""Transport: every ``torch.distributed`` call of the library, and the rank agreement built on them.

- :mod:`.process_groups`: queries of process groups (backends, sizes, ranks, timeouts);
- :mod:`.collectives`: the few collectives the library issues, each over one data-parallel process group;
- :mod:`.point_to_point`: batches of ``isend``/``irecv`` (the ``send_recv`` strategy);
- :mod:`.agreement`: validate → agree → run, the one small collective every communicating call starts with;
- :mod:`.signature`: what the agreement hashes of a call, by construction: the bound arguments of every call marked
  :func:`~.signature.collective`, with the one table of arguments not agreed by value;
- :mod:`.dtensor_new`: DTensors built from a local tensor without ``DTensor.from_local``'s overhead.

Nothing here knows a layout: it moves tensors it is given.
"""
