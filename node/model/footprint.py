"""How much memory a node needs: what `hivespec demo` checks before it starts N nodes, `hivespec doctor` reports, and
a CPU node fits its micro batch to before every training step.

A CPU node holds, for as long as it runs, the trainer's float32 weights and AdamW's two moments,
the engine's copy of the weights, and the interpreter with torch and transformers loaded. Each
training step adds, for the length of a micro batch, the gradients, autocast's 16-bit copy of the
weights, the optimizer's temporaries (a float32 copy's worth), the activations kept for the
backward and (where the trainer picked eager attention) the attention probabilities, at most
`EAGER_ATTENTION_BYTES` (node/model/attention.py). The step is what decides whether N nodes fit a
machine: five public-preset nodes of the embedded model fit a 24 GiB machine between steps, and the
kernel killed one in its step.

`node_peak_bytes` adds these up from the model's shape and the step's rows, times `MARGIN`: an upper
bound that tests/test_swarm.py (tiny nodes) and tests/test_first_run.py (the embedded model's demo)
check against real nodes' `peak_resident_mb` (the round report: the kernel's high-water mark). The
activations per token and layer are a Llama block's saved tensors, about 10 values per hidden unit
and 4 per MLP unit, at `ACTIVATION_BYTES` a value: more than their 16 or 32 bits, as measured (norms
and the residual stream stay float32 under autocast, and autograd keeps more than those tensors).
Before a node has run a step its rows are taken as `PROMPT_TOKENS` + the config's completion length
(`auto` precision as the CPU will likely pick it: bf16 where it flags native bf16); before each step
the node knows its rows' real length, a user's long prompts included.

A node short of memory trains in smaller micro batches (`fit_micro_batch`, before every step of a CPU node:
node/supervise.py `MicroBatchFit`): the optimizer steps once over the same samples whatever the micro batch, so
only the time changes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hivespec.node.model.attention import EAGER_ATTENTION_BYTES
from hivespec.node.model.precision import cpu_facts

if TYPE_CHECKING:
    from hivespec.node.config import NodeConfig

# Interpreter, torch, transformers, tokenizer, hivemind client, drafter, journal, and what the heap keeps of freed
# steps: a demo-model node held 0.6-0.9 GB of its own beyond weights, engine copy, gradients and AdamW's moments,
# plus 0.15-0.5 GB of shared libraries' pages (RssAnon and RSS sampled every 0.1 s over three rounds).
RUNTIME_BYTES = 1300 * 10**6
# A row's prompt before the node has seen one: the bundled tasks' prompts with their chat template are at most 63 tokens
# (1000 of each preset's, SmolLM2's tokenizer); a longer prompt of a user's own tasks is what its step's fit measures.
PROMPT_TOKENS = 96
# Bytes a saved activation value takes, with and without autocast: bench/step_memory.py's steps of SmolLM2-135M on the
# 2-core AMD EPYC (one thread, 16 samples, rows of 48-432 tokens) rose by 1.16-1.67 MB a token under bf16 autocast with
# SDPA (1.84 with eager attention, its probabilities counted apart) and 2.15 in float32 beyond their fixed part: 3.2-4.7
# and 6.0 bytes a value; taken as 4.5 and 7, with the probabilities counted for every micro batch (which also covers
# what SDPA keeps that grows with the row's length).
ACTIVATION_BYTES = {True: 4.5, False: 7.0}
# What the sum leaves out, and the allocator's swings: 13 of bench/step_memory.py's 14 steps rose by 0.78-0.98 of
# `step_bytes`, one by 1.07. The demo's nodes' high-water marks came to 0.72-0.76 of the bound with it (5.3-5.6 GB
# against 7.4 GB, bf16 autocast, micro batches of 8, on a 2-core AMD EPYC; their steps are lighter than the rows of
# the config's longest answers it assumes), a node in micro batches of one to 0.78 (4.14 GB against 5.3); a `public`
# node alone to 0.75 (6.2 GB against 8.3: the estimate before the step was measured said 6.6), a `demo` node in float32
# to 0.56 (4.8 GB against 8.5).
MARGIN = 1.1
_ENGINE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


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
    from safetensors import SafetensorError

    from hivespec.node.model.loader import TINY_MODEL, ModelSourceError, load_tokenizer, model_folder, tiny_config

    if model_name == TINY_MODEL:
        config = tiny_config(load_tokenizer()).to_dict()
    else:
        config_file = model_folder(model_name, revision) / "config.json"
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise ModelSourceError(f"cannot read the config of model {model_name!r} ({config_file}): {exc}") from None
    try:
        return shape_of(config, parameter_count(model_name, revision) if params is None else params)
    except ModelSourceError:
        raise
    except (OSError, ValueError, SafetensorError) as exc:  # no weights, cut-short weights, a config without sizes
        raise ModelSourceError(f"cannot size model {model_name!r}: {exc}") from None


# Each size under the names architectures spell it in config.json (and `to_dict()`: transformers' attribute_map aliases
# are not written there): Llama's, GPT-2's (GPT-J, GPT-BigCode), OPT's and T5-style ones.
_NAMES = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
}


def _size(config: dict, what: str) -> int | None:
    return next((int(config[name]) for name in _NAMES[what] if config.get(name)), None)


def shape_of(config: dict, params: int) -> ModelShape:
    """A model's shape from its config as a dict (config.json, or a loaded model's `config.to_dict()`)."""
    config = config.get("text_config", config)  # a multimodal wrapper keeps its language model's config inside
    hidden, layers = _size(config, "hidden"), _size(config, "layers")
    if hidden is None or layers is None:
        raise ValueError(f"the model's config names no hidden size or layer count (any of {_NAMES['hidden']} and "
                         f"{_NAMES['layers']}); keys: {sorted(config)}")
    return ModelShape(params=params, layers=layers, hidden=hidden,
                      intermediate=_size(config, "intermediate") or 4 * hidden, heads=_size(config, "heads") or 1)


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


def config_peak_bytes(config: NodeConfig, shape: ModelShape, *, micro_batch_size: int | None = None,
                      row_tokens: int | None = None) -> int:
    """`node_peak_bytes` for a node of this config, in micro batches of `micro_batch_size` (the config's where None),
    its rows `row_tokens` long (a step's longest: prompt and completion), or `PROMPT_TOKENS` + the config's completion
    length before it has any. `auto` precision (before the node has measured its machine) is taken as bf16 autocast and
    engine on a CPU with native bf16 flags and as float32 on any other: what most such CPUs measured, not all (a 2-core
    Xeon model 207 exposing avx512_bf16 without AMX trained 1.8x faster in float32). `hivespec doctor` sizes a node by the
    precision it measured, `hivespec demo` by the trainer's (`precision.trainer_precision`); a node fits its micro batch
    to the precision it runs."""
    model = config.model
    on_gpu = model.device.startswith("cuda")
    autocast, engine_dtype = model.autocast, model.engine_dtype
    if "auto" in (autocast, engine_dtype):  # a node that knows its precision (fit_micro_batch's case) asks nothing
        bf16 = not on_gpu and bool(cpu_facts()["native_bf16_flags"])
        autocast = bf16 if autocast == "auto" else autocast
        engine_dtype = ("bfloat16" if bf16 else "float32") if engine_dtype == "auto" else engine_dtype
    return node_peak_bytes(shape, engine_dtype=engine_dtype, autocast=bool(autocast), on_gpu=on_gpu,
                           micro_batch_size=micro_batch_size or config.train.micro_batch_size,
                           row_tokens=row_tokens or PROMPT_TOKENS + config.rollout.max_completion_length)


def node_peak_bytes(shape: ModelShape, *, engine_dtype: str, autocast: bool, on_gpu: bool, micro_batch_size: int,
                    row_tokens: int) -> int:
    """The most host memory one node takes: its lasting state plus one training step of micro batches of
    `micro_batch_size` rows of `row_tokens` tokens (the module doc), with MARGIN. A GPU node keeps weights, optimizer
    and activations in device memory; the host holds the runtime and a staging copy."""
    if on_gpu:
        return RUNTIME_BYTES + shape.params * 4
    state = shape.params * (4 + 8 + _ENGINE_BYTES.get(engine_dtype, 4))  # fp32 weights, AdamW moments, engine copy
    step = step_bytes(shape, autocast=autocast, micro_batch_size=micro_batch_size, row_tokens=row_tokens)
    return int(MARGIN * (RUNTIME_BYTES + state + step))


def step_bytes(shape: ModelShape, *, autocast: bool, micro_batch_size: int, row_tokens: int) -> int:
    """What one training step adds on a CPU, without MARGIN (bench/step_memory.py measures it): gradients, the
    optimizer's temporaries (a float32 copy's worth: SmolLM2-135M's steps kept 1.2-1.4 GB beyond their activations,
    1.6 once, where this says 1.35), autocast's 16-bit copy of the weights; a micro batch's saved activations, ~10 values per
    hidden unit and 4 per MLP unit per token and layer at ACTIVATION_BYTES each; eager attention's saved probabilities
    (MicroBatchAttention.choose: within its budget, or not eager at all)."""
    rows, length = micro_batch_size, row_tokens
    fixed = shape.params * (4 + 4 + (2 if autocast else 0))
    activations = rows * length * shape.layers * ACTIVATION_BYTES[autocast] * (10 * shape.hidden + 4 * shape.intermediate)
    probabilities = min(rows * length * length * shape.heads * shape.layers * 8, EAGER_ATTENTION_BYTES)
    return int(fixed + activations + probabilities)


class MicroBatchChoice(NamedTuple):
    """`fit_micro_batch`'s answer: the micro batch to train in, what to tell the user ("" where the config's fits),
    and whether its step fits the memory available (False: not even one sample a micro batch may)."""

    size: int
    why: str
    fits: bool


def fit_micro_batch(config: NodeConfig, shape: ModelShape, *, available: int, resident: int, wanted: int | None = None,
                    row_tokens: int | None = None) -> MicroBatchChoice:
    """The micro batch to train in: `wanted` (the config's where None), or the largest smaller one whose step (rows of
    `row_tokens`, as `config_peak_bytes` takes them) fits the memory `available` now beside the `resident` bytes the
    node holds already of its own (its anonymous memory: a library's pages that another process paid for would count
    twice); the optimizer steps once over the same samples whatever the micro batch, so only the time changes."""
    wanted = wanted or config.train.micro_batch_size

    def need(size: int) -> int:
        return config_peak_bytes(config, shape, micro_batch_size=size, row_tokens=row_tokens) - resident

    if need(wanted) <= available:
        return MicroBatchChoice(wanted, "", fits=True)
    gib = 1 << 30
    size = next((n for n in range(wanted - 1, 0, -1) if need(n) <= available), None)
    if size is not None:
        samples = "1 sample" if size == 1 else f"{size} samples"
        return MicroBatchChoice(size, f"training in micro batches of {samples}, not {wanted}: {wanted} would take up to "
                                      f"~{need(wanted) / gib:.1f} GiB more than this node holds now, and "
                                      f"{available / gib:.1f} GiB is available (the same updates, in more passes)", fits=True)
    # A GPU node's host memory does not follow its micro batch: fewer samples at once would only slow it.
    size = wanted if need(1) == need(wanted) else 1
    return MicroBatchChoice(size, f"this node may take ~{need(size) / gib:.1f} GiB more than it holds now while it "
                                  f"trains{', even in micro batches of one sample,' if size == 1 else ''} and "
                                  f"{available / gib:.1f} GiB is available: the kernel may stop it mid-round. Close "
                                  "other programs, or run a smaller model", fits=False)
