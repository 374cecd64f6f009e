"""The reasoning-gym family: self-describing specs, receiver-side regeneration and re-scoring, the closed stuffing hole."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest

from hivespec.node.config import ConfigError, TaskMix
from hivespec.node.tasks import MixEntry, TaskSource
from hivespec.node.tasks.rg import RgConfigError, RgDataset, extract_final_answer, installed_version, scorer_runs_answer_as_code

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the rg extra is installed by `make install`")

LEGS = MixEntry("rg", name="leg_counting", config={"min_animals": 1, "max_animals": 2, "max_instances": 2})
SUMS = MixEntry("rg", name="chain_sum", config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})


def test_spec_names_dataset_version_config_seed_and_index() -> None:
    source = TaskSource([LEGS, SUMS])
    tasks = source.prompts(seed=3, round=0, count=12)
    assert {t.prompt_id.split(":")[1] for t in tasks} == {"leg_counting", "chain_sum"}
    for task in tasks:
        family, dataset, version, digest, seed, index = task.prompt_id.split(":")
        assert (family, version, seed) == ("rg", installed_version(), "0")
        assert len(digest) == 8 and 0 <= int(index) < 100_000
        # reasoning-gym itself, built from the spec alone, gives the same question and answer.
        config = dict(LEGS.config if dataset == "leg_counting" else SUMS.config)
        item = reasoning_gym.create_dataset(dataset, seed=0, size=100_000, **config)[int(index)]
        assert (task.question, task.answer) == (item["question"], str(item["answer"]))


def test_a_receiver_regenerates_a_peers_task_itself() -> None:
    sender, receiver = TaskSource([LEGS, SUMS]), TaskSource([SUMS, LEGS, ("arith", 1, 1.0)])
    for task in sender.prompts(seed=11, round=2, count=8):
        assert receiver.resolve(task.prompt_id) == (task, "")


def test_a_peer_with_another_seed_is_regenerated_with_that_seed() -> None:
    other_seed = dataclasses.replace(LEGS, config={**LEGS.config, "seed": 77})
    peer, receiver = TaskSource([other_seed]), TaskSource([LEGS])
    task = peer.prompts(seed=1, round=0, count=1)[0]
    assert task.prompt_id.split(":")[4] == "77"
    assert receiver.lookup(task.prompt_id) == task


def test_specs_we_cannot_regenerate_say_why() -> None:
    receiver = TaskSource([LEGS])
    task = receiver.prompts(seed=1, round=0, count=1)[0]
    _, name, version, digest, seed, index = task.prompt_id.split(":")
    harder = TaskSource([dataclasses.replace(LEGS, config={**LEGS.config, "max_animals": 5})]).prompts(seed=1, round=0, count=1)[0]
    cases = {
        f"rg:{name}:0.0.1:{digest}:{seed}:{index}": "rg_other_version",
        harder.prompt_id: "rg_other_config",
        f"rg:chain_sum:{version}:{digest}:{seed}:{index}": "rg_unknown_dataset",  # exists in reasoning-gym, not in our mix
        f"rg:no_such_thing:{version}:{digest}:0:0": "rg_unknown_dataset",
        f"rg:{name}:{version}:{digest}:{seed}:100000": "malformed_spec",  # index past the dataset's size
        f"rg:{name}:{version}:{digest}:0{seed}:{index}": "malformed_spec",  # not canonical
        f"rg:{name}:{version}:{digest}:{seed}": "malformed_spec",
    }
    for prompt_id, reason in cases.items():
        assert receiver.resolve(prompt_id) == (None, reason), prompt_id
    assert TaskSource().resolve(task.prompt_id) == (None, "rg_unknown_dataset")
    # Resolving foreign specs built nothing: the receiver still holds only its own dataset.
    assert list(receiver.families["rg"].datasets) == [("leg_counting", task.prompt_id.split(":")[3])]


def test_reward_is_the_extracted_answer_under_reasoning_gyms_scorer() -> None:
    source = TaskSource([SUMS])
    task = source.prompts(seed=5, round=0, count=1)[0]
    right, wrong = task.answer, str(int(task.answer) + 1)
    assert source.reward(task, f"<answer>{right}</answer>") == 1.0
    assert source.reward(task, f"Let me think. The answer is {right}.") == 1.0
    assert source.reward(task, f"{right}") == 1.0
    assert source.reward(task, f"<answer>{wrong}</answer>") == 0.0
    assert source.reward(task, "I cannot tell.") == 0.0


def test_answer_stuffing_earns_nothing() -> None:
    """reasoning-gym's default scorer pays partial credit to any answer containing the oracle; ours does not."""
    source = TaskSource([LEGS])
    task = next(t for t in source.prompts(seed=2, round=0, count=20) if int(t.answer) > 0)
    stuffed = " ".join(str(n) for n in range(int(task.answer) + 3))
    dataset = source.families["rg"].datasets[("leg_counting", task.prompt_id.split(":")[3])]
    item = dataset.entry(0, int(task.prompt_id.split(":")[5]))
    assert 0 < dataset._dataset_for(0).score_answer(stuffed, item) < 1, "the hole this family closes"
    for completion in (f"<answer>{stuffed}</answer>", stuffed, f"The answer is {stuffed}", f"<answer>{task.answer}, {stuffed}</answer>"):
        assert source.reward(task, completion) == 0.0, completion


