"""``ShardedGrads``: a live, sharded view of every reduced gradient of a DeepSpeed ZeRO engine (the gradient front).

Everything it offers is the generic front of :mod:`zero_dtensor.families.tensors` (:class:`~zero_dtensor.families.tensors.
ShardedTensors`: views, materialization, writes; :mod:`~zero_dtensor.families.tensor_math`: transforms;
:mod:`~zero_dtensor.families.tensor_reductions`: reductions; :mod:`~zero_dtensor.families.tensor_owners`: DTensors
and owners), with the gradient's semantics: valid from
``engine.backward()`` at an accumulation boundary until ``engine.step()`` (then
:class:`~zero_dtensor.errors.StaleGradientsError`), fp16 loss scaling, frozen parameters absent. The fp32 master
weights and the optimizer state are the same front over other families (:mod:`zero_dtensor.families.master`).
"""

from __future__ import annotations

from ..errors import StaleGradientsError
from ..core.state import STALE
from .tensors import ParamView, ShardedTensors

__all__ = ["ParamGrad", "ShardedGrads"]


class ParamGrad(ParamView):
    """The gradient of one parameter: its local fragment on this rank and, on request, the full tensor.

    For ZeRO-1/2 the fragments are ragged (a parameter straddles ranks at arbitrary offsets), so a parameter is *not*
    a DTensor; for ZeRO-3 (``torch.chunk`` pieces) and replicated groups :meth:`as_dtensor` gives an exact one. See
    :class:`~zero_dtensor.families.tensors.ParamView` for every method (``to_local()`` is a live view of the gradient memory;
    under fp16 loss scaling it holds ``true gradient × grads.loss_scale``).
    """

    __slots__ = ()


class ShardedGrads(ShardedTensors):
    """Every trainable parameter's reduced gradient, sharded as DeepSpeed stores it. A mapping ``name -> ParamGrad``.

    Valid from ``engine.backward()`` at an accumulation boundary until ``engine.step()``; afterwards every call raises
    :class:`~zero_dtensor.errors.StaleGradientsError`. Views and group DTensors alias DeepSpeed's storage: in-place
    changes are what ``engine.step()`` uses. Frozen parameters (``requires_grad=False``) are absent; a tied
    parameter appears once, under its first name in ``named_parameters()``.

    Transforms (``mul_`` … ``add_noise_``) work on the local shards with **no communication**; reductions
    (``norms``, ``global_norm``, ``dots``, ``clip_*``) issue **one all_reduce of a (k,) vector per process group**
    (``stats`` at most two), after the rank agreement. Every operation takes ``params=``: ``None`` (all trainable
    parameters), a collection of names, or a predicate ``name -> bool``; unknown names raise ``KeyError`` before
    anything is written. Operands and results are in true (unscaled) units under fp16 loss scaling. Each call runs a
    fixed number of tensor operations whatever the number of parameters (see :mod:`zero_dtensor.layout.plan`). The
    other operand of ``add_``/``lerp_``/``copy_``/``dots`` may be any family with the same geometry (a clone, the
    fp32 masters, an optimizer-state key; not ``BF16_Optimizer``'s sharded masters against its replicated gradient).
    """

    _VIEW = ParamGrad

    def _stale_error(self) -> Exception:
        return StaleGradientsError(STALE)
