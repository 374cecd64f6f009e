"""Device-aware precision: explicit values win, "auto" measures once per machine and follows the numbers.

Measurements run for real on the tiny model's shapes (milliseconds). The decision rule is checked
against cache entries written the way a measurement writes them, so it does not depend on what
this CPU happens to measure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hivespec.node.config import ConfigError, RolloutConfig, load_config
from hivespec.node.model.loader import load_tokenizer, tiny_config
from hivespec.node.model.precision import (
    MARGIN,
    ModelShape,
    cpu_facts,
    measure_decode,
    measure_training,
    measurement_key,
    resolve_precision,
    train_rows,
)

THREADS = 1


@pytest.fixture(scope="module")
def tiny():
    return tiny_config(load_tokenizer("tiny"))


def _resolve(tiny, cache, **overrides):
    settings = {"engine_dtype": "auto", "autocast": "auto", "train_dtype": "float32", "device": "cpu",
                "batch": 16, "rows": 256, "threads": THREADS, "cache": cache}
    return resolve_precision(tiny, **{**settings, **overrides})


def _seed_cache(path: Path, tiny, *, engine: tuple[float, float], trainer: tuple[float, float], batch=16, rows=256,
                sync: tuple[float, float] = (0.0, 0.0), local_sync: tuple[float, float] = (0.0, 0.0),
                learning_rate: float = 1e-3) -> None:
    """Write (float32, bfloat16) seconds per role under the keys this machine's node would look up."""
    shape, facts = ModelShape.of(tiny), cpu_facts()
    data = {
        measurement_key("engine", shape, batch, THREADS, facts): {"float32": engine[0], "bfloat16": engine[1]},
        measurement_key("engine-linears", shape, batch, THREADS, facts): {"float32": engine[0], "bfloat16": engine[1]},
        measurement_key("trainer", shape, rows, THREADS, facts): {"float32": trainer[0], "bfloat16": trainer[1]},
        measurement_key("sync", shape, learning_rate, THREADS, facts): {"float32": sync[0], "bfloat16": sync[1]},
        measurement_key("sync-local", shape, learning_rate, THREADS, facts): {"float32": local_sync[0], "bfloat16": local_sync[1]},
    }
    path.write_text(json.dumps(data))


def test_explicit_settings_are_honoured_without_measuring(tiny, tmp_path):
    cache = tmp_path / "precision.json"
    plan = _resolve(tiny, cache, engine_dtype="bfloat16", autocast=False)
    assert plan.engine.dtype == torch.bfloat16 and plan.engine.source == "explicit"
    assert plan.trainer.dtype is None and plan.trainer.source == "explicit"
    plan = _resolve(tiny, cache, engine_dtype="float32", autocast=True)
    assert plan.engine.dtype == torch.float32 and plan.trainer.dtype == torch.bfloat16
    assert plan.engine_dtype_name == "float32" and plan.trainer.label == "bfloat16 autocast"
    assert not cache.exists()  # nothing was measured


def test_float64_master_weights_never_autocast(tiny, tmp_path):
    plan = _resolve(tiny, tmp_path / "p.json", engine_dtype="float64", autocast="auto", train_dtype="float64")
    assert plan.engine.dtype == torch.float64 and plan.trainer.dtype is None and "float64" in plan.trainer.reason


def test_auto_measures_once_then_reads_the_machine_cache(tiny, tmp_path):
    cache = tmp_path / "precision.json"
    first = _resolve(tiny, cache)
    assert first.engine.source == first.trainer.source == "measured"
    assert first.engine.dtype in (torch.float32, torch.bfloat16)
    # The reason carries both measured numbers and the CPU evidence.
    for choice in (first.engine, first.trainer):
        assert "float32" in choice.reason and "bfloat16" in choice.reason and cpu_facts()["cpu"] in choice.reason
    entries = json.loads(cache.read_text())
    assert len(entries) == 2 and all({"float32", "bfloat16"} <= set(e) for e in entries.values())  # no sync term asked
    second = _resolve(tiny, cache)
    assert second.engine.source == second.trainer.source == "cached"
    assert (second.engine.dtype, second.trainer.dtype) == (first.engine.dtype, first.trainer.dtype)
    assert second.engine.reason == first.engine.reason
    # Another decode batch is another measurement: the engine may choose differently at batch 1.
    assert _resolve(tiny, cache, batch=1).engine.source == "measured"
    assert len(json.loads(cache.read_text())) == 3


