"""Which checkpoint a data file belongs to: the checkpoint's ``save_id`` written into every rank's ``.distcp`` file.

DCP records a checkpoint's identity, its ``save_id`` (a new UUID per save), only in ``.metadata``, and each entry's
CRC-32 only vouches for the entry. A data file copied from another save of the same model (another run at the same
step, a re-save into the same directory that failed part-way, an object store serving a stale object) holds entries
of the same names and sizes with valid CRC-32s, and would load as a mixture. So :func:`~zero_dtensor.save` writes,
into each rank's file, one bytes entry holding the checkpoint's ``save_id``, and :func:`~zero_dtensor.load` reads it
from every file it reads before anything else of that file, in its first pass (before the agreement and before the
engine is written):

* **Format.** Rank ``r`` of the saving group writes the DCP bytes entry ``zero_dtensor.save_id.<r>`` into its file
  (``__<r>_0.distcp``); its value is ``torch.save(save_id)`` of the ``str`` that ``.metadata`` records as
  ``storage_meta.save_id`` (so ``dcp.load`` of that key gives the ``str`` back). Any DCP reader reads the checkpoint
  as before (the entries are ordinary bytes entries, which a reader that does not ask for them never reads).
* **How the ranks learn the id** without a collective of their own: DCP's coordinator writes its storage writer's
  ``save_id`` into ``.metadata``; :class:`~.writer.DirectWriter` puts that ``save_id`` into every rank's plan where
  DCP hands each rank its file prefix (``prepare_global_plan``: :class:`BoundPrefix`, sent with DCP's own scatter of
  the plans), and :class:`~.planners.CachingSavePlanner` writes it as the entry's data (``resolve_data``; with
  cached plans, the prefix of the current save is kept, ``finish_plan``).
* **Writing it elsewhere** (e.g. a converter): call :func:`bind` on the state dict with the rank's position in the
  saving group and save with :class:`~.writer.DirectWriter` and :class:`~.planners.CachingSavePlanner`; or write,
  into each data file, a bytes entry named by :func:`entry_name` holding :func:`save_id_bytes` of the ``save_id``
  that the same save's ``.metadata`` records.
* **At load** (:class:`FileBindings`): a checkpoint whose ``.metadata`` lists no ``zero_dtensor.save_id.*`` entry
  (written by FSDP2, ``dcp.save``, or before this entry existed) is not checked. Otherwise every data file read must
  hold an entry with this ``save_id``: a file with none, one whose entry holds another ``save_id``, or one whose
  entry cannot be read raises ``OSError`` naming the file (the load turns it into ``CheckpointReadError`` on every
  rank, nothing written).

No communication. Memory: one small entry per file.
"""

from __future__ import annotations

import io
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["PLACEHOLDER", "PREFIX", "BoundPrefix", "FileBindings", "bind", "entry_name", "is_binding", "save_id_bytes"]

#: the section and name start of the ``save_id`` entries (DCP key ``zero_dtensor.save_id.<rank>``)
SECTION = "zero_dtensor"
PREFIX = f"{SECTION}.save_id."


@dataclass
class BoundPrefix(_StoragePrefix):
    """DCP's file-name prefix of one rank's plan (``__<rank>_``), with the ``save_id`` the coordinator's writer
    records in ``.metadata``: what each rank writes into its file (module docstring)."""

    save_id: str


def entry_name(rank: int) -> str:
    """The DCP key of the ``save_id`` entry that the rank at position ``rank`` of the saving group writes."""
    return f"{PREFIX}{rank}"


def is_binding(fqn: str) -> bool:
    """Whether the DCP key ``fqn`` is a ``save_id`` entry."""
    return fqn.startswith(PREFIX)


def save_id_bytes(save_id: str) -> io.BytesIO:
    """The stored bytes of a ``save_id`` entry: ``torch.save`` of the ``str`` (what DCP's planner writes for a
    ``str`` value)."""
    out = io.BytesIO()
    torch.save(save_id, out)
    out.seek(0)
    return out


#: the value :func:`bind` puts into the state dict: :class:`~.planners.CachingSavePlanner` writes the save's
#: ``save_id`` instead (a load refuses a file that holds this text)
PLACEHOLDER = "<the save_id, written by zero_dtensor's CachingSavePlanner>"


def bind(state: MutableMapping[str, Any], rank: int) -> None:
    """Add this rank's ``save_id`` entry to ``state`` (a DCP state dict, before ``dcp.save``), as a placeholder
    that :class:`~.planners.CachingSavePlanner` replaces with the save's ``save_id`` when DCP writes it (the id
    exists only once DCP's coordinator has planned the save). ``rank``: this rank's position in the saving group."""
    state.setdefault(SECTION, {})[entry_name(rank)[len(SECTION) + 1:]] = PLACEHOLDER


class FileBindings:
    """The ``save_id`` each data file of a checkpoint must hold, from its ``.metadata`` (module docstring):
    :meth:`check` compares one file's entry with it, once per file. ``where``: per file name, the storage info of
    its entry."""

    def __init__(self, save_id: str, where: dict[str, Any]) -> None:
        self.save_id, self.where = save_id, where
        self._checked: set[str] = set()

    @classmethod
    def of(cls, metadata: Metadata) -> FileBindings | None:
        """The bindings ``metadata`` lists; ``None`` for a checkpoint without ``save_id`` entries (not checked)."""
        where = {info.relative_path: info for index, info in metadata.storage_data.items() if is_binding(index.fqn)}
        if not where:
            return None
        return cls(str(getattr(getattr(metadata, "storage_meta", None), "save_id", None)), where)

    def check(self, stream: IO[bytes], relative_path: str) -> None:
        """``OSError`` naming ``relative_path`` where the file open as ``stream`` does not hold this checkpoint's
        ``save_id`` (module docstring). One seek and one small read, the first time a file is checked."""
        if relative_path in self._checked:
            return
        info = self.where.get(relative_path)
        if info is None:
            raise OSError(f"checkpoint file {relative_path!r} holds no save_id entry, although every file this "
                          "checkpoint's .metadata lists does: a file from another checkpoint? Nothing was loaded")
        stream.seek(info.offset)
        data = stream.read(info.length)
        try:
            found = torch.load(io.BytesIO(data), weights_only=True) if len(data) == info.length else None
        except Exception:  # noqa: BLE001 - whatever lies there, it is not this checkpoint's save_id
            found = None
        if found != self.save_id:
            held = f"save_id {found}" if isinstance(found, str) else "no readable save_id where .metadata says"
            raise OSError(f"checkpoint file {relative_path!r} belongs to another checkpoint: it holds {held}, "
                          f".metadata save_id {self.save_id} (a file copied from another save, or left by a save "
                          "that did not finish?). Nothing was loaded")
        self._checked.add(relative_path)
