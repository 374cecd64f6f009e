"""jsonl sources beyond JSONL (Parquet, JSON, hub datasets offline), the math-verify check, and fuzzing foreign specs."""

from __future__ import annotations

import builtins
import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivespec.node.tasks import JsonlFamily, JsonlTaskError, MixEntry, TaskSource
from hivespec.node.tasks.jsonl import gold_answer, math_reward

GSM_ROWS = [
    {"q": "Ann has 1,200 stamps and buys 34 more. How many?", "sol": "1200 + 34 = 1234\n#### 1,234"},
    {"q": "Half of 7?", "sol": "7 / 2 = \\boxed{\\frac{7}{2}}"},
    {"q": "2 + 2?", "sol": "#### 4"},
]


def _parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow", reason="the data extra is installed by `make install`")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_math_check_reads_gsm8k_and_boxed_references() -> None:
    assert gold_answer("so 5 + 5 = 10\n#### 1,010") == "1010"
    assert gold_answer("it is \\boxed{\\frac{7}{2}}") == "\\frac{7}{2}"
    assert math_reward("work\n#### 1,234", "The answer is 1234.") == 1.0
    assert math_reward("work\n#### 1,234", "The answer is 1,234") == 1.0
    assert math_reward("work\n#### 1,234", "The answer is 1235") == 0.0
    assert math_reward("\\boxed{\\frac{7}{2}}", "So 7/2 = 3.5") == 1.0
    assert math_reward("\\boxed{\\frac{7}{2}}", "\\boxed{\\frac{7}{2}}") == 1.0
    assert math_reward("\\boxed{\\frac{7}{2}}", "\\boxed{7/2}") == 1.0
    assert math_reward("#### 4", "I do not know") == 0.0
    # A peer's LaTeX is never handed to sympy: only numbers and simple fractions are read.
    assert math_reward("#### 4", "\\boxed{9^{9^{9^{9}}}}") == 0.0


def test_parquet_with_custom_columns_and_math_check(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "gsm.parquet", GSM_ROWS)
    family = JsonlFamily(path, question_column="q", answer_column="sol", answer_check="math")
    assert len(family) == 3
    task = family.make(0)
    assert task.question.startswith("Ann has") and family.from_prompt_id(task.prompt_id) == task
    assert family.reward(task, "1200 + 34 = 1234") == 1.0
    # The same bytes read as plain numbers are refused with the fix in the message.
    with pytest.raises(JsonlTaskError, match="answer_check: math"):
        JsonlFamily(path, question_column="q", answer_column="sol")
    with pytest.raises(JsonlTaskError, match=r"missing key\(s\) question"):
        JsonlFamily(path)


def test_json_list_and_the_reading_enters_the_id(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([{"question": "1 + 1?", "answer": 2, "alt": "What is one plus one?"}]))
    plain = JsonlFamily(path)
    other_column = JsonlFamily(path, question_column="alt")
    assert plain.make(0).question == "1 + 1?" and other_column.make(0).question == "What is one plus one?"
    assert plain.digest != other_column.digest, "the same file read differently names other tasks"
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text('{"question": "1 + 1?", "answer": 2}\n')
    assert JsonlFamily(jsonl).digest == JsonlFamily(jsonl).digest


