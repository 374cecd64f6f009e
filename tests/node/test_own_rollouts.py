"""A round's own rollouts: a prompt too long for the model's positions is skipped, not the round."""

import json
import logging

import pytest
import torch

from hivespec.node.config import RolloutConfig
from hivespec.node.model.engine import SamplingParams, SpeculationStats, TorchEngine
from hivespec.node.model.loader import load_model, load_tokenizer
from hivespec.node.own_rollouts import make_rollouts
from hivespec.node.tasks.source import TaskSource


def test_a_prompt_too_long_for_the_models_positions_is_skipped_and_the_others_roll_out(tmp_path, caplog):
    # A user's task file with one long question: the engine refuses a prompt past the model's positions, which had
    # ended the round (and the node) whenever that question was drawn.
    model = load_model("tiny", dtype=torch.float32).eval()
    positions = model.config.max_position_embeddings
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 3?", "answer": 5}) + "\n"
                    + json.dumps({"question": "word " * positions, "answer": 1}) + "\n")
    tasks, tokenizer = TaskSource(mix=[("jsonl", 1, 1.0)], jsonl_path=path), load_tokenizer("tiny")
    config = RolloutConfig(prompts_per_round=8, num_generations=2, max_completion_length=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    lengths = {len(tasks.chat_prompt_ids(tokenizer, t)) for t in tasks.prompts(seed=0, round=0, count=8)}
    assert max(lengths) + 4 > positions >= min(lengths) + 4, "the round draws both questions"

    def roll(max_positions):
        return make_rollouts(TorchEngine(model), tasks, tokenizer, sampling, config, seed=0, round_index=0,
                             stats=SpeculationStats(), max_positions=max_positions)

    with pytest.raises(ValueError, match="positions"):
        roll(None)
    with caplog.at_level(logging.WARNING):
        rollouts = roll(positions)
    assert rollouts and all(len(r.prompt_ids) + 4 <= positions for r in rollouts)
    assert len(rollouts) % 2 == 0 and "skipped (shorten it, or lower rollout.max_completion_length)" in caplog.text
