"""How much memory a node needs: what `hivespec demo` checks before it starts N nodes, and `hivespec doctor` reports.

A CPU node holds, for as long as it runs, the trainer's float32 weights and AdamW's two moments,
the engine's copy of the weights, and the interpreter with torch and transformers loaded. Each
training step adds, for the length of a micro batch, the gradients, autocast's low-precision copy
of the weights, the activations kept for the backward and (where the trainer picked eager
attention) the attention probabilities, at most `EAGER_ATTENTION_BYTES` (node/model/attention.py). The step is what decides
whether N nodes fit a machine: five demo-model nodes fit a 24 GiB machine between steps and the
kernel killed one in its step (4.9 GB resident then).

`node_peak_bytes` adds these up from the model's shape and the config; it is an upper bound
checked against real nodes' `peak_resident_mb` (the round report: the kernel's high-water mark)
in tests/node/test_footprint.py. The activations per token and layer are a Llama block's saved
tensors under autocast (about 20 bytes per hidden unit and 8 per MLP unit); a prompt is counted
as `PROMPT_TOKENS` tokens, more than the bundled tasks' prompts with their chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hivespec.node.model.attention import EAGER_ATTENTION_BYTES

if TYPE_CHECKING:
    from hivespec.node.config import NodeConfig

RUNTIME_BYTES = 900 * 10**6  # interpreter, torch, transformers, tokenizer, hivemind client, drafter, journal
PROMPT_TOKENS = 160  # a bundled task's prompt with its chat template is under 100 tokens
_ENGINE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "auto": 4}  # auto: at most float32


@dataclass(frozen=True)
class ModelShape:
    """What a model's memory follows: its parameters and the size of a token's activations in a layer."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int


def model_shape(model_name: str, revision: str | None = None, *, params: int | None = None) -> ModelShape:
    """The configured model's shape from its config alone (no weights loaded); `params` where the caller counted them."""
    from hivespec.node.model.loader import TINY_MODEL, load_tokenizer, model_folder, tiny_config

    if model_name == TINY_MODEL:
        config = tiny_config(load_tokenizer()).to_dict()
    else:
        config = json.loads((model_folder(model_name, revision) / "config.json").read_text())
    config = config.get("text_config", config)  # a multimodal wrapper keeps its language model's config inside
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    heads = int(config.get("num_attention_heads") or 1)
    if params is None:
        params = parameter_count(model_name, revision)
    return ModelShape(params=params, layers=layers, hidden=hidden, intermediate=intermediate, heads=heads)


def parameter_count(model_name: str, revision: str | None = None) -> int:
    """Parameters of the configured model, read from file headers (no weights are loaded); a hub id from its cached snapshot."""
    import torch

    from hivespec.node.model.loader import EMBEDDED_MODEL, TINY_MODEL, embedded_gguf_path, load_model, model_folder

    if model_name == TINY_MODEL:
        return sum(p.numel() for p in load_model(TINY_MODEL).parameters())
    if model_name == EMBEDDED_MODEL:
        import gguf

        return sum(int(t.n_elements) for t in gguf.GGUFReader(embedded_gguf_path()).tensors)
    from safetensors import safe_open

    folder = model_folder(model_name, revision)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_name}")
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shape = f.get_slice(key).get_shape()
                total += int(torch.tensor(shape).prod()) if shape else 1
    return total


def config_peak_bytes(config: NodeConfig, shape: ModelShape) -> int:
    """`node_peak_bytes` for a node of this config."""
    return node_peak_bytes(shape, engine_dtype=config.model.engine_dtype, on_gpu=config.model.device.startswith("cuda"),
                           micro_batch_size=config.train.micro_batch_size,
                           max_completion_length=config.rollout.max_completion_length)


def node_peak_bytes(shape: ModelShape, *, engine_dtype: str, on_gpu: bool, micro_batch_size: int,
                    max_completion_length: int) -> int:
    """The most host memory one node takes: its lasting state plus one training step (the module doc). A GPU node
    keeps weights, optimizer and activations in device memory; the host holds the runtime and a staging copy."""
    if on_gpu:
        return RUNTIME_BYTES + shape.params * 4
    state = shape.params * (4 + 8 + _ENGINE_BYTES.get(engine_dtype, 4))  # fp32 weights, AdamW moments, engine copy
    step_weights = shape.params * (4 + 2)  # gradients, autocast's bf16 copy of the weights
    length = PROMPT_TOKENS + max_completion_length
    activations = micro_batch_size * length * shape.layers * (20 * shape.hidden + 8 * shape.intermediate)
    # eager attention's saved probabilities (MicroBatchAttention.choose): within its budget, or not eager at all
    probabilities = min(micro_batch_size * length * length * shape.heads * shape.layers * 8, EAGER_ATTENTION_BYTES)
    return RUNTIME_BYTES + state + step_weights + activations + probabilities


def nodes_that_fit(per_node: int, available: int) -> int:
    """How many such nodes the memory available now holds."""
    return max(0, available // per_node)
