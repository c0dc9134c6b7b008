"""mtp.bench.tables: Markdown tables of the results."""

from mtp.bench.tables import table


def test_table() -> None:
    assert table(["a", "b"], [[1, 2]]) == "| a | b |\n| --- | --- |\n| 1 | 2 |"
