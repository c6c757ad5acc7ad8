"""The DeepSpeed versions and optimizer classes zero_dtensor knows (the only version check)."""

from __future__ import annotations

import functools

from packaging.version import Version

from ..errors import UnsupportedDeepSpeedError

__all__ = ["MAX_DEEPSPEED_EXCLUSIVE", "MIN_DEEPSPEED", "SUPPORTED_OPTIMIZERS", "check_deepspeed_version"]

MIN_DEEPSPEED = Version("0.18.9")
MAX_DEEPSPEED_EXCLUSIVE = Version("0.20.0")
SUPPORTED_OPTIMIZERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer")


def check_deepspeed_version(version: str | None = None) -> Version:
    """Raise :class:`UnsupportedDeepSpeedError` unless ``version`` (default: the installed one) is known."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    parsed = _parsed(version)
    if not _known(parsed):
        raise UnsupportedDeepSpeedError(
            f"zero_dtensor reads DeepSpeed's private ZeRO state and knows DeepSpeed >= {MIN_DEEPSPEED}, "
            f"< {MAX_DEEPSPEED_EXCLUSIVE} (0.18.9 and 0.19.x); found {version}. "
            f"Install a known version, e.g. `pip install 'deepspeed>={MIN_DEEPSPEED},<{MAX_DEEPSPEED_EXCLUSIVE}'`."
        )
    return parsed


@functools.lru_cache(maxsize=8)
def _parsed(version: str) -> Version:
    """``version`` without its local part, parsed once per string (``Version``'s parse costs a regular expression
    search, and every ``sharded_*`` call checks the installed version)."""
    return Version(version.split("+")[0])


@functools.lru_cache(maxsize=8)
def _known(parsed: Version) -> bool:
    """Whether ``parsed`` is in the known range (two ``Version`` comparisons, made once per version)."""
    return MIN_DEEPSPEED <= parsed < MAX_DEEPSPEED_EXCLUSIVE
