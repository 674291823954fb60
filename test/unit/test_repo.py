"""Promises the repository makes about itself."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

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
    # the README's commands do all the set-up themselves (bootstrap.sh), so CI adds none of its own
    assert not any("apt-get" in line or "pip " in line for line in ci_lines)


def _options_doc_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_options_doc", ROOT / "scripts" / "gen_options_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_doc_is_generated_from_the_config_and_lists_every_option() -> None:
    import dataclasses

    from sglang_oasis.config import OasisConfig

    generator = _options_doc_generator()
    doc = (ROOT / "docs" / "options.md").read_text()
    assert doc == generator.render(), "docs/options.md is stale: run python scripts/gen_options_doc.py"
    assert generator.main(["--check"]) == 0
    for field in dataclasses.fields(OasisConfig):
        option = "--oasis-" + field.name.replace("_", "-")
        assert f"\n| `{option}` |" in doc, f"{option} missing from docs/options.md"


def test_readme_is_a_short_guide_whose_docs_links_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    lines = len(readme.splitlines())
    assert lines <= 200, f"README.md has {lines} lines; the rest belongs in docs/"
    links = set(re.findall(r"\bdocs/[\w./-]+?\.md\b", readme))
    assert "docs/options.md" in links
    for link in links:
        assert (ROOT / link).is_file(), f"README.md links {link}, which does not exist"


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


def test_bootstrap_names_the_debian_package_it_cannot_install(tmp_path: Path) -> None:
    """Not root and libibverbs.so.1 missing: the README's commands stop with the command to run (as
    root they install it; .ci/run relies on that)."""
    import os
    import subprocess

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, output in (("ldconfig", ""), ("id", "1000")):
        (fake_bin / name).write_text(f"#!/bin/sh\necho '{output}'\n")
        (fake_bin / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
        "SGLANG_OASIS_CACHE": str(tmp_path / "c"),
    }
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bootstrap.sh")], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 1
    assert "sudo apt-get install -y libibverbs1" in result.stderr
    assert result.stdout == ""  # no venv path: nothing was built
    assert not (tmp_path / "c").exists()


def test_the_runtime_package_never_imports_the_test_helpers() -> None:
    """``sglang_oasis_testing`` (tiny models, the in-process PD deployment, the staging peer) and
    ``sglang_oasis_training`` (the EAGLE-3 head in torch) are for tests, benchmarks and scripts (dev/);
    the runtime, ``launch_pd`` included, must run without them."""
    dev_import = re.compile(r"^\s*(from|import) sglang_oasis_(testing|training)\b", re.M)
    importers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "python" / "sglang_oasis").rglob("*.py")
        if dev_import.search(path.read_text())
    ]
    assert importers == []
    import subprocess
    import sys

    code = "import sys, sglang_oasis.launch_pd; print('sglang_oasis_testing' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_wheel_holds_the_runtime_only(tmp_path: Path) -> None:
    """``pip wheel .`` ships the runtime (with its model assets and start-up hook) and the kernels, and no
    test helper, broken variant or training code."""
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "source"  # a copy: setuptools builds in the source tree (build/, egg-info)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("python", "sgl-kernel-oasis"):
        shutil.copytree(ROOT / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("sglang_oasis-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"sglang_oasis", "sgl_kernel_oasis", "sglang_oasis_startup.pth"}
    assert not [name for name in names if re.search(r"testing|training|draft_head|headwise|broken", name)]
    assert any(name.endswith("model.safetensors") for name in names)  # the shipped EAGLE-3 head


def test_where_things_are_names_files_that_exist() -> None:
    """design.md's "Where things are" table: every mechanism row names files, each one exists (a bare file
    name: in the folder of a path before it in its row), and every runtime module is named (itself, or its
    folder)."""
    text = (ROOT / "docs/design.md").read_text()
    table = text.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| Mechanism")
    ]
    assert len(rows) >= 15
    named: set[Path] = set()
    for row in rows:
        names = re.findall(r"`([\w./-]+)`", row.split("|")[2])  # the Files column
        assert any("/" in name for name in names), row
        folder = None
        for name in names:
            if "/" in name:
                path = ROOT / name
                folder = path if name.endswith("/") else path.parent
            else:  # a bare file name
                assert folder is not None, f"{name} before any path in: {row}"
                path = folder / name
            assert path.exists(), f"{name} ({path.relative_to(ROOT)}) in: {row}"
            named.add(path)
    modules = [
        path for path in (ROOT / "python/sglang_oasis").rglob("*.py")
        if path.name != "__init__.py" and not any(parent in named for parent in path.parents)
    ]  # fmt: skip
    unnamed = sorted(str(path.relative_to(ROOT)) for path in modules if path not in named)
    assert unnamed == [], "modules design.md's table does not name"


# A piece of shared state -> how a write to it reads in the source, and the one runtime file that writes it
# (everyone else calls the owner's methods: KVIntake.mark/restart, Selector.prompts_extended,
# BlockSummaryStore.update/recycle; docs/design.md's "Who writes what").
STATE_WRITERS = {
    "summarised": (r"summarised\[[^\]]*\]\s*=(?!=)", "attention/kv_intake.py"),
    "prompt_len": (r"prompt_len(\[[^\]]*\]\s*=(?!=)|\.update\(|\.pop\(|\.clear\()", "attention/selector.py"),
    "summary epochs": (r"\bepoch\[[^\]]*\]\s*[-+]?=(?!=)", "memory/summary_store.py"),
}


def test_each_piece_of_shared_state_has_one_writer() -> None:
    package = ROOT / "python/sglang_oasis"
    sources = {str(path.relative_to(package)): path.read_text() for path in package.rglob("*.py")}
    for state, (pattern, owner) in STATE_WRITERS.items():
        writers = sorted(name for name, text in sources.items() if re.search(pattern, text))
        assert writers == [owner], f"{state} is written in {writers}"
    design = (ROOT / "docs/design.md").read_text()
    assert all(
        f"`{owner.split('/')[-1]}`" in design.split("## Who writes what", 1)[1]
        for _, owner in STATE_WRITERS.values()
    )


# Parts get what they listen to when they are built, or through a method of their own that says why it
# comes later (``Selector.fold_first``: SGLang makes CUDA graphs after the backend): no runtime file
# assigns a field of another part (``self.selector.x = ...``, ``selector.prefetcher.y = ...``).
WIRED_PARTS = (
    r"\b(selector|prefetcher|summaries|tier|working_sets|pipeline|intake|recall|stats)\.\w+\s*=(?!=)"
)


def test_no_part_is_wired_after_it_is_built() -> None:
    package = ROOT / "python/sglang_oasis"
    wired = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in package.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(WIRED_PARTS, line.split("#", 1)[0])
    ]
    assert wired == []


# Sized by responsibility: a runtime file over ~450 lines, a class over ~250 or a function over ~60 has
# more than one job. What is over is named here at its size, as debt: it may shrink, never grow.
CAPS = {"file": 450, "class": 250, "function": 60}
OVER_CAP: dict[str, int] = {}  # none left (issue 57 emptied it)


def test_no_file_class_or_function_outgrows_its_job() -> None:
    import ast

    package = ROOT / "python/sglang_oasis"
    sizes: dict[str, tuple[str, int]] = {}
    for path in package.rglob("*.py"):
        name, text = str(path.relative_to(package)), path.read_text()
        sizes[name] = ("file", len(text.splitlines()))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                assert node.end_lineno is not None
                sizes[f"{name}:{node.name}"] = (kind, node.end_lineno - node.lineno + 1)
    over = {key: size for key, (kind, size) in sizes.items() if size > CAPS[kind]}
    grown = {key: size for key, size in over.items() if size > OVER_CAP.get(key, CAPS[sizes[key][0]])}
    assert grown == {}, "over the cap (split by responsibility), or grown past its recorded debt"
    assert set(OVER_CAP) <= set(over), f"back under the cap, drop from OVER_CAP: {set(OVER_CAP) - set(over)}"


def _package_imports() -> dict[str, set[str]]:
    """Module -> the ``sglang_oasis`` modules it imports (anywhere in it: a function's import closes a
    circle as surely as a top-level one, only later), read from the source."""
    import ast

    package = ROOT / "python"
    modules = {
        ".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (package / "sglang_oasis").rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_runtime_package_has_no_import_circle() -> None:
    graph = _package_imports()
    assert "sglang_oasis.attention.oasis_backend" in graph["sglang_oasis.plugin"] | set().union(
        *graph.values()
    )
    assert _circles(graph) == []
    # No arrow points up at the hooks: only the plugin registers them; the backend's parts read the
    # names they share with the hooks from sglang_contract.
    assert {name for name, targets in graph.items() if "sglang_oasis.sglang_hooks" in targets} == {
        "sglang_oasis.plugin"
    }
    # the check sees one: the draft backend (which hook 1 builds) reading a name from the hooks, as
    # pd_node once did, would close one
    closed = {
        **graph,
        "sglang_oasis.attention.draft_backend": graph["sglang_oasis.attention.draft_backend"]
        | {"sglang_oasis.sglang_hooks"},
    }
    assert any("sglang_oasis.sglang_hooks" in circle for circle in _circles(closed))
