"""mtp.bench.markers: the generated blocks of Markdown files are rewritten between their markers."""

from mtp.bench.markers import block_names, replace_blocks


def marked(*names: str) -> str:
    return "".join(f"text\n<!-- mtp.bench:begin {n} -->\nold {n}\n<!-- mtp.bench:end {n} -->\n"
                   for n in names) + "end\n"


def test_replace_blocks_keeps_the_markers_and_everything_around_them() -> None:
    text = marked("a", "b")
    new = replace_blocks(text, {"a": "new a\n", "c": "unused"})
    assert new == text.replace("old a", "new a")
    assert block_names(new) == ["a", "b"]
    assert replace_blocks(new, {"a": "new a"}) == new  # idempotent
