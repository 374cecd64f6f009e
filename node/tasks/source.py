"""TaskSource: the node's prompt supply (a weighted mix of families), the lookup that verifies peers'
prompt ids, and the chat-template encoding of a task.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hivespec.node.tasks.arithmetic import ArithmeticFamily
from hivespec.node.tasks.base import MAX_PROMPT_ID_LENGTH, MAX_SEED, Task, TaskFamily
from hivespec.node.tasks.counting import CountingFamily
from hivespec.node.tasks.jsonl import JsonlFamily

log = logging.getLogger(__name__)

# None keeps the chat template's own system prompt. Measured with bench/base_rates.py (32 samples
# per cell, arith:d1/d2, count:d1, gsm_mini) it did as well as prompts asking for "The answer is N."
# (which SmolLM2-135M often copied literally, "N" included) or for "only the final number".
SYSTEM_PROMPT: str | None = None

# The only cells inside the useful 10-60% base-rate window (bench/base_rates.py, 48 samples each,
# T=1.0): arith:d1 35%, count:d1 19%. Every harder cell measured at or below 8%.
DEFAULT_MIX: tuple[tuple[str, int, float], ...] = (("arith", 1, 1.0), ("count", 1, 1.0))


class TaskSource:
    """Draws prompts from a weighted mix of ``(family, difficulty, weight)`` and resolves prompt ids.

    The built-in families (``arith``, ``count``) are always available to ``lookup``, at any of
    their difficulties; ``jsonl`` is available when a ``jsonl_path`` is given.
    """

    def __init__(
        self,
        mix: Sequence[tuple[str, int, float]] = DEFAULT_MIX,
        jsonl_path: str | Path | None = None,
        system_prompt: str | None = SYSTEM_PROMPT,
        heldout_fraction: float = 0.0,
    ) -> None:
        if not 0 <= heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.heldout_fraction = heldout_fraction
        self.families: dict[str, TaskFamily] = {"arith": ArithmeticFamily(), "count": CountingFamily()}
        if jsonl_path is not None:
            self.families["jsonl"] = JsonlFamily(jsonl_path)
        self.system_prompt = system_prompt
        if not mix:
            raise ValueError("the task mix is empty; give at least one (family, difficulty, weight)")
        self.mix: list[tuple[TaskFamily, int]] = []
        self.weights: list[float] = []
        for family_name, difficulty, weight in mix:
            family = self.families.get(family_name)
            if family is None:
                hint = " (set a jsonl_path for it)" if family_name == "jsonl" else ""
                raise ValueError(f"unknown task family {family_name!r}{hint}; known: {', '.join(sorted(self.families))}")
            if not 1 <= difficulty <= family.max_difficulty:
                raise ValueError(f"{family_name}: difficulty must be in 1..{family.max_difficulty}, got {difficulty}")
            if not weight > 0:
                raise ValueError(f"{family_name}: weight must be > 0, got {weight}")
            self.mix.append((family, difficulty))
            self.weights.append(float(weight))

    @classmethod
    def from_config(cls, tasks_config: Any, system_prompt: str | None = SYSTEM_PROMPT) -> TaskSource:
        """Build from a ``TaskConfig``-shaped object: ``.mix`` entries with family/difficulty/weight and ``.jsonl_path``."""
        mix = [(entry.family, entry.difficulty, entry.weight) for entry in tasks_config.mix]
        return cls(mix, tasks_config.jsonl_path, system_prompt, getattr(tasks_config, "heldout_fraction", 0.0))

    def prompts(self, seed: int, round: int, count: int) -> list[Task]:
        """``count`` tasks for (``seed``, ``round``); the same arguments give the same tasks in any process.

        Held-out questions (``is_heldout``) are skipped and redrawn, so training never sees them.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        # Hash rather than combine arithmetically so nearby (seed, round) pairs share nothing.
        key = hashlib.sha256(f"hivespec-prompts:{seed}:{round}".encode()).digest()
        rng = random.Random(int.from_bytes(key[:8], "big"))
        tasks: list[Task] = []
        while len(tasks) < count:
            family, difficulty = rng.choices(self.mix, weights=self.weights)[0]
            task = family.make(rng.randint(0, MAX_SEED), difficulty)
            if not self.is_heldout(task):
                tasks.append(task)
        return tasks

    def is_heldout(self, task: Task) -> bool:
        """Whether ``task``'s question is in the held-out share (decided by its text, so two seeds
        that render the same question fall on the same side)."""
        if self.heldout_fraction <= 0:
            return False
        digest = hashlib.sha256(f"hivespec-heldout:{task.family}:{task.question}".encode()).digest()
        return int.from_bytes(digest[:8], "big") < self.heldout_fraction * 2**64

    def heldout(self, seed: int, count: int, max_draws: int = 1_000_000) -> list[Task]:
        """``count`` held-out tasks with distinct questions, drawn from the mix for ``seed``.

        Raises ValueError when the held-out share is empty or ``max_draws`` draws do not find
        enough distinct questions (a family with few questions, like arith d1's 100).
        """
        if self.heldout_fraction <= 0:
            raise ValueError("heldout_fraction is 0: there are no held-out questions; set tasks.heldout_fraction")
        key = hashlib.sha256(f"hivespec-heldout-set:{seed}".encode()).digest()
        rng = random.Random(int.from_bytes(key[:8], "big"))
        tasks: dict[str, Task] = {}
        for _ in range(max_draws):
            if len(tasks) >= count:
                break
            family, difficulty = rng.choices(self.mix, weights=self.weights)[0]
            task = family.make(rng.randint(0, MAX_SEED), difficulty)
            if self.is_heldout(task):
                tasks.setdefault(task.question, task)
        if len(tasks) >= count:
            return list(tasks.values())
        raise ValueError(f"found only {len(tasks)} distinct held-out questions in {max_draws} draws, {count} asked")

    def lookup(self, prompt_id: object) -> Task | None:
        """The task a (possibly hostile) prompt id names, or None; never raises."""
        if not isinstance(prompt_id, str) or len(prompt_id) > MAX_PROMPT_ID_LENGTH:
            return None
        family = self.families.get(prompt_id.partition(":")[0])
        if family is None:
            return None
        try:
            return family.from_prompt_id(prompt_id)
        except Exception:  # a peer's bytes must never crash the receive loop
            log.debug("prompt id %r made %s.from_prompt_id fail", prompt_id, family.name, exc_info=True)
            return None

    def reward(self, task: Task, completion: str) -> float:
        """The reward of ``completion`` for ``task`` under its family's rule (1.0 or 0.0)."""
        return self.families[task.family].reward(task, completion)

    def chat_prompt_ids(self, tokenizer: Any, task: Task) -> list[int]:
        """Token ids of ``task`` in the tokenizer's chat template, ending with the assistant turn opener."""
        return chat_prompt_ids(tokenizer, task, self.system_prompt)


def chat_prompt_ids(tokenizer: Any, task: Task, system_prompt: str | None = SYSTEM_PROMPT) -> list[int]:
    """Encode ``task`` with the chat template (``add_generation_prompt=True``); None keeps the template's own system prompt.

    Rendering to text and encoding without extra special tokens is what ``apply_chat_template``
    does internally, and returns a plain list in every transformers version.
    """
    messages = [{"role": "user", "content": task.question}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
