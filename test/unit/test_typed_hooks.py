"""The hooks and the backend's parts name SGLang's types, and mypy reads them (it runs in CI, in
scripts/run_tests.sh; not here: a cold run takes minutes).

An SGLang object annotated ``Any`` is never checked: a hook whose target changes its arguments in an
SGLang upgrade, or a part that reads an attribute the pool does not have, passes mypy. These tests read
the source (no import of SGLang) and fail when such an ``Any`` comes back or mypy stops reading SGLang.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "sglang_oasis"
HOOKS = PACKAGE / "sglang_hooks.py"

# Parameter names that hold SGLang objects (or our parts that wrap them) wherever they appear.
SGLANG_OBJECTS = frozenset({
    "scheduler", "batch", "req", "reqs", "forward_batch", "model_runner", "kv_pool", "req_to_token_pool",
    "req_pool", "pool", "allocator", "layer", "tree_cache", "factory", "params", "mode", "backend", "remote",
    "tier", "config", "candidates", "req_to_token",
})  # fmt: skip


def _functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method with its dotted name inside the module (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def _untyped(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Its named parameters annotated ``Any`` (``Any | None`` too), and ``return`` for ``-> Any``. A
    wrapper's ``*args: Any, **kwargs: Any`` and ``original: Callable[..., Any]`` are variadic by nature."""
    args = function.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    found = [arg.arg for arg in named if _is_any(arg.annotation)]
    return [*found, "return"] if _is_any(function.returns) else found


def _is_any(annotation: ast.expr | None) -> bool:
    return annotation is not None and ast.unparse(annotation) in ("Any", "Any | None", "Optional[Any]")


def test_the_sglang_hooks_name_sglangs_types() -> None:
    """Every hook types what SGLang hands it (scheduler, batch, request, pools, forward batch, the PD
    sender, queue, bootstrap server, ...) and what it returns."""
    untyped = {
        name: found
        for name, function in _functions(ast.parse(HOOKS.read_text()))
        if (found := _untyped(function))
    }
    assert untyped == {}, f"sglang_hooks.py: annotated Any where SGLang has a type: {untyped}"


def test_no_part_takes_an_sglang_object_as_any() -> None:
    """No parameter named for an SGLang object (or one of our parts) is ``Any``, anywhere."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for name, function in _functions(ast.parse(path.read_text())):
            found += [f"{relative}:{name}({arg})" for arg in _untyped(function) if arg in SGLANG_OBJECTS]
    assert found == []


def _mypy_config() -> dict:
    import tomllib  # Python 3.11 (the venv's); the package supports 3.10

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_mypy_checks_the_runtime_package_against_sglangs_own_source() -> None:
    """mypy reads the runtime package, and reads SGLang (it ships no ``py.typed``: without
    ``follow_untyped_imports`` every SGLang type would be ``Any`` to mypy, silently); an SGLang module that
    is gone is an error, not ``Any``."""
    config = _mypy_config()
    assert "python/sglang_oasis" in config["files"]
    assert not config.get("exclude")
    sglang = [override for override in config.get("overrides", []) if "sglang.*" in override["module"]]
    assert len(sglang) == 1
    assert sglang[0].get("follow_untyped_imports") is True
    assert sglang[0].get("ignore_missing_imports") is False
    assert sglang[0].get("follow_imports", config.get("follow_imports")) in ("normal", "silent")
    # the one SGLang module mypy does not read: ServerArgs gets its fields at import, so mypy would see none
    unread = {
        module
        for override in config.get("overrides", [])
        if override.get("follow_untyped_imports") is False or override.get("follow_imports") == "skip"
        for module in override["module"]
    }
    assert unread == {"sglang.srt.server_args"}
