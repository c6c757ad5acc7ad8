"""Tools beside the calls: the exact bytes of a redistribution, and Muon's Newton–Schulz iteration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.state import state_of
from ..core.storage import FlatStorage
from .assignment import owners
from .plan import OWNERS, ROWS, plan_for


def traffic(grads: Any, names: Sequence[str] | None = None, *, target: str = ROWS,
            assignment: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes this rank sends to / receives from other ranks for a read and a write of ``target`` (``"rows"`` or
    ``"owners"``, with ``assignment`` or the balanced one), from the plan (exact, stored dtype). ``grads``: a ``ShardedGrads`` or its storage. No
    communication."""
    storage: FlatStorage = grads if isinstance(grads, FlatStorage) else state_of(grads).storage
    layout = storage.layout
    selected = list(layout.params) if names is None else [layout.by_name[n] for n in names]
    plan = plan_for(storage, selected, target, owners(storage, selected, assignment) if target == OWNERS else None)
    out = {"read_sent": 0, "read_received": 0, "write_sent": 0, "write_received": 0}
    for bucket in plan.buckets:
        size = torch.empty(0, dtype=bucket.dtype).element_size()
        out["read_sent"] += size * bucket.read.sent_elements
        out["read_received"] += size * bucket.read.received_elements
        out["write_sent"] += size * bucket.write.sent_elements
        out["write_received"] += size * bucket.write.received_elements
    return out


def newton_schulz(grad: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's quintic Newton–Schulz iteration: an approximately orthogonal matrix with ``grad``'s row/column spaces
    (``U Vᵀ`` of its SVD, singular values pushed into about [0.7, 1.2]). 2-D input; computed in float32, returned
    in ``grad``'s dtype. Local (no communication)."""
    if grad.ndim != 2:
        raise ValueError(f"newton_schulz takes a matrix, got shape {tuple(grad.shape)}")
    a, b, c = 3.4445, -4.7750, 2.0315
    x = grad.to(torch.float32)
    x = x / (x.norm() + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(grad.dtype)
