"""Counter-based Gaussian noise: element ``j`` of parameter ``key`` depends only on ``(seed, key, j)``.

The value is computed, not drawn from a stateful generator: a 64-bit integer hash (splitmix64) of the element's
counter gives two uniforms, and Box–Muller turns them into one standard normal. So any slice of a parameter's
noise equals the same slice of the whole vector, whoever computes it, at every world size and ZeRO stage, and a
batch of fragments of many parameters is drawn with a fixed number of tensor operations (the counters of all of
them in one tensor). The integer part is exact on every device; the float part (``log``, ``cos``) follows the
device's math library, so CPU and CUDA agree to float32 rounding, not bit for bit. No communication.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["counter_normal", "normal_from_counters", "stream_key"]

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def stream_key(seed: int, key: str) -> int:
    """The 64-bit (signed) stream of ``(seed, key)``: a hash, so nearby seeds and names give unrelated streams."""
    digest = hashlib.blake2b(f"zero_dtensor-noise\0{int(seed)}\0{key}".encode(), digest_size=8).digest()
    return _signed(int.from_bytes(digest, "little"))


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    z = z + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def normal_from_counters(streams: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Standard normals (float32) for int64 ``streams`` (per element) and ``counters`` (element positions).

    A fixed number of elementwise operations, whatever the number of parameters the elements come from.
    """
    bits = _splitmix64(_splitmix64(streams ^ counters) + counters)
    u1 = (_shift_right(bits, 40).to(torch.float64) + 0.5) * (1.0 / (1 << 24))  # (0, 1): log is finite
    u2 = (_shift_right(bits, 16) & 0xFFFFFF).to(torch.float64) * (1.0 / (1 << 24))
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * torch.pi * u2)).to(torch.float32)


def counter_normal(
    seed: int,
    key: str,
    numel: int,
    start: int = 0,
    stop: int | None = None,
    *,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Elements ``[start, stop)`` of a standard-normal float32 vector of length ``numel`` identified by ``(seed, key)``.

    Any slice equals the same slice of the whole vector: the reference for ``add_noise_``, whose noise does not depend
    on the sharding (a splitmix64 counter per element, Box-Muller).

    Args:
        seed: an int.
        key: a string, e.g. the parameter name.
        numel: the length of the whole vector.
        start: the first element.
        stop: one past the last element (default ``numel``).
        device: where to compute it.

    Returns:
        torch.Tensor: ``stop - start`` float32 values.

    Raises:
        ValueError: a range outside ``[0, numel]``.

    Communication:
        None.

    Device and memory:
        The result on ``device``.

    Example:
        ```python
        noise = zd.counter_normal(seed=7, key="fc1.weight", numel=64 * 33)
        ```
    """
    stop = numel if stop is None else stop
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"counter_normal: bad range [{start}, {stop}) for numel {numel}")
    device = torch.device(device)
    counters = torch.arange(start, stop, dtype=torch.int64, device=device)
    streams = torch.full_like(counters, stream_key(seed, key))
    return normal_from_counters(streams, counters)
