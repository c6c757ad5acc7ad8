"""The floors of the benchmark: the bare primitives that move a bulk gather's bytes, the cheapest of them chosen in
the same run, and the timing of a row beside its floors.

A full read must move every rank's partitions to every rank, ``(N-1)/N·S`` bytes per rank whatever the primitive.
The bare candidates, on copies of the same padded flat partitions into preallocated buffers:

- ``all_gather``: one ``all_gather_into_tensor`` (coalesced over the flat groups), what ``strategy="all_gather"``
  issues;
- ``all_to_all``: one ``all_to_all_single`` per flat group (:func:`~zero_dtensor.comm.collectives.all_gather_by_all_to_all`;
  with more than 2 ranks its input is the partition repeated, a copy of ``S``);
- ``send_recv``: one batch of ``isend`` / ``irecv`` (:func:`~zero_dtensor.comm.point_to_point.send_recv`), every peer's
  partition received in place.

:func:`cheapest` times them round-robin (``repeat`` rounds, each call starting at a barrier, the slowest rank's
time) and names the one of least median. :func:`beside` then times a row's repetitions each right after one of
every floor's, so that a row's ratio is to floors measured within a second of it (a floor measured once moved
15.8-39 ms between quiet runs of the same machine).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CANDIDATES", "bare_gathers", "beside", "cheapest"]

#: the bare primitives :func:`bare_gathers` builds, in table order
CANDIDATES = ("all_gather", "all_to_all", "send_recv")


def bare_gathers(parts: Sequence[Any], numels: Sequence[int], pg: Any) -> dict[str, Callable[[], Any]]:
    """``{candidate: call}`` gathering copies of ``parts`` (this rank's partition of each sharded flat group, whose
    full sizes are ``numels``) into preallocated buffers by each of :data:`CANDIDATES`. Memory: the copies and the
    outputs, about ``S`` and ``S/N`` per rank."""
    import torch

    from ..comm.collectives import all_gather_by_all_to_all, all_gather_into
    from ..comm.point_to_point import gather_exchanges, send_recv
    from ..comm.process_groups import rank_in

    ins = [p.clone() for p in parts]  # copies: holding the partitions would keep the adapter's buffers busy
    outs = [torch.empty(n, dtype=p.dtype, device=p.device) for p, n in zip(parts, numels)]
    sends: list[Any] = []
    recvs: list[Any] = []
    owns: list[tuple[Any, Any]] = []
    for out, part in zip(outs, ins):
        s, r = gather_exchanges(out, part, pg)
        sends += s
        recvs += r
        owns.append((out.narrow(0, rank_in(pg) * part.numel(), part.numel()), part))

    def by_all_to_all() -> None:
        for out, part in zip(outs, ins):
            all_gather_by_all_to_all(out, part, pg)

    def by_send_recv() -> None:
        works = send_recv(sends, recvs, pg, async_op=True)
        for own, part in owns:
            own.copy_(part)
        for work in works:
            work.wait()

    return {"all_gather": lambda: all_gather_into(outs, ins, pg), "all_to_all": by_all_to_all,
            "send_recv": by_send_recv}


def cheapest(candidates: dict[str, Callable[[], Any]], timed: Callable[[Callable[[], Any]], float],
             slowest: Callable[[list[float]], list[float]], repeat: int) -> tuple[str, dict[str, float]]:
    """The candidate of least median time over ``repeat`` round-robin rounds (after one untimed round), and every
    candidate's median (seconds). ``timed(fn)``: one timed call on this rank; ``slowest(times)``: the slowest
    rank's time per entry (one collective). Ties go to the first in ``candidates``."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(max(1, repeat)):
        for name, fn in candidates.items():
            times[name].append(timed(fn))
    names = list(candidates)
    flat = slowest([t for name in names for t in times[name]])
    per = len(times[names[0]])
    medians = {name: statistics.median(flat[i * per:(i + 1) * per]) for i, name in enumerate(names)}
    return min(names, key=lambda name: (medians[name], names.index(name))), medians


def beside(fn: Callable[[], Any], floors: dict[str, Callable[[], Any]], timed: Callable[[Callable[[], Any]], float],
           repeat: int, before: Callable[[], Any] | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """``repeat`` timed calls of ``fn`` (each after ``before()``, untimed, where given), each beside one timed call
    of every floor: the floors first in even rounds, ``fn`` first in odd ones, so that neither side always follows
    the other (a call right after another that touched the same memory or left the backend busy is not the same
    call). This rank's ``(times, {floor: times})``."""
    times: list[float] = []
    floor_times: dict[str, list[float]] = {name: [] for name in floors}

    def floors_once() -> None:
        for name, floor in floors.items():
            floor_times[name].append(timed(floor))

    for round_ in range(repeat):
        if round_ % 2 == 0:
            floors_once()
        if before is not None:
            before()
        times.append(timed(fn))
        if round_ % 2 == 1:
            floors_once()
    return times, floor_times
