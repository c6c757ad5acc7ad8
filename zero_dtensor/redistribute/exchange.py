"""Executing a plan: pack, one ``all_to_all_single`` per bucket (with error codes where a user function ran
before the write), unpack; a fixed number of tensor operations whatever the number of parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..comm import collectives, process_groups
from ..layout.devices import to_device
from ..materialize.buffers import BUFFERS
from ..core.storage import FlatStorage
from .plan import BucketPlan, Piece, Plan, Transfer


def _pack(sources: Sequence[torch.Tensor], pieces: Sequence[Piece], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """One ``torch.cat`` of narrow views (type promotion across sources); an empty tensor when nothing is sent."""
    if not pieces:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([sources[s].narrow(0, o, n) for s, o, n in pieces])


def _unpack(buffer: torch.Tensor, pieces: Sequence[Piece], dests: Sequence[torch.Tensor]) -> None:
    """One ``torch.split_with_sizes_copy`` of ``buffer`` into narrow views of ``dests``."""
    if pieces:
        torch.split_with_sizes_copy(buffer, [n for _, _, n in pieces],
                                    out=[dests[s].narrow(0, o, n) for s, o, n in pieces])


def _exchange(send: torch.Tensor, transfer: Transfer, storage: FlatStorage, bucket: BucketPlan) -> torch.Tensor:
    """The bucket's one ``all_to_all_single`` (or the send buffer itself when nothing crosses ranks)."""
    if not transfer.communicates:
        return send
    recv = torch.empty(sum(transfer.recv_counts), dtype=send.dtype, device=send.device)
    pg = storage.process_groups[bucket.groups[0]]
    collectives.all_to_all_into(recv, send, transfer.recv_counts, transfer.send_counts, pg)
    return recv


def _comm_device(storage: FlatStorage, bucket: BucketPlan) -> torch.device:
    return collectives.comm_device(storage.partitions[bucket.groups[0]], storage.process_groups[bucket.groups[0]],
                                   storage.device)


def read_targets(storage: FlatStorage, plan: Plan, dtype: torch.dtype | None
                 ) -> list[tuple[BucketPlan, tuple[torch.Tensor, ...]]]:
    """Per bucket, every target of this rank (true units, ``dtype``) as a view shaped like its slot, all views of
    one output buffer the caller owns.

    Per bucket: the pieces sent are packed with one ``torch.cat`` into a kept send buffer, or sent as they lie where
    they are one run of a partition (owners holding contiguous runs: :func:`~.assignment.balanced_owners`); one
    ``all_to_all_single`` receives straight into the output buffer where what arrives already is the targets in
    order; else, where the pieces were packed, this rank's own share is copied straight into place (one
    ``_foreach_copy_``) and the other ranks' travel alone, into a kept receive buffer, then one
    ``split_with_sizes_copy`` into the output (sent as they lie: every share travels, then one
    ``split_with_sizes_copy``); where nothing crosses ranks the pieces are
    packed straight into the output. The output buffer is recycled: a new one only while every earlier result
    still holds its own (:meth:`~zero_dtensor.materialize.buffers.BufferPool.recycled_or_new`, which also keeps the
    per-target views). Memory: the output (``S/N`` for rows, the owned tensors for owners), plus the kept send and
    receive buffers (about ``S/N`` each, kept for later calls)."""
    results = []
    for bucket in plan.buckets:
        parts = [storage.partitions[g] for g in bucket.groups]
        device = _comm_device(storage, bucket)
        read = bucket.read
        out = BUFFERS.recycled_or_new(("redistribute", bucket.out_numel, bucket.dtype, device), bucket.out_numel,
                                      bucket.dtype, device)
        direct = read.recv_in_order and sum(read.recv_counts) == bucket.out_numel
        run = _run_on(parts, read.send_run, device)  # what is sent, where it lies as one run (no packing)
        if not read.communicates:  # nothing crosses ranks: what is sent is what is received
            if direct:
                _pack_into(out, parts, read.send_pieces, device)
            else:
                send = _pack_into(_scratch("send", bucket, device), parts, read.send_pieces, device)
                _unpack(send, read.recv_pieces, [out])
        elif direct:
            send = run if run is not None else _pack_into(_scratch("send", bucket, device), parts, read.send_pieces,
                                                          device)
            collectives.all_to_all_into(out, send, read.recv_counts, read.send_counts,
                                        storage.process_groups[bucket.groups[0]])
        elif run is not None:  # sent as it lies; own share unpacked with the rest
            recv = _scratch("recv", bucket, device, sum(read.recv_counts))
            collectives.all_to_all_into(recv, run, read.recv_counts, read.send_counts,
                                        storage.process_groups[bucket.groups[0]])
            _unpack(recv, read.recv_pieces, [out])
        else:  # this rank's own share copied straight into place; the others' packed, exchanged, unpacked
            (own_sent, own_received), (sent, received) = read.own_pieces(), read.peer_pieces()
            send_counts, recv_counts = read.peer_counts()
            send = _pack_into(_scratch("send", bucket, device, sum(send_counts)), parts, sent, device)
            recv = _scratch("recv", bucket, device, sum(recv_counts))
            collectives.all_to_all_into(recv, send, recv_counts, send_counts, storage.process_groups[bucket.groups[0]])
            if own_sent:  # (copy_ moves pieces of a partition kept elsewhere, e.g. offloaded to the CPU)
                torch._foreach_copy_([out.narrow(0, o, n) for _, o, n in own_received],
                                     [parts[s].narrow(0, o, n) for s, o, n in own_sent])
            _unpack(recv, received, [out])
        true = storage.to_true(out)
        if dtype is not None and true.dtype != dtype:
            true = true.to(dtype)
        cache = BUFFERS.view_cache(out) if true is out else None
        if cache is not None and (cache.holds(("targets", bucket)) or cache.entries < KEPT_VIEW_SETS):
            views = cache.get(("targets", bucket), lambda b: _slot_views(b, bucket))
        else:
            views = _slot_views(true, bucket)
        results.append((bucket, views))
    return results


