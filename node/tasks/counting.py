"""Family "count": how often a word occurs in a short list; difficulty is the list length.

"How many times does the word 'pear' appear in this list: apple, pear, plum, pear?" The
target occurs at least once; the other items come from two or three distractor words, so the
answer needs counting, not spotting.
"""

from __future__ import annotations

import random

from hivespec.node.tasks.base import (
    DEFAULT_ANSWER_PATTERNS,
    NUMBER,
    Task,
    check_make_args,
    numeric_reward,
    parse_procedural_id,
    procedural_id,
)

# Short, single-token-ish common nouns; the model knows them and they never contain each other.
WORDS = ("apple", "pear", "plum", "fig", "lime", "kiwi", "cat", "dog", "cow", "fox", "hat", "cup")
# List length per difficulty 1..5.
LIST_LENGTHS = (3, 5, 7, 10, 14)

# Counting answers also come as "appears 3 times", "appears twice".
COUNT_ANSWER_PATTERNS: tuple[str, ...] = (
    *DEFAULT_ANSWER_PATTERNS[:3],
    r"\b(?:appears|occurs|shows up|is listed|is mentioned)\s+(?:exactly\s+|only\s+|just\s+)?" + NUMBER,
    *DEFAULT_ANSWER_PATTERNS[3:],
)


class CountingFamily:
    """Seeded list counting; prompt ids ``"count:d<difficulty>:<seed>"``."""

    name = "count"
    max_difficulty = len(LIST_LENGTHS)

    def make(self, seed: int, difficulty: int) -> Task:
        """The question for ``seed`` at ``difficulty`` (1..5); deterministic across processes."""
        check_make_args(self.name, seed, difficulty, self.max_difficulty)
        rng = random.Random(seed)
        length = LIST_LENGTHS[difficulty - 1]
        target, *distractors = rng.sample(WORDS, 3 if length < 7 else 4)
        hits = rng.randint(1, length - 1)
        items = [target] * hits + [rng.choice(distractors) for _ in range(length - hits)]
        rng.shuffle(items)
        return Task(
            prompt_id=procedural_id(self.name, difficulty, seed),
            family=self.name,
            question=f"How many times does the word '{target}' appear in this list: {', '.join(items)}?",
            answer=str(hits),
        )

    def from_prompt_id(self, prompt_id: str) -> Task | None:
        """The task a ``"count:..."`` id names, or None for anything else."""
        parsed = parse_procedural_id(prompt_id, self.name, self.max_difficulty)
        return None if parsed is None else self.make(parsed[1], parsed[0])

    def reward(self, task: Task, completion: str) -> float:
        """Binary: the completion's extracted count equals the true count."""
        return numeric_reward(task.answer, completion, COUNT_ANSWER_PATTERNS)
