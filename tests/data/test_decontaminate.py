"""data=installed: every sys.path folder's Python, deduplicated by content and decontaminated
against HumanEval and MBPP (a planted solution is dropped, naming its problem)."""

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mtp.data import InstalledSource
from mtp.data.decontaminate import (MIN_WORDS, NGRAM, References, benchmark_texts,
                                    load_references, tokens)
from mtp.data.sources import _load_installed
from mtp.data.benchmarks import humaneval
from mtp.paths import mbpp_file

MBPP_FILE = mbpp_file()  # read in place, never copied here
needs_mbpp = pytest.mark.skipif(MBPP_FILE is None, reason="no mbpp.jsonl ($MTP_MBPP_FILE)")


@pytest.fixture(autouse=True)
def _fresh_loads():
    _load_installed.cache_clear()  # each test's sources are read afresh
    yield
    _load_installed.cache_clear()


def test_words_leave_out_spacing_punctuation_numbers_letters_and_keywords():
    assert tokens("for i in range(len(numbers)):\n    x_1 = 2 * numbers[i]  # café") == [
        "range", "len", "numbers", "x_1", "numbers", "café"]


def test_a_shared_ngram_matches_however_it_is_spaced():
    text = "def mean_absolute_deviation(numbers): return sum(abs(x - mean) for x in numbers)"
    refs = References.from_texts([("P/1", text)], ngram=4)  # 6 words: 3 four-grams
    assert refs.matches("y = sum(  abs( x-mean )\n\tfor y in numbers)") == {"P/1"}
    assert refs.matches("y = sum(abs(x - median) for x in numbers)") == set()
    assert refs.matches("mean_absolute_deviation numbers sum") == set()  # 3 words < n = 4


def test_hash_hits_are_confirmed_word_by_word():
    refs = References.from_texts([("A", "alpha beta gamma"), ("B", "beta gamma delta")], ngram=2)
    assert refs.matches("gamma delta") == {"B"}
    assert refs.matches("beta gamma") == {"A", "B"}
    assert refs.matches("gamma beta") == set()


def planted(problem, indent: str = "        ") -> str:
    """A HumanEval problem's prompt and solution, re-indented, inside unrelated code."""
    body = "\n".join(indent + line for line in (problem.prompt + problem.reference).splitlines())
    return f"import os\n\nclass Copied:\n{body}\n\nprint(os.sep)\n"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """Two install folders: a duplicate file, a link, an empty file, a planted solution."""
    first, second = tmp_path / "lib", tmp_path / "site-packages"
    for folder in (first, second / "pkg", first / ".hidden"):
        folder.mkdir(parents=True)
    for i in range(5):
        (first / f"mod{i}.py").write_text(f"def helper_{i}(value):\n    return value * {i}\n")
    (second / "pkg" / "copy.py").write_text((first / "mod0.py").read_text())  # same bytes
    (second / "pkg" / "link.py").symlink_to(first / "mod1.py")  # the same file again
    (second / "pkg" / "broken.py").symlink_to(first / "gone.py")  # a link to nothing: skipped
    (second / "pkg" / "__init__.py").write_text("")
    (first / ".hidden" / "secret.py").write_text("never = 'read'\n")
    problem = humaneval().problems["HumanEval/2"]
    (second / "pkg" / "solved.py").write_text(planted(problem))
    return tmp_path


def test_installed_source_dedupes_and_drops_a_planted_humaneval_solution(site: Path) -> None:
    source = InstalledSource(paths=[str(site / "lib"), str(site / "site-packages")],
                             decontaminate=["humaneval"], cache_dir=str(site / "cache"))
    corpus = source.load()
    solved = str((site / "site-packages" / "pkg" / "solved.py").resolve())
    assert corpus.contaminated == {solved: ["HumanEval/2"]}
    assert corpus.skipped == {"empty": 1, "duplicate": 2, "contaminated": 1}
    ids = corpus.documents["id"]
    assert len(ids) == 5 and all(Path(i).name.startswith("mod") for i in ids)
    assert not any(".hidden" in i for i in ids)