#: a recycled output buffer keeps the target views of at most this many bucket plans (selections)
KEPT_VIEW_SETS = 8


def _slot_views(buffer: torch.Tensor, bucket: BucketPlan) -> tuple[torch.Tensor, ...]:
    """Every target of ``bucket`` as a view of ``buffer`` (its ``out_numel`` elements), shaped like its slot."""
    return tuple(buffer.narrow(0, slot.start, slot.numel).view(slot.shape) for slot in bucket.params)


def _run_on(parts: Sequence[torch.Tensor], run: Piece | None, device: torch.device) -> torch.Tensor | None:
    """The view of ``parts`` that ``run`` names, where there is one on ``device`` (else ``None``)."""
    if run is None or parts[run[0]].device != device:
        return None
    slot, start, length = run
    return parts[slot].narrow(0, start, length)


def _scratch(what: str, bucket: BucketPlan, device: torch.device, numel: int | None = None) -> torch.Tensor:
    """A kept 1-D buffer used within one call (:meth:`~zero_dtensor.materialize.buffers.BufferPool.transient`):
    ``what`` is ``"send"`` (the packed pieces) or ``"recv"`` (``numel`` elements)."""
    n = sum(bucket.read.send_counts) if numel is None else numel
    return BUFFERS.transient(("redistribute " + what, bucket.dtype, device), n, bucket.dtype, device)


def _pack_into(buffer: torch.Tensor, sources: Sequence[torch.Tensor], pieces: Sequence[Piece],
               device: torch.device) -> torch.Tensor:
    """The pieces of ``sources`` back to back in ``buffer`` (on ``device``): one ``torch.cat(out=)``; where the
    sources are elsewhere (a CPU-offloaded partition for a GPU collective), one ``cat`` there, then one copy."""
    if pieces:
        views = [sources[s].narrow(0, o, n) for s, o, n in pieces]
        if views[0].device == device:
            torch.cat(views, out=buffer)
        else:  # gathered where the pieces are, then one copy across (copy_ crosses devices)
            buffer.copy_(torch.cat(views))
    return buffer