@pytest.fixture
def hub_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A hub cache holding dataset 'hivespec-test/gsm-tiny' (subset main, splits train and test) as Parquet."""
    from huggingface_hub import constants

    repo = "hivespec-test/gsm-tiny"
    root = tmp_path / "hub" / f"datasets--{repo.replace('/', '--')}"
    commit = "c" * 40
    data = root / "snapshots" / commit / "main"
    data.mkdir(parents=True)
    _parquet(data / "train-00000-of-00001.parquet", GSM_ROWS)
    _parquet(data / "test-00000-of-00001.parquet", GSM_ROWS[:1])
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo


def test_a_hub_dataset_by_id_is_read_from_the_cache_and_regenerated_by_receivers(hub_dataset: str) -> None:
    entry = MixEntry("jsonl", name=hub_dataset, subset="main", split="train", question_column="q", answer_column="sol",
                     answer_check="math")
    sender, receiver = TaskSource([entry]), TaskSource([entry, ("arith", 1, 1.0)])
    tasks = sender.prompts(seed=1, round=0, count=6)
    assert {t.question for t in tasks} <= {row["q"] for row in GSM_ROWS}
    for task in tasks:
        assert receiver.resolve(task.prompt_id) == (task, "")
    assert TaskSource().resolve(tasks[0].prompt_id) == (None, "jsonl_other_source")
    test_split = TaskSource([MixEntry("jsonl", name=hub_dataset, subset="main", split="test", question_column="q",
                                      answer_column="sol", answer_check="math")])
    assert test_split.resolve(tasks[0].prompt_id) == (None, "jsonl_other_source")
    with pytest.raises(JsonlTaskError, match="no Parquet or JSON"):
        JsonlFamily(dataset=hub_dataset, subset="main", split="validation", question_column="q", answer_column="sol")
    with pytest.raises(JsonlTaskError, match="hivespec-test/absent"):
        JsonlFamily(dataset="hivespec-test/absent")


# --- foreign specs are untrusted input ---------------------------------------------------------

_SPEC_ALPHABET = string.ascii_letters + string.digits + ":._-/@+ \\\x00\u00e9"


def _receiver(tmp_path: Path) -> tuple[TaskSource, list[str]]:
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"question": "1 + 1?", "answer": 2}\n{"question": "2 + 2?", "answer": 4}\n')
    mix: list = [("arith", 1, 1.0), ("count", 2, 1.0), MixEntry("jsonl", name=str(jsonl))]
    try:
        import reasoning_gym  # noqa: F401

        mix.append(MixEntry("rg", name="chain_sum", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}))
    except ImportError:
        pass
    source = TaskSource(mix)
    return source, [t.prompt_id for t in source.prompts(seed=0, round=0, count=16)]


@st.composite
def _specs(draw: st.DrawFn, canonical: list[str]) -> str:
    """Arbitrary text, and canonical ids with a field replaced, spliced or truncated."""
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.text(_SPEC_ALPHABET, max_size=200))
    fields = draw(st.sampled_from(canonical)).split(":")
    if kind == 1:
        index = draw(st.integers(0, len(fields) - 1))
        fields[index] = draw(st.one_of(st.text(_SPEC_ALPHABET, max_size=30), st.integers(-5, 2**70).map(str),
                                       st.sampled_from(["../../etc/passwd", "/etc/passwd", "0" * 30, "1e9", ""])))
        return ":".join(fields)
    return ":".join(fields)[: draw(st.integers(0, 80))]


def test_fuzzed_specs_never_raise_open_files_or_build_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, canonical = _receiver(tmp_path)
    rg = source.families.get("rg")
    datasets_before = dict(rg.datasets) if rg is not None else {}
    known = {prompt_id: source.lookup(prompt_id) for prompt_id in canonical}
    opened: list[str] = []
    resolving = [False]
    real_open = builtins.open

    def spy_open(file, *args, **kwargs):
        if resolving[0]:  # hypothesis itself opens files between examples
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    reasons: set[str] = set()

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_specs(canonical))
    def check(prompt_id: str) -> None:
        resolving[0] = True
        try:
            task, reason = source.resolve(prompt_id)
        finally:
            resolving[0] = False
        if task is None:
            assert reason, prompt_id
            reasons.add(reason)
        else:
            # Only canonical ids resolve, and to the task their owner drew (never a respelling).
            assert reason == "" and task.prompt_id == prompt_id
            if prompt_id in known:
                assert task == known[prompt_id]

    check()
    assert opened == [], f"resolving peer specs opened files: {opened[:5]}"
    assert {"malformed_spec", "unknown_family"} <= reasons
    if rg is not None:
        assert rg.datasets == datasets_before, "a spec never adds a dataset"
    for value in (None, 12, b"arith:d1:1", ["rg"], "x" * 10_000):
        assert source.resolve(value) == (None, "malformed_spec")