@pytest.mark.parametrize(
    ("engine", "trainer", "engine_dtype", "autocast"),
    [
        ((0.139, 0.348), (10.9, 215.0), torch.float32, None),  # AVX2 only: bf16 slower in both roles
        ((0.069, 0.037), (10.9, 215.0), torch.bfloat16, None),  # batch 1 on AVX2: bf16 decodes faster
        ((0.100, 0.050), (10.0, 5.0), torch.bfloat16, torch.bfloat16),  # native bf16
        # Within the margin the cheaper choice wins: a bf16 engine (half the memory, a sparse delta),
        # a float32 trainer (no autocast).
        ((0.100, 0.095), (10.0, 9.5), torch.bfloat16, None),
        ((0.095, 0.100), (10.0, 9.5), torch.bfloat16, None),
    ],
)
def test_auto_follows_the_measured_numbers(tiny, tmp_path, engine, trainer, engine_dtype, autocast):
    cache = tmp_path / "precision.json"
    _seed_cache(cache, tiny, engine=engine, trainer=trainer)
    plan = _resolve(tiny, cache)
    assert plan.engine.source == plan.trainer.source == "cached"
    assert plan.engine.dtype == engine_dtype and plan.trainer.dtype == autocast
    assert f"float32 {engine[0] * 1e3:.0f} ms" in plan.engine.reason
    assert 0.95 > MARGIN


def test_a_leaders_dense_float32_delta_can_outweigh_slower_bf16_decoding(tiny, tmp_path):
    """A leader codes a dense float32 delta after every step; the round, not one decode step, decides."""
    cache = tmp_path / "precision.json"
    _seed_cache(cache, tiny, engine=(0.139, 0.348), trainer=(10.9, 215.0), sync=(110.0, 9.0), local_sync=(1.3, 2.0))
    per_step = _resolve(tiny, cache)
    assert per_step.engine.dtype == torch.float32  # decode alone: float32
    leader = _resolve(tiny, cache, new_tokens=48, sequences=16, learning_rate=1e-3, publish=True)
    assert leader.engine.dtype == torch.bfloat16 and leader.engine.source == "cached"
    assert "weight sync after a step (coded for followers): float32 110.0 s, bfloat16 9.0 s" in leader.engine.reason
    assert "a round of 48 steps + sync" in leader.engine.reason
    # Without followers the engine is written directly, about as fast in either dtype: decoding decides.
    alone = _resolve(tiny, cache, new_tokens=48, sequences=16, learning_rate=1e-3)
    assert alone.engine.dtype == torch.float32 and "weight sync after a step: float32 1.3 s, bfloat16 2.0 s" in alone.engine.reason
    # float64 master weights: no sync term (the bf16 sparsity argument is about float32 masters).
    assert _resolve(tiny, cache, new_tokens=48, sequences=16, learning_rate=1e-3, train_dtype="float64").engine.dtype == torch.float32


def test_sync_measurement_runs_the_real_weight_sync(tiny):
    from hivespec.node.model.loader import load_model
    from hivespec.node.model.precision import measure_sync, weight_sample

    weights = weight_sample(load_model("tiny"), elements=1 << 14)
    seconds = measure_sync(10**6, 1e-3, weights)
    assert set(seconds) == {"float32", "bfloat16"} and all(v > 0 for v in seconds.values())


def test_a_corrupt_cache_is_measured_over(tiny, tmp_path):
    cache = tmp_path / "precision.json"
    cache.write_text("{not json")
    plan = _resolve(tiny, cache)
    assert plan.engine.source == "measured" and len(json.loads(cache.read_text())) == 2


def test_measurements_are_positive_and_scale_with_work(tiny):
    shape = ModelShape.of(tiny)
    assert (shape.hidden, shape.intermediate, shape.layers, shape.q_width, shape.kv_width) == (64, 128, 2, 64, 32)
    decode = measure_decode(shape, 4, budget_s=0.05)
    train = measure_training(shape, 64, budget_s=0.05)
    assert all(v > 0 for v in (*decode.values(), *train.values()))
    assert measure_training(shape, 6400, budget_s=0.05)["float32"] > train["float32"]  # scaled to the rows asked


def test_a_node_times_its_real_models_decode_step(tiny, tmp_path):
    """With the model at hand the engine's step is the model's own forward over a KV cache, in both dtypes."""
    from hivespec.node.model.loader import load_model
    from hivespec.node.model.precision import measure_model_decode

    model = load_model("tiny")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    decode = measure_model_decode(model, 4, budget_s=0.05)
    assert set(decode) == {"float32", "bfloat16"} and all(v > 0 for v in decode.values())
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())  # untouched
    plan = _resolve(tiny, tmp_path / "p.json", model=model)
    assert plan.engine.source == "measured" and plan.engine.reason.startswith("decode step at batch 16")
    assert "matmuls" in _resolve(tiny, tmp_path / "p.json").engine.reason  # config only: an estimate, its own cache key


