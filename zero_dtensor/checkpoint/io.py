"""Save and load a DeepSpeed ZeRO engine through torch's distributed checkpoint (DCP), at any world size and stage.

One DCP checkpoint (a directory: ``__<rank>_0.distcp`` per saving rank and ``.metadata``) holds:

==================================  ================================================================================
DCP key                             value
==================================  ================================================================================
``model.<fqn>``                     fp32 master weights (frozen parameters: working weights), sharded as ZeRO holds
                                    them: this rank's pieces as row boxes (:mod:`.state_dict`)
``optim.state.<fqn>.<key>``         optimizer state shaped like the parameter (Adam ``exp_avg``, ``exp_avg_sq``)
``optim.state.<fqn>.step``          the optimizer step, a 0-d float32 tensor
``optim.param_groups.<fqn>.<hp>``   the hyperparameters of the parameter's group (``lr``, ``betas``, ...)
``zero_dtensor.engine``             the engine's ``global_steps``, ``global_samples``, ``skipped_steps``
``zero_dtensor.lr_scheduler``       ``engine.lr_scheduler.state_dict()`` (``None`` without a scheduler)
``zero_dtensor.loss_scaler``        the fp16 loss scaler's numbers (``cur_scale``, ``cur_iter``, ...) or ``None``
``zero_dtensor.client_state``       the ``client_state`` given to :func:`save` (as rank 0 had it)
``zero_dtensor.save_id.<r>``        in rank ``r``'s file: the checkpoint's ``save_id`` (:mod:`.binding`), which
                                    :func:`load` checks in every file it reads
==================================  ================================================================================

The ``model.*`` and ``optim.*`` keys are those of FSDP2 + a torch optimizer saved with
``{"model": model_sd, "optim": optim_sd}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict(...,
options=StateDictOptions(flatten_optimizer_state_dict=True))``: such a checkpoint loads here (the
``zero_dtensor.*`` entries are then left alone), and one written here loads there.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from .._deepspeed import checkpointing as ds
from .._deepspeed.sync import sync_model_params
from ..comm.agreement import agree, agree_outcome
from ..comm.signature import collective
from ..errors import (
    CheckpointMismatchError,
    CheckpointReadError,
    IncompleteCheckpointError,
    RankDisagreementError,
    RankFailedError,
)
from ..families.master import clear_write_mark
from ..comm.process_groups import cpu_group_for, group_ranks, rank_in, world_size_of
from .binding import FileBindings, bind
from .boxes import storage_exact_entry
from .metadata import METADATA, check_metadata, collector_paused, identity, read_metadata
from .planners import CachingLoadPlanner, CachingSavePlanner, PlansNotCachedError, forget_plans, plan_key
from .reader import DirectReader, read_bytes_entries
from .state_dict import CheckedState, apply_state, check_state, current_steps, state_partitions
from .target import Target, describe, hyperparameters_by_name, model_dict, optim_dict
from .writer import DirectWriter

__all__ = ["load", "save"]

#: differences listed in a refusal's message (the rest counted)
MAX_LINES = 12
EXTRAS = ("engine", "lr_scheduler", "loss_scaler", "client_state")


def normalized(path: str | os.PathLike) -> str:
    """``path`` as :func:`save` and :func:`load` agree on it: absolute and normalized (``os.path.abspath``), so a
    relative path means the same directory on every rank only where the working directories agree too."""
    return os.path.abspath(os.fspath(path))


def _blob(value: Any) -> io.BytesIO:
    """``value`` pickled into one DCP bytes entry (DCP would otherwise split dicts and lists into entries)."""
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def _unblob(value: Any) -> Any:
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, weights_only=False)
    return value


def _share_of(entries: Mapping[str, Any], rank: int, world: int) -> dict[str, Any]:
    """What this rank writes of ``entries``: every DTensor entry (this rank's pieces) and every ``world``-th of the
    others, round robin in the entries' order (the same on every rank). The others hold the same value on every
    rank (steps, hyperparameters, replicated frozen weights): each is written by one rank, so it is neither planned,
    pickled and gathered for every rank nor deduplicated by DCP's coordinator afterwards, and the thousands of
    small hyperparameter entries of torch's optimizer format are shared out instead of all falling to rank 0."""
    shared = [k for k, v in entries.items() if not isinstance(v, DTensor)]
    mine = set(shared[rank::world])
    return {k: v for k, v in entries.items() if isinstance(v, DTensor) or k in mine}


def _engine_extras(engine: Any, client_state: Any) -> dict[str, io.BytesIO]:
    return {"engine": _blob(ds.engine_counters(engine)), "lr_scheduler": _blob(ds.lr_scheduler_state(engine)),
            "loss_scaler": _blob(ds.loss_scaler_state(engine)), "client_state": _blob(client_state)}


@collective
@collector_paused()
def save(engine: Any, path: str | os.PathLike, *, async_: bool = False, client_state: Any = None,
         sync_files: bool = True) -> Any:
    """Write the engine's whole training state into the DCP checkpoint directory ``path``; call on every rank.

    Each rank writes only what it holds: fp32 masters, optimizer state and step, hyperparameters, frozen weights,
    step counters, the lr scheduler, the fp16 loss scaler and ``client_state``. The engine is not changed.
    ``zd.load`` reads it at any world size and ZeRO stage; FSDP2 reads it with torch's own functions. A ``.metadata``
    left in ``path`` by an earlier checkpoint is removed first, so an unfinished save never looks finished.
    Each rank's file holds the checkpoint's ``save_id``, so a file from another save is refused at load.

    Args:
        engine: a DeepSpeed ZeRO engine (between steps).
        path: the checkpoint directory, the same on every rank.
        async_: return once the state is staged in CPU memory; a background thread writes it.
        client_state: any picklable object, saved as rank 0 passes it; ``zd.load`` returns it.
        sync_files: ``fsync`` each file before ``.metadata`` is written (a checkpoint that looks complete survives
            a power loss); ``False`` leaves the flush to the OS, as DeepSpeed's ``save_checkpoint`` does.

    Returns:
        Future | None: with ``async_``, DCP's future (call ``.result()`` before the next save); else ``None``
            once the checkpoint is complete.

    Raises:
        RankDisagreementError: the ranks' paths, ``async_`` or ``sync_files`` differ (raised on every rank before
            anything is written or removed).
        UnsupportedDeepSpeedError: an engine zero_dtensor does not map.

    Communication:
        One agreement, then DCP's small planning collectives (plans and metadata; about 9 at 2 ranks); no tensor
        data moves between ranks.

    Device and memory:
        No copy of pieces in CPU memory; a piece on a GPU is copied to the CPU as it is written (at most one
        parameter); before the first step, one zero-filled partition per optimizer-state key. ``async_`` stages the
        rank's whole state in CPU memory.

    Example:
        ```python
        zd.save(engine, f"ckpt/step{engine.global_steps}", client_state={"epoch": epoch})
        ```
    """
    target = describe(engine)
    path = os.fspath(path)
    # before the first collective (DCP's, or async_'s process group creation) and before anything is written
    agree("checkpoint.save", (), [target.process_group], target.masters.device)
    model = model_dict(target, target.masters.partitions, {f.name: f.local for f in target.frozen}, exact=True)
    optim = optim_dict(target, state_partitions(engine, target), current_steps(engine, target),
                       hyperparameters_by_name(engine, target), exact=True)
    rank, world = rank_in(target.process_group), world_size_of(target.process_group)
    first = rank == 0
    state: dict[str, Any] = {k: {name: storage_exact_entry(v) for name, v in _share_of(d, rank, world).items()}
                             for k, d in (("model", model), ("optim", optim))}
    if first:  # the engine's counters, scheduler, scaler and the client state: as rank 0 has them
        state["zero_dtensor"] = _engine_extras(engine, client_state)
    bind(state, rank)  # this rank's file holds the checkpoint's save_id (:mod:`.binding`)
    if first and os.path.exists(os.path.join(path, METADATA)):
        os.remove(os.path.join(path, METADATA))
    if async_:
        stager = DefaultStager(StagingOptions(False, False, False, False))  # what async_save picks without a writer
        return dcp.async_save(state, storage_writer=DirectWriter(path, sync_files=sync_files),
                              planner=CachingSavePlanner(dedup_save_to_lowest_rank=True), async_stager=stager,
                              process_group=cpu_group_for(target.process_group))
    key = plan_key({"model": model, "optim": optim}, group_ranks(target.process_group))
    _save_with_cached_plans(state, path, sync_files, key, target.process_group)
    return None


def _save_with_cached_plans(state: dict[str, Any], path: str, sync_files: bool, key: str, group: Any) -> None:
    """``dcp.save`` reusing this process's plans of the last save with ``key`` (:mod:`.planners`). A failed save
    drops them on every rank (DCP raises the failure on every rank); one refused because the coordinator had no
    cached plans (:class:`~.planners.PlansNotCachedError`) runs once more, planned in full."""
    for attempt in range(2):
        try:
            dcp.save(state, storage_writer=DirectWriter(path, sync_files=sync_files),
                     planner=CachingSavePlanner(dedup_save_to_lowest_rank=True, plan_key=key), process_group=group)
            return
        except CheckpointException as exc:
            forget_plans(key)
            refused = any(isinstance(failure, PlansNotCachedError) for failure, _ in exc.failures.values())
            if attempt or not refused:
                raise


class _CheckedReader(DirectReader):
    """The file-system reader (:class:`~.reader.DirectReader`), handing DCP the metadata :func:`load` already read
    and checked (read once, and the load reads exactly what was checked)."""

    def __init__(self, path: str, metadata: Metadata, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._checked, "storage_meta", None) is not None:
            self._checked.storage_meta.load_id = self.load_id
        return self._checked


def _read(staged: dict[str, Any], path: str, metadata: Metadata, in_engine: set[int],
          between: Callable[[], None]) -> None:
    """``dcp.load`` of this rank's pieces into ``staged``, planned by each rank on its own (``no_dist``: every
    rank already holds the checked metadata, and a load plan needs no coordination: DCP's default global load plan
    is the local plans unchanged); a failed read raises :class:`CheckpointReadError` on this rank (:func:`load`'s
    agreements tell the others). Destinations whose storage is in ``in_engine`` are read in
    :class:`~.reader.DirectReader`'s second pass, after ``between``. The hyperparameter entries (thousands: one per
    parameter and hyperparameter) are read apart, a few reads per file (:func:`~.reader.read_bytes_entries`), and
    unpickled once per distinct value. No communication here (``between`` agrees): none of DCP's gather and scatter
    of every rank's pickled plan (thousands of read items) and its all_gather of the read results."""
    try:
        optim = staged["optim"]
        # bytes entries by name, from one pass over the metadata (a lookup by MetadataIndex builds and hashes one)
        stored = {index.fqn[len("optim."):]: info for index, info in metadata.storage_data.items()
                  if index.offset is None and index.fqn.startswith("optim.param_groups.")}
        bulk = {k: info for k in optim if (info := stored.get(k)) is not None and not info.transform_descriptors}
        planner = CachingLoadPlanner(allow_partial_load=False)
        bindings = FileBindings.of(metadata)  # each file read must hold this checkpoint's save_id
        for key, data in read_bytes_entries(path, bulk, bindings).items():
            optim[key] = planner.objects.load(data)
        rest = {**staged, "optim": {k: v for k, v in optim.items() if k not in bulk}}
        reader = _CheckedReader(path, metadata, defer=lambda t: t.untyped_storage().data_ptr() in in_engine,
                                between=between, bindings=bindings)
        with warnings.catch_warnings():  # no_dist warns that it assumes a single process: here it is each rank's
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(rest, storage_reader=reader, no_dist=True, planner=planner)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any failed read must reach every rank
        raise CheckpointReadError(f"reading checkpoint {path!r} failed ({exc})") from exc

def _destination(engine: Any, target: Target, metadata: Metadata) -> tuple[dict[str, Any], set[int]]:
    """The state dict ``dcp.load`` reads into, and the storages (data pointers) in it that are the engine's own.
    Where the optimizer state exists: the engine's masters, optimizer state and frozen weights themselves (read in
    place, by :class:`~.reader.DirectReader`'s second pass, after the agreement). Before the first step: new
    buffers (the state is created, by a zero-learning-rate step, only after the agreement), copied in afterwards.
    Steps, hyperparameters and the extras entries are new objects either way."""
    entries = metadata.state_dict_metadata
    if target.ready:
        masters = target.masters.partitions
        frozen = {f.name: f.local for f in target.frozen}
        states = state_partitions(engine, target)
        own = (*masters, *frozen.values(), *(p for parts in states.values() for p in parts))
        in_engine = {t.untyped_storage().data_ptr() for t in own}
    else:
        masters = tuple(torch.empty_like(p) for p in target.masters.partitions)
        frozen = {f.name: torch.empty_like(f.local) for f in target.frozen}
        states = {k: tuple(torch.empty_like(p) for p in target.masters.partitions) for k in target.state_keys}
        in_engine = set()
    hparams = {name: {hp: v for hp, v in values.items() if f"optim.param_groups.{name}.{hp}" in entries}
               for name, values in hyperparameters_by_name(engine, target).items()}
    steps = (0.0,) * len(masters)
    extras = {k: io.BytesIO() for k in EXTRAS if f"zero_dtensor.{k}" in entries}
    model = {k: v for k, v in model_dict(target, masters, frozen).items() if f"model.{k}" in entries}  # aliases
    state = {"model": model, "optim": optim_dict(target, states, steps, hparams),
             **({"zero_dtensor": extras} if extras else {})}
    return state, in_engine


class _Passes:
    """One :func:`load`'s state between :class:`~.reader.DirectReader`'s passes: what was read, the checked copy
    plan, and how the first agreement went."""

    def __init__(self, engine: Any, target: Target, path: str | os.PathLike) -> None:
        self.engine, self.target, self.path = engine, target, path
        self.staged: dict[str, Any] = {}
        self.checked: CheckedState | None = None
        self.agreed = False
        self.refusal: BaseException | None = None
        #: what every rank's first agreement compares: the normalized path and the checkpoint's identity
        self.signature: tuple[str, str] | None = None

    def between(self) -> None:
        """After this rank's first pass: check what it read, then the agreement (raises where any rank failed)."""
        error: BaseException | None = None
        try:
            self.checked = check_state(self.engine, self.staged["model"], self.staged["optim"], self.target)
        except Exception as exc:  # noqa: BLE001 - whatever failed here must reach every rank before any rank writes
            error = _documented(exc, self.path)
        self.agreed = True
        try:
            _agree_loaded(self.path, error, self.target, self.signature)
        except BaseException as exc:
            self.refusal = exc
            raise


#: the classes a failed :func:`load` raises (each naming the checkpoint)
_DOCUMENTED = (CheckpointMismatchError, CheckpointReadError, IncompleteCheckpointError)


def _check_at_boundary(engine: Any, path: str | os.PathLike) -> None:
    """:class:`CheckpointMismatchError` where ``engine`` is inside a gradient accumulation cycle: the gradients of its
    micro-steps since the last optimizer step would be added to the loaded state at a shifted boundary."""
    taken, gas = ds.micro_steps_into_accumulation(engine)
    if taken:
        raise CheckpointMismatchError(
            f"checkpoint {os.fspath(path)!r}: the engine is {taken} of {gas} micro-steps into a gradient accumulation "
            "cycle; the gradients it holds would be added to the loaded state at a shifted boundary. Load before "
            "training or after the engine.step() that ends a cycle. Nothing was loaded.")


def _documented(error: Exception, path: str | os.PathLike) -> Exception:
    """``error`` as :func:`load` raises it: one of the documented checkpoint classes, naming the checkpoint. Any
    other failure becomes :class:`CheckpointReadError` (caused by it); a documented one whose message does not
    name the checkpoint gets a new one of its class that does (caused by it); the agreement's own errors
    (:class:`~zero_dtensor.errors.RankDisagreementError`) are kept."""
    if isinstance(error, RankDisagreementError):
        return error
    shown = os.fspath(path)
    if isinstance(error, _DOCUMENTED):
        if repr(shown) in str(error):
            return error
        named: Exception = type(error)(f"checkpoint {shown!r}: {error}")
    else:
        named = CheckpointReadError(f"loading checkpoint {shown!r} failed ({type(error).__name__}: {error}); "
                                    "nothing was loaded")
    named.__cause__ = error
    return named


def _agree_loaded(path: str | os.PathLike, error: BaseException | None, target: Target,
                  signature: tuple[str, str] | None) -> None:
    """:func:`load`'s first agreement: every rank raises where any rank could not read or check the checkpoint (its
    own error there; elsewhere :class:`CheckpointReadError` or the refusal's class, caused by the agreement's
    :class:`~zero_dtensor.errors.RankFailedError`), or where the ranks' normalized paths or checkpoint identities
    (``signature``) differ (:class:`~zero_dtensor.errors.RankDisagreementError` listing every rank's): each rank
    picking its own "latest" checkpoint would otherwise load a mixture. One small collective."""
    _agree("checkpoint.load", error, target, "Nothing was loaded into the engine on any rank.",
           (f"loading checkpoint {os.fspath(path)!r} failed on another rank", "; the engine is unchanged"),
           signature)


def _agree_read_in_place(path: str | os.PathLike, error: BaseException | None, target: Target) -> None:
    """:func:`load`'s second agreement, after reading into the engine's memory: every rank raises where the read
    failed on any rank (an I/O error after every entry was checked). One small collective."""
    consequence = (f"Reading checkpoint {os.fspath(path)!r} into the engine failed after every entry was checked: "
                   "the masters and optimizer state of the failing rank(s) are partly overwritten. Load a checkpoint "
                   "again.")
    _agree("checkpoint.load.in_place", error, target, consequence, ("zero_dtensor.load: another rank failed", ""))


def _agree(what: str, error: BaseException | None, target: Target, consequence: str,
           elsewhere: tuple[str, str], signature: Any = None) -> None:
    """One agreement of :func:`load` (:func:`~zero_dtensor.comm.agreement.agree_outcome`): a failing rank raises its own
    error; every other rank :class:`CheckpointReadError` (``elsewhere``: the text before and after the agreement's
    :class:`~zero_dtensor.errors.RankFailedError`, which carries ``consequence``), or the refusal's class where
    the agreement raises that."""
    try:
        agree_outcome(what, error, [target.process_group], target.masters.device, consequence=consequence,
                      signature=signature)
    except RankFailedError as exc:
        if error is not None:
            raise
        raise CheckpointReadError(f"{elsewhere[0]} ({exc}){elsewhere[1]}") from exc


@collective
@collector_paused()
def load(engine: Any, path: str | os.PathLike) -> Any:
    """Load a checkpoint written by ``zd.save`` (at any world size and ZeRO stage 1-3) or by FSDP2 into ``engine``.

    Call on every rank. Everything is checked on every rank before the engine's memory is written: another model
    or optimizer, an unfinished save, a missing, truncated or damaged file (each tensor entry's CRC-32 is checked),
    a file from another checkpoint (each file holds its checkpoint's ``save_id``)
    all raise on every rank with the engine unchanged. Then the state is read straight into the engine's memory and
    the working weights are made the loaded masters (which clears the write mark). Internals: ``docs/design.md``.

    Args:
        engine: a DeepSpeed ZeRO engine built with the same model and optimizer (world size, stage and offload may
            differ), at a gradient accumulation boundary (before training, or after the ``engine.step()`` that
            ends a cycle).
        path: the checkpoint directory, the same checkpoint on every rank.

    Returns:
        object: the saved ``client_state`` (``None`` if none was saved).

    Raises:
        IncompleteCheckpointError: no finished checkpoint at ``path``.
        CheckpointMismatchError: names, shapes or optimizer-state keys differ from the engine's (the message lists
            them), or the engine is inside a gradient accumulation cycle.
        CheckpointReadError: a missing, truncated, damaged or foreign file, or a CRC-32 mismatch; names the checkpoint (and,
            on the rank that read it, the file and entry). Only an I/O error after the checks leaves the failing
            rank's state partly overwritten, and the message says so.
        RankDisagreementError: ranks name different checkpoints.

    Communication:
        Two agreements (one before the engine's first step), each rank reading its own pieces (no DCP collective),
        then the working-weight refresh: ZeRO-1/2 one gather per param group, ZeRO-3 one of the persistent
        parameters.

    Device and memory:
        Reads in place: no staging copy, except entries that cannot land in place (another world size's boxes,
        another dtype) and, before the first step, one copy of this rank's partition; 1 MiB buffers for the CRC
        checks.

    Example:
        ```python
        client_state = zd.load(engine, "ckpt/step100")
        ```
    """
    target = describe(engine)
    passes = _Passes(engine, target, path)
    error: BaseException | None = None
    try:
        _check_at_boundary(engine, path)
        metadata = read_metadata(path)
        passes.signature = (normalized(path), identity(metadata))
        problems = check_metadata(target, metadata)
        if problems:
            shown = problems[:MAX_LINES] + ([f"... and {len(problems) - MAX_LINES} more"]
                                            if len(problems) > MAX_LINES else [])
            raise CheckpointMismatchError(f"checkpoint {os.fspath(path)!r} does not fit this engine:\n  "
                                          + "\n  ".join(shown) + "\nNothing was loaded.")
        passes.staged, in_engine = _destination(engine, target, metadata)
        _read(passes.staged, os.fspath(path), metadata, in_engine, passes.between)
    except Exception as exc:  # noqa: BLE001 - whatever failed here must reach every rank
        error = _documented(exc, path)
    if passes.refusal is not None:  # the agreement after the first pass raised: nothing was written
        raise passes.refusal
    if not passes.agreed:  # failed before the agreement: it is this rank's error, every rank raises
        passes.staged.clear()
        _agree_loaded(path, error, target, passes.signature)
    if target.ready:  # the second pass read into the engine: did it succeed on every rank?
        _agree_read_in_place(path, error, target)
    elif error is not None:
        raise error
    assert passes.checked is not None
    apply_state(engine, passes.checked)
    extras: Mapping[str, Any] = {k: _unblob(v) for k, v in passes.staged.get("zero_dtensor", {}).items()}
    passes.checked = None  # the staging buffers go before the refresh allocates its own (ZeRO-1/2: the working model)
    passes.staged.clear()
    sync_model_params(engine)
    clear_write_mark(engine)  # the refresh made the working weights from the masters: an earlier write is gone
    if "engine" in extras:
        ds.set_engine_counters(engine, extras["engine"])
    ds.set_lr_scheduler_state(engine, extras.get("lr_scheduler"))
    ds.set_loss_scaler_state(engine, extras.get("loss_scaler"))
    return extras.get("client_state")
