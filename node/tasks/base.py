"""The task interface, self-describing prompt ids, and the answer-extraction rule shared by all families.

A prompt id names everything needed to rebuild its task (``"arith:d2:123456"`` is family,
difficulty and seed), so a node can regenerate a peer's prompt and recompute its reward
instead of trusting it.

Rewards are binary: 1.0 when the one answer extracted from a completion equals the reference,
else 0.0. There is no format bonus: it would pay for the form of an answer, not its truth.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Protocol

# A prompt id longer than this is garbage; checked before any regex runs on peer input.
MAX_PROMPT_ID_LENGTH = 128
# Seeds are non-negative and below 2**63 so they fit a signed 64-bit column anywhere.
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Task:
    """One verifiable prompt: ``question`` for the model, ``answer`` the reference (a number as text)."""

    prompt_id: str
    family: str
    question: str
    answer: str


class TaskFamily(Protocol):
    """A source of tasks with a difficulty knob (1..max_difficulty) and a reward."""

    name: str
    max_difficulty: int

    def make(self, seed: int, difficulty: int) -> Task:
        """The task for ``seed`` at ``difficulty``; the same arguments give the same task in any process."""
        ...

    def from_prompt_id(self, prompt_id: str) -> Task | None:
        """Rebuild the task a prompt id names, or None when the id is not a canonical id of this family."""
        ...

    def reward(self, task: Task, completion: str) -> float:
        """1.0 if the completion's answer equals ``task.answer``, else 0.0."""
        ...


# --- prompt ids of procedural families: "<family>:d<difficulty>:<seed>" -------------------------

_CANONICAL_INT = r"(?:0|[1-9][0-9]*)"
_PROCEDURAL_ID = re.compile(rf"([a-z]+):d({_CANONICAL_INT}):({_CANONICAL_INT})")


def procedural_id(family: str, difficulty: int, seed: int) -> str:
    """The prompt id of a seeded task, e.g. ``"arith:d2:123456"``."""
    return f"{family}:d{difficulty}:{seed}"


def parse_procedural_id(prompt_id: str, family: str, max_difficulty: int) -> tuple[int, int] | None:
    """``(difficulty, seed)`` of a canonical procedural id of ``family``, else None.

    Only the canonical spelling is accepted (no leading zeros or signs), so one task has one id
    and a peer cannot dodge deduplication by respelling it.
    """
    if not isinstance(prompt_id, str) or len(prompt_id) > MAX_PROMPT_ID_LENGTH:
        return None
    match = _PROCEDURAL_ID.fullmatch(prompt_id)
    if match is None or match.group(1) != family:
        return None
    difficulty, seed = int(match.group(2)), int(match.group(3))
    if not 1 <= difficulty <= max_difficulty or seed > MAX_SEED:
        return None
    return difficulty, seed


def check_make_args(family: str, seed: int, difficulty: int, max_difficulty: int) -> None:
    """Raise ValueError naming the bad argument when ``make`` is called out of range."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{family}: seed must be in [0, 2**63 - 1], got {seed}")
    if not 1 <= difficulty <= max_difficulty:
        raise ValueError(f"{family}: difficulty must be in 1..{max_difficulty}, got {difficulty}")


# --- answer extraction ---------------------------------------------------------------------------

_NUMBER_WORDS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "once": 1, "twice": 2,
}
# A signed number with optional thousands commas and decimals ("-1,234.5"), or a number word.
# "\$?" lets "$12" count; the lookarounds keep "12" out of "a12" or "3.14.15".
# A number followed by an operator and another operand ("= 3 * 4 = 12", "the answer is 4 + 8") or
# by "=" is a step, not a result. "3 - so" is a dash and "**12**" markdown bold, not operators.
NUMBER = (
    r"(?P<num>[-\u2212]?\$?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|\.\d)"
    r"|\b(?:" + "|".join(sorted(_NUMBER_WORDS, key=len, reverse=True)) + r")\b)"
    r"(?!\s*(?:=|(?:[-+/x\u00d7\u00f7^\u2212]|\*(?!\*))\s*[\d(]))"
)

# Ordered from most to least explicit; the first rule that matches anywhere decides, and within
# a rule the first match wins. "First" matters: a completion listing several candidates gets
# judged on its first, so hedging never pays.
DEFAULT_ANSWER_PATTERNS: tuple[str, ...] = (
    r"\\boxed\{\s*" + NUMBER + r"\s*\}",
    r"answer\s*(?:is|:|=)\s*:?\s*(?:\*\*)?\s*" + NUMBER,
    # A completion that opens with its answer: "12", "15 is the answer", "**12**.". The number must
    # end the text or its line, or be followed by "is": "1. First, ..." is a list, not an answer.
    r"^\s*(?:\*\*)?" + NUMBER + r"(?:\*\*)?(?=[ \t]*(?:$|\n|\bis\b)|[.!][ \t]*(?:$|\n))",
    # The natural SmolLM2 form: "7 + 5 = 12", "... which is 12", "34 - 18 equals 16", "is equal to 16".
    r"(?:=|\bequals|\bequal to|\bis|\bare|\bgives|\bget)\s*(?:\*\*)?\s*" + NUMBER,
)

_BLANK_RUN = re.compile(r"[^\S\n]+")
_NEWLINE_RUN = re.compile(r"\s*\n\s*")
_RULES_CACHE: dict[tuple[str, ...], list[re.Pattern[str]]] = {}


def _compiled(patterns: tuple[str, ...]) -> list[re.Pattern[str]]:
    if patterns not in _RULES_CACHE:
        _RULES_CACHE[patterns] = [re.compile(p, re.IGNORECASE) for p in patterns]
    return _RULES_CACHE[patterns]


def parse_number(text: str) -> Decimal | None:
    """A number written as digits (signs, ``$``, thousands commas, decimals) or as an English word up to twenty."""
    token = text.strip().lower().replace("\u2212", "-").replace("$", "").replace(",", "")
    if token in _NUMBER_WORDS:
        return Decimal(_NUMBER_WORDS[token])
    try:
        value = Decimal(token)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_answer(completion: str, patterns: Iterable[str] = DEFAULT_ANSWER_PATTERNS) -> Decimal | None:
    """The one number a completion gives as its answer, or None.

    Rules are tried in order (``\\boxed{N}``; "answer is N"; a completion that starts with N;
    the first "= N" / "is N" / "equals N"); the first rule with a match decides and its first
    match is the answer. Rambling after the answer is ignored, which suits SmolLM2-135M,
    which writes "7 + 5 = 12" and then keeps talking.
    """
    # Runs of whitespace become one character, so the patterns' neighbouring \s* cannot backtrack
    # polynomially on a peer's completion full of spaces; a run with a newline stays a newline.
    text = _NEWLINE_RUN.sub("\n", _BLANK_RUN.sub(" ", completion))
    for rule in _compiled(tuple(patterns)):
        match = rule.search(text)
        if match is not None:
            return parse_number(match.group("num"))
    return None


def numeric_reward(reference: str, completion: str, patterns: Iterable[str] = DEFAULT_ANSWER_PATTERNS) -> float:
    """1.0 when the extracted answer equals the numeric ``reference`` exactly ("12.0" equals "12"), else 0.0."""
    expected = parse_number(reference)
    got = extract_answer(completion, patterns)
    return 1.0 if expected is not None and got is not None and got == expected else 0.0