def test_a_slow_bf16_prefill_outweighs_a_tied_decode_step(tiny, tmp_path):
    """Short rollouts at a small batch: reading the prompts (compute-bound) decides, not the decode steps."""
    from hivespec.node.model.loader import load_model
    from hivespec.node.model.precision import measure_model_prefill

    model = load_model("tiny")
    per_token = measure_model_prefill(model, budget_s=0.05)
    assert set(per_token) == {"float32", "bfloat16"} and all(v > 0 for v in per_token.values())
    cache = tmp_path / "precision.json"
    _seed_cache(cache, tiny, engine=(0.123, 0.137), trainer=(6.8, 91.2), batch=4, local_sync=(1.5, 1.6))
    shape, facts = ModelShape.of(tiny), cpu_facts()
    data = json.loads(cache.read_text())
    data[measurement_key("prefill", shape, 16, THREADS, facts)] = {"float32": 0.002, "bfloat16": 0.03}
    cache.write_text(json.dumps(data))
    settings = {"batch": 4, "new_tokens": 16, "sequences": 4, "learning_rate": 1e-3}
    plan = _resolve(tiny, cache, model=model, **settings)
    assert plan.engine.dtype == torch.float32 and plan.engine.source == "cached"
    assert "prefill of 256 prompt tokens: float32 512 ms, bfloat16 7.7 s" in plan.engine.reason
    # Without the model (an estimate from the config) there is no prefill term: the tie keeps bf16.
    assert _resolve(tiny, cache, **settings).engine.dtype == torch.bfloat16


def test_sizes_the_node_measures_at():
    def batch(prompts, generations, most):
        return RolloutConfig(prompts_per_round=prompts, num_generations=generations, max_batch_size=most).decode_batch

    assert batch(4, 4, 16) == 16 and batch(1, 4, 16) == 4 and batch(4, 8, 16) == 16
    assert train_rows(8, 48) == 8 * (64 + 48)


@pytest.mark.cuda
def test_cuda_decides_from_bf16_support_without_measuring(tiny, tmp_path):
    plan = _resolve(tiny, tmp_path / "p.json", device="cuda")
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    assert plan.engine.dtype == expected and plan.engine.source == "device" and "compute capability" in plan.engine.reason
    assert not (tmp_path / "p.json").exists()


def test_config_accepts_auto_and_the_old_booleans():
    config = load_config(None, environ={})
    assert config.model.engine_dtype == "auto" and config.model.autocast == "auto"
    for preset in ("demo", "public"):
        model = load_config(preset, environ={}).model
        assert (model.engine_dtype, model.autocast) == ("auto", "auto"), preset
    tiny_model = load_config("tiny", environ={}).model
    assert (tiny_model.engine_dtype, tiny_model.autocast) == ("float32", False)  # tests stay deterministic
    assert load_config(None, overrides={"model.autocast": "true"}, environ={}).model.autocast is True
    assert load_config(None, environ={"HIVESPEC_MODEL__AUTOCAST": "auto"}).model.autocast == "auto"
    with pytest.raises(ConfigError, match="model.autocast.*true or false.*'auto'"):
        load_config(None, overrides={"model.autocast": "fast"}, environ={})


def test_doctor_warns_when_an_explicit_dtype_is_the_slower_one_here(tiny, tmp_path):
    from hivespec.node.doctor import check_precision

    cache = tmp_path / "precision.json"
    config = load_config("tiny", overrides={"model.engine_dtype": "bfloat16", "model.autocast": "true",
                                            "model.threads": str(THREADS), "rollout.prompts_per_round": "4",
                                            "rollout.max_completion_length": "48"}, environ={})
    batch, rows = 16, train_rows(8, 48)
    _seed_cache(cache, tiny, engine=(0.139, 0.348), trainer=(10.9, 215.0), batch=batch, rows=rows,
                sync=(1.0, 1.0), learning_rate=config.train.learning_rate)
    (check, attention), _ = check_precision(config, cache=cache)
    assert check.status == "warn"
    assert "set model.engine_dtype: auto" in check.detail and "set model.autocast: auto" in check.detail
    assert attention.name == "attention" and attention.status == "ok" and "trainer attention" in attention.detail
    auto = load_config("tiny", overrides={"model.engine_dtype": "auto", "model.autocast": "auto", "model.threads": str(THREADS),
                                          "rollout.prompts_per_round": "4", "rollout.max_completion_length": "48"}, environ={})
    (check, attention), plan = check_precision(auto, cache=cache)
    assert check.status == "ok" and "engine float32 (cached" in check.detail and "trainer float32 (cached" in check.detail
    assert plan is not None and (plan.engine.dtype, plan.trainer.dtype) == (torch.float32, None)  # the ram line's precision
    assert attention.status == "ok" and "engine attention" in attention.detail and "trainer runs" in attention.detail


