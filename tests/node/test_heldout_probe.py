"""A node's held-out accuracy every eval.every_rounds rounds: a real node on the tiny digit model, no mocks."""

from __future__ import annotations

import pytest
from test_resume import make_digit_model

from hivespec.node.config import ConfigError, load_config
from hivespec.node.evaluate import EvalSettings, score_model
from hivespec.node.heldout_probe import HeldoutProbe
from hivespec.node.tasks.source import TaskSource
from hivespec.protocol.status import decode_status


def _config(tmp_path, model, rounds: str = "4", **extra):
    return load_config("tiny", overrides={
        "home": str(tmp_path / "home"), "name": "prober", "model.name": str(model), "rounds": rounds, "seed": "7",
        "swarm.swarm": "test-heldout", "swarm.expected_peers": "0", "swarm.bootstrap_timeout": "0", "status.enabled": "false",
        "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false", "checkpoint.resume": "false",
        "speculation.enabled": "false", "tasks.mix": "[{family: count, difficulty: 1}]", "tasks.heldout_fraction": "0.25",
        "rollout.prompts_per_round": "4", "eval.questions": "6", "eval.max_new_tokens": "8", **extra,
    })


def test_eval_settings_declare_their_ranges():
    with pytest.raises(ConfigError, match="eval.every_rounds must be >= 0"):
        load_config(None, overrides={"eval.every_rounds": "-1"})
    with pytest.raises(ConfigError, match="eval.questions"):
        load_config(None, overrides={"eval.questions": "0"})
    assert load_config(None).eval.every_rounds == 0  # off unless asked


@pytest.mark.timeout(600)
def test_a_node_scores_itself_every_n_rounds_as_hivespec_eval_would(tmp_path):
    from hivespec.node.build import build_node

    model = make_digit_model(tmp_path / "digit-model")
    phases: list[tuple[str, str]] = []
    node = build_node(_config(tmp_path, model, **{"eval.every_rounds": "2"}), on_phase=lambda *phase: phases.append(phase))
    try:
        mode = node.trainer.model.training
        reports = node.run()
        assert [r.heldout_accuracy is None for r in reports] == [True, False, True, False]
        # While it scores, the node says so (the demo prints the phase): after rounds 2 and 4.
        assert [detail for phase, detail in phases if phase == "evaluating"][:1] == ["held-out accuracy after 2 rounds: 6 questions"]
        assert sum(detail.endswith(": 6 questions") for phase, detail in phases if phase == "evaluating") == 2
        assert [r.to_dict()["heldout_accuracy"] for r in reports][1::2] == [r.heldout_accuracy for r in reports][1::2]
        # The status snapshot carries the curve, through its wire form too (the dashboard reads only those bytes).
        curve = [(r.round, r.heldout_accuracy) for r in reports if r.heldout_accuracy is not None]
        verdict, snapshot = decode_status(node.status.snapshot_bytes())
        assert snapshot is not None, verdict
        assert [(p.round, p.accuracy) for p in snapshot.heldout] == curve
        assert node.trainer.model.training == mode  # the probe gives the trainer its mode back
        # The last figure is hivespec eval's greedy score of the final weights on the same questions.
        config = node.config
        questions = TaskSource.from_config(config.tasks).heldout(seed=0, count=6)
        assert [q.prompt_id for q in node.heldout.questions] == [q.prompt_id for q in questions]
        scores = score_model(node.trainer.model, node.tokenizer, node.tasks, questions,
                             EvalSettings(questions=6, samples=0, max_new_tokens=8, batch_size=6), label="x", name="x")
        assert reports[3].heldout_accuracy == sum(scores.greedy) / 6
    finally:
        node.close()


@pytest.mark.timeout(600)
def test_a_stop_during_the_probe_ends_it_at_the_next_decode_step_and_the_trained_round_is_kept(tmp_path):
    # A stop (Ctrl-C, SIGTERM, the dashboard) had waited for the whole probe: a minute at 256 questions of 512 tokens
    # on the tiny model, far longer on a real one.
    from hivespec.node.build import build_node

    node = None

    def on_phase(phase: str, detail: str) -> None:
        if phase == "evaluating":
            node.control.stop()

    node = build_node(_config(tmp_path, "tiny", rounds="3", **{"eval.every_rounds": "1", "eval.max_new_tokens": "64"}),
                      on_phase=on_phase)
    try:
        mode = node.trainer.model.training
        reports = node.run()
        assert [(r.round, r.heldout_accuracy) for r in reports] == [(0, None)]  # round 0 trained, its probe not finished
        assert node.next_round == 1 and node.trainer.model.training == mode and node.stop_report == ""
    finally:
        node.close()


def test_no_held_out_share_is_a_config_error_naming_the_fix(tmp_path):
    config = load_config(None, overrides={"eval.every_rounds": "1", "tasks.heldout_fraction": "0"})
    with pytest.raises(ConfigError, match="tasks.heldout_fraction > 0"):
        HeldoutProbe.from_config(config, TaskSource.from_config(config.tasks), tokenizer=None)


def test_a_question_too_long_for_the_model_is_left_out_at_start_and_none_left_is_a_config_error(tmp_path, caplog):
    # A user's task file with a long question: the engine refused its prompt, and the first probe ended the node.
    import json
    import logging

    from hivespec.node.model.loader import load_model, load_tokenizer

    model, tokenizer = load_model("tiny"), load_tokenizer("tiny")
    positions = model.config.max_position_embeddings
    rows = [{"question": f"What is {i} + 3?", "answer": i + 3} for i in range(20)]
    rows += [{"question": "word " * positions + str(i), "answer": 1} for i in range(20)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(None, overrides={"eval.every_rounds": "1", "eval.questions": "4", "eval.max_new_tokens": "4",
                                          "tasks.heldout_fraction": "0.5", "tasks.jsonl_path": str(tmp_path / "tasks.jsonl"),
                                          "tasks.mix": "[{family: jsonl}]"})
    tasks = TaskSource.from_config(config.tasks)
    with caplog.at_level(logging.WARNING):
        probe = HeldoutProbe.from_config(config, tasks, tokenizer, max_positions=positions)
    assert 0 < len(probe.questions) < 4 and f"{4 - len(probe.questions)} of 4 questions are too long" in caplog.text
    assert 0.0 <= probe.score(model) <= 1.0  # a mean over the questions that fit (the engine had refused the others)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[20:]))
    with pytest.raises(ConfigError, match="every one of the 4 held-out questions is too long"):
        HeldoutProbe.from_config(config, TaskSource.from_config(config.tasks), tokenizer, max_positions=positions)
