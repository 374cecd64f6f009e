"""Family "rg": reasoning-gym's procedural datasets, rebuilt and re-scored by every receiver.

A mix entry ``{family: rg, name: basic_arithmetic, config: {...}}`` builds one reasoning-gym
dataset (``reasoning_gym.create_dataset(name, seed=..., size=..., **config)``; the seed defaults
to 0 and the size to ``DEFAULT_SIZE``, so every node with the same entry draws from the same
questions). Its prompt ids name everything a receiver needs to rebuild the question and the
oracle answer itself::

    rg:<dataset>:<reasoning-gym version>:<config hash>:<seed>:<index>

The config hash covers the dataset's resolved config (defaults filled in, the size included, the
seed left out: it has its own field). A receiver rebuilds a spec only when it names a dataset of
its own mix, the same installed reasoning-gym version and the same config hash; anything else is
not regenerable (`RgFamily.explain` says why) and the rollout is ignored, never trusted. A peer's
id therefore cannot make a node construct a dataset its own config does not name.

Rewards are binary, like every family's: the completion's final answer is extracted first
(`extract_final_answer`) and scores 1.0 only when reasoning-gym's own scorer gives it full marks.
reasoning-gym's default scorer pays ``len(oracle) / len(answer)`` to any answer that merely
contains the oracle, so a completion listing many candidates would earn partial credit; scoring
one extracted answer, all or nothing, closes that.

A dataset whose scorer runs the answer's text as code (Python's ``eval``, sympy's ``parse_expr``:
countdown, n_queens, the integration sets, ...) is refused when the mix is built: the answer it
would run is a stranger's completion (`scorer_runs_answer_as_code`).

reasoning-gym is an optional extra (``pip install 'hivespec[rg]'``): its dependency set brings
matplotlib, sympy and a C extension built from source. It is imported only when a mix names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from hivespec.node.tasks.base import MAX_PROMPT_ID_LENGTH, MAX_SEED, Task, extract_answer, parse_number
from hivespec.protocol.errors import UserError

INSTALL_HINT = "pip install 'hivespec[rg]'"
# Questions per configured dataset when its config names no size; index = draw seed mod size.
DEFAULT_SIZE = 100_000
DEFAULT_SEED = 0
# Datasets built for other seeds than our own (a peer with another `seed` in the same config).
_SEED_CACHE = 8
_RG_ID = re.compile(
    r"rg:([a-z][a-z0-9_]{0,47}):([0-9A-Za-z.+]{1,24}):([0-9a-f]{8}):(0|[1-9][0-9]{0,18}):(0|[1-9][0-9]{0,18})"
)
# Longest final answer handed to a scorer; longer is not an answer, and bounds the scorer's work.
MAX_ANSWER_CHARS = 512
# What runs a string as Python: eval/exec, and sympy's parsers (which eval). A free call only: ``re.compile(`` is no such call.
_RUNS_TEXT = re.compile(r"(?<![\w.])(?:eval|exec)\s*\(|\b(?:parse_expr|sympify|parse_latex)\s*\(")
# Datasets whose class runs only its own data so (read in reasoning-gym 0.1.25): codeio execs its bundled
# generators, number_sorting evals its own oracle. Their scorers never run the answer.
_RUNS_OWN_DATA_ONLY = {"codeio": "0.1.25", "number_sorting": "0.1.25"}
# "answer is: **x**". Each whitespace run is one \s*: three in a row ("\s*:?\s*(?:\*\*)?\s*", the same language) split a
# peer's "answer is" + 2,000 newlines every way before failing, 18 s of one core for one completion.
_ANSWER_PHRASE = re.compile(r"\banswer\s*(?:is|:|=)\s*(?::\s*)?(?:\*\*\s*)?([^\n]+)", re.IGNORECASE)


class RgConfigError(UserError):
    """A reasoning-gym mix entry cannot be built: missing package, unknown dataset or bad config; the message says what to do."""


def installed_version() -> str | None:
    """The installed reasoning-gym distribution's version, or None when it is not installed.

    Read from the package metadata: ``reasoning_gym.__version__`` is stale in some releases
    (0.1.25 reports "0.1.19").
    """
    try:
        return importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        return None


def _registry() -> dict[str, Any]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise RgConfigError(
            f"tasks.mix names the reasoning-gym family (family: rg), but reasoning-gym is not installed; run: {INSTALL_HINT}"
        ) from None
    return DATASETS


def scorer_runs_answer_as_code(dataset: str, dataset_cls: type) -> str | None:
    """How ``dataset``'s scorer may run an answer's text as code (``"eval"``, ``"parse_expr"``), or None when it cannot.

    Read from the source of the class that defines ``score_answer``, its helper methods included. A peer's
    completion is such an answer: ``<answer>__import__('os').system(...)</answer>`` would run on this node.
    """
    if _RUNS_OWN_DATA_ONLY.get(dataset) == installed_version():
        return None
    owner = next((cls for cls in dataset_cls.__mro__ if "score_answer" in vars(cls)), dataset_cls)
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return "a scorer whose source cannot be read to check"
    found = _RUNS_TEXT.search(source)
    return None if found is None else found.group(0).rstrip("( ")


def config_hash(config: Any) -> str:
    """8 hex digits of sha256 over a reasoning-gym config dataclass, its ``seed`` left out."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "seed"}
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:8]


