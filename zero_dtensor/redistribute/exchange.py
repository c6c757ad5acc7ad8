"""Executing a plan: one ``all_to_all_single`` per bucket (with error codes where a user function ran before the
write), a fixed number of tensor operations whatever the number of parameters, and each byte copied at most once
locally beyond the exchange itself.

Copies (counted per rank by ``tests/workers/dispatch_probe.py``: bytes written by local operations, collectives
aside): what is sent is packed only where it does not already lie as one run in send order (then the run itself is
sent, a view); what arrives is received straight into its destination (the result buffer of a read, DeepSpeed's
partition of a write) where it arrives in the destination's order, else into a receive buffer and copied once into
place. Where neither side can be a view, this rank's own share does not travel: it is copied once, straight from
where it lies to where it goes. So a byte is copied at most once on the rank that sends it and once on the rank
that receives it, and the own share once: per call at most ``own + sent + received`` bytes (the exchange's own
traffic). Where the partitions live on another device than the exchange (CPU offload with NCCL) the pack or the
unpack is that device move itself (``copy_`` crosses devices): no extra copy. Exceptions: fp16 loss scaling and a
``dtype=`` that differs from the stored one add one converted copy of the result (reads) or of what is sent
(writes).

Memory: reads allocate their result once (recycled between calls) and writes nothing of the data's size; the send
and receive buffers, where needed, are kept between calls (:meth:`~zero_dtensor.materialize.buffers.BufferPool.
transient`), each at most the bytes that go through it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from ..comm import collectives, process_groups
from ..layout.devices import to_device
from ..layout.views import ViewCache
from ..materialize.buffers import BUFFERS
from ..core.storage import FlatStorage, shares_memory
from .plan import BucketPlan, Piece, Plan, Transfer, one_run


def _unpack(buffer: torch.Tensor, pieces: Sequence[Piece], dests: Sequence[torch.Tensor],
            device: torch.device | None = None, outs: Sequence[torch.Tensor] | None = None) -> None:
    """``buffer``'s elements (on the communication ``device``, default its own), back to back, into narrow views of
    ``dests`` (``outs``: those views, made earlier): one ``torch.split_with_sizes_copy``; one ``_foreach_copy_``
    where the destinations lie on another device (CPU offload), the move across being the one copy."""
    if not pieces:
        return
    if outs is None:
        outs = [dests[s].narrow(0, o, n) for s, o, n in pieces]
    if outs[0].device == (buffer.device if device is None else device):
        torch.split_with_sizes_copy(buffer, [n for _, _, n in pieces], out=outs)
    else:
        torch._foreach_copy_(outs, list(buffer.split([n for _, _, n in pieces])))


def _copy_pieces(dests: Sequence[torch.Tensor], dest_pieces: Sequence[Piece], sources: Sequence[torch.Tensor],
                 source_pieces: Sequence[Piece], device: torch.device | None = None,
                 outs: Sequence[torch.Tensor] | None = None, source_run: Piece | None = None) -> None:
    """Each source piece straight into the matching destination piece (same order, same lengths; ``outs``: views
    of the destination pieces, made earlier; ``source_run``: the source pieces as the one run they form, where
    they do). One ``torch.cat(out=)`` where the destination pieces are one run on ``device`` (where the sources
    are, when given) in the sources' dtype (a write's own share into a partition: no view per destination piece,
    none per source piece that is a whole value); one ``torch.split_with_sizes_copy`` where the source pieces are
    one run on ``device`` and ``outs`` lie there in its dtype (a ZeRO-3 owner's own share: no view per source piece);
    else one ``_foreach_copy_`` (it converts dtypes and crosses devices)."""
    if not dest_pieces:
        return
    if outs is not None and source_run is not None and device is not None:
        src = sources[source_run[0]].narrow(0, source_run[1], source_run[2])
        if src.device == device and outs[0].device == device and outs[0].dtype == src.dtype:
            torch.split_with_sizes_copy(src, [n for _, _, n in source_pieces], out=list(outs))
            return
    srcs = [_piece_of(sources[s], o, n) for s, o, n in source_pieces]
    run = one_run(dest_pieces) if device is not None else None
    if run is not None:
        out = dests[run[0]].narrow(0, run[1], run[2])
        if out.device == device and all(t.device == device and t.dtype == out.dtype for t in srcs):
            torch.cat(srcs, out=out)
            return
    torch._foreach_copy_(list(outs) if outs is not None else
                         [dests[s].narrow(0, o, n) for s, o, n in dest_pieces], srcs)


def _piece_of(source: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """Elements ``[offset, offset + length)`` of the 1-D ``source``: ``source`` itself where that is all of it."""
    return source if offset == 0 and length == source.shape[0] else source.narrow(0, offset, length)


def _comm_device(storage: FlatStorage, bucket: BucketPlan) -> torch.device:
    return collectives.comm_device(storage.partitions[bucket.groups[0]], storage.process_groups[bucket.groups[0]],
                                   storage.device)


def read_targets(storage: FlatStorage, plan: Plan, dtype: torch.dtype | None
                 ) -> list[tuple[BucketPlan, tuple[torch.Tensor, ...]]]:
    """Per bucket, every target of this rank (true units, ``dtype``) as a view shaped like its slot, all views of
    one output buffer the caller owns.

    Per bucket (see the module docstring for the copies): where nothing crosses ranks, each piece is copied once
    from the partition into the output; where what arrives already is the targets in order, one
    ``all_to_all_single`` receives straight into the output and sends the run of a partition that is to go (a
    view: owners holding contiguous runs, :func:`~.assignment.balanced_owners`) or, where this rank keeps no more
    than it receives, the pieces packed once; else this rank's own share is copied straight into place and the
    others' pieces travel alone: sent as they lie where they are one run, else packed into the output itself
    (free until the exchange returns), received into a buffer of what arrives from the other ranks and copied
    into place (ZeRO-3 owners, whose owned pieces arrive grouped by sender). So no buffer besides the output holds
    more than this rank sends and receives, and none is a staging twin of the output. The output buffer is
    recycled: a new one only while every earlier result still holds its own
    (:meth:`~zero_dtensor.materialize.buffers.BufferPool.recycled_or_new`, which also keeps the per-target views).
    Memory: the output (``S/N`` for rows, the owned tensors for owners), plus, kept between calls, a send buffer
    where pieces are packed outside the output and a receive buffer of the other ranks' pieces where they do not
    arrive in place (each at most what goes through it)."""
    results = []
    for bucket in plan.buckets:
        parts = [storage.partitions[g] for g in bucket.groups]
        device = _comm_device(storage, bucket)
        read = bucket.read
        out = BUFFERS.recycled_or_new(("redistribute", bucket.out_numel, bucket.dtype, device), bucket.out_numel,
                                      bucket.dtype, device)
        kept = BUFFERS.view_cache(out)  # the recycled output's views (None: memory the pool does not keep)
        pg = storage.process_groups[bucket.groups[0]]
        direct = read.recv_in_order and sum(read.recv_counts) == bucket.out_numel
        run = _run_on(parts, read.send_run, device)  # what is sent, where it lies as one run (no packing)
        if not read.communicates:  # nothing crosses ranks: each piece once, partition to output
            _copy_pieces([out], read.runs[1], parts, read.runs[0])
        elif direct and (run is not None or _kept(read) <= read.received_elements):
            # (packing the own share too costs less than copying what arrives: else the own share goes alone)
            send = run if run is not None else _pack_into(_scratch("send", bucket, device), parts,
                                                          _as_run(read.send_pieces, read.send_run), device)
            collectives.all_to_all_into(out, send, read.recv_counts, read.send_counts, pg)
        else:  # this rank's own share copied straight into place; the others' sent (as they lie where they are
            # one run, else packed into the output, free until they arrive), received alone and copied into place:
            # no receive buffer of the result's size (ZeRO-3 owners: what arrives is grouped by sender)
            _exchange_peers(parts, [out], read, device, bucket, pg, send_space=out,
                            outs=_piece_views(kept, bucket))
        true = storage.to_true(out)
        if dtype is not None and true.dtype != dtype:
            true = true.to(dtype)
        cache = kept if true is out else None
        if _keeps(cache, ("targets", bucket)):
            views = cache.get(("targets", bucket), lambda b: _slot_views(b, bucket))
        else:
            views = _slot_views(true, bucket)
        results.append((bucket, views))
    return results


def _as_run(pieces: Sequence[Piece], run: Piece | None) -> Sequence[Piece]:
    """``pieces``, as the one piece ``run`` where they form it (one copy across devices instead of one per piece,
    where a partition lies elsewhere)."""
    return pieces if run is None else (run,)


def _kept(transfer: Transfer) -> int:
    """Elements of this rank's own share (what it keeps)."""
    return sum(transfer.recv_counts) - transfer.received_elements


def _exchange_peers(sources: Sequence[torch.Tensor], dests: Sequence[torch.Tensor], transfer: Transfer,
                    device: torch.device, bucket: BucketPlan, pg: object,
                    send_space: torch.Tensor | None = None,
                    outs: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None) -> None:
    """``transfer`` with this rank's own share copied straight from ``sources`` into ``dests`` (one copy:
    :func:`_copy_pieces`), the other ranks' pieces sent as they lie where they are one run (a view), else packed
    into ``send_space`` (memory nothing reads until the exchange returned: a read's output, written only after it)
    where it holds them, else into a kept send buffer; exchanged into a kept receive buffer of what arrives from the
    other ranks (one ``all_to_all_single`` with this rank's own split 0) and copied into place. ``outs``: the views
    of ``dests`` that the own share and the received pieces go to (:func:`_piece_views`), else made here."""
    (own_sent, own_received), sent, received = transfer.own_runs, transfer.peer_pieces()[0], transfer.peer_recv_runs
    send_counts, recv_counts = transfer.peer_counts()
    send = _run_on(sources, transfer.peer_send_run, device)
    if send is None or (send.numel() > 1 and send.stride(0) != 1):  # (a write's value may be expanded: stride 0)
        n = sum(send_counts)
        space = send_space.narrow(0, 0, n) if send_space is not None and send_space.numel() >= n \
            else _scratch("send", bucket, device, n)
        send = _pack_into(space, sources, sent, device)
    recv = _scratch("recv", bucket, device, sum(recv_counts))
    collectives.all_to_all_into(recv, send, recv_counts, send_counts, pg)
    own_outs, received_outs = outs if outs is not None else (None, None)
    _copy_pieces(dests, own_received, sources, own_sent, device, own_outs, transfer.own_source_run)
    _unpack(recv, received, dests, device, received_outs)


def _keeps(cache: ViewCache | None, key: object) -> bool:
    """Whether ``cache`` (a recycled output's) keeps the views under ``key``: it holds them, or fewer than
    :data:`KEPT_VIEW_SETS` sets of views."""
    return cache is not None and (cache.holds(key) or cache.entries < KEPT_VIEW_SETS)


def _piece_views(cache: ViewCache | None, bucket: BucketPlan
                 ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None:
    """The views of a read's output that this rank's own pieces and the received pieces of ``bucket`` go to
    (:func:`_exchange_peers`), made once per recycled output and plan (``cache``: its view cache): a ZeRO-3
    owner's pieces are one per parameter and peer, and a view costs microseconds. ``None`` where not kept."""
    key = ("pieces", bucket)
    if not _keeps(cache, key):
        return None
    assert cache is not None
    own = bucket.read.own_runs[1]
    views = cache.get(key, lambda b: [b.narrow(0, o, n) for _, o, n in own + bucket.read.peer_recv_runs])
    return views[:len(own)], views[len(own):]


#: a recycled output buffer keeps at most this many sets of views: two per bucket plan (its targets; the landing
#: places of a read's own and received pieces, :func:`_piece_views`), so those of 8 plans (selections)
KEPT_VIEW_SETS = 16


def _slot_views(buffer: torch.Tensor, bucket: BucketPlan) -> tuple[torch.Tensor, ...]:
    """Every target of ``bucket`` as a view of ``buffer`` (its ``out_numel`` elements), shaped like its slot."""
    return tuple(buffer.narrow(0, slot.start, slot.numel).view(slot.shape) for slot in bucket.params)


def _run_on(parts: Sequence[torch.Tensor], run: Piece | None, device: torch.device) -> torch.Tensor | None:
    """The view of ``parts`` that ``run`` names, where there is one on ``device`` (else ``None``)."""
    if run is None or parts[run[0]].device != device:
        return None
    slot, start, length = run
    return parts[slot].narrow(0, start, length)


def _scratch(what: str, bucket: BucketPlan, device: torch.device, numel: int | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """A kept 1-D buffer used within one call (:meth:`~zero_dtensor.materialize.buffers.BufferPool.transient`):
    ``what`` is ``"send"`` (the packed pieces), ``"recv"`` (``numel`` elements) or a write's ``"framed ..."``."""
    n = sum(bucket.read.send_counts) if numel is None else numel
    dtype = bucket.dtype if dtype is None else dtype
    return BUFFERS.transient(("redistribute " + what, dtype, device), n, dtype, device)


def _pack_into(buffer: torch.Tensor, sources: Sequence[torch.Tensor], pieces: Sequence[Piece],
               device: torch.device) -> torch.Tensor:
    """The pieces of ``sources`` back to back in ``buffer`` (on ``device``): one ``torch.cat(out=)``; where the
    sources are elsewhere (a CPU-offloaded partition for a GPU collective), one ``_foreach_copy_`` of the pieces
    across, the device move itself (no staging copy where they lie)."""
    if pieces:
        views = [sources[s].narrow(0, o, n) for s, o, n in pieces]
        if views[0].device == device:
            torch.cat(views, out=buffer)
        else:
            torch._foreach_copy_(list(buffer.split([n for _, _, n in pieces])), views)
    return buffer


def write_targets(storage: FlatStorage, plan: Plan, values: Mapping[str, torch.Tensor], *,
                  code: int | None = None) -> list[tuple[int, int]]:
    """Send every bucket's targets back into the partitions. ``values[name]``: this rank's flattened target (true
    units, any floating dtype); names absent on this rank must have an empty target here.

    Copies (module docstring): the targets are sent as they lie where they are one run in send order (e.g. the
    views :func:`read_targets` returned, modified in place), else packed once; what arrives is received straight
    into the partition where it fills one run of it in order, else copied into place once; where neither holds,
    this rank's own share goes straight from its value into the partition. Nothing of the data's size is
    allocated: send and receive buffers, where needed, are kept between calls. fp16 loss scaling, values of
    another dtype than the stored one or values sharing memory with a partition: packed (scaled, converted) first,
    one more copy of this rank's values.

    ``code`` (a user function ran before this write; :func:`~zero_dtensor.comm.agreement.error_code` of its failure on
    this rank): every multi-rank bucket's exchange then carries one error code per peer after its data, every
    exchange completes before anything is written, and where any rank failed nothing is written: returns
    ``(global rank, code)`` of the failed ranks (this one included), in rank order. A failed rank sends its code
    in place of its data."""
    failed: dict[int, int] = {}
    deferred = []
    with torch.no_grad():
        for index, bucket in enumerate(plan.buckets):
            device = _comm_device(storage, bucket)
            parts = [storage.partitions[g] for g in bucket.groups]
            sources = _sources(storage, bucket, values, device, code, parts)
            if code is None:
                _write_bucket(sources, parts, bucket, device, storage)
                continue
            if not process_groups.collective_path(bucket.world_size):
                deferred.append((bucket, sources, parts, None, device))
                continue
            framed, codes = _framed_exchange(sources, bucket, device, storage, code, index)
            members = process_groups.group_ranks(storage.process_groups[bucket.groups[0]])
            failed.update({members[r]: c for r, c in enumerate(codes) if c})
            deferred.append((bucket, sources, parts, framed, device))
        if code:
            failed[my_rank(storage)] = code
        if failed:
            return sorted(failed.items())
        for bucket, sources, parts, framed, device in deferred:
            if framed is None:
                _copy_pieces(parts, bucket.write.recv_pieces, sources, bucket.write.send_pieces, device)
            else:
                _unpack_framed(framed, sources, parts, bucket, device)
    return []


def _sources(storage: FlatStorage, bucket: BucketPlan, values: Mapping[str, torch.Tensor], device: torch.device,
             code: int | None, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per target slot, this rank's value flattened on ``device`` in stored units and dtype: the values themselves
    where they are (views), else one packed, scaled and converted buffer the slots are views of (also where a value
    shares memory with a partition: then nothing written can overwrite what is still to be read). A failed rank
    (``code``) sends nothing of its values."""
    none = _empty(bucket.dtype, device)  # for targets this rank does not hold
    if code:
        return [none for _ in bucket.params]
    sources = [_flat_on(values.get(slot.name), none, device) for slot in bucket.params]
    if storage.loss_scale == 1.0 and all(t.dtype == bucket.dtype for t in sources) and not shares_memory(sources, parts):
        return sources
    # stored units or dtype differ, or a value is a view of a partition: every slot's value copied once
    flat = storage.to_stored(torch.cat(sources))  # (type promotion across the values, as the old pack)
    flat = flat if flat.dtype == bucket.dtype else flat.to(bucket.dtype)
    return list(flat.split([t.numel() for t in sources]))


def _write_bucket(sources: Sequence[torch.Tensor], parts: Sequence[torch.Tensor], bucket: BucketPlan,
                  device: torch.device, storage: FlatStorage) -> None:
    """One bucket's write without error codes (module docstring: each byte copied at most once locally)."""
    write = bucket.write
    if not write.communicates:  # every piece stays on this rank: once, value to partition
        _copy_pieces(parts, write.recv_pieces, sources, write.send_pieces, device)
        return
    pg = storage.process_groups[bucket.groups[0]]
    run = _source_run(sources, write.send_pieces, device)  # (no value shares memory with a partition: _sources)
    dest = _run_on(parts, write.recv_run, device)
    if dest is not None and (run is not None or _kept(write) <= write.received_elements):
        recv = dest  # received in place (packing the own share costs less than copying what arrives)
    elif run is not None and write.sent_elements > _kept(write):
        recv = _scratch("recv", bucket, device, sum(write.recv_counts))  # every share received, copied once
    else:  # the own share straight from the values into the partitions; the others' pieces travel alone
        _exchange_peers(sources, parts, write, device, bucket, pg)
        return
    send = run if run is not None else _pack_into(_scratch("send", bucket, device, sum(write.send_counts)),
                                                  sources, write.send_pieces, device)
    collectives.all_to_all_into(recv, send, write.recv_counts, write.send_counts, pg)
    if recv is not dest:
        _unpack(recv, _as_run(write.recv_pieces, write.recv_run), parts, device)


def _source_run(sources: Sequence[torch.Tensor], pieces: Sequence[Piece], device: torch.device
                ) -> torch.Tensor | None:
    """The pieces as one view, where they lie back to back in one storage in send order (e.g. views of one
    buffer :func:`read_targets` returned), on ``device``; else ``None``. Metadata only: no tensor operation."""
    if not pieces:
        return None
    first = sources[pieces[0][0]]
    if first.device != device:
        return None
    storage_ptr = first.untyped_storage().data_ptr()
    start = end = first.storage_offset() + pieces[0][1]
    for s, o, n in pieces:
        t = sources[s]
        if (t.dtype != first.dtype or t.untyped_storage().data_ptr() != storage_ptr
                or (t.numel() > 1 and t.stride(0) != 1) or t.storage_offset() + o != end):
            return None
        end += n
    return first.as_strided((end - start,), (1,), start)


_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared empty tensor (made once per dtype and device; nothing can be written into it)."""
    key = (dtype, device)
    t = _EMPTY.get(key)
    if t is None:
        t = _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return t


def _framed_exchange(sources: Sequence[torch.Tensor], bucket: BucketPlan, device: torch.device,
                     storage: FlatStorage, code: int, index: int) -> tuple[torch.Tensor, list[int]]:
    """The bucket's write ``all_to_all_single`` with this rank's error ``code`` after what it sends each peer (also
    where no data crosses ranks): the other ranks' pieces copied once into the framed send buffer (their own
    share stays: :func:`_unpack_framed` copies it straight into place), one more element each way per peer.
    Returns the framed receive buffer (kept, one per bucket ``index``; written into the partitions only once
    every rank's code is known) and every peer's code in group-rank order."""
    write = bucket.write
    sent = write.peer_pieces()[0]
    data_send, data_recv = write.peer_counts()
    send_counts = [n + 1 for n in data_send]
    recv_counts = [n + 1 for n in data_recv]
    framed = _scratch("framed send", bucket, device, sum(send_counts))
    if code:  # a failed rank sends its code in every element (its data is never written anywhere)
        framed.fill_(float(code))
    else:  # each peer's pieces by one cat into its block (the sources are on ``device`` in the bucket's dtype),
        # then the 0 codes after the blocks
        ends = list(itertools.accumulate(send_counts))
        for end, count, peer in zip(ends, send_counts, _per_peer(write.send_piece_counts, write.rank, sent)):
            if peer:
                block = framed.narrow(0, end - count, count - 1)
                torch.cat([_piece_of(sources[s], o, n) for s, o, n in peer], out=block)
        torch._foreach_zero_([framed.narrow(0, end - 1, 1) for end in ends])
    recv = _scratch(f"framed recv {index}", bucket, device, sum(recv_counts))  # one per bucket: kept until written
    collectives.all_to_all_into(recv, framed, recv_counts, send_counts, storage.process_groups[bucket.groups[0]])
    at = [sum(recv_counts[:s + 1]) - 1 for s in range(len(recv_counts))]
    codes = [int(c) for c in torch.cat([recv.narrow(0, i, 1) for i in at]).tolist()]
    return recv, codes


def _per_peer(piece_counts: Sequence[int], me: int, pieces: Sequence[Piece]) -> list[list[Piece]]:
    """``pieces`` (this rank's own left out) grouped per peer, in rank order (this rank: an empty group)."""
    groups, at = [], 0
    for r, k in enumerate(piece_counts):
        k = 0 if r == me else k
        groups.append(list(pieces[at:at + k]))
        at += k
    return groups


def _unpack_framed(framed: torch.Tensor, sources: Sequence[torch.Tensor], parts: Sequence[torch.Tensor],
                   bucket: BucketPlan, device: torch.device) -> None:
    """After every rank's code was 0: this rank's own share straight from its values (on ``device``) into the
    partitions (:func:`_copy_pieces`: one ``cat`` or ``_foreach_copy_``), and the peers' pieces from the framed
    receive buffer (codes skipped, one ``_foreach_copy_`` of the merged runs,
    :attr:`~.plan.Transfer.framed_recv_runs`): each byte once."""
    write = bucket.write
    own_sent, own_received = write.own_runs
    _copy_pieces(parts, own_received, sources, own_sent, device)
    in_framed, received = write.framed_recv_runs  # (merged: a ZeRO-3 rank's pieces from one owner are one run)
    _copy_pieces(parts, received, [framed], in_framed)


def _flat_on(value: torch.Tensor | None, none: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` flattened without autograd history (a view when contiguous), on ``device`` (a copy only there)."""
    if value is None:
        return none
    flat = value.detach().reshape(-1)
    return flat if flat.device == device else to_device(flat, device)


def my_rank(storage: FlatStorage) -> int:
    """This process's global rank (from the first group's process group and group rank). No communication."""
    return process_groups.group_ranks(storage.process_groups[0])[storage.layout.groups[0].rank]
