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

from ..comm.agreement import agree
from ..comm.signature import collective
from ..comm.collectives import all_reduce_op
from ..layout.devices import to_comm
from .reductions import communicating_groups
from ..core.state import state_of

__all__ = ["found_inf"]


def _not_finite(part: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``part``'s device: whether some element is inf or nan. One read (``aminmax`` propagates nan;
    an infinity is the max or the min), no temporary of the partition's size (``isfinite(part)`` would make an
    N-byte mask)."""
    if not part.numel():
        return torch.zeros((), dtype=torch.bool, device=part.device)
    lo, hi = torch.aminmax(part)
    return torch.stack([lo, hi]).isfinite().all().logical_not()


@collective
def found_inf(grads: Any) -> bool:
    """Whether any element of any gradient, on any rank, is inf or nan (an fp16 overflow check).

    Args:
        grads: a ``ShardedGrads`` (or another family).

    Returns:
        bool: the same answer on every rank.

    Raises:
        TypeError: not a zero_dtensor family.
        StaleTensorsError: the values are no longer DeepSpeed's.

    Communication:
        The agreement, then one ``all_reduce`` (max) of one float per process group; none when every group is
        replicated.

    Device and memory:
        One read of the local data (``aminmax``); one host sync (the answer).

    Example:
        ```python
        if zd.found_inf(zd.sharded_grads(engine)):
            print("overflow: DeepSpeed will skip this step")
        ```
    """
    state = state_of(grads)
    state.check_current()
    storage = state.storage
    device = storage.device
    pgs = communicating_groups(state)
    agree("found_inf", (), pgs, device)
    flags = to_comm(torch.stack([_not_finite(p) for p in storage.partitions]), storage.devices)
    if not pgs:
        return bool(flags.any())
    flag = flags.any().to(torch.float32).reshape(1)
    for pg in pgs:  # one per distinct process group (DeepSpeed models normally have one)
        all_reduce_op(flag, pg, dist.ReduceOp.MAX)
    return bool(flag.item() > 0)