def test_doctor_warns_when_sharing_a_prompt_is_set_where_it_is_the_slower_way(tiny, tmp_path):
    from hivespec.node.doctor import check_precision
    from hivespec.node.model.attention import SHARED_PROMPT_MIN_SAMPLES

    cache = tmp_path / "precision.json"
    config = load_config("tiny", overrides={"train.share_prompts": "true", "model.threads": str(THREADS),
                                            "rollout.max_completion_length": "48"}, environ={})
    _seed_cache(cache, tiny, engine=(0.139, 0.348), trainer=(10.9, 215.0), batch=16, rows=train_rows(8, 48),
                learning_rate=config.train.learning_rate)
    data = json.loads(cache.read_text())
    rows = max(SHARED_PROMPT_MIN_SAMPLES, min(config.rollout.num_generations, config.train.micro_batch_size))
    for kernel in ("own", "eager"):  # whichever the trainer's attention measurement picks: as an H100 measured it
        role = f"shared-prompt-cpu-{cpu_facts()['cpu']}-off-{kernel}-64-48"
        data[measurement_key(role, ModelShape.of(tiny), rows, THREADS, cpu_facts())] = {
            "whole-1": 0.060, "whole-2": 0.062, "shared-1": 0.110, "shared-2": 0.113}
    cache.write_text(json.dumps(data))
    (_, attention), _ = check_precision(config, cache=cache)
    assert attention.status == "warn" and "train.share_prompts is true, but here trainer runs every row whole" in attention.detail
    assert "set train.share_prompts: auto" in attention.detail


def test_status_snapshot_carries_the_choice_and_older_snapshots_still_decode():
    from hivespec.dashboard.text import render_text
    from hivespec.protocol.status import STATUS_VERSION, NodeInfo, StatusSnapshot, decode_status, encode_status

    info = NodeInfo(name="n", peer_id="hs00", swarm="s", engine_dtype="bfloat16", train_precision="float32",
                    engine_dtype_reason="measured: a round of 48 steps + sync: float32 78 s, bfloat16 52 s",
                    train_precision_reason="measured: forward+backward of 896 tokens: float32 5.7 s, bfloat16 autocast 117 s",
                    attention=["engine attention eager (measured: sdpa 74.6 ms, eager 43.9 ms; AMD EPYC)",
                               "trainer runs a group's prompt once (cached: ...)"])
    snapshot = StatusSnapshot(version=STATUS_VERSION, time=1.0, node=info)
    verdict, decoded = decode_status(encode_status(snapshot))
    assert verdict.ok and decoded == snapshot
    text = render_text(decoded)
    assert "precision: engine bfloat16, trainer float32" in text and "float32 78 s, bfloat16 52 s" in text
    assert "attention:\n  engine attention eager (measured: sdpa 74.6 ms, eager 43.9 ms; AMD EPYC)\n  trainer runs a group's prompt once" in text
    older = json.dumps({"version": STATUS_VERSION, "time": 1.0, "node": {"name": "n", "peer_id": "hs00", "swarm": "s"}})
    verdict, decoded = decode_status(older.encode())
    assert verdict.ok and decoded.node.engine_dtype == "" and decoded.node.attention == [] and "precision:" not in render_text(decoded)
    assert "attention:" not in render_text(decoded)


def test_the_trainer_measured_from_the_models_config_is_the_one_a_node_reads_back(tiny, tmp_path):
    """`trainer_precision` (what the demo sizes its nodes by, no weights loaded) times at the node's threads under the key
    the node's own start (`resolve_node_precision`, the loaded model) then finds in the cache."""
    from hivespec.node.model.loader import load_model
    from hivespec.node.model.precision import resolve_node_precision, trainer_precision

    cache = tmp_path / "precision.json"
    config = load_config("tiny", overrides={"model.engine_dtype": "auto", "model.autocast": "auto"}, environ={})
    threads = torch.get_num_threads()
    before = trainer_precision(config, tiny, threads=THREADS, cache=cache)
    assert (before.role, before.source, torch.get_num_threads()) == ("trainer", "measured", threads)
    plan = resolve_node_precision(config, load_model("tiny"), threads=THREADS, cache=cache)
    assert (plan.trainer.source, plan.trainer.dtype) == ("cached", before.dtype)
