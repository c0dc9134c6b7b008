"""Prompt files: `.jsonl` holds one prompt per line, any other file is one prompt.

A line is a JSON string, an object with a string "prompt", or a conversation for the model's
chat template: an object with "messages", or a list, of {"role", "content"} messages.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtp.chat import check_conversation
from mtp.tokenizers import Prompt


def read_prompts(path: str | Path, *, conversations: bool = False) -> list[Prompt]:
    """Prompts from `path` (texts, or conversations as lists of message dicts; see the module
    docstring); `conversations`: every line must be a conversation (a messages file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl" and not conversations:
        return [text]
    prompts: list[Prompt] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not JSON: {e}") from e
        if isinstance(item, dict) and "messages" in item:
            item = item["messages"]
        elif isinstance(item, dict):
            item = item.get("prompt")
        if isinstance(item, list):
            prompts.append(check_conversation(item, f"{path}:{number}"))
        elif isinstance(item, str) and not conversations:
            prompts.append(item)
        else:
            wanted = ("a conversation: a list of {role, content} messages, or an object with "
                      "'messages'")
            if not conversations:
                wanted = f"a JSON string or an object with a string 'prompt' (or {wanted})"
            raise ValueError(f"{path}:{number} must be {wanted}, got {line.strip()[:80]!r}")
    return prompts
