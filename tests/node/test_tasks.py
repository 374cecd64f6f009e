"""Task families, prompt ids, answer extraction, rewards, the JSONL loader and TaskSource."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import pytest

from hivespec.node.config import ConfigError
from hivespec.node.tasks import (
    GSM_MINI_PATH,
    ArithmeticFamily,
    CountingFamily,
    JsonlFamily,
    JsonlTaskError,
    MixEntry,
    Task,
    TaskSource,
    chat_prompt_ids,
    extract_answer,
)

FAMILIES = [ArithmeticFamily(), CountingFamily()]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_make_is_deterministic_and_seed_dependent(family) -> None:
    for difficulty in range(1, family.max_difficulty + 1):
        first = [family.make(seed, difficulty) for seed in range(20)]
        assert first == [family.make(seed, difficulty) for seed in range(20)]
        assert len({task.question for task in first}) > 5


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_prompt_id_round_trip(family) -> None:
    for difficulty in range(1, family.max_difficulty + 1):
        for seed in (0, 1, 123456, 2**63 - 1):
            task = family.make(seed, difficulty)
            assert task.prompt_id == f"{family.name}:d{difficulty}:{seed}"
            assert family.from_prompt_id(task.prompt_id) == task


def test_arithmetic_answers_are_right() -> None:
    family = ArithmeticFamily()
    for difficulty in range(1, 7):
        for seed in range(50):
            task = family.make(seed, difficulty)
            expression = task.question.removeprefix("What is ").removesuffix("?")
            assert int(task.answer) == eval(expression)  # our own generated text


def test_arithmetic_difficulty_shapes() -> None:
    family = ArithmeticFamily()
    assert all(int(family.make(s, 1).answer) <= 18 for s in range(50))
    assert all(11 <= int(family.make(s, 2).answer) <= 108 for s in range(50))
    assert all(int(family.make(s, 3).answer) >= 0 for s in range(50))
    assert all("*" in family.make(s, 4).question for s in range(20))
    assert all(family.make(s, 5).question.count(" ") == 6 for s in range(20))
    assert all("*" in family.make(s, 6).question for s in range(20))


def test_counting_answers_are_right() -> None:
    family = CountingFamily()
    for difficulty in range(1, 6):
        for seed in range(30):
            task = family.make(seed, difficulty)
            target = task.question.split("'")[1]
            items = task.question.split(": ", 1)[1].rstrip("?").split(", ")
            assert int(task.answer) == items.count(target) >= 1
            assert len(items) == (3, 5, 7, 10, 14)[difficulty - 1]


@pytest.mark.parametrize(
    "prompt_id",
    [
        "", "arith", "arith:d2", "arith:d2:", "arith:d0:5", "arith:d7:5", "arith:d2:-5", "arith:d2:05",
        "arith:d02:5", "arith:d2:+5", "arith:d2:5:6", "arith:D2:5", "arith:d2:5 ", "arith:d2:1e3",
        f"arith:d2:{2**63}", "arith:d2:" + "9" * 200, "count:d9:1", "nope:d1:1", "jsonl:deadbeef:0",
        "arith:d2:٣", ":::", "\x00",
    ],
)
def test_lookup_rejects_garbage(prompt_id: str) -> None:
    assert TaskSource(jsonl_path=GSM_MINI_PATH).lookup(prompt_id) is None


@pytest.mark.parametrize("value", [None, 5, b"arith:d1:1", ["arith:d1:1"]])
def test_lookup_rejects_non_strings(value: object) -> None:
    assert TaskSource().lookup(value) is None


def test_lookup_dispatches_to_each_family() -> None:
    source = TaskSource(jsonl_path=GSM_MINI_PATH)
    for task in [ArithmeticFamily().make(7, 3), CountingFamily().make(7, 5), source.families["jsonl"].make(3, 1)]:
        assert source.lookup(task.prompt_id) == task
    # Without a JSONL file, its ids resolve to nothing.
    assert TaskSource().lookup(source.families["jsonl"].make(3, 1).prompt_id) is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("12", 12),
        ("7 + 5 = 12. Now let's try 8 + 3 = 11, which is easy.", 12),
        ("The answer is 12.", 12),
        ("1\n\nThe answer is 1.", 1),
        ("Let me think: 3 x 4 = 12 apples, so 12 - 2 = 10. The answer is 10.", 10),
        ("We get \\boxed{-7} because 3 - 10 = -7", -7),
        ("It's 34 - 18, which is 16. That's a confusion.", 16),
        ("15 is the answer to using 7 + 5.", 15),
        ("**42**", 42),
        ("The total is $1,234.", 1234),
        ("The answer is: **-3**", -3),
        ("The answer is \u22125.", -5),
        ("The answer is 12.0", 12),
        ("The answer is seven.", 7),
        ("Mixing things up, 3 + 4 equals 7 and then some.", 7),
        ("3 + 77 is equal to 80 (wrapping around).", 80),
        ("I like cats and dogs.", None),
        ("", None),
    ],
)
def test_extract_answer(completion: str, expected: int | None) -> None:
    got = extract_answer(completion)
    assert (None if got is None else int(got)) == expected


def test_arith_reward_binary_on_correct_wrong_and_rambling() -> None:
    family = ArithmeticFamily()
    task = Task("arith:d1:0", "arith", "What is 7 + 5?", "12")
    assert family.reward(task, "7 + 5 = 12") == 1.0
    assert family.reward(task, "The answer is 12.") == 1.0
    assert family.reward(task, "7 + 5 = 12. Fun fact: 2 + 2 = 4, and 100 is a big number ...") == 1.0
    assert family.reward(task, "7 + 5 = 13") == 0.0
    assert family.reward(task, "The answer is 13. Oh wait, the answer is 12.") == 0.0  # first answer counts
    assert family.reward(task, "Numbers are fun! Math teaches us patience and care.") == 0.0
    assert family.reward(task, "The answer is 120") == 0.0
    assert family.reward(task, "The answer is 1.2") == 0.0


def test_count_reward_reads_times_phrasing() -> None:
    family = CountingFamily()
    task = Task("count:d1:0", "count", "How many times does the word 'fig' appear in this list: fig, cat, fig?", "2")
    assert family.reward(task, "The word 'fig' appears twice in the list.") == 1.0
    assert family.reward(task, "It appears only twice.") == 1.0
    assert family.reward(task, "'fig' appears 2 times.") == 1.0
    assert family.reward(task, "The word 'fig' appears three times.") == 0.0
    # A statement about the word outranks the generic "are N" rule, wherever it stands.
    assert family.reward(task, "There are 3 items; 'fig' appears 2 times.") == 1.0
    assert family.reward(task, "'fig' appears 3 times, or maybe it appears 2 times.") == 0.0


def test_gsm_mini_loads_and_rewards() -> None:
    family = JsonlFamily(GSM_MINI_PATH)
    assert len(family) >= 20
    task = family.make(0, 1)
    assert task.prompt_id == f"jsonl:{family.digest}:0"
    assert family.from_prompt_id(task.prompt_id) == task
    assert family.reward(task, f"The answer is {task.answer}.") == 1.0
    assert family.make(len(family), 1) == task  # seeds wrap around the file
    with pytest.raises(ValueError, match="difficulty"):
        family.make(0, 2)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"question": "q", "answer": 1}\n{"question": "q2", "answer": \n', r"tasks\.jsonl:2: not valid JSON"),
        ('{"question": "q", "answer": 1}\n\n[1, 2]\n', r"tasks\.jsonl:3: expected an object"),
        ('{"question": "q"}\n', r"tasks\.jsonl:1: missing key\(s\) answer"),
        ('{"question": "", "answer": 3}\n', r"tasks\.jsonl:1: 'question' must be a non-empty string"),
        ('{"question": "q", "answer": "Paris"}\n', r"tasks\.jsonl:1: 'answer' must be a number"),
        ('{"question": "q", "answer": true}\n', r"tasks\.jsonl:1: 'answer' must be a number"),
        ("\n\n", r"no tasks"),
        ('{"question": "q", "answer": ' + "1" * 5000 + "}\n", r"tasks\.jsonl:1: not readable JSON \(an integer of more than 4300 digits"),
        ('{"question": "q", "answer": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n", r"tasks\.jsonl:1: not readable JSON \(nested too deeply"),
    ],
)
def test_jsonl_bad_lines_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(JsonlTaskError, match=message):
        JsonlFamily(_write(tmp_path, text))


def test_jsonl_rows_are_lines_ended_by_newline_alone(tmp_path: Path) -> None:
    """JSON lets a string hold U+2028 and U+0085 unescaped; str.splitlines would cut such a row in two."""
    rows = [{"question": "first\u2028line?", "answer": 1}, {"question": "caf\x85e?", "answer": 2}, {"question": "c?", "answer": 3}]
    text = "\r\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\r\n"
    family = JsonlFamily(_write(tmp_path, text))
    assert [family.from_prompt_id(f"jsonl:{family.digest}:{i}").question for i in range(3)] == ["first\u2028line?", "caf\x85e?", "c?"]


def test_jsonl_with_a_utf8_byte_order_mark_loads(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"question": "a?", "answer": 1}\n')
    assert JsonlFamily(path).make(0).question == "a?"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"question": "\xff", "answer": 1}\n')
    with pytest.raises(JsonlTaskError, match=r"not UTF-8 \(byte 17\)"):
        JsonlFamily(path)


def test_a_json_file_of_one_object_says_so(tmp_path: Path) -> None:
    """A valid .json holding {"data": [...]} was called 'not valid JSON' at its first line."""
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"data": [{"question": "a?", "answer": 1}]}, indent=2))
    with pytest.raises(JsonlTaskError, match=r"tasks\.json: one JSON object \(keys 'data'\), not a list of rows"):
        JsonlFamily(path)
    path.write_text('{"question": "a?", "answer": 1}\n{"question": "b?", "answer": 2}\n')  # one object a line still reads
    assert len(JsonlFamily(path)) == 2


def test_jsonl_missing_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(JsonlTaskError, match="cannot read task file"):
        JsonlFamily(tmp_path / "absent.jsonl")


def test_jsonl_ids_are_line_indices_and_file_bound(tmp_path: Path) -> None:
    lines = ['{"question": "a?", "answer": 1}', "", '{"question": "b?", "answer": "2,000"}']
    family = JsonlFamily(_write(tmp_path, "\n".join(lines) + "\n"))
    assert len(family) == 2
    assert family.from_prompt_id(f"jsonl:{family.digest}:2").question == "b?"
    assert family.from_prompt_id(f"jsonl:{family.digest}:1") is None  # blank line
    assert family.from_prompt_id(f"jsonl:{family.digest}:3") is None
    task = family.from_prompt_id(f"jsonl:{family.digest}:2")
    assert family.reward(task, "The answer is 2000.") == 1.0
    other = JsonlFamily(_write(tmp_path, json.dumps({"question": "a?", "answer": 5}) + "\n"))
    assert other.digest != family.digest
    assert other.from_prompt_id(f"jsonl:{family.digest}:0") is None


def test_source_prompts_are_deterministic_and_follow_the_mix() -> None:
    source = TaskSource([("arith", 2, 3.0), ("count", 4, 1.0)])
    batch = source.prompts(seed=5, round=3, count=40)
    assert batch == TaskSource([("arith", 2, 3.0), ("count", 4, 1.0)]).prompts(seed=5, round=3, count=40)
    assert batch != source.prompts(seed=5, round=4, count=40)
    assert batch != source.prompts(seed=6, round=3, count=40)
    assert {t.prompt_id.rsplit(":", 1)[0] for t in batch} == {"arith:d2", "count:d4"}
    assert sum(t.family == "arith" for t in batch) > 20
    assert all(source.lookup(t.prompt_id) == t for t in batch)
    assert source.prompts(seed=5, round=3, count=0) == []


@pytest.mark.parametrize(
    ("mix", "jsonl", "message"),
    [
        ([("algebra", 1, 1.0)], None, "unknown task family 'algebra'"),
        ([("jsonl", 1, 1.0)], None, "set a jsonl_path"),
        ([("arith", 9, 1.0)], None, r"difficulty must be in 1\.\.6"),
        ([("count", 1, 0.0)], None, "weight must be > 0"),
        ([], None, "mix is empty"),
    ],
)
def test_source_rejects_bad_mix(mix, jsonl, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TaskSource(mix, jsonl_path=jsonl)


def test_source_from_config_shape() -> None:
    class Entry:
        def __init__(self, family: str, difficulty: int, weight: float) -> None:
            self.family, self.difficulty, self.weight = family, difficulty, weight

    class Config:
        mix: ClassVar[list[Entry]] = [Entry("arith", 1, 1.0), Entry("jsonl", 1, 2.0)]
        jsonl_path = str(GSM_MINI_PATH)

    source = TaskSource.from_config(Config())
    assert {t.family for t in source.prompts(seed=1, round=0, count=30)} == {"arith", "jsonl"}


class _TemplateTokenizer:
    """Stands in for a HF tokenizer: records the messages and encodes one id per character."""

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = []

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        self.messages = messages
        return "|".join(m["content"] for m in messages) + "|assistant:"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert not add_special_tokens
        return [ord(c) for c in text]


def test_chat_prompt_ids_system_prompt_choice() -> None:
    task = ArithmeticFamily().make(1, 1)
    tokenizer = _TemplateTokenizer()
    ids = TaskSource(system_prompt="Be brief.").chat_prompt_ids(tokenizer, task)
    assert tokenizer.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task.question}]
    assert "".join(map(chr, ids)) == f"Be brief.|{task.question}|assistant:"
    TaskSource().chat_prompt_ids(tokenizer, task)  # default: the template's own system prompt
    assert [m["role"] for m in tokenizer.messages] == ["user"]
    chat_prompt_ids(tokenizer, task, system_prompt=None)
    assert [m["role"] for m in tokenizer.messages] == ["user"]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("So the answer is 4 + 8. Indeed 4 + 8 = 12.", 12),  # "answer is 4 + 8" is not a result
        ("Number of apples = 3 * 4\nNumber of apples = 12 apples", 12),
        ("1. 9 + 3 = 12\n2. Done", 12),  # a list marker is not an answer
        ("12.\nThat was easy.", 12),
        ("The 12-year-old has 3 x 4 = 12 marbles", 12),
    ],
)
def test_extract_answer_skips_intermediate_steps(completion: str, expected: int) -> None:
    assert int(extract_answer(completion)) == expected


def test_extract_answer_is_fast_on_hostile_text() -> None:
    import time

    hostile = ("answer is" + " " * 5000 + ":" + "\t" * 5000) * 4 + "= " + "1" * 5000 + "x"
    started = time.perf_counter()
    extract_answer(hostile)
    extract_answer("is " * 20000)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("The answer is 3 - so true, or maybe 2.", 3),  # a dash, not a minus
        ("The answer is 3 -2 = 1", 1),
        ("The answer is 5 = 2 + 3", None),
        ("1 + 8 = 9 \n\nNote: 1 + 2 = 3", 9),
    ],
)
def test_extract_answer_dash_versus_minus(completion: str, expected: int | None) -> None:
    got = extract_answer(completion)
    assert (None if got is None else int(got)) == expected


def test_a_mix_entry_whose_every_question_is_held_out_is_refused_for_training(tmp_path: Path) -> None:
    """`prompts` redraws held-out questions: a source wholly held out made a training node's first round redraw forever."""
    path = tmp_path / "one.jsonl"
    for n in range(100):  # a one-question file whose question falls in the held-out quarter
        path.write_text(json.dumps({"question": f"What is {n} + 1?", "answer": n + 1}) + "\n")
        alone = TaskSource([MixEntry("jsonl", name=str(path))], heldout_fraction=0.25)
        if alone.is_heldout(alone.mix[0][0].make(0, 1)):
            break
    with pytest.raises(ConfigError, match=rf"0.25 holds out every question of tasks.mix jsonl:{re.escape(str(path))} \("):
        alone.check_trainable()
    with pytest.raises(ConfigError, match="every question of tasks.mix jsonl:"):  # beside another entry it would never train
        TaskSource([MixEntry("jsonl", name=str(path)), ("arith", 1, 1.0)], heldout_fraction=0.25).check_trainable()
    assert len(alone.heldout(seed=0, count=1)) == 1  # an evaluation may hold out a whole source
    TaskSource([("arith", 1, 1.0), ("count", 1, 1.0)], heldout_fraction=0.25).check_trainable()
    TaskSource([MixEntry("jsonl", name=str(path))]).check_trainable()
