"""Prompt files: `.jsonl` holds one prompt per line, any other file is one prompt."""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from `path`: a `.jsonl` line is a JSON string or an object with "prompt"."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        return [text]
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not JSON: {e}") from e
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise ValueError(f"{path}:{number} must be a JSON string or an object with a "
                             f"string 'prompt', got {line.strip()[:80]!r}")
        prompts.append(prompt)
    return prompts
