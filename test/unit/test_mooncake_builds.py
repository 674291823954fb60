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


def test_a_missing_system_library_names_its_debian_package() -> None:
    from sglang_oasis.disaggregation.mooncake_builds import MissingSystemLibrary, check_system_libraries

    with pytest.raises(
        MissingSystemLibrary, match=r"needs libibverbs\.so\.1.*apt-get install -y libibverbs1"
    ):
        check_system_libraries(lambda soname: False)
    check_system_libraries(lambda soname: True)
    check_system_libraries()  # this machine: the bootstrap installed it


@pytest.mark.parametrize("launcher", ["sglang_oasis.launch_pd", "sglang_oasis.launch_server"])
def test_launchers_name_the_missing_library(launcher: str, tmp_path) -> None:
    """Both launchers stop before SGLang starts, naming the library (LD_LIBRARY_PATH cannot hide an
    installed one, so the check is made to fail by a sitecustomize that reports it missing)."""
    import subprocess
    import sys

    from sglang_oasis.server_process import child_env

    (tmp_path / "sitecustomize.py").write_text(
        "import sglang_oasis.disaggregation.mooncake_builds as m\nm._loadable = lambda soname: False\n"
    )
    args = ["--disaggregation-mode", "prefill"] if launcher.endswith("server") else []
    env = child_env({"PYTHONPATH": str(tmp_path)})
    result = subprocess.run(
        [sys.executable, "-m", launcher, *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode != 0
    assert "apt-get install -y libibverbs1" in result.stderr, result.stderr[-2000:]
