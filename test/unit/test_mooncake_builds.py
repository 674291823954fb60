"""Exactly one of the two Mooncake builds may be installed."""

from __future__ import annotations

import pytest

from sglang_oasis.disaggregation.mooncake_builds import (
    CPU_BUILD,
    CUDA_BUILD,
    ConflictingMooncakeBuilds,
    check_single_mooncake_build,
)


def fake(installed: dict[str, str]):
    return lambda name: installed.get(name)


def test_both_builds_fail_with_a_message_naming_them() -> None:
    with pytest.raises(ConflictingMooncakeBuilds, match=f"{CPU_BUILD}==0.3.13.post1 and {CUDA_BUILD}"):
        check_single_mooncake_build(fake({CPU_BUILD: "0.3.13.post1", CUDA_BUILD: "0.3.13.post1"}))


@pytest.mark.parametrize(
    ("installed", "expected"),
    [({CPU_BUILD: "1"}, CPU_BUILD), ({CUDA_BUILD: "1"}, CUDA_BUILD), ({}, None)],
)
def test_one_or_no_build_is_fine(installed: dict[str, str], expected: str | None) -> None:
    assert check_single_mooncake_build(fake(installed)) == expected


def test_this_environment_has_the_cpu_build_only() -> None:
    import sglang_oasis.disaggregation  # noqa: F401 - importing runs the check

    assert check_single_mooncake_build() == CPU_BUILD
