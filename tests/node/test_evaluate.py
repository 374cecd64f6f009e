"""`hivespec eval`: pass@k and standard errors, and base vs trained on the same held-out questions (tiny model)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from hivespec.node.config import InputError, load_config
from hivespec.node.evaluate import EvalSettings, ModelScores, compare, format_table, mean_and_se, pass_at_k
from hivespec.node.export import export_policy, find_policy
from hivespec.node.latest_policy import PolicyRecord, keep_latest_policy, recorded_mix
from hivespec.node.model.loader import load_model, load_tokenizer, model_fingerprint
from hivespec.node.results_cli import add_result_commands
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.checkpoint import model_tensors

MIX = [{"family": "arith", "difficulty": 1, "weight": 1.0}, {"family": "count", "difficulty": 1, "weight": 1.0}]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the share of right samples
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert EvalSettings(samples=8).ks == [1, 4, 8] and EvalSettings(samples=2).ks == [1, 2] and EvalSettings(samples=0).ks == []


def test_differences_are_paired_by_question():
    base = ModelScores("base", "b", greedy=[0.0, 1.0, 0.0, 1.0], correct=[0, 2, 1, 2], samples=2)
    trained = ModelScores("trained", "t", greedy=[1.0, 1.0, 0.0, 1.0], correct=[1, 2, 2, 2], samples=2)
    diff = compare(base, trained, [1, 2])
    assert diff["greedy"].mean == 0.25 and diff["greedy"].se == pytest.approx(mean_and_se([1, 0, 0, 0])[1])
    assert diff["pass@1"].mean == pytest.approx(0.25)
    table = format_table([base, trained], EvalSettings(questions=4, samples=2), "4 questions")
    assert "trained - base (paired)" in table and "+0.250 ± 0.250" in table and "pass@2 (T=1, n=2)" in table


def _eval(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_result_commands(parser.add_subparsers())
    args = parser.parse_args(["eval", *argv, "--n", "4", "--samples", "2", "--max-new-tokens", "4", "--json"])
    return args


def _home(tmp_path, *, nudge: float, heldout: float = 0.5, base: str = "tiny", mix: list[dict] = MIX):
    model, tokenizer = load_model(base), load_tokenizer(base)
    with torch.no_grad():
        model.lm_head.weight.add_(nudge)  # tied to the embeddings: a different policy unless 0
    record = PolicyRecord(node="n0", peer_id="p", swarm="s", model=base, revision=None,
                          commit=getattr(model.config, "_commit_hash", None),
                          fingerprint=model_fingerprint(model.config, tokenizer), policy_version=1, rounds=1, policy_hash="",
                          weights="", weights_sha256="", train_dtype="float32", tasks=mix, heldout_fraction=heldout)
    home = tmp_path / "home"
    keep_latest_policy(home, record, model_tensors(model))
    return home


def test_eval_asks_held_out_questions_of_the_trained_mix_and_an_unchanged_policy_scores_as_its_base(tmp_path, capsys):
    home = _home(tmp_path, nudge=0.0)
    out = export_policy(find_policy(home), tmp_path / "exported").out
    args = _eval("--model", str(out))
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert "is not the file hivespec export wrote" not in captured.err  # the export as written
    result = json.loads(captured.out)
    tasks = TaskSource.from_config(load_config(None, overrides={"tasks.mix": json.dumps(MIX), "tasks.heldout_fraction": "0.5"}).tasks)
    expected = [t.prompt_id for t in tasks.heldout(seed=0, count=4)]
    assert result["questions"] == expected
    base, trained = result["models"]["base"], result["models"]["trained"]
    assert base["model"] == "tiny" and trained["model"] == str(out)
    # Same weights, same questions, same sampling keys: the same completions, a difference of exactly 0.
    assert base["greedy_per_question"] == trained["greedy_per_question"] and base["correct_per_question"] == trained["correct_per_question"]
    assert result["difference"]["greedy"] == {"mean": 0.0, "se": 0.0} and set(result["difference"]) == {"greedy", "pass@1", "pass@2"}
    assert all(v in (0.0, 1.0) for v in base["greedy_per_question"]) and all(0 <= c <= 2 for c in base["correct_per_question"])


def test_eval_says_how_it_goes_on_stderr_beside_its_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("hivespec.node.evaluate.PROGRESS_EVERY_S", 0.0)  # a line after every decode step
    args = _eval("--home", str(_home(tmp_path, nudge=0.05)))
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["models"]["trained"]["model"].endswith("policy version 1")  # stdout: the JSON alone
    lines = captured.err.splitlines()
    # 4 questions x 4 new tokens at most: greedy 16 tokens, then 2 samples a question 32.
    assert any(line.startswith("  base, greedy: ") and line.endswith(" s") and "of at most 16 tokens" in line for line in lines)
    assert any(line.startswith("  trained, 2 samples a question: ") and "of at most 32 tokens" in line for line in lines)


def test_eval_of_a_home_and_what_it_refuses(tmp_path, capsys):
    home = _home(tmp_path, nudge=0.05)
    args = _eval("--home", str(home))
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["models"]["trained"]["model"].endswith("policy version 1") and len(result["questions"]) == 4
    no_split = _home(tmp_path / "other", nudge=0.0, heldout=0.0)
    args = _eval("--home", str(no_split))
    with pytest.raises(InputError, match="heldout_fraction 0"):
        args.func(args)


def test_eval_refuses_a_damaged_or_mismatched_trained_model_before_it_scores_anything(tmp_path, monkeypatch):
    """Each of these was found only after the base had been scored (minutes at the defaults)."""
    from hivespec.node.model.loader import tiny_config

    def scored(*_, **__):
        raise AssertionError("a model was scored before the inputs were checked")

    monkeypatch.setattr("hivespec.node.evaluate.score_model", scored)
    home = _home(tmp_path, nudge=0.05)
    other_base = tmp_path / "one-layer"
    config = tiny_config(load_tokenizer("tiny"))
    config.num_hidden_layers = 1
    config.save_pretrained(other_base)
    load_tokenizer("tiny").save_pretrained(other_base)  # a config and a tokenizer, no weights: only they are read
    args = _eval("--home", str(home), "--base", str(other_base))
    with pytest.raises(InputError, match="not the same architecture and tokenizer"):
        args.func(args)
    no_weights = tmp_path / "no-weights"
    config.save_pretrained(no_weights)
    args = _eval("--model", str(no_weights), "--base", "tiny", "--config", "demo")
    with pytest.raises(InputError, match=f"cannot load --model {no_weights}"):
        args.func(args)
    (home / "policy" / "model.safetensors").write_bytes(b"damaged")
    args = _eval("--home", str(home))
    with pytest.raises(InputError, match="the file is damaged or was replaced") as refused:
        args.func(args)
    assert "then `hivespec eval --model OUT`" in str(refused.value) and "with --checkpoint" not in str(refused.value)  # eval has none


def _task_file(path, *, short: int, long: int):
    """A user's task file: `short` questions, and `long` ones too long for the tiny model's positions with any completion."""
    words = "word " * load_model("tiny").config.max_position_embeddings
    rows = [{"question": f"What is {i} + 3?", "answer": i + 3} for i in range(short)]
    rows += [{"question": f"{words}{i}", "answer": 1} for i in range(long)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [{"family": "jsonl", "name": str(path)}]


def test_eval_skips_a_question_too_long_for_the_model_as_training_does_and_says_so(tmp_path, capsys):
    # A user's task file with a long question: the engine refused its prompt, and eval ended in a ValueError traceback.
    home = _home(tmp_path, nudge=0.05, mix=_task_file(tmp_path / "tasks.jsonl", short=20, long=20))
    args = _eval("--home", str(home))
    assert args.func(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["skipped"] and len(result["questions"]) + len(result["skipped"]) == 4
    # Every score is over the questions it names, and those alone.
    assert all(len(m["greedy_per_question"]) == len(result["questions"]) for m in result["models"].values())
    assert f"skipped {len(result['skipped'])} of 4 held-out questions, too long for the model's 2048 positions" in captured.err
    only_long = _home(tmp_path / "long", nudge=0.05, mix=_task_file(tmp_path / "long.jsonl", short=0, long=20))
    args = _eval("--home", str(only_long))
    with pytest.raises(InputError, match="every one of the 4 held-out questions is too long .* nothing to score"):
        args.func(args)


def test_eval_of_a_policy_trained_on_tasks_jsonl_path_asks_for_its_config_and_takes_it(tmp_path, capsys):
    # The record keeps tasks.mix, whose jsonl entry has no name (it read tasks.jsonl_path): eval's rebuilt mix ended in
    # "set a jsonl_path (tasks.jsonl_path)", a key eval has no flag for.
    [jsonl] = _task_file(tmp_path / "tasks.jsonl", short=40, long=0)
    home = _home(tmp_path, nudge=0.05, mix=[{"family": "jsonl", "name": None}])
    args = _eval("--home", str(home))
    with pytest.raises(InputError, match="tasks.jsonl_path, which its record does not name; pass --config"):
        args.func(args)
    config = tmp_path / "trained.yaml"
    config.write_text(f"tasks:\n  jsonl_path: {jsonl['name']}\n  mix: [{{family: jsonl}}]\n  heldout_fraction: 0.5\n")
    args = _eval("--home", str(home), "--config", str(config))
    assert args.func(args) == 0 and len(json.loads(capsys.readouterr().out)["questions"]) == 4


def test_a_policy_trained_on_tasks_jsonl_path_records_the_file_and_eval_asks_its_questions(tmp_path, capsys, monkeypatch):
    """A node records tasks.mix with the file tasks.jsonl_path named (relative to where it ran): eval needs no config."""
    _task_file(tmp_path / "tasks.jsonl", short=40, long=0)
    monkeypatch.chdir(tmp_path)
    trained = load_config(None, overrides={"tasks.jsonl_path": "tasks.jsonl", "tasks.mix": "[{family: jsonl}]",
                                           "tasks.heldout_fraction": "0.5"}, environ={}).tasks
    mix = recorded_mix(trained)
    assert mix[0]["name"] == str(tmp_path / "tasks.jsonl")
    expected = [t.prompt_id for t in TaskSource.from_config(trained).heldout(seed=0, count=4)]
    home = _home(tmp_path, nudge=0.05, mix=mix)
    monkeypatch.chdir(tmp_path.parent)  # eval runs elsewhere
    args = _eval("--home", str(home))
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["questions"] == expected


HUB_REPO, HUB_COMMIT = "hivespec-test/tiny-chat", "c" * 40


@pytest.fixture
def hub_base(tmp_path, monkeypatch) -> str:
    """A hub cache holding the tiny model as HUB_REPO at HUB_COMMIT (as tests/node/test_hub_model.py builds one), offline."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / f"models--{HUB_REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / HUB_COMMIT
    load_model("tiny").save_pretrained(snapshot)
    load_tokenizer("tiny").save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return HUB_REPO


def test_an_export_of_a_policy_trained_from_a_hub_model_is_evaluated_and_rejoins_its_swarm(tmp_path, capsys, hub_base):
    """save_pretrained drops the hub commit the node's fingerprint covers: eval compared the two and always refused."""
    home = _home(tmp_path, nudge=0.05, base=hub_base)
    out = export_policy(find_policy(home), tmp_path / "exported").out
    args = _eval("--model", str(out))
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["models"]["base"]["model"] == hub_base and result["models"]["trained"]["model"] == str(out)
    # `hivespec join --model DIR`: the fingerprint the node trained under (its swarm's), hub commit and all.
    trained_under = find_policy(home).record.fingerprint
    assert model_fingerprint(load_model(str(out)).config, load_tokenizer(str(out))) == trained_under


def test_eval_of_an_export_whose_weights_changed_since_says_so_and_scores_them(tmp_path, capsys):
    """An export's weights are hashed into its record; a file changed since (by the user on purpose, or a copy gone
    wrong) was scored without a word. eval now says so on stderr and scores the folder as it is."""
    from safetensors.torch import load_file, save_file

    out = export_policy(find_policy(_home(tmp_path, nudge=0.05)), tmp_path / "exported").out
    [weights] = out.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, weights, metadata={"format": "pt"})
    args = _eval("--model", str(out))
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert f"{weights.name} is not the file hivespec export wrote" in captured.err
    assert json.loads(captured.out)["models"]["trained"]["model"] == str(out)
