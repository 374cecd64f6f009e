"""Family "jsonl": question/answer rows from a JSONL, JSON or Parquet file, or a Hugging Face dataset.

Sources:
- a local ``.jsonl`` (one object a line; blank lines are skipped but keep their index), ``.json``
  (a list of objects) or ``.parquet`` file (pyarrow: ``pip install 'hivespec[data]'``);
- a Hugging Face dataset id (``openai/gsm8k``) with an optional ``revision`` and ``subset``/``split``:
  its split's Parquet or JSON(L) files are read from the hub cache snapshot (downloaded when
  missing and online; see `hivespec.node.hub`).

Question and answer column names are configurable. Prompt ids are
``"jsonl:<8 hex>:<row>"``: the hex is sha256 over the rows' source bytes (for a hub dataset
its files at the resolved commit) and, when they differ from the defaults, the column names and
the answer check. A peer's id resolves only if this node holds the very same source with the
same reading of it; nothing in an id makes a node open a file or a dataset.

Answer checks: ``number`` (the default) compares numbers like every family; ``math`` verifies
with math-verify (numeric equivalence: "1,234" = "1234", "0.5" = "\\frac{1}{2}"), reading a
GSM8K reference from after its ``####`` and a MATH-style one from its ``\\boxed{}``.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from hivespec.node.tasks.base import MAX_PROMPT_ID_LENGTH, MAX_SEED, Task, extract_answer, numeric_reward, parse_number
from hivespec.protocol.errors import UserError

log = logging.getLogger(__name__)

_JSONL_ID = re.compile(r"jsonl:([0-9a-f]{8}):(0|[1-9][0-9]{0,18})")
AnswerCheck = Literal["number", "math"]
DATA_HINT = "pip install 'hivespec[data]'"
# File kinds a hub dataset split may be stored as, in order of preference.
_TABLE_SUFFIXES = (".parquet", ".jsonl", ".json")
# A reference answer longer than this is a worked solution without a final answer we can find.
_MAX_REFERENCE_CHARS = 64
# What a completion's answer may be for the `math` check: a number or a simple fraction, never a
# peer's arbitrary LaTeX (sympy on hostile input can run for minutes).
_FRACTION = re.compile(r"\\[dt]?frac\{\s*(-?\d{1,12})\s*\}\{\s*(\d{1,12})\s*\}|(-?\d{1,12})\s*/\s*(\d{1,12})")
_BOXED = re.compile(r"\\boxed\{([^{}]{1,40}(?:\{[^{}]{0,20}\}[^{}]{0,20}){0,2})\}")


class JsonlTaskError(UserError):
    """A task source is unreadable or has a bad row; the message names the source and row."""


def gold_answer(reference: str) -> str:
    """The final answer inside a reference solution: after GSM8K's ``####``, inside the last ``\\boxed{}``, else all of it."""
    text = reference.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = _BOXED.findall(text)
    return boxed[-1].strip() if boxed else text


def completion_answer(completion: str) -> str | None:
    """The one answer of a completion for the ``math`` check: a simple fraction in ``\\boxed{}``, else hivespec's number."""
    boxed = _BOXED.search(completion)
    if boxed is not None:
        fraction = _FRACTION.fullmatch(boxed.group(1).strip())
        if fraction is not None:
            numerator, denominator = fraction.group(1) or fraction.group(3), fraction.group(2) or fraction.group(4)
            return f"{numerator}/{denominator}"
    number = extract_answer(completion)
    return None if number is None else format(number, "f")


def math_reward(reference: str, completion: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference's final answer, else 0.0."""
    from math_verify import parse, verify

    predicted = completion_answer(completion)
    if predicted is None:
        return 0.0
    # Timeouts off: math-verify's use signal.alarm (main thread only), and both sides are short
    # plain numbers or fractions by construction.
    gold = parse(f"${gold_answer(reference)}$", parsing_timeout=None)
    guess = parse(f"${predicted}$", parsing_timeout=None)
    try:
        return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=None) else 0.0
    except Exception:  # noqa: BLE001 - sympy failing on a comparison is a wrong answer, not a crash
        return 0.0


