"""Family "jsonl": questions from a local JSONL file of ``{"question": ..., "answer": ...}`` lines.

Prompt ids are ``"jsonl:<first 8 hex of the file's sha256>:<0-based line index>"``: a peer's
id resolves only if this node holds the very same file. Answers must be numbers (or numeric
strings) because rewards compare numbers; blank lines are skipped but keep their index.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from hivespec.node.tasks.base import MAX_PROMPT_ID_LENGTH, MAX_SEED, Task, numeric_reward, parse_number

_JSONL_ID = re.compile(r"jsonl:([0-9a-f]{8}):(0|[1-9][0-9]*)")


class JsonlTaskError(ValueError):
    """A JSONL task file is unreadable or has a bad line; the message names the file and line."""


def _parse_line(path: Path, number: int, line: str) -> tuple[str, str]:
    """``(question, answer)`` of one non-blank line; ``number`` is 1-based for the message."""
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise JsonlTaskError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise JsonlTaskError(f'{where}: expected an object {{"question": ..., "answer": ...}}, got {type(record).__name__}')
    missing = [key for key in ("question", "answer") if key not in record]
    if missing:
        raise JsonlTaskError(f"{where}: missing key(s) {', '.join(missing)}")
    question, answer = record["question"], record["answer"]
    if not isinstance(question, str) or not question.strip():
        raise JsonlTaskError(f"{where}: 'question' must be a non-empty string, got {question!r}")
    # bool is an int subclass; true/false are not answers.
    if isinstance(answer, bool) or not isinstance(answer, (int, float, str)):
        raise JsonlTaskError(f"{where}: 'answer' must be a number, got {answer!r}")
    if parse_number(str(answer)) is None:
        raise JsonlTaskError(f"{where}: 'answer' must be a number (rewards compare numbers), got {answer!r}")
    return question.strip(), str(answer).strip()


class JsonlFamily:
    """Tasks read from one JSONL file; ``make(seed, 1)`` picks line ``seed mod records``."""

    name = "jsonl"
    # The file is the difficulty: there is no knob to turn.
    max_difficulty = 1

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
        except OSError as error:
            raise JsonlTaskError(f"cannot read task file {self.path}: {error.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise JsonlTaskError(f"{self.path}: not UTF-8 (byte {error.start})") from None
        self.digest = hashlib.sha256(raw).hexdigest()[:8]
        self._records: dict[int, tuple[str, str]] = {}
        for index, line in enumerate(text.splitlines()):
            if line.strip():
                self._records[index] = _parse_line(self.path, index + 1, line)
        if not self._records:
            raise JsonlTaskError(f"{self.path}: no tasks (the file is empty or blank)")
        self._indices = sorted(self._records)

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
        """The task for ``"jsonl:<hash>:<line>"`` when the hash is this file's and the line holds a task."""
        if not isinstance(prompt_id, str) or len(prompt_id) > MAX_PROMPT_ID_LENGTH:
            return None
        match = _JSONL_ID.fullmatch(prompt_id)
        if match is None or match.group(1) != self.digest:
            return None
        index = int(match.group(2))
        return self._task(index) if index in self._records else None

    def reward(self, task: Task, completion: str) -> float:
        """Binary: the completion's extracted number equals the file's answer."""
        return numeric_reward(task.answer, completion)
