"""Family "arith": seeded integer arithmetic questions with a difficulty knob.

Difficulty levels:
    1. single-digit addition                    "What is 7 + 5?"
    2. two-digit plus single-digit addition     "What is 23 + 8?"
    3. two-digit addition or subtraction (never negative)
    4. two-digit times single-digit
    5. three two-digit operands with + and - (may be negative)
    6. three operands mixing * with + or - (precedence matters)

Level 2 exists because SmolLM2-135M solves level 1 about a third of the time and two-digit
pairs almost never (bench/base_rates.py): the knob needs a step in between.
"""

from __future__ import annotations

import random

from hivespec.node.tasks.base import Task, check_make_args, numeric_reward, parse_procedural_id, procedural_id


def _expression(rng: random.Random, difficulty: int) -> str:
    """A Python-evaluable integer expression for ``difficulty``; its text is also what the model reads."""
    if difficulty == 1:
        return f"{rng.randint(0, 9)} + {rng.randint(0, 9)}"
    if difficulty == 2:
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        return f"{a} + {b}" if rng.random() < 0.5 else f"{b} + {a}"
    if difficulty == 3:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return f"{a} + {b}"
        return f"{max(a, b)} - {min(a, b)}"
    if difficulty == 4:
        return f"{rng.randint(10, 99)} * {rng.randint(2, 9)}"
    if difficulty == 5:
        a, b, c = (rng.randint(10, 99) for _ in range(3))
        return f"{a} {rng.choice('+-')} {b} {rng.choice('+-')} {c}"
    a, b, c = rng.randint(2, 19), rng.randint(2, 9), rng.randint(2, 99)
    op = rng.choice("+-")
    return f"{a} * {b} {op} {c}" if rng.random() < 0.5 else f"{c} {op} {a} * {b}"


def _evaluate(expression: str) -> int:
    """Integer value of an expression made only of ints, ``+``, ``-`` and ``*`` (with precedence)."""
    # The expression comes from _expression, never from a peer, but parse it by hand anyway
    # rather than eval(): sums of products.
    total, sign, product = 0, 1, 1
    for token in expression.split():
        if token in "+-":
            total += sign * product
            sign, product = (1 if token == "+" else -1), 1
        elif token != "*":
            product *= int(token)
    return total + sign * product


class ArithmeticFamily:
    """Seeded arithmetic; prompt ids ``"arith:d<difficulty>:<seed>"``."""

    name = "arith"
    max_difficulty = 6

    def make(self, seed: int, difficulty: int) -> Task:
        """The question for ``seed`` at ``difficulty`` (1..6); deterministic across processes."""
        check_make_args(self.name, seed, difficulty, self.max_difficulty)
        expression = _expression(random.Random(seed), difficulty)
        return Task(
            prompt_id=procedural_id(self.name, difficulty, seed),
            family=self.name,
            question=f"What is {expression}?",
            answer=str(_evaluate(expression)),
        )

    def from_prompt_id(self, prompt_id: str) -> Task | None:
        """The task an ``"arith:..."`` id names, or None for anything else."""
        parsed = parse_procedural_id(prompt_id, self.name, self.max_difficulty)
        return None if parsed is None else self.make(parsed[1], parsed[0])

    def reward(self, task: Task, completion: str) -> float:
        """Binary: the completion's extracted number equals the result."""
        return numeric_reward(task.answer, completion)
