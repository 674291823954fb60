"""Multi-turn conversations for ``--format messages`` from the PyPI package ``chitchat-dataset``.

    python -m sglang_oasis.replay.build_chitchat --out chats.jsonl --conversations 20 [--max-turns 4]

The dataset holds real two-person chats (7,168 of them); the first speaker becomes ``user`` and the
other ``assistant``, a speaker's consecutive utterances join into one message. Conversations are taken
in the dataset's own order (from ``--skip``), so the output is the same on every machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PACKAGE_PIN = "chitchat-dataset==0.9.0"


def _dataset() -> dict[str, Any]:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"building conversations needs the PyPI package {PACKAGE_PIN}")
    return dict(json.loads((Path(spec.origin).parent / "dataset.json").read_text()))


def chitchat_conversations(
    count: int, max_turns: int | None = None, skip: int = 0
) -> Iterator[dict[str, Any]]:
    """``{"id", "messages"}`` records with at least one user message followed by a reply."""
    made = 0
    for index, (key, chat) in enumerate(_dataset().items()):
        if made >= count:
            return
        if index < skip:
            continue
        messages: list[dict[str, str]] = []
        first_sender = None
        for group in chat.get("messages", []):
            text = " ".join(u["text"].strip() for u in group if u.get("text", "").strip())
            if not text:
                continue
            first_sender = first_sender or group[0]["sender"]
            role = "user" if group[0]["sender"] == first_sender else "assistant"
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += " " + text
            else:
                messages.append({"role": role, "content": text})
        if max_turns is not None:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if len(users) > max_turns:
                messages = messages[: users[max_turns]]
        if len(messages) < 2:
            continue
        made += 1
        yield {"id": key, "messages": messages}


def write_chitchat(out: Path, count: int, max_turns: int | None = None, skip: int = 0) -> int:
    """Write ``count`` conversations as JSONL (atomically); returns how many were written."""
    records = list(chitchat_conversations(count, max_turns, skip))
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    with os.fdopen(handle, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)
    os.replace(temp, out)
    return len(records)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--max-turns", type=int, default=None, help="keep at most this many user turns each")
    p.add_argument("--skip", type=int, default=0, help="start after this many dataset conversations")
    args = p.parse_args(argv)
    if args.conversations < 1 or (args.max_turns is not None and args.max_turns < 1) or args.skip < 0:
        p.error("--conversations and --max-turns must be >= 1, --skip >= 0")
    written = write_chitchat(args.out, args.conversations, args.max_turns, args.skip)
    print(f"wrote {written} conversations to {args.out}")


if __name__ == "__main__":
    main()
