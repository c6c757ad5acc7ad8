"""Executing a plan: pack, one ``all_to_all_single`` per bucket (with error codes where a user function ran
before the write), unpack; a fixed number of tensor operations whatever the number of parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .. import collectives
from ..storage import FlatStorage
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


def read_targets(storage: FlatStorage, plan: Plan, dtype: torch.dtype | None) -> list[tuple[BucketPlan, torch.Tensor]]:
    """Per bucket, the output buffer (true units, ``dtype``): every target of this rank back to back."""
    results = []
    for bucket in plan.buckets:
        parts = [storage.partitions[g] for g in bucket.groups]
        send = _pack(parts, bucket.read.send_pieces, bucket.dtype, parts[0].device).to(_comm_device(storage, bucket))
        recv = _exchange(send, bucket.read, storage, bucket)  # a new tensor either way: never DeepSpeed's memory
        if bucket.read.recv_in_order and recv.numel() == bucket.out_numel:
            out = recv
        else:
            out = torch.empty(bucket.out_numel, dtype=recv.dtype, device=recv.device)
            _unpack(recv, bucket.read.recv_pieces, [out])
        out = storage.to_true(out)
        results.append((bucket, out if dtype is None or out.dtype == dtype else out.to(dtype)))
    return results


def write_targets(storage: FlatStorage, plan: Plan, values: Mapping[str, torch.Tensor], *,
           code: int | None = None) -> list[tuple[int, int]]:
    """Send every bucket's targets back into the partitions. ``values[name]``: this rank's flattened target (true
    units, any floating dtype); names absent on this rank must have an empty target here.

    ``code`` (a user function ran before this write; :func:`~zero_dtensor.agreement.error_code` of its failure on
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
                members = collectives.group_ranks(storage.process_groups[bucket.groups[0]])
                failed.update({members[r]: c for r, c in enumerate(codes) if c})
            received.append((bucket, recv))
        if code:
            failed[my_rank(storage)] = code
        if failed:
            return sorted(failed.items())
        for bucket, recv in received:
            parts = [storage.partitions[g] for g in bucket.groups]
            _unpack(recv.to(parts[0].device), bucket.write.recv_pieces, parts)
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
    return flat if flat.device == device else flat.to(device)


def my_rank(storage: FlatStorage) -> int:
    """This process's global rank (from the first group's process group and group rank). No communication."""
    return collectives.group_ranks(storage.process_groups[0])[storage.layout.groups[0].rank]