def _check_row(where: str, record: Any, question_column: str, answer_column: str, check: AnswerCheck) -> tuple[str, str]:
    """``(question, answer)`` of one row, or JsonlTaskError naming ``where``."""
    if not isinstance(record, dict):
        raise JsonlTaskError(f'{where}: expected an object {{"{question_column}": ..., "{answer_column}": ...}}, got {type(record).__name__}')
    missing = [key for key in (question_column, answer_column) if key not in record]
    if missing:
        raise JsonlTaskError(f"{where}: missing key(s) {', '.join(missing)} (columns: {', '.join(map(str, record))})")
    question, answer = record[question_column], record[answer_column]
    if not isinstance(question, str) or not question.strip():
        raise JsonlTaskError(f"{where}: {question_column!r} must be a non-empty string, got {question!r}")
    # bool is an int subclass; true/false are not answers.
    if isinstance(answer, bool) or not isinstance(answer, (int, float, str)):
        raise JsonlTaskError(f"{where}: {answer_column!r} must be a number or text, got {answer!r}")
    if check == "number" and parse_number(str(answer)) is None:
        raise JsonlTaskError(
            f"{where}: {answer_column!r} must be a number (rewards compare numbers), got {answer!r}; "
            "for worked solutions (GSM8K's '#### 42', MATH's \\boxed{}) set answer_check: math"
        )
    if check == "math":
        gold = gold_answer(str(answer))
        if not gold or len(gold) > _MAX_REFERENCE_CHARS:
            raise JsonlTaskError(f"{where}: no final answer ('#### N' or \\boxed{{N}}) in {answer_column!r}: {str(answer)[:80]!r}")
    return question.strip(), str(answer).strip()


def _read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(row index, record)`` of a JSONL, JSON or Parquet file; a JSONL's blank lines keep their index."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise JsonlTaskError(f"{path}: reading Parquet needs pyarrow; run: {DATA_HINT}") from None
        try:
            yield from enumerate(pq.read_table(path).to_pylist())
        except Exception as error:  # noqa: BLE001 - pyarrow raises many kinds on a corrupt file
            raise JsonlTaskError(f"{path}: not a readable Parquet file ({error})") from None
        return
    data = path.read_bytes()
    body = data.removeprefix(codecs.BOM_UTF8)  # the mark Excel and Windows PowerShell write before UTF-8
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise JsonlTaskError(f"{path}: not UTF-8 (byte {error.start + len(data) - len(body)})") from None
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise JsonlTaskError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
        except (ValueError, RecursionError) as error:
            raise JsonlTaskError(f"{path}: not readable JSON ({_past_json_limits(error)})") from None
        yield from enumerate(records)
        return
    if suffix == ".json" and "\n" in text.strip() and text.lstrip().startswith("{"):
        _refuse_one_object(path, text)
    # Rows end at "\n" only: str.splitlines also splits at U+2028, U+0085 and others, which JSON lets a string
    # hold unescaped (json.dumps(..., ensure_ascii=False) writes them so), cutting such a row in two.
    for index, line in enumerate(text.split("\n")):
        if line.strip():
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as error:
                raise JsonlTaskError(f"{path}:{index + 1}: not valid JSON ({error.msg} at column {error.colno})") from None
            except (ValueError, RecursionError) as error:
                raise JsonlTaskError(f"{path}:{index + 1}: not readable JSON ({_past_json_limits(error)})") from None


def _refuse_one_object(path: Path, text: str) -> None:
    """Raise JsonlTaskError when a .json file's text is one object over several lines (``{"data": [...]}``), which
    the reading as one object a line would call invalid JSON at its first line."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):  # not one document: rows, one a line, read as such
        return
    if isinstance(document, dict):
        keys = ", ".join(map(repr, list(document)[:8]))
        raise JsonlTaskError(
            f"{path}: one JSON object (keys {keys}), not a list of rows: write the rows as a list [{{...}}, ...] "
            "or one object a line (.jsonl)"
        )


def _past_json_limits(error: ValueError | RecursionError) -> str:
    """What in valid JSON Python's json refused: an integer too long to convert, or nesting deeper than the stack."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    return f"an integer of more than {sys.get_int_max_str_digits()} digits; write it as a string"


def _split_files(folder: Path, subset: str | None, split: str) -> list[Path]:
    """A hub dataset snapshot's files of ``split`` (in ``subset``), in path order, of the first file kind present."""
    base = folder / subset if subset else folder
    for suffix in _TABLE_SUFFIXES:
        found = sorted(
            path for path in base.rglob(f"*{suffix}")
            if path.is_file() and (path.stem == split or path.stem.startswith(f"{split}-") or path.parent.name == split)
        )
        if found:
            return found
    return []


