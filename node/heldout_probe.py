"""A node's own held-out accuracy every ``eval.every_rounds`` rounds (issue 24, item 2).

The questions and the scoring are `hivespec eval`'s (`TaskSource.heldout`, `evaluate.score_model`):
greedy completions of the trainer's current weights on ``eval.questions`` fixed held-out
questions (seed ``eval.seed``), scored by each task's verifier. No sampled completions, so
pass@k is `hivespec eval`'s alone. A question too long for the model's positions with
``eval.max_new_tokens`` is left out at start with a warning (`fitting_questions`), as a training
round skips it; none left is a `ConfigError`. Built once per node (`from_config`; None when off);
`score` runs on the thread that runs the rounds, between rounds, and gives the model back in the mode it had.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hivespec.node.config import ConfigError, EvalConfig, NodeConfig
from hivespec.node.evaluate import EvalSettings, fitting_questions, score_model

log = logging.getLogger(__name__)


class HeldoutProbe:
    """Greedy accuracy of a model on a fixed set of held-out questions."""

    def __init__(self, config: EvalConfig, tasks, tokenizer, *, name: str = "", max_positions: int | None = None) -> None:
        self.every_rounds = config.every_rounds
        self.settings = EvalSettings(questions=config.questions, samples=0, max_new_tokens=config.max_new_tokens,
                                     seed=config.seed, batch_size=config.questions)
        try:
            self.questions = tasks.heldout(seed=config.seed, count=config.questions)
        except ValueError as exc:
            raise ConfigError(f"eval.every_rounds={config.every_rounds} needs held-out questions: {exc}; set "
                              "tasks.heldout_fraction > 0 (the demo preset has 0.25), fewer eval.questions, "
                              "or eval.every_rounds=0") from None
        self.questions, skipped = fitting_questions(tasks, tokenizer, self.questions, config.max_new_tokens, max_positions)
        too_long = f"too long for the model's {max_positions} positions with eval.max_new_tokens={config.max_new_tokens}"
        if not self.questions:
            raise ConfigError(f"every one of the {len(skipped)} held-out questions is {too_long}: the held-out accuracy "
                              "would score none; lower eval.max_new_tokens, pick others with eval.seed, or set "
                              "eval.every_rounds=0")
        if skipped:
            log.warning("held-out accuracy: %d of %d questions are %s, skipped (as a training round skips them): %s",
                        len(skipped), config.questions, too_long, ", ".join(t.prompt_id for t in skipped[:5]))
        self._tasks, self._tokenizer, self._name = tasks, tokenizer, name

    @classmethod
    def from_config(cls, config: NodeConfig, tasks, tokenizer, *, max_positions: int | None = None) -> HeldoutProbe | None:
        if config.eval.every_rounds == 0:
            return None
        return cls(config.eval, tasks, tokenizer, name=config.name or "", max_positions=max_positions)

    def due(self, rounds_done: int) -> bool:
        """Whether the probe runs after ``rounds_done`` rounds."""
        return rounds_done > 0 and rounds_done % self.every_rounds == 0

    def score(self, model, *, on_progress: Callable[[str], None] | None = None,
              check_stop: Callable[[], None] | None = None) -> float:
        """The mean greedy reward of ``model`` over the questions (1.0: every one right); ``on_progress`` hears how far
        it is every few seconds (`score_model`'s lines); ``check_stop`` runs after every decode step and may raise to
        end the scoring (a stop request: the node's own stop switch)."""
        was_training = model.training
        try:
            scores = score_model(model, self._tokenizer, self._tasks, self.questions, self.settings,
                                 label="policy", name=self._name, on_progress=on_progress, check_stop=check_stop)
        finally:
            model.train(was_training)
        return sum(scores.greedy) / len(scores.greedy)