def test_extract_final_answer_rules() -> None:
    assert extract_final_answer("<answer>a</answer> then <answer> b </answer>", "x") == "b"
    assert extract_final_answer("2 + 3 = 5, so that is it", "5") == "5"
    assert extract_final_answer("The answer is **-4.50**", "-4.5") == "-4.5"
    assert extract_final_answer("The answer is: gnisucxe.\nMore text", "gnisucxe") == "gnisucxe"
    assert extract_final_answer("\n  nus  \nsun", "nus") == "nus"
    assert extract_final_answer("no number here", "7") is None
    assert extract_final_answer("<answer>" + "9" * 600 + "</answer>", "9") is None
    assert extract_final_answer("<answer> a </answer><answer>b", "x") == "a"  # an unclosed tag is no pair
    assert extract_final_answer("The answer is:\n\n **gnisucxe**", "gnisucxe") == "gnisucxe"


def test_a_hostile_completion_is_read_in_linear_time() -> None:
    """"answer is" + 20,000 newlines was split three ways by the phrase rule (hours), 40,000 unclosed <answer> tags were
    each searched to the end (minutes); each is one pass now. In a child process: a regex cannot be interrupted."""
    code = (
        "from hivespec.node.tasks.rg import extract_final_answer as final\n"
        "assert final('answer is' + '\\n' * 20_000, 'abc') == 'answer is'\n"
        "assert final('<answer>' * 40_000, '12') is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bad_rg_configs_are_actionable() -> None:
    with pytest.raises(RgConfigError, match="no dataset 'leg_countin'"):
        RgDataset("leg_countin")
    with pytest.raises(RgConfigError, match=r"unknown config key\(s\) \['max_legs'\]"):
        RgDataset("leg_counting", {"max_legs": 3})
    with pytest.raises(RgConfigError, match="refuses config"):
        RgDataset("leg_counting", {"min_animals": 5, "max_animals": 2})
    with pytest.raises(RgConfigError, match="seed must be"):
        RgDataset("leg_counting", {"seed": -1})


@pytest.mark.parametrize("name", ["countdown", "n_queens", "string_insertion", "polynomial_multiplication"])
def test_a_dataset_whose_scorer_runs_the_answer_as_code_is_refused(name: str, tmp_path) -> None:
    """reasoning-gym's scorer evals these answers: a peer's completion would run on the node that scores it."""
    dataset = reasoning_gym.create_dataset(name, seed=0, size=2)
    marker = tmp_path / "ran"
    dataset.score_answer(f"__import__('pathlib').Path({str(marker)!r}).touch()", dataset[0])
    assert marker.exists(), "the hole this check closes"
    with pytest.raises(RgConfigError, match=rf"rg {name}: .* running the answer's text as code .*choose another dataset"):
        TaskSource([MixEntry("rg", name=name)])


def test_datasets_that_run_only_their_own_data_are_offered() -> None:
    for name in ("number_sorting", "codeio", "leg_counting"):
        assert scorer_runs_answer_as_code(name, reasoning_gym.factory.DATASETS[name][0]) is None, name


def test_config_without_the_extra_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'hivespec\[rg\]'"):
        TaskMix(family="rg", name="leg_counting")


def test_rg_preset_loads_and_builds() -> None:
    from hivespec.node.config import load_config

    config = load_config("rg")
    source = TaskSource.from_config(config.tasks)
    assert {label.split(":")[0] for label in source.labels} == {"rg"}
    assert len(source.prompts(seed=0, round=0, count=8)) == 8
