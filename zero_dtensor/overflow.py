"""fp16 overflow made visible: did this step's reduced gradient overflow (inf/nan)?

Under fp16 dynamic loss scaling DeepSpeed checks for overflow only inside ``engine.step()`` (and then skips the step,
lowers the scale and clears the gradients). Between ``backward()`` and ``step()`` the stored gradient may already
hold inf/nan: :meth:`ShardedGrads.full_tensors` returns them as they are (unscaling keeps inf/nan), and
:func:`found_inf` answers the question for the whole model in one small collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import debug as _debug

__all__ = ["found_inf"]


def found_inf(grads: Any) -> bool:
    """True if any element of any gradient (on any rank) is inf or nan. **Collective** (same answer on every rank).

    Communication: one ``all_reduce`` (max) of one float per distinct process group; none when every group is
    replicated (``BF16_Optimizer``: every rank holds the same full buffer). Padding is zero and never counts.
    """
    grads._check_current()
    _debug.check_grads_call(grads, "found_inf")
    storage = grads._storage
    flags: dict[int, tuple[Any, torch.Tensor]] = {}
    replicated_bad = False
    for group, part in zip(grads.layout.groups, storage.partitions):
        bad = not bool(torch.isfinite(part).all()) if part.numel() else False
        if group.replicated:
            replicated_bad |= bad
            continue
        pg = storage.process_groups[group.index]
        entry = flags.setdefault(id(pg), (pg, torch.zeros(1, dtype=torch.float32, device=storage.device)))
        if bad:
            entry[1].fill_(1.0)
    result = replicated_bad
    for pg, flag in flags.values():
        if replicated_bad:
            flag.fill_(1.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
        result |= bool(flag.item() > 0)
    return result
