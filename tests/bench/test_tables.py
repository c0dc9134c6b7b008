"""mtp.bench.tables: Markdown tables of the results."""

from mtp.bench.tables import headline, methods, rows, table


def test_table() -> None:
    assert table(["a", "b"], [[1, 2]]) == "| a | b |\n| --- | --- |\n| 1 | 2 |"


def test_rows_shows_a_scripts_records_as_they_are() -> None:
    """bench_layer_skip's records by name (a column per key, missing cells blank) and
    bench_threads' list of records; plain figures above the table, nested ones left out."""
    named = rows({"rows": {"autoregressive": {"tokens_per_second": 17.4, "acceptance": None},
                           "skip 2 of 29": {"tokens_per_second": 14.1, "acceptance": 0.9,
                                            "skipped": [3, 7]}},
                  "prompts": 12, "load": [1.0, 0.5, 0.2], "checkpoint": "/home/x/model.gguf"})
    assert named.splitlines() == [
        "prompts 12", "",
        "|  | tokens_per_second | acceptance | skipped |", "| --- | --- | --- | --- |",
        "| autoregressive | 17.4 |  |  |", "| skip 2 of 29 | 14.1 | 0.9 | 3 7 |"]
    listed = rows({"rows": [{"model": "byte8", "loaded_over_idle": 0.45123}]})
    assert listed.splitlines()[-1] == "| byte8 | 0.451 |"


def test_methods_leaves_blank_what_a_row_does_not_count() -> None:
    """bench_methods' transformers rows (hf=true) count no forwards: blank cells, not a crash."""
    mtp_row = {"tokens_per_second": 18.4, "speedup": 1.102, "tokens_per_forward": 1.489,
               "forward_cost": 1.351, "identical": True, "repeated": 0.112}
    hf_row = {**mtp_row, "tokens_per_forward": None, "forward_cost": None}
    text = methods({"methods": {"heads(k=4)": mtp_row, "transformers": hf_row},
                    "prompts": 12, "max_new_tokens": 80, "threads": 2,
                    "auto_calibration_seconds": {}})
    assert text.splitlines()[-2:] == ["| heads(k=4) | 18.4 | 1.10x | 1.49 | 1.35 | True | 0.11 |",
                                      "| transformers | 18.4 | 1.10x |  |  | True | 0.11 |"]


def test_the_headline_says_which_run_its_figures_come_from() -> None:
    decode = {"prompts": 12, "k": 4, "speedup": 1.31, "tokens_per_forward": 2.5,
              "identical": True, "repeated": 0.4}
    results = {"suite": "cpu", "commit": "abc", "seconds": 3000.0,
               "machine": {"device_name": "CPU X", "cpus": 2, "cpu_flags": ["avx2"],
                           "torch": "2.13.0"},
               "parts": {"decode": {"result": decode, "commit": "abc",
                                    "load_before": [1.0], "load_after": [2.0]},
                         "hf": {"result": None, "commit": "abc"}}}
    text = headline(results)
    assert "**1.31x** at k = 4 (2.50 tokens per forward), ids identical; 40% repeats" in text
    assert "run of 50 minutes at commit abc on CPU X (2 cores, flags avx2" in text
    assert "load average 1.0-2.0" in text and "transformers" not in text  # hf failed: no row
    assert headline({**results, "parts": {}}) == "No headline figures: the run measured none."
