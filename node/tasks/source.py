"""TaskSource: the node's prompt supply (a weighted mix of families), the lookup that verifies peers'
prompt ids, and the chat-template encoding of a task.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivespec.node.config import ConfigError, InputError
from hivespec.node.tasks.arithmetic import ArithmeticFamily
from hivespec.node.tasks.base import MAX_PROMPT_ID_LENGTH, MAX_SEED, Task, TaskFamily
from hivespec.node.tasks.counting import CountingFamily
from hivespec.node.tasks.jsonl import JsonlFamily, JsonlTaskError, jsonl_digest

log = logging.getLogger(__name__)

# None keeps the chat template's own system prompt. Measured with bench/base_rates.py (32 samples
# per cell, arith:d1/d2, count:d1, gsm_mini) it did as well as prompts asking for "The answer is N."
# (which SmolLM2-135M often copied literally, "N" included) or for "only the final number".
SYSTEM_PROMPT: str | None = None

# The only cells inside the useful 10-60% base-rate window (bench/base_rates.py, 48 samples each,
# T=1.0): arith:d1 35%, count:d1 19%. Every harder cell measured at or below 8%.
DEFAULT_MIX: tuple[tuple[str, int, float], ...] = (("arith", 1, 1.0), ("count", 1, 1.0))
# Seeds 0..N-1 of each mix entry that `check_trainable` tries for a question outside the held-out share: every
# question of a source of up to N (a jsonl file's rows, an rg dataset's indices).
TRAINABLE_DRAWS = 1000


@dataclass(frozen=True)
class MixEntry:
    """One entry of a task mix (the shape of a ``tasks.mix`` item in the config).

    ``name`` is the reasoning-gym dataset for ``rg``, and for ``jsonl`` a file (.jsonl, .json,
    .parquet) or a Hugging Face dataset id (default: the source's ``jsonl_path``). ``config`` is
    the reasoning-gym dataset config; ``revision``, ``subset`` and ``split`` pick a hub dataset's
    files; the column names and ``answer_check`` ("number" or "math") say how rows are read.
    """

    family: str
    difficulty: int = 1
    weight: float = 1.0
    name: str | None = None
    config: Mapping[str, Any] | None = None
    revision: str | None = None
    subset: str | None = None
    split: str = "train"
    question_column: str = "question"
    answer_column: str = "answer"
    answer_check: str = "number"

    @classmethod
    def of(cls, entry: Any) -> MixEntry:
        """A MixEntry from a ``(family, difficulty, weight)`` tuple or any object with MixEntry's attributes."""
        if isinstance(entry, MixEntry):
            return entry
        if isinstance(entry, tuple):
            return cls(*entry)
        values = {f.name: getattr(entry, f.name) for f in dataclasses.fields(cls) if hasattr(entry, f.name)}
        return cls(**values)

    def label(self) -> str:
        """How reports name the entry: ``arith:d1``, ``rg:leg_counting``, ``jsonl:<file or dataset>``."""
        return f"{self.family}:{self.name}" if self.name else f"{self.family}:d{self.difficulty}"


class TaskSource:
    """Draws prompts from a weighted mix and resolves prompt ids.

    The built-in families (``arith``, ``count``) are always available to ``lookup``, at any of
    their difficulties; ``jsonl`` sources and reasoning-gym (``rg``) datasets only as configured:
    a prompt id never makes a node open a file, a dataset or a reasoning-gym generator that its
    own mix (or ``jsonl_path``) does not name.
    """

    def __init__(
        self,
        mix: Sequence[Any] = DEFAULT_MIX,
        jsonl_path: str | Path | None = None,
        system_prompt: str | None = SYSTEM_PROMPT,
        heldout_fraction: float = 0.0,
    ) -> None:
        if not 0 <= heldout_fraction < 1:
            raise ConfigError(f"tasks.heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.heldout_fraction = heldout_fraction
        self.families: dict[str, TaskFamily] = {"arith": ArithmeticFamily(), "count": CountingFamily()}
        self._tables: dict[str, JsonlFamily] = {}  # jsonl sources by content digest
        self._rg: Any = None  # RgFamily, built on the first rg entry (reasoning-gym is an optional extra)
        self.jsonl_path = jsonl_path
        if jsonl_path is not None:
            self._add_table(JsonlFamily(jsonl_path))
        self.system_prompt = system_prompt
        if not mix:
            raise ConfigError("tasks.mix is empty; give at least one entry, e.g. [{family: arith, difficulty: 1}]")
        self.mix: list[tuple[TaskFamily, int]] = []
        self.weights: list[float] = []
        self.labels: list[str] = []
        for raw in mix:
            entry = MixEntry.of(raw)
            family = self._entry_family(entry)
            if not 1 <= entry.difficulty <= family.max_difficulty:
                raise ConfigError(f"tasks.mix {entry.family}: difficulty must be in 1..{family.max_difficulty}, got {entry.difficulty}")
            if not entry.weight > 0:
                raise ConfigError(f"tasks.mix {entry.family}: weight must be > 0, got {entry.weight}")
            self.mix.append((family, entry.difficulty))
            self.weights.append(float(entry.weight))
            self.labels.append(entry.label())

    def _add_table(self, table: JsonlFamily) -> JsonlFamily:
        table = self._tables.setdefault(table.digest, table)
        self.families.setdefault("jsonl", table)  # the first source, for callers that read it directly
        return table

    def _entry_family(self, entry: MixEntry) -> TaskFamily:
        """The family object that draws ``entry``'s prompts (building jsonl sources and rg datasets)."""
        if entry.family == "rg":
            from hivespec.node.tasks.rg import RgDataset, RgFamily

            if not entry.name:
                raise ConfigError("tasks.mix: an rg entry needs the reasoning-gym dataset as name (e.g. name: leg_counting)")
            if self._rg is None:
                self._rg = self.families["rg"] = RgFamily()
            return self._rg.add(RgDataset(entry.name, entry.config))
        if entry.family == "jsonl":
            if entry.name is None:
                if not self._tables:
                    raise ConfigError("tasks.mix: a jsonl entry needs a name (a file or a Hugging Face dataset id), or set a jsonl_path (tasks.jsonl_path)")
                return self.families["jsonl"]
            return self._add_table(_table_source(entry))
        if entry.config:
            raise ConfigError(f"tasks.mix {entry.family}: only rg entries take a config, got {dict(entry.config)}")
        family = self.families.get(entry.family)
        if family is None:
            raise ConfigError(f"unknown task family {entry.family!r} in tasks.mix; use one of arith, count, jsonl, rg")
        return family

    @classmethod
    def from_config(cls, tasks_config: Any, system_prompt: str | None = SYSTEM_PROMPT) -> TaskSource:
        """Build from a ``TaskConfig``-shaped object: ``.mix`` entries shaped like `MixEntry` and ``.jsonl_path``."""
        mix = [MixEntry.of(entry) for entry in tasks_config.mix]
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

    def check_trainable(self) -> None:
        """Raise ConfigError naming each mix entry whose questions are all held out (none of seeds 0..TRAINABLE_DRAWS-1
        gives one that is not): training would never draw it, and `prompts` of a mix of such entries redraws forever.

        For a training node; an evaluation may hold out a whole source.
        """
        if self.heldout_fraction <= 0:
            return
        unused = [
            label for (family, difficulty), label in zip(self.mix, self.labels)
            if all(self.is_heldout(family.make(seed, difficulty)) for seed in range(TRAINABLE_DRAWS))
        ]
        if unused:
            raise ConfigError(
                f"tasks.heldout_fraction {self.heldout_fraction:g} holds out every question of tasks.mix {', '.join(unused)} "
                f"(the first {TRAINABLE_DRAWS} drawn): training could never draw one; lower tasks.heldout_fraction or give "
                "the entry more questions"
            )

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
        return self.resolve(prompt_id)[0]

    def resolve(self, prompt_id: object) -> tuple[Task | None, str]:
        """``(task, "")`` for a prompt id this node can regenerate, else ``(None, reason)``; never raises.

        Reasons: ``malformed_spec`` (not a canonical id), ``unknown_family``, ``jsonl_other_source``
        (a file or dataset we do not hold), ``rg_unknown_dataset``, ``rg_other_version``,
        ``rg_other_config`` (reasoning-gym datasets outside our mix, or built by another version or config).
        """
        if not isinstance(prompt_id, str) or len(prompt_id) > MAX_PROMPT_ID_LENGTH:
            return None, "malformed_spec"
        family_name = prompt_id.partition(":")[0]
        try:
            if family_name == "jsonl":
                digest = jsonl_digest(prompt_id)
                if digest is None:
                    return None, "malformed_spec"
                table = self._tables.get(digest)
                if table is None:
                    return None, "jsonl_other_source"
                task = table.from_prompt_id(prompt_id)
                return (task, "") if task is not None else (None, "malformed_spec")
            if family_name == "rg" and self._rg is None:
                return None, "rg_unknown_dataset"  # no rg entry in our mix (maybe no reasoning-gym installed)
            family = self.families.get(family_name)
            if family is None:
                return None, "unknown_family"
            task = family.from_prompt_id(prompt_id)
            if task is not None:
                return task, ""
            return None, family.explain(prompt_id) if hasattr(family, "explain") else "malformed_spec"
        except Exception:  # a peer's bytes must never crash the receive loop
            log.debug("prompt id %r failed to resolve", prompt_id, exc_info=True)
            return None, "malformed_spec"

    def reward(self, task: Task, completion: str) -> float:
        """The reward of ``completion`` for ``task`` under its family's rule (1.0 or 0.0)."""
        if task.family == "jsonl":
            return self._tables[jsonl_digest(task.prompt_id) or ""].reward(task, completion)
        return self.families[task.family].reward(task, completion)

    def chat_prompt_ids(self, tokenizer: Any, task: Task) -> list[int]:
        """Token ids of ``task`` in the tokenizer's chat template, ending with the assistant turn opener."""
        return chat_prompt_ids(tokenizer, task, self.system_prompt)


def chat_prompt_ids(tokenizer: Any, task: Task, system_prompt: str | None = SYSTEM_PROMPT) -> list[int]:
    """Encode ``task`` with the chat template (``add_generation_prompt=True``); None keeps the template's own system prompt.

    Rendering to text and encoding without extra special tokens is what ``apply_chat_template``
    does internally, and returns a plain list in every transformers version.
    """
    if getattr(tokenizer, "chat_template", "") is None:  # a Hugging Face tokenizer of a base model
        raise InputError(
            f"model.name: the tokenizer of {getattr(tokenizer, 'name_or_path', 'this model')!r} has no chat template; hivespec "
            "encodes every task through it: use an instruct/chat model (or a tokenizer folder with chat_template.jinja)"
        )
    messages = [{"role": "user", "content": task.question}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _table_source(entry: MixEntry) -> JsonlFamily:
    """The jsonl source an entry names: a local file when the path exists, else a Hugging Face dataset id."""
    from hivespec.node.hub import looks_like_repo_id

    name = str(entry.name)
    reading: dict[str, Any] = {
        "question_column": entry.question_column, "answer_column": entry.answer_column, "answer_check": entry.answer_check,
    }
    if Path(name).expanduser().exists():
        return JsonlFamily(name, **reading)
    if looks_like_repo_id(name):
        return JsonlFamily(dataset=name, revision=entry.revision, subset=entry.subset, split=entry.split, **reading)
    raise JsonlTaskError(f"tasks.mix jsonl name {name!r} is neither an existing file nor a Hugging Face dataset id (owner/name)")
