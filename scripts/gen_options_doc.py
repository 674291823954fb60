"""Write docs/options.md, the table of every ``--oasis-*`` option, from ``OasisConfig``.

    python scripts/gen_options_doc.py            # (re)write docs/options.md
    python scripts/gen_options_doc.py --check    # exit 1 if docs/options.md is not what this writes

One row per field of the frozen dataclass in ``python/sglang_oasis/config.py``: the option name the CLI
derives from it (``foo_bar`` -> ``--oasis-foo-bar``), its default as the command line spells it, and the
field's ``help`` metadata (plus its ``choices``). ``test/unit/test_repo.py`` fails when the file is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "options.md"
COMMAND = "python scripts/gen_options_doc.py"

HEADER = f"""\
# `--oasis-*` options

Generated from `OasisConfig` (`python/sglang_oasis/config.py`) by

    {COMMAND}

Edit a field's `help` there and rerun it; never edit this file (`{COMMAND} --check`
and `test/unit/test_repo.py` fail when it is stale).

`python -m sglang_oasis.launch_server` (and `scripts/serve.sh`, `scripts/launch_pd.sh`) take these
besides every SGLang server argument (`--help` lists both). A bad value stops start-up with a message
naming the option. Booleans take `true` or `false`. In sparse mode the launcher also sets
`--attention-backend oasis`, `--page-size <block size>` and disables CUDA graphs; contradicting values
(another attention backend, another page size) are refused.
"""


def option_name(field_name: str) -> str:
    return "--oasis-" + field_name.replace("_", "-")


def default_text(value: Any) -> str:
    """The default as it would be typed on the command line."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return f"`{','.join(str(v) for v in value)}`" if value else "none"
    return f"`{value}`"


def cell(text: str) -> str:
    """One table cell: one line, pipes escaped, ``<name>`` kept visible (not read as an HTML tag)."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def render() -> str:
    if str(ROOT / "python") not in sys.path:  # run without the package installed
        sys.path.insert(0, str(ROOT / "python"))
    from sglang_oasis.config import OasisConfig

    rows = ["| option | default | what it does |", "| --- | --- | --- |"]
    for field in dataclasses.fields(OasisConfig):
        what = field.metadata["help"]
        if "choices" in field.metadata:
            what += " Choices: " + ", ".join(f"`{choice}`" for choice in field.metadata["choices"]) + "."
        rows.append(f"| `{option_name(field.name)}` | {default_text(field.default)} | {cell(what)} |")
    return HEADER + "\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale; write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
