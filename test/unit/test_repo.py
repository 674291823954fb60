"""Promises the repository makes about itself."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [cmd.strip() for cmd in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    commands = _readme_commands()
    assert "bash scripts/run_tests.sh" in commands
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash scripts/run_tests.sh" in ci_lines


def test_readme_lists_every_oasis_option() -> None:
    import dataclasses

    from sglang_oasis.config import OasisConfig

    readme = (ROOT / "README.md").read_text()
    for field in dataclasses.fields(OasisConfig):
        option = "--oasis-" + field.name.replace("_", "-")
        assert f"| `{option}` |" in readme, f"{option} missing from the README options table"


def test_dockerfile_copies_what_exists_and_installs_the_cuda_mooncake_extra() -> None:
    """The GPU image cannot be built here (no registry for its base image); keep it from rotting: every
    COPY source exists, it installs the `mooncake-cuda` extra that pyproject.toml declares, and the
    README shows how to build and run it."""
    import tomllib

    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (\S+(?: \S+)*) \S+$", dockerfile, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"docker/Dockerfile copies {path}, which does not exist"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "mooncake-cuda" in extras and '.[mooncake-cuda]"' in dockerfile
    assert "mooncake-cpu" not in dockerfile  # the two builds of `mooncake` must never meet
    readme = (ROOT / "README.md").read_text()
    assert "docker build -f docker/Dockerfile" in readme and "docker run --gpus all" in readme
