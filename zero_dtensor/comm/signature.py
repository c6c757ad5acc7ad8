"""The signature of a collective call, by construction: every argument the caller passed, as the call binds it.

Every public call of zero_dtensor that communicates is marked :func:`collective`. The mark records the call's
arguments while it runs (no work, no copy: a reference), and the rank agreement
(:func:`zero_dtensor.comm.agreement.agree`) hashes them: ``inspect.signature(fn).bind(*args, **kwargs)``, with the
defaults applied, each argument encoded by :func:`encode`. So an argument is agreed the day it is added, and
none can be forgotten: the only way out is :data:`NOT_BY_VALUE`, one table naming each argument that is left out
(or agreed in another form than its value) with the reason. Calls nest: ``get_full_model_grads`` calls
``full_tensors``, and an agreement hashes every marked call it runs inside, outermost first.

The encoding (:func:`encode`) is the same text on every rank for the same request, and differs wherever the call
would do something else:

- ``None``, booleans, integers (NumPy's too), strings: their ``repr``; a float: ``repr(float(x))``, which round-trips,
  so two floats that differ in their last bit differ (``-0.0`` and ``0.0`` too; every NaN is ``nan``);
- ``torch.dtype``: its name; ``torch.device``: its type only (each rank has its own accelerator index);
- a tensor: its type, shape, dtype and device type, never its values (those differ between ranks by design, or are
  checked by the call itself); a ``DTensor``: its global shape, dtype and placements; a family (gradients, masters,
  an optimizer-state key, a clone) or one parameter's view: which tensors it is (``__zero_dtensor_agreement__``);
- lists and tuples in their order; mappings by key (sorted: their order changes no result); a mapping of plain
  tensors (10,000 values) by its keys and the sets of its values' dtypes and device kinds (CUDA, CPU, other; a
  value's shape is checked against the parameter on every rank; a few C-level passes instead of one ``repr`` per
  value);
- a function (a ``names=`` predicate): a marker; what it selects is resolved by the call and agreed by it;
- anything else: its type's name.

No communication here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import numbers
import operator
import os
from collections.abc import Callable, Iterator, Mapping
from itertools import repeat
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

__all__ = ["COLLECTIVE_CALLS", "NOT_BY_VALUE", "collective", "current_calls", "encode", "internal_call"]

F = TypeVar("F", bound=Callable[..., Any])


def _type_name(value: Any) -> str:
    return type(value).__name__


def _numbers_of(value: Any) -> str:
    if not isinstance(value, Mapping):
        return encode(value)
    return encode({k: v for k, v in value.items() if not isinstance(v, torch.Tensor)})


def _normalized_path(value: Any) -> str:
    return repr(os.path.abspath(os.fspath(value))) if isinstance(value, (str, os.PathLike)) else encode(value)


#: The one table of arguments that the agreement does not compare by value: ``(call, argument)`` → ``(reason,
#: encoder)``; ``encoder`` ``None`` leaves the argument out, else the agreement compares ``encoder(value)``. ``call``
#: is a :data:`COLLECTIVE_CALLS` key, ``"*"`` any call. Every other argument of every :func:`collective` call is
#: agreed by value (:func:`encode`).
NOT_BY_VALUE: dict[tuple[str, str], tuple[str, Callable[[Any], str] | None]] = {
    ("*", "engine"): (
        "an engine object cannot be compared between processes; what the call reads of it (the family, its layout "
        "and process groups) is agreed through the family's fingerprint and the selection", None),
    ("TensorOwners.map_full_", "fn"): (
        "a function cannot be compared between processes; its outcome (an exception or a bad result on any rank) is "
        "agreed afterwards, carried by the write exchange", None),
    ("TensorOwners.set_owned_", "mapping"): (
        "each rank passes its own entries by design; which rank passed which parameter is agreed by value (the "
        "agreement's payload), and every entry is checked on its rank, any refusal raising on every rank", None),
    ("save", "client_state"): (
        "saved as rank 0 passes it (documented): any picklable object, not compared", None),
    ("set_state_dict", "model_state_dict"): (
        "each rank's own pieces (a rank holding nothing of a parameter has no entry for it), each checked against "
        "the engine on its rank, any failure raising on every rank", None),
    ("set_state_dict", "optim_state_dict"): (
        "agreed as its entries that are not tensors (the hyperparameters, exactly); its tensors are each rank's own "
        "pieces, checked as model_state_dict's", _numbers_of),
    ("ShardedTensors.full_tensors", "out"): (
        "agreed as its type only: a per-rank buffer (with dst= only the destination's holds entries); each entry is "
        "checked on its rank and any refusal raises on every rank", _type_name),
    ("save", "path"): ("agreed as the normalized path (os.path.abspath): the same directory, however written",
                       _normalized_path),
    ("load", "path"): ("agreed as the normalized path (os.path.abspath): the same directory, however written",
                       _normalized_path),
}

#: every :func:`collective` call: ``qualified name → the marked function`` (a method: the class attribute); filled as
#: the modules are imported
COLLECTIVE_CALLS: dict[str, Callable[..., Any]] = {}


#: one running :func:`collective` call: its name, its Python signature and the arguments as passed (signature
#: ``None`` for an internal agreement, :func:`internal_call`); a plain tuple (a marked call costs one more)
_Frame = tuple[str, "inspect.Signature | None", tuple[Any, ...], Mapping[str, Any]]

_FRAMES: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar("zero_dtensor_calls", default=())


def collective(fn: F) -> F:
    """Mark ``fn`` (a public function or method) as a collective call: while it runs, every agreement hashes its
    bound arguments (module docstring). Registers it in :data:`COLLECTIVE_CALLS` under its ``__qualname__``. The
    wrapper keeps references to the arguments for the duration of the call, nothing else. No communication."""
    name = fn.__qualname__
    if name in COLLECTIVE_CALLS:
        raise RuntimeError(f"zero_dtensor: two collective calls named {name!r}")
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        token = _FRAMES.set((*_FRAMES.get(), (name, signature, args, kwargs)))
        try:
            return fn(*args, **kwargs)
        finally:
            _FRAMES.reset(token)

    call.__zero_dtensor_collective__ = name  # type: ignore[attr-defined]
    COLLECTIVE_CALLS[name] = call
    return call  # type: ignore[return-value]


@contextlib.contextmanager
def internal_call(name: str) -> Iterator[None]:
    """An agreement the library makes on its own (``engine.step``'s debug checkpoint, ``engine.save_checkpoint``'s
    sync): a frame without arguments, so that :func:`current_calls` knows it is not a forgotten mark."""
    token = _FRAMES.set((*_FRAMES.get(), (name, None, (), {})))
    try:
        yield
    finally:
        _FRAMES.reset(token)


def current_calls() -> str | None:
    """The running collective calls with their arguments encoded (outermost first), ``None`` outside any.
    No communication."""
    frames = _FRAMES.get()
    if not frames:
        return None
    return " > ".join(_describe(frame) for frame in frames)


def _describe(frame: _Frame) -> str:
    name, signature, args, kwargs = frame
    if signature is None:
        return name
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # the call itself raises for these arguments on this rank
        return f"{name}(<arguments refused: {len(args)} positional, {sorted(kwargs)}>)"
    bound.apply_defaults()
    parts = []
    for arg, value in bound.arguments.items():
        rule = NOT_BY_VALUE.get((name, arg)) or NOT_BY_VALUE.get(("*", arg))
        if rule is None:
            parts.append(f"{arg}={encode(value)}")
        elif rule[1] is not None:
            parts.append(f"{arg}={rule[1](value)}")
    return f"{name}({', '.join(parts)})"


_DTYPE = operator.attrgetter("dtype")
_IS_CUDA = operator.attrgetter("is_cuda")
_IS_CPU = operator.attrgetter("is_cpu")


def encode(value: Any) -> str:
    """``value`` as the agreement compares it (module docstring). No communication, no tensor operation."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, numbers.Integral):
        return repr(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))  # shortest round-trip repr: one differing bit is another text
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"device({value.type})"
    if isinstance(value, DTensor):
        return f"DTensor({tuple(value.shape)}, {value.dtype}, {tuple(map(str, value.placements))})"
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__}({tuple(value.shape)}, {value.dtype}, {value.device.type})"
    agreement = getattr(type(value), "__zero_dtensor_agreement__", None)
    if agreement is not None:
        return str(agreement(value))
    if isinstance(value, os.PathLike):
        return repr(os.fspath(value))
    if isinstance(value, Mapping):
        return _encode_mapping(value)
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(encode, value))}]"
    if isinstance(value, (set, frozenset)):
        return f"{{{', '.join(sorted(map(encode, value)))}}}"
    if callable(value):
        return "<function>"
    return f"<{type(value).__qualname__}>"


def _plain_tensor(kind: type) -> bool:
    return issubclass(kind, torch.Tensor) and not issubclass(kind, DTensor)


def _encode_mapping(value: Mapping[Any, Any]) -> str:
    keys = list(value)
    if all(map(isinstance, keys, repeat(str))):
        values = list(value.values())
        kinds = set(map(type, values))
        if values and all(map(_plain_tensor, kinds)):  # many tensors: their names, dtypes and device kinds
            dtypes = sorted(map(str, set(map(_DTYPE, values))))
            # (is_cuda, is_cpu) pairs: ``.device`` makes a device object per value, 30x the cost
            devices = sorted({"cuda" if cuda else "cpu" if cpu else "other"
                              for cuda, cpu in set(zip(map(_IS_CUDA, values), map(_IS_CPU, values)))})
            return (f"{type(value).__name__}(keys={sorted(keys)!r}, tensors of {sorted(k.__name__ for k in kinds)} "
                    f"{dtypes} on {devices})")
    items = sorted(f"{encode(k)}: {encode(v)}" for k, v in value.items())
    return f"{{{', '.join(items)}}}"
