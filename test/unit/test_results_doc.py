"""docs/results.md reads as results, not as a lab notebook, and code comments say what and why, not when.

Pure file checks: nothing here imports the runtime.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results.md"
DATE = re.compile(r"20\d\d-\d\d-\d\d")


def _sections() -> dict[str, str]:
    """Each ``## `` heading of results.md -> the text up to the next one."""
    parts = re.split(r"^## (.+)$", RESULTS.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_results_doc_is_short() -> None:
    lines = len(RESULTS.read_text().splitlines())
    assert lines < 350, f"docs/results.md has {lines} lines: keep the latest run of each benchmark only"


def test_no_heading_is_dated_and_no_history_is_told() -> None:
    text = RESULTS.read_text()
    dated = [line for line in text.splitlines() if line.startswith("#") and DATE.search(line)]
    assert not dated, f"dated headings (history is in git): {dated}"
    assert "tried, not kept" not in text.lower()
    issues = re.findall(r"\bissue\s+#?\d+", text, flags=re.I)
    assert not issues, f"issue references in docs/results.md: {issues}"


def test_every_section_is_one_existing_benchmark_with_its_command_and_table() -> None:
    sections = _sections()
    assert sections, "docs/results.md has no ## sections"
    for heading, body in sections.items():
        named = re.findall(r"\bbench_\w+", heading)
        assert named, f"'## {heading}' names no benchmark/bench_*.py"
        for name in named:
            script = name.removesuffix(".py")
            assert (ROOT / "benchmark" / f"{script}.py").is_file(), (
                f"'## {heading}': no benchmark/{script}.py"
            )
        assert "```" in body, f"'## {heading}' has no command block"
        assert any(line.startswith("|") for line in body.splitlines()), f"'## {heading}' has no table"


def test_links_into_results_doc_name_its_headings() -> None:
    anchors = {_anchor(heading) for heading in _sections()}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for anchor in re.findall(r"results\.md#([\w-]+)", doc.read_text()):
            assert anchor in anchors, f"{doc.relative_to(ROOT)} links results.md#{anchor}, no such heading"


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                found.append((node.body[0].lineno, docstring))
    return found


def test_code_comments_carry_no_dates() -> None:
    package = ROOT / "python" / "sglang_oasis"
    dated = [
        f"{path.relative_to(package)}:{line}: {text.strip()[:80]}"
        for path in sorted(package.rglob("*.py"))
        for line, text in _comments_and_docstrings(path)
        if DATE.search(text)
    ]
    assert not dated, f"comments say what and why, not when: {dated}"