class JsonlFamily:
    """Tasks read from one source; ``make(seed, 1)`` picks row ``seed mod rows``."""

    name = "jsonl"
    # The source is the difficulty: there is no knob to turn.
    max_difficulty = 1

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        dataset: str | None = None,
        revision: str | None = None,
        subset: str | None = None,
        split: str = "train",
        question_column: str = "question",
        answer_column: str = "answer",
        answer_check: AnswerCheck = "number",
    ) -> None:
        if (path is None) == (dataset is None):
            raise JsonlTaskError("a jsonl task source needs exactly one of a file path or a Hugging Face dataset id")
        if answer_check not in ("number", "math"):
            raise JsonlTaskError(f"answer_check must be 'number' or 'math', got {answer_check!r}")
        self.answer_check: AnswerCheck = answer_check
        if dataset is not None:
            files, self.source = self._hub_files(dataset, revision, subset, split)
        else:
            self.path = Path(path).expanduser()  # type: ignore[arg-type]
            files, self.source = [self.path], str(self.path)
        self.path = files[0]
        digest = hashlib.sha256()
        for file in files:
            try:
                digest.update(file.read_bytes())
            except OSError as error:
                raise JsonlTaskError(f"cannot read task file {file}: {error.strerror}") from None
        reading = (question_column, answer_column, answer_check)
        if reading != ("question", "answer", "number") or len(files) > 1:
            # The same bytes read with other columns or checks are other tasks: another id.
            digest.update(json.dumps([[f.name for f in files], *reading]).encode())
        self.digest = digest.hexdigest()[:8]
        self._records: dict[int, tuple[str, str]] = {}
        offset = 0
        for file in files:
            last = -1
            for index, record in _read_rows(file):
                where = f"{file}:{index + 1}" if file.suffix.lower() == ".jsonl" else f"{file} row {index}"
                self._records[offset + index] = _check_row(where, record, question_column, answer_column, answer_check)
                last = index
            offset += last + 1
        if not self._records:
            raise JsonlTaskError(f"{self.source}: no tasks (the file is empty or blank)")
        self._indices = sorted(self._records)

    @staticmethod
    def _hub_files(dataset: str, revision: str | None, subset: str | None, split: str) -> tuple[list[Path], str]:
        from hivespec.node.hub import HubError, resolve_snapshot

        patterns = [f"**/*{suffix}" for suffix in _TABLE_SUFFIXES] + [f"*{suffix}" for suffix in _TABLE_SUFFIXES]
        try:
            snapshot = resolve_snapshot(dataset, revision=revision, repo_type="dataset", allow_patterns=patterns)
        except HubError as error:
            raise JsonlTaskError(str(error)) from None
        files = _split_files(snapshot.folder, subset, split)
        if not files:
            where = f"{dataset}" + (f"/{subset}" if subset else "")
            raise JsonlTaskError(f"dataset {where} at {snapshot.commit[:12]} has no Parquet or JSON(L) files for split {split!r}")
        return files, f"{dataset}@{snapshot.commit[:12]}/{split}"

    def __len__(self) -> int:
        return len(self._records)

    def _task(self, index: int) -> Task:
        question, answer = self._records[index]
        return Task(prompt_id=f"{self.name}:{self.digest}:{index}", family=self.name, question=question, answer=answer)

    def make(self, seed: int, difficulty: int = 1) -> Task:
        """The record at position ``seed mod len(self)``; ``difficulty`` must be 1."""
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"jsonl: seed must be in [0, 2**63 - 1], got {seed}")
        if difficulty != 1:
            raise ValueError(f"jsonl: the family has no difficulty knob, use difficulty 1 (got {difficulty})")
        return self._task(self._indices[seed % len(self._indices)])

    def from_prompt_id(self, prompt_id: str) -> Task | None:
        """The task for ``"jsonl:<hash>:<row>"`` when the hash is this source's and the row holds a task."""
        if not isinstance(prompt_id, str) or len(prompt_id) > MAX_PROMPT_ID_LENGTH:
            return None
        match = _JSONL_ID.fullmatch(prompt_id)
        if match is None or match.group(1) != self.digest:
            return None
        index = int(match.group(2))
        return self._task(index) if index in self._records else None

    def reward(self, task: Task, completion: str) -> float:
        """Binary: the completion's answer equals the source's (numbers, or math-verify for ``answer_check: math``)."""
        if self.answer_check == "math":
            return math_reward(task.answer, completion)
        return numeric_reward(task.answer, completion)


def jsonl_digest(prompt_id: object) -> str | None:
    """The source hash of a well-formed ``jsonl:`` id, else None."""
    if not isinstance(prompt_id, str) or len(prompt_id) > MAX_PROMPT_ID_LENGTH:
        return None
    match = _JSONL_ID.fullmatch(prompt_id)
    return None if match is None else match.group(1)