def test_verdicts_are_cached_by_content(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = InstalledSource(paths=[str(site)], decontaminate=["humaneval"],
                             cache_dir=str(site / "cache"))
    first = source.load()
    [cache] = (site / "cache" / "decontamination").iterdir()
    assert len(json.loads(cache.read_text())) == 6  # one verdict per distinct content
    _load_installed.cache_clear()
    monkeypatch.setattr(References, "matches", lambda *_: pytest.fail("not cached"))
    again = source.load()
    assert again.key == first.key and again.contaminated == first.contaminated


@needs_mbpp
def test_a_planted_mbpp_solution_is_dropped(tmp_path: Path) -> None:
    # MBPP/16: text_lowercase_underscore, a regular-expression solution of 12 words (found whole)
    row = next(r for r in map(json.loads, MBPP_FILE.open()) if r["task_id"] == 16)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "tutorial.py").write_text(f"# from a tutorial\n{row['code']}\n")
    (tmp_path / "lib" / "other.py").write_text("import re\n\ndef text_match(t):\n"
                                               "    return re.search('^[a-z]+$', t)\n")
    corpus = InstalledSource(paths=[str(tmp_path / "lib")], mbpp_file=str(MBPP_FILE),
                             cache_dir=str(tmp_path / "cache")).load()
    assert list(corpus.contaminated.values()) == [["MBPP/16"]]
    assert corpus.documents["id"] == [str((tmp_path / "lib" / "other.py").resolve())]


def test_default_folders_are_sys_path_less_the_script_and_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script, installed, cwd = (tmp_path / name for name in ("script", "installed", "cwd"))
    for folder in (script, installed, cwd):
        folder.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", [str(script), "", str(installed), str(cwd),
                                      str(tmp_path / "missing"), str(tmp_path / "x.zip")])
    assert InstalledSource(decontaminate=[]).roots() == [installed]


def test_a_source_without_files_names_its_folders(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \.py files in \[.*empty'\] \(data=installed\)"):
        InstalledSource(paths=[str(tmp_path / "empty")], decontaminate=[]).load()
    with pytest.raises(ValueError, match="paths: .*nowhere.* are not folders"):
        InstalledSource(paths=[str(tmp_path / "nowhere")], decontaminate=[]).load()


def test_an_unreadable_reference_is_named_before_any_file_is_read(tmp_path: Path) -> None:
    missing = tmp_path / "mbpp.jsonl"
    with pytest.raises(ValueError, match=rf"decontamination reference mbpp: cannot read it "
                                         rf"from {missing} .*data\.source\.mbpp_file="):
        InstalledSource(paths=[str(tmp_path / "not-read")], mbpp_file=str(missing)).load()
    with pytest.raises(ValueError, match="'gsm8k' is not one of"):
        InstalledSource(decontaminate=["gsm8k"])


def test_mbpp_from_an_unreachable_hub_fails_fast_naming_the_option(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    with pytest.raises(ValueError, match=r"reference mbpp: cannot read it from the Hugging Face "
                                         r"Hub .*unreachable.*data\.source\.mbpp_file=/path"):
        InstalledSource(paths=[str(tmp_path)]).load()


def test_every_humaneval_problem_would_be_caught() -> None:
    """Each problem's prompt + solution has an n-gram of NGRAM words (or, shorter, at least
    MIN_WORDS to be found whole); problems that share text (56 and 61) match each other."""
    refs = load_references(["humaneval"], {})
    problems = humaneval().problems
    assert len(dict(benchmark_texts("humaneval"))) == 164 and refs.ngram == NGRAM
    assert min(len(tokens(p.prompt + p.reference)) for p in problems.values()) >= MIN_WORDS
    for task_id, problem in problems.items():
        assert task_id in refs.matches(planted(problem)), task_id
    assert refs.matches(planted(problems["HumanEval/56"])) == {"HumanEval/56", "HumanEval/61"}
