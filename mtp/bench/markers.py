"""Generated blocks in Markdown, between `<!-- mtp.bench:begin NAME -->` and
`<!-- mtp.bench:end NAME -->`."""

from __future__ import annotations

import re

BLOCK = re.compile(r"(<!-- mtp\.bench:begin (?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                   r"(<!-- mtp\.bench:end (?P=name) -->)", re.DOTALL)


def block_names(text: str) -> list[str]:
    """The names of the generated blocks in `text`, in order."""
    return [m.group("name") for m in BLOCK.finditer(text)]


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    """`text` with the body of each block named in `blocks` replaced (the markers stay; a
    block with no new body keeps its old one)."""
    def body(match: re.Match) -> str:
        if match["name"] not in blocks:
            return match[0]
        return match[1] + blocks[match["name"]].rstrip("\n") + "\n" + match[4]

    return BLOCK.sub(body, text)
