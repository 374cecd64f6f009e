"""The attention kernel per role, and whether the trainer runs a group's prompt once: explicit values win, "auto"
measures once per machine and follows the numbers.

Measurements run for real on a tiny model (milliseconds). The decision rule is checked against
cache entries written the way a measurement writes them, so it does not depend on what this CPU
happens to measure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hivespec.node.config import ConfigError, load_config
from hivespec.node.model import attention
from hivespec.node.model.loader import load_model
from hivespec.node.model.precision import ModelShape, cpu_facts, measurement_key

THREADS = 1


@pytest.fixture
def tiny():
    return load_model("tiny", dtype=torch.float32)


def _engine(model, cache, requested="auto", device="cpu"):
    return attention.decide_engine(requested, model, device=device, batch=4, context=12, threads=THREADS, cache=cache)


def _trainer(model, cache, requested="auto", device="cpu"):
    return attention.decide_trainer(requested, model, device=device, rows=2, tokens=16, autocast_dtype=None, threads=THREADS, cache=cache)


def _seed(path: Path, model, *, engine: tuple[float, float], trainer: tuple[float, float]) -> None:
    """Write (sdpa, eager) seconds per role under the keys the decisions above look up."""
    shape, facts = ModelShape.of(model.config), cpu_facts()
    data = {
        measurement_key("attention-decode-float32-12", shape, 4, THREADS, facts): dict(zip(("sdpa", "eager"), engine, strict=True)),
        measurement_key("attention-train-off-16", shape, 2, THREADS, facts): dict(zip(("sdpa", "eager"), trainer, strict=True)),
    }
    path.write_text(json.dumps(data))


def test_explicit_and_non_cpu_choices_measure_nothing(tiny, tmp_path):
    cache = tmp_path / "precision.json"
    for requested, eager in (("eager", True), ("sdpa", False)):
        for decide in (_engine, _trainer):
            choice = decide(tiny, cache, requested)
            assert choice.eager is eager and choice.source == "explicit" and choice.implementation == requested
    choice = _engine(tiny, cache, device="cuda")
    assert not choice.eager and choice.source == "device" and "sdpa" in choice.reason  # the model's own
    assert not cache.exists()


def test_auto_measures_once_then_reads_the_machine_cache_and_leaves_the_model_as_it_was(tiny, tmp_path):
    cache = tmp_path / "precision.json"
    first = [_engine(tiny, cache), _trainer(tiny, cache)]
    assert [c.source for c in first] == ["measured", "measured"]
    assert all("sdpa" in c.reason and "eager" in c.reason and cpu_facts()["cpu"] in c.reason for c in first)
    assert tiny.config._attn_implementation == "sdpa"
    entries = json.loads(cache.read_text())
    assert len(entries) == 2 and all({"sdpa", "eager"} <= set(e) and min(e["sdpa"], e["eager"]) > 0 for e in entries.values())
    second = [_engine(tiny, cache), _trainer(tiny, cache)]
    assert [c.source for c in second] == ["cached", "cached"]
    assert [c.eager for c in second] == [c.eager for c in first] and [c.reason for c in second] == [c.reason for c in first]


@pytest.mark.parametrize(
    ("engine", "trainer", "engine_eager", "trainer_eager"),
    [
        ((0.075, 0.044), (0.28, 0.22), True, True),  # the 2-core EPYC at batch 16, bf16 autocast
        ((0.031, 0.029), (0.62, 0.63), False, False),  # batch 2, float32 training: within the margin SDPA stays
        ((0.050, 0.080), (0.20, 0.40), False, False),
    ],
)
def test_auto_follows_the_measured_numbers(tiny, tmp_path, engine, trainer, engine_eager, trainer_eager):
    cache = tmp_path / "precision.json"
    _seed(cache, tiny, engine=engine, trainer=trainer)
    choices = _engine(tiny, cache), _trainer(tiny, cache)
    assert [c.source for c in choices] == ["cached", "cached"]
    assert [c.eager for c in choices] == [engine_eager, trainer_eager]


def _sharing(model, cache, requested="auto", rows=2, packed=4):
    return attention.decide_shared_prompts(requested, model, device="cpu", rows=rows, packed=packed, prompt_tokens=8, completion_tokens=6,
                                           autocast_dtype=None, eager=False, threads=THREADS, cache=cache)


def test_sharing_a_prompt_is_explicit_or_measured_once_at_a_group_of_at_least_four(tiny, tmp_path):
    cache = tmp_path / "precision.json"
    for requested in (True, False):
        choice = _sharing(tiny, cache, requested)
        assert choice.share is requested and choice.source == "explicit"
    assert not cache.exists()
    first = _sharing(tiny, cache)
    # 2 rows of a prompt: measured at 4, and whole rows in micro batches of at least as many
    assert first.source == "measured" and f"the prompt once for {attention.SHARED_PROMPT_MIN_SAMPLES} of a prompt" in first.reason
    assert "micro batches of 4" in first.reason
    (entry,) = json.loads(cache.read_text()).values()
    assert min(entry[name] for name in attention.SHARING_RUNS) > 0
    second = _sharing(tiny, cache)
    assert second.source == "cached" and (second.share, second.reason) == (first.share, first.reason)


@pytest.mark.parametrize(
    ("timings", "packed", "share"),
    [
        # (1 layer, 2 layers) per way. The 2-core EPYC, 8 completions of a 64-token prompt, bf16 autocast: at 2 layers
        # the prompt once costs 0.92x; taken to 30 layers, 0.68x.
        (((0.123, 0.232), (0.140, 0.212)), 4, True),
        (((0.060, 0.062), (0.110, 0.113)), 4, False),  # a GPU: one more forward costs more than the tokens it saves
        (((0.100, 0.200), (0.095, 0.190)), 4, False),  # within the margin: every row whole
        (((0.100, 0.095), (0.050, 0.049)), 4, True),  # noise below the cost of a layer: taken as 0 per layer
        # Per sample: 8 whole rows a micro batch in 1.6x the time of 4 (whole-*: 8 rows), against the prompt once for 4
        # at 0.85x of 4 whole rows: faster for one group, slower for a round (twice the micro batches).
        (((0.160, 0.320), (0.085, 0.170)), 8, False),
        (((0.160, 0.320), (0.060, 0.120)), 8, True),  # 4 shared at 0.6x of 4 whole: 0.75x of a whole row's time
    ],
)
def test_sharing_follows_the_numbers_per_sample_taken_to_the_models_depth(tiny, tmp_path, timings, packed, share):
    cache = tmp_path / "precision.json"
    tiny.config.num_hidden_layers = 30  # the depth the timings are taken to (nothing runs it: the cache answers)
    name = f"shared-prompt-cpu-{cpu_facts()['cpu']}-off-own-8-6-packed{packed}"
    key = measurement_key(name, ModelShape.of(tiny.config), 4, THREADS, cpu_facts())
    (w1, w2), (s1, s2) = timings
    cache.write_text(json.dumps({key: {"whole-1": w1, "whole-2": w2, "shared-1": s1, "shared-2": s2}}))
    choice = _sharing(tiny, cache, packed=packed)
    assert choice.source == "cached" and choice.share is share
    assert attention.predicted_seconds({"x-1": 0.123, "x-2": 0.232}, "x", 30) == pytest.approx(0.123 + 29 * 0.109)


def test_a_shared_prompt_gives_the_hidden_states_of_every_row_whole(tiny):
    """What the measurement times is what the trainer runs: `hidden_states` with a prompt equals the rows run whole."""
    model = tiny.double()
    backbone = model.model
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    ids[:, :5] = ids[0, :5]
    mask = torch.ones_like(ids)
    whole = attention.hidden_states(backbone, ids, mask)
    shared = attention.hidden_states(backbone, ids[:, 5:], mask, ids[:1, :5])
    assert shared.shape == (3, 5, model.config.hidden_size)  # the prompt's last state, then the 4 completion tokens'
    assert torch.allclose(shared, whole[:, 4:], rtol=0, atol=1e-12)


def test_a_model_loaded_with_eager_attention_keeps_it(tmp_path):
    model = load_model("tiny", dtype=torch.float32)
    model.set_attn_implementation("eager")
    choice = _engine(model, tmp_path / "precision.json")
    assert choice.eager and choice.source == "device"


def test_config_takes_auto_sdpa_and_eager():
    assert load_config("tiny").model.attention == "auto"
    assert load_config("tiny", overrides={"model.attention": "eager"}).model.attention == "eager"
    with pytest.raises(ConfigError, match="attention"):
        load_config("tiny", overrides={"model.attention": "flash"})
    assert load_config("tiny").train.share_prompts == "auto"
    assert load_config("tiny", overrides={"train.share_prompts": "false"}).train.share_prompts is False
    with pytest.raises(ConfigError, match="share_prompts"):
        load_config("tiny", overrides={"train.share_prompts": "sometimes"})


@pytest.mark.timeout(300)
def test_a_node_runs_the_kernels_it_was_given(tmp_path):
    """`model.attention: eager` reaches the node: its engine copy decodes with eager attention, its trainer may run it
    per micro batch, the trainer's model stays on its own kernel between forwards, and the node says what it chose."""
    from test_resume import make_digit_model

    from hivespec.node.build import build_node

    model = make_digit_model(tmp_path / "digit-model")
    config = load_config("tiny", overrides={
        "home": str(tmp_path / "home"), "model.name": str(model), "model.attention": "eager", "train.share_prompts": "true", "rounds": "1",
        "swarm.swarm": "test-attention", "swarm.expected_peers": "0", "swarm.bootstrap_timeout": "0", "status.enabled": "false",
        "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false", "checkpoint.resume": "false", "speculation.enabled": "false",
    })
    node = build_node(config)
    try:
        assert node.engine._model.config._attn_implementation == "eager"
        assert node.trainer.model.config._attn_implementation == "sdpa" and node.trainer._attention.cells_per_token_pair > 0
        described = "; ".join(node.attention)
        assert "engine attention eager (explicit" in described and "trainer attention eager (explicit" in described
        assert node.trainer.share_prompts and "trainer runs a group's prompt once (explicit" in described
        (report,) = node.run(lambda report: None, keep=1)
        assert report.round == 0 and node.trainer.model.config._attn_implementation == "sdpa"
    finally:
        node.close()
