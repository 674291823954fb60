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

# Remote partial fetching (hook 7: PD disaggregation's prefill sends, bootstrap routes, decode admission)
# keeps ``Any`` for now: that code is being reworked. Its objects are SGLang's disaggregation internals
# (the Mooncake sender, the decode queue and its entries and pollers, the bootstrap server, numpy page
# indices) and our PD parts (stager, fetcher), to be typed with it.
PD_HOOKS = frozenset({
    "_pd_part", "mark_staged_send", "_is_mooncake_sender", "send_last_page_only", "_one_page",
    "remote_fetch_routes", "wait_for_admissions", "_AdmissionGate.__init__", "_AdmissionGate.poll", "_fetches",
    "fetch_admission_blocks", "refuse_staged_requests", "_refuse_if_staged", "_complete_before_caching",
    "_complete_before_caching.checkpoint_complete",
})  # fmt: skip
# Their named parameters annotated Any today (the scheduler, request, sender, queue, server, page-index and
# PD-part parameters of the functions above), at most: lower it as they get their types.
MAX_PD_ANY_PARAMETERS = 21
# Files of the same rework, in the same state.
PD_FILES = frozenset({
    "disaggregation/pd_partial.py", "disaggregation/remote_fetch.py", "attention/pd_node.py", "launch_pd.py",
})  # fmt: skip
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
    """Every hook outside remote partial fetching types what SGLang hands it (scheduler, batch, request,
    pools, forward batch, ...) and what it returns; the PD hooks keep at most today's ``Any``."""
    untyped = {
        name: found
        for name, function in _functions(ast.parse(HOOKS.read_text()))
        if (found := _untyped(function))
    }
    outside = {name: found for name, found in untyped.items() if name not in PD_HOOKS}
    assert outside == {}, f"sglang_hooks.py: annotated Any where SGLang has a type: {outside}"
    pd_parameters = sum(len([arg for arg in found if arg != "return"]) for found in untyped.values())
    assert pd_parameters <= MAX_PD_ANY_PARAMETERS, untyped


def test_no_part_takes_an_sglang_object_as_any() -> None:
    """Outside the PD rework, no parameter named for an SGLang object (or one of our parts) is ``Any``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in PD_FILES:
            continue
        for name, function in _functions(ast.parse(path.read_text())):
            if path == HOOKS and name in PD_HOOKS:
                continue
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
