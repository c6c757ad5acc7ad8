"""Redistribute ZeRO gradients in bulk: per-parameter ``Shard(0)`` DTensors, whole parameters on owner ranks.

DeepSpeed keeps a gradient in its own layout (ZeRO-1/2: ragged pieces of a flat buffer; ZeRO-3: ``torch.chunk``
pieces of the *flattened* parameter; ``BF16_Optimizer``: the whole buffer on every rank). Two other layouts are
what sharded training code needs, and each moves about ``S/N`` bytes per rank instead of the ``(N-1)/N·S`` of
``full_tensors`` (``S`` the selected gradient bytes in the stored dtype, ``N`` ranks):

=============  ===============================================  ==============================================
target         rank ``r`` holds                                 communication (per process group and dtype)
=============  ===============================================  ==============================================
``rows``       rows ``[r·c, min((r+1)·c, R))`` of every          read: one ``all_to_all_single`` with uneven
               parameter, ``c = ceil(R/N)`` (``torch.chunk``,    splits, none for replicated groups (each rank
               FSDP2's ``Shard(0)``); a 0-d parameter whole      slices its own rows); write: one, the reverse
               on every rank (``Replicate``)                     (replicated groups too: every rank needs all)
``owners``     the whole gradient of the parameters assigned    the same
               to ``r`` (:func:`balanced_owners` or the user's)
=============  ===============================================  ==============================================

Bytes per rank of one exchange: this rank sends the part of its stored fragments that other ranks' targets cover and
receives the part of its targets that other ranks store: about ``(N-1)/N · S/N`` each way when the targets are
balanced (:func:`traffic` gives the exact figures of a call).

**Plan.** :func:`plan_for` computes, once per (layout, selection, target) and cached (the :data:`PLAN_CACHE_SIZE`
most recently used), every piece this rank sends
and receives: for each parameter and peer, the intersection of the source's fragment (``ParamLayout.rank_range``,
ragged ZeRO-1/2 pieces and ``torch.chunk`` ZeRO-3 pieces alike) with the destination's target range, as ``(slot,
offset, length)`` triples in peer order. Executing a plan takes a fixed number of tensor operations whatever the
number of parameters: at most one pack (``torch.cat`` of narrow views into a kept send buffer; none where what is
sent lies as one run in send order), one ``all_to_all_single`` (into the destination itself, the output buffer or
DeepSpeed's partition, where what arrives is in its order), at most one ``torch.split_with_sizes_copy`` of a kept
receive buffer into narrow views of the destination, one ``_foreach_copy_`` of this rank's own share where it does
not travel, and at most two casts (fp16 unscaling, ``dtype=``). Each byte is copied at most once locally on the rank
that sends it and once on the rank that receives it (the own share once); no buffer besides a read's output holds
more than this rank sends and receives (:mod:`.exchange`). Per-parameter results are views into the output buffer.

**Validation.** Writes check every entry on every rank before anything is sent or written; a bad entry on one rank
raises on every rank (one ``all_reduce`` of ``N`` int64 error codes per process group): the failing rank raises
its own error, the others the same exception class (``ValueError``, ``TypeError``, ``KeyError``; a failure of a
user function: :class:`~zero_dtensor.errors.RankFailedError`) naming the failing ranks.

Nothing here prints; every collective goes through :mod:`zero_dtensor.comm.collectives`.

Modules: :mod:`.calls` (the calls), :mod:`.checks` (entry validation), :mod:`.assignment` (owners), :mod:`.plan`
(the exchange plan), :mod:`.exchange` (a plan executed), :mod:`.tools` (traffic figures, Newton–Schulz).
"""

from __future__ import annotations

from .calls import checked_dtensors, map_full_, owned, set_dtensors_, set_owned_, to_dtensors
from .checks import agreement_groups, mapping_names
from .assignment import balanced_owners, owners
from .plan import OWNERS, PLAN_CACHE_SIZE, ROWS, BucketPlan, Plan, TargetSlot, Transfer, plan_for
from .tools import newton_schulz, traffic

__all__ = [
    "BucketPlan",
    "OWNERS",
    "PLAN_CACHE_SIZE",
    "Plan",
    "ROWS",
    "TargetSlot",
    "Transfer",
    "agreement_groups",
    "balanced_owners",
    "checked_dtensors",
    "map_full_",
    "mapping_names",
    "newton_schulz",
    "owned",
    "owners",
    "plan_for",
    "set_dtensors_",
    "set_owned_",
    "to_dtensors",
    "traffic",
]