def write_targets(storage: FlatStorage, plan: Plan, values: Mapping[str, torch.Tensor], *,
           code: int | None = None) -> list[tuple[int, int]]:
    """Send every bucket's targets back into the partitions. ``values[name]``: this rank's flattened target (true
    units, any floating dtype); names absent on this rank must have an empty target here.

    ``code`` (a user function ran before this write; :func:`~zero_dtensor.comm.agreement.error_code` of its failure on
    this rank): every multi-rank bucket's exchange then carries one error code per peer after its data, every
    exchange completes before anything is written, and where any rank failed nothing is written: returns
    ``(global rank, code)`` of the failed ranks (this one included), in rank order. A failed rank sends zeros."""
    failed: dict[int, int] = {}
    received = []
    with torch.no_grad():
        for bucket in plan.buckets:
            device = _comm_device(storage, bucket)
            if code:
                send = torch.zeros(sum(bucket.write.send_counts), dtype=bucket.dtype, device=device)
            else:
                none = _empty(bucket.dtype, device)  # for targets this rank does not hold
                sources = [_flat_on(values.get(slot.name), none, device) for slot in bucket.params]
                send = _pack(sources, bucket.write.send_pieces, bucket.dtype, device)
                send = storage.to_stored(send)
                send = send if send.dtype == bucket.dtype else send.to(bucket.dtype)
            if code is None or bucket.world_size == 1:
                recv = _exchange(send, bucket.write, storage, bucket)
            else:
                recv, codes = _exchange_with_codes(send, bucket.write, storage, bucket, code)
                members = process_groups.group_ranks(storage.process_groups[bucket.groups[0]])
                failed.update({members[r]: c for r, c in enumerate(codes) if c})
            received.append((bucket, recv))
        if code:
            failed[my_rank(storage)] = code
        if failed:
            return sorted(failed.items())
        for bucket, recv in received:
            parts = [storage.partitions[g] for g in bucket.groups]
            _unpack(to_device(recv, parts[0].device), bucket.write.recv_pieces, parts)
    return []


_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared empty tensor (made once per dtype and device; nothing can be written into it)."""
    key = (dtype, device)
    t = _EMPTY.get(key)
    if t is None:
        t = _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return t


def _exchange_with_codes(send: torch.Tensor, transfer: Transfer, storage: FlatStorage, bucket: BucketPlan,
                         code: int) -> tuple[torch.Tensor, list[int]]:
    """The bucket's ``all_to_all_single`` with this rank's error ``code`` appended to what it sends each peer (also
    where no data crosses ranks): returns the received data, as :func:`_exchange` would, and every peer's code in
    group-rank order. One element more each way per peer; one copy of the data on each side."""
    send_counts = [n + 1 for n in transfer.send_counts]
    recv_counts = [n + 1 for n in transfer.recv_counts]
    framed = torch.full((sum(send_counts),), float(code), dtype=send.dtype, device=send.device)
    torch.split_with_sizes_copy(send, list(transfer.send_counts),
                                out=[c.narrow(0, 0, n) for c, n in zip(framed.split(send_counts),
                                                                        transfer.send_counts)])
    recv = torch.empty(sum(recv_counts), dtype=send.dtype, device=send.device)
    collectives.all_to_all_into(recv, framed, recv_counts, send_counts, storage.process_groups[bucket.groups[0]])
    chunks = recv.split(recv_counts)
    codes = [int(c) for c in torch.cat([c.narrow(0, n, 1) for c, n in zip(chunks, transfer.recv_counts)]).tolist()]
    return torch.cat([c.narrow(0, 0, n) for c, n in zip(chunks, transfer.recv_counts)]), codes


def _flat_on(value: torch.Tensor | None, none: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` flattened without autograd history (a view when contiguous), on ``device`` (a copy only there)."""
    if value is None:
        return none
    flat = value.detach().reshape(-1)
    return flat if flat.device == device else to_device(flat, device)


def my_rank(storage: FlatStorage) -> int:
    """This process's global rank (from the first group's process group and group rank). No communication."""
    return process_groups.group_ranks(storage.process_groups[0])[storage.layout.groups[0].rank]