def extract_final_answer(completion: str, oracle: str) -> str | None:
    """The one final answer of a completion, as text for reasoning-gym's scorer, or None.

    In order, the first rule that applies decides: the last ``<answer>...</answer>`` (reasoning-gym's
    own convention); for a numeric oracle, hivespec's number extractor (``\\boxed{}``, "answer is",
    a leading number, "= N"), written plainly ("12", "-3.5"); else the text after "answer is"
    up to the end of its line; else the completion's first non-empty line. Never more than
    ``MAX_ANSWER_CHARS`` characters.
    """
    tagged = _last_tagged(completion)
    if tagged is not None:
        answer = tagged
    elif parse_number(oracle) is not None:
        number = extract_answer(completion)
        if number is None:
            return None
        answer = "0" if number == 0 else format(number.normalize(), "f")
    else:
        phrase = _ANSWER_PHRASE.search(completion)
        line = phrase.group(1) if phrase else next((ln for ln in completion.splitlines() if ln.strip()), "")
        answer = line.strip().strip("*").strip().removesuffix(".").strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def _last_tagged(completion: str) -> str | None:
    """The text of the last ``<answer>...</answer>`` pair (pairs taken left to right, each to its first closing tag), stripped.

    A scan, not a lazy regex: ``<answer>\\s?(.*?)\\s?</answer>`` searched to the end of the text from each of a
    peer's thousands of unclosed ``<answer>`` tags (seconds per completion).
    """
    last, at = None, 0
    while (start := completion.find("<answer>", at)) >= 0:
        end = completion.find("</answer>", start + len("<answer>"))
        if end < 0:
            break
        last, at = completion[start + len("<answer>"):end], end + len("</answer>")
    return None if last is None else last.strip()


class RgDataset:
    """One configured reasoning-gym dataset; ``make(seed)`` is the question at index ``seed mod size``."""

    name = "rg"
    max_difficulty = 1

    def __init__(self, dataset: str, config: Mapping[str, Any] | None = None) -> None:
        registry = _registry()
        if dataset not in registry:
            raise RgConfigError(
                f"reasoning-gym has no dataset {dataset!r} (version {installed_version()}); "
                f"some known ones: {', '.join(sorted(registry)[:12])}, ..."
            )
        runs = scorer_runs_answer_as_code(dataset, registry[dataset][0])
        if runs is not None:
            raise RgConfigError(
                f"rg {dataset}: reasoning-gym scores it by running the answer's text as code ({runs}), and the answers "
                "a node scores are its peers' completions: any peer could run code on this node; choose another dataset"
            )
        options = dict(config or {})
        self.seed = options.pop("seed", DEFAULT_SEED)
        size = options.pop("size", DEFAULT_SIZE)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise RgConfigError(f"rg {dataset}: config seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_SEED:
            raise RgConfigError(f"rg {dataset}: config size must be a positive integer, got {size!r}")
        self.dataset = dataset
        self.options = options
        self.version = installed_version()
        self._datasets: OrderedDict[int, Any] = OrderedDict()
        own = self._build(self.seed, size, options)
        self.size = own.size
        self.config_hash = config_hash(own.config)
        self._datasets[self.seed] = own

    def _build(self, seed: int, size: int, options: Mapping[str, Any]) -> Any:
        dataset_cls, config_cls = _registry()[self.dataset]
        valid = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise RgConfigError(f"rg {self.dataset}: unknown config key(s) {unknown}; valid: {sorted(valid - {'seed', 'size'})}")
        try:
            config = config_cls(seed=seed, size=size, **options)
            if hasattr(config, "validate"):
                config.validate()
            return dataset_cls(config=config)
        except (AssertionError, TypeError, ValueError) as error:
            raise RgConfigError(f"rg {self.dataset}: reasoning-gym refuses config {dict(options)}: {error}") from None

    def _dataset_for(self, seed: int) -> Any:
        """Our dataset rebuilt for ``seed`` (same config); a few are kept, least recently used dropped."""
        built = self._datasets.get(seed)
        if built is None:
            built = self._build(seed, self.size, self.options)
            self._datasets[seed] = built
            while len(self._datasets) > _SEED_CACHE + 1:
                oldest = next(k for k in self._datasets if k != self.seed)
                del self._datasets[oldest]
        else:
            self._datasets.move_to_end(seed)
        return built

    def prompt_id(self, seed: int, index: int) -> str:
        return f"rg:{self.dataset}:{self.version}:{self.config_hash}:{seed}:{index}"

    def entry(self, seed: int, index: int) -> dict[str, Any]:
        """reasoning-gym's item (question, answer, metadata) at ``index`` of the dataset built with ``seed``."""
        return self._dataset_for(seed)[index]

    def task(self, seed: int, index: int) -> Task:
        item = self.entry(seed, index)
        return Task(prompt_id=self.prompt_id(seed, index), family=self.name, question=item["question"], answer=str(item["answer"]))

    def make(self, seed: int, difficulty: int = 1) -> Task:
        """The question at index ``seed mod size`` of our dataset; ``difficulty`` must be 1 (the config is the difficulty)."""
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"rg: seed must be in [0, 2**63 - 1], got {seed}")
        if difficulty != 1:
            raise ValueError(f"rg: the config sets the difficulty, use difficulty 1 (got {difficulty})")
        return self.task(self.seed, seed % self.size)

    def score(self, seed: int, index: int, completion: str) -> float:
        """1.0 when the completion's extracted final answer gets reasoning-gym's full score, else 0.0."""
        item = self.entry(seed, index)
        answer = extract_final_answer(completion, str(item["answer"]))
        if answer is None:
            return 0.0
        try:
            score = float(self._dataset_for(seed).score_answer(answer, item))
        except Exception:  # noqa: BLE001 - a scorer's bug on odd text is a wrong answer, not a crash
            return 0.0
        return 1.0 if score >= 1.0 - 1e-9 else 0.0


