"""Elastic checkpoints of DeepSpeed ZeRO engines through torch's distributed checkpoint (DCP).

:func:`get_state_dict` / :func:`set_state_dict` give an engine's state in the format torch's
``torch.distributed.checkpoint.state_dict`` uses for FSDP2 (model FQNs; the optimizer flattened), with sharded
values DCP saves and reshards exactly; :func:`save` / :func:`load` write and read a whole engine (also the step
counters, the lr scheduler, the fp16 loss scaler and a client state) at any world size and ZeRO stage 1-3.

Modules: :mod:`.io` (``save``/``load``), :mod:`.metadata` (the ``.metadata`` read and checked against the engine),
:mod:`.state_dict` (``get_state_dict``/``set_state_dict``), :mod:`.target` (what an engine holds, as a checkpoint
sees it), :mod:`.boxes` (fragments as row boxes), :mod:`.planners` (DCP planners), :mod:`.writer` and
:mod:`.reader` (DCP storage writer and reader), :mod:`.pipelined_writer` (the offline converter's writer), :mod:`.layouts` (where an entry's data and CRC-32 lie), :mod:`.crc`
(CRC-32 checks of the data read), :mod:`.binding` (every data file bound to its checkpoint's ``save_id``).
"""

from __future__ import annotations

from ..errors import CheckpointMismatchError, CheckpointReadError, IncompleteCheckpointError
from .io import load, save
from .state_dict import get_state_dict, set_state_dict

__all__ = [
    "CheckpointMismatchError",
    "CheckpointReadError",
    "IncompleteCheckpointError",
    "get_state_dict",
    "load",
    "save",
    "set_state_dict",
]
