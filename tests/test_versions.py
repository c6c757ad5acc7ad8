"""Issue 3: unsupported DeepSpeed versions, optimizer classes and configurations are refused by name."""

from __future__ import annotations

import pytest

import zero_dtensor as zd
from zero_dtensor._deepspeed import check_deepspeed_version
from workers import bad_input


@pytest.mark.parametrize("version", ["0.18.8", "0.17.0", "0.20.0", "1.0.0"])
def test_version_outside_range_is_refused(version: str) -> None:
    with pytest.raises(zd.UnsupportedDeepSpeedError, match=r"0\.18\.9.*0\.19\.x") as info:
        check_deepspeed_version(version)
    assert version in str(info.value)


@pytest.mark.parametrize("version", ["0.18.9", "0.19.0", "0.19.8", "0.19.8+cpu", "0.19.12"])
def test_known_versions_are_accepted(version: str) -> None:
    check_deepspeed_version(version)


def test_monkeypatched_version_refused_on_a_live_engine(ranks) -> None:
    ranks(2).run(bad_input.unsupported_version, "0.21.0")


def test_non_zero_optimizer_is_refused(ranks) -> None:
    message = ranks(2).run(bad_input.unsupported_stage0)[0]
    assert "stage" in message


def test_zero3_with_several_partition_groups_is_refused(ranks) -> None:
    """MoE-like ZeRO-3 (parameters over different process groups): refused, naming what is supported."""
    message = ranks(2).run(bad_input.unsupported_zero3_multi_group)[0]
    assert "single data-parallel partition group" in message
