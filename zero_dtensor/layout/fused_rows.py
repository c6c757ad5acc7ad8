"""The optional fused row pass of :mod:`zero_dtensor.layout.segments` (issue 42): ``stats`` and ``dots`` reading
each buffer's rows once, through functions ``torch.compile`` builds (no hand-written kernel).

The eager recipe reads a buffer's full rows once per quantity: ``joint_stats`` three times (``vector_norm``,
``sum``, ``vector_norm(inf)``, plus a ``topk`` of the non-finite rows to count nan and inf), ``joint_dots`` through
float32 copies of row chunks. Here one function per quantity set is compiled over the (R, W) row view:

- :func:`row_moments`: per row the sum of squares, the sum, the max ``|x|`` (nan where the row holds one), the nan
  count and the inf count, accumulated in float32 (float64 for float64 rows). Inductor fuses reductions of one
  input over one dimension into one kernel: the rows are read once, and the counts are exact;
- :func:`row_dots`: per row ``sum x·y`` with exact products (float32 for bf16/fp16, float64 if either is float64),
  both operands read once, no float32 copy.

Everything above the rows (the bits gathered by :mod:`.segments`, the float64 ``segment_reduce`` over a
:class:`~.segment_plan.JointPlan`) keeps the eager precision model: float32 within a row, float64 across.

**When it runs** (:func:`applies`): only where :func:`zero_dtensor.settings.set_fused_reductions` (or
``ZERO_DTENSOR_FUSED_REDUCTIONS``) turned it on, for rows on an accelerator (offloaded CPU buffers keep the CPU
recipe), and never while the caller is itself compiling (``torch.compiler.is_compiling()``), while a CUDA graph is
captured, or under an active ``TorchDispatchMode`` (the tests' op counters and device tags included): then the
eager path runs. On CUDA it needs Triton (``RuntimeError`` saying to install it, before anything is read). One
compile per (dtype, device, W, which inputs start 16-byte aligned): the row count is dynamic (a single row runs the
same function uncompiled, so no graph is built for R = 1); the first call of each compiles for seconds. No
communication; results live on the rows' device; temporaries are per row ((R, 5) float32, then (5, R) float64) and
per bit, never the size of the data.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from .. import settings
from .segment_plan import acc_dtype

__all__ = ["ALIGN", "MOMENTS", "applies", "row_dots", "row_moments"]

#: the columns of :func:`row_moments`, in order
MOMENTS = ("sum of squares", "sum", "max |x|", "nan count", "inf count")
#: inputs starting at an address aligned to this many bytes and those that do not get compiled functions of their
#: own (:func:`_compiled`)
ALIGN = 16
#: tests only: let :func:`applies` take CPU rows too (Inductor's C++ backend compiles them)
_FORCE_CPU = False


def _moments(rows: torch.Tensor) -> torch.Tensor:
    """(R, 5) of :data:`MOMENTS`; traced by ``torch.compile`` (one fused reduction), or run as is for one row."""
    acc = acc_dtype(rows.dtype)
    x = rows.to(acc)
    return torch.stack([(x * x).sum(1), x.sum(1), x.abs().amax(1), torch.isnan(rows).sum(1, dtype=acc),
                        torch.isinf(rows).sum(1, dtype=acc)], dim=1)


def _dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(R,) per row ``sum x·y`` in the accumulation dtype (exact products for bf16/fp16)."""
    acc = acc_dtype(x.dtype, y.dtype)
    return (x.to(acc) * y.to(acc)).sum(1)


#: the compiled functions, per (function, which inputs start :data:`ALIGN`-byte aligned)
_COMPILED: dict[tuple[Callable[..., torch.Tensor], tuple[bool, ...]], Callable[..., torch.Tensor]] = {}


def _compiled(fn: Callable[..., torch.Tensor], aligned: tuple[bool, ...]) -> Callable[..., torch.Tensor]:
    """``fn`` compiled, lazily, once per process and alignment pattern (Dynamo then keeps one graph per dtype,
    device and row width). Inductor builds GPU kernels assuming an input is aligned when its first example was,
    without a guard, and copies a misaligned input whole before such a kernel: so each pattern of aligned inputs
    (a partition often starts at an element offset that is not) gets a code object of its own, first traced with
    that pattern."""
    key = (fn, aligned)
    if key not in _COMPILED:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{''.join('a' if a else 'u' for a in aligned)}")
        _COMPILED[key] = torch.compile(types.FunctionType(code, fn.__globals__, code.co_name), fullgraph=True)
    return _COMPILED[key]


def _run(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
    """``fn(*rows)`` through its compiled form, the row count dynamic and the width static (one graph for every
    R), under ``no_grad`` (masters may require grad; grad mode is part of Dynamo's guards). One row: ``fn`` itself
    (a 1-row graph would be a specialization of its own)."""
    if rows[0].shape[0] < 2:
        with torch.no_grad():
            return fn(*rows)
    for r in rows:
        torch._dynamo.maybe_mark_dynamic(r, 0)
        torch._dynamo.mark_static(r, 1)
    with torch.no_grad():
        return _compiled(fn, tuple(r.data_ptr() % ALIGN == 0 for r in rows))(*rows)


def row_moments(rows: torch.Tensor) -> torch.Tensor:
    """(R, 5) float32 (float64 for float64 rows) on ``rows.device``: :data:`MOMENTS` of each row of a (R, W) view,
    in one fused reduction (one read). The counts are exact (at most W per row); the max propagates nan."""
    return _run(_moments, rows)


def row_dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(R,) float32 (float64 if either is float64) on ``x.device``: per row ``sum x·y`` of two (R, W) views, exact
    products, one fused reduction reading each once."""
    return _run(_dots, x, y)


def applies(rows: Sequence[torch.Tensor]) -> bool:
    """Whether ``rows`` (every buffer's row view, one device) take the fused path: the setting is on, the rows are
    on an accelerator (or CPU rows under the tests' ``_FORCE_CPU``), and no compile, CUDA graph capture or
    ``TorchDispatchMode`` is active. ``RuntimeError`` (install Triton) for CUDA rows where Triton is missing. Host
    checks only: no device work, no sync."""
    if not rows or not settings.fused_reductions():
        return False
    kind = rows[0].device.type
    if kind == "meta" or (kind == "cpu" and not _FORCE_CPU):
        return False
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return False
    if kind == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return False
        settings.check_fused_available()
    return True