class RgFamily:
    """Dispatches ``rg:`` prompt ids to the configured datasets and scores their completions."""

    name = "rg"
    max_difficulty = 1

    def __init__(self, datasets: list[RgDataset] | None = None) -> None:
        self.datasets: dict[tuple[str, str], RgDataset] = {}
        for dataset in datasets or []:
            self.add(dataset)

    def add(self, dataset: RgDataset) -> RgDataset:
        """Register ``dataset`` (one with the same name and config hash is reused) and return the registered one."""
        return self.datasets.setdefault((dataset.dataset, dataset.config_hash), dataset)

    def _parse(self, prompt_id: object) -> tuple[RgDataset | None, int, int, str]:
        """``(dataset, seed, index, reason)``; dataset is None when the spec is not regenerable, with the reason."""
        if not isinstance(prompt_id, str) or len(prompt_id) > MAX_PROMPT_ID_LENGTH:
            return None, 0, 0, "malformed_spec"
        match = _RG_ID.fullmatch(prompt_id)
        if match is None:
            return None, 0, 0, "malformed_spec"
        name, version, digest = match.group(1), match.group(2), match.group(3)
        seed, index = int(match.group(4)), int(match.group(5))
        ours = [dataset for key, dataset in self.datasets.items() if key[0] == name]
        if not ours:
            return None, 0, 0, "rg_unknown_dataset"
        if version != ours[0].version:
            return None, 0, 0, "rg_other_version"
        dataset = self.datasets.get((name, digest))
        if dataset is None:
            return None, 0, 0, "rg_other_config"
        if seed > MAX_SEED or index >= dataset.size:
            return None, 0, 0, "malformed_spec"
        return dataset, seed, index, ""

    def explain(self, prompt_id: object) -> str:
        """Why ``prompt_id`` is not regenerable ("" when it is): malformed_spec, rg_unknown_dataset, rg_other_config, rg_other_version."""
        return self._parse(prompt_id)[3]

    def make(self, seed: int, difficulty: int = 1) -> Task:
        raise TypeError("RgFamily only resolves prompt ids; draw prompts from an RgDataset")

    def from_prompt_id(self, prompt_id: str) -> Task | None:
        """The task an ``rg:`` spec names when it is one of our datasets at our version, else None."""
        dataset, seed, index, _ = self._parse(prompt_id)
        return None if dataset is None else dataset.task(seed, index)

    def reward(self, task: Task, completion: str) -> float:
        """Binary: reasoning-gym's scorer gives the extracted final answer full marks."""
        dataset, seed, index, reason = self._parse(task.prompt_id)
        if dataset is None:
            raise ValueError(f"cannot score {task.prompt_id!r}: {reason}")
        return dataset.score(seed, index, completion)
