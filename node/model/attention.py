"""Which attention kernel the engine and the trainer run on a CPU: the model's eager attention or torch's SDPA.

transformers runs a model's attention through torch's fused ``scaled_dot_product_attention`` by
default. On a CPU its kernel is slow at the shapes a node runs, short sequences and a decode step
of one token per row, next to the model's eager attention (two matmuls and a softmax): on a
2-core AMD EPYC with AVX512-BF16 (SmolLM2-135M, bf16 engine, 1 thread) 96 decode steps of 16 rows
took 9.1 s with SDPA and 6.1-6.4 s eager, and a training step of 8 rows of 160 tokens 4.5 against
3.8 s. Eager attention keeps every layer's probabilities for the backward, though, and the other
way round at long sequences (at 768 tokens 36 against 27 s, and 7 GB more). So with
``model.attention: auto`` the node decides at start-up, per role, from what this machine does:

- engine: one real decode step of the engine's model at its decode batch over a cache of a
  prompt and half a completion, both ways;
- trainer: a forward and backward of the first two layers (a fresh copy, random weights) on one
  micro batch's rows and tokens under the trainer's autocast, both ways; a micro batch then runs
  eager only where its saved probabilities also fit ``EAGER_ATTENTION_BYTES`` (`MicroBatchAttention`).

Eager is chosen where it takes at most ``MARGIN`` of SDPA's time (a tie keeps SDPA, the model's
own). The timings are cached beside the precision measurements (``precision.json``, keyed by the
machine, shapes and threads). On CUDA, or for a model loaded with another implementation, the
model's own runs. The choice changes numerics only by rounding: on the embedded model the bf16
engine's log-probs were 0.0324 nats from float32's on the mean with eager attention and 0.0326
with SDPA; the bf16-autocast trainer's 0.0246 eager and 0.0222 with SDPA on the loaded weights
(bench/train_step.py: eager adds about a tenth to the rounding autocast already brings).

A GRPO group's completions share their prompt, and the trainer can run it once: `hidden_states`
runs the prompt with a KV cache, repeats its keys and values for every completion and runs the
completions on top (the same log-probs as every row whole). That saves the prompt's tokens in
every row but one, for one more forward: on the 2-core EPYC 8 completions of a 64-token prompt
trained in 2.75 s instead of 4.06 (with eager attention), while on an H100, where a 135M model's
step is kernel launches, the same step took 0.204 s instead of 0.124. So ``train.share_prompts:
auto`` decides by measurement too (`decide_shared_prompts`: a forward and backward of 1- and 2-layer
copies both ways, on this device, taken to the model's depth and compared per sample: a group's rows with
the prompt once against a full micro batch of whole rows, since whole rows of several prompts fill a micro
batch and a shared one holds one prompt's).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from hivespec.kernels.host_transfer import synchronize
from hivespec.node.model.device import work_clock
from hivespec.node.model.precision import MARGIN, PROMPT_TOKENS, ModelShape, cached_measurement, cpu_facts

if TYPE_CHECKING:
    from hivespec.node.config import NodeConfig

Requested = Literal["auto", "sdpa", "eager"]
IMPLEMENTATIONS = ("sdpa", "eager")
_MEASURE_BUDGET_S = 0.5  # per role: repeats stop once both are timed and this is spent
_TRAIN_LAYERS = 2  # layers of the copy a training step is timed on (every layer costs the same)
# Where the trainer runs eager attention, a micro batch runs it only where every layer's attention probabilities, kept
# for the backward, fit in this many bytes (8 x 160 tokens of SmolLM2-135M: 0.44 GB). On the 2-core EPYC, 8 sequences
# forward + backward took 3.79 s eager against 4.52 s with SDPA at 160 tokens, 10.3 against 11.3 s at 384 (2.3 GB
# more), 36.2 against 27.4 s at 768 (7 GB more).
EAGER_ATTENTION_BYTES = 512 << 20
# A prompt's forward is run once for this many of its samples in one micro batch, at least (where sharing measured
# faster: `decide_shared_prompts`). SmolLM2-135M on the 2-core EPYC (1 thread, bf16 autocast, 64-token prompt, 80-96-token
# completions): forward + backward of 8 completions 2.82 -> 2.02 s; of 2, 1.01 -> 1.09 s (the second call costs more
# than the 64 tokens it saves).
SHARED_PROMPT_MIN_SAMPLES = 4


@dataclass(frozen=True)
class AttentionChoice:
    """One role's attention and why: ``source`` is explicit, device, measured or cached."""

    role: str
    eager: bool
    source: str
    reason: str

    @property
    def implementation(self) -> str:
        return "eager" if self.eager else "sdpa"

    def describe(self) -> str:
        return f"{self.role} attention {self.implementation} ({self.source}: {self.reason})"


def _alternate(runs: dict[str, Callable[[], None]], budget_s: float, device: torch.device) -> dict[str, float]:
    """Best seconds of each run on `device` (by its `work_clock`): one warm-up each, then they alternate until
    `budget_s` of wall time is spent (2-5 rounds)."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, math.inf)
    clock, started = work_clock(device), time.perf_counter()
    for rounds in range(1, 6):
        for name, run in runs.items():
            mark = clock()
            run()
            best[name] = min(best[name], clock() - mark)
        if rounds >= 2 and time.perf_counter() - started > budget_s:
            break
    return best


@contextmanager
def running(model: torch.nn.Module, implementation: str | None) -> Iterator[None]:
    """`model` runs `implementation` inside the block (None, or its own: nothing changes); its own kernel again after."""
    own = model.config._attn_implementation if implementation is not None else None
    if implementation is None or implementation == own:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def _using(model: torch.nn.Module, implementation: str | None, run: Callable[[], None]) -> Callable[[], None]:
    """`run` with `model` on attention `implementation` (None: its own)."""

    def timed() -> None:
        with running(model, implementation):
            run()

    return timed


@dataclass(frozen=True)
class MicroBatchAttention:
    """Which kernel one training micro batch runs once the trainer's role may run eager (`decide_trainer`): eager
    where every layer's attention probabilities, kept for the backward, fit EAGER_ATTENTION_BYTES, else the model's own."""

    cells_per_token_pair: int  # heads x layers: probabilities per (query, key) pair and sequence; 0: never eager

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, eager: bool) -> MicroBatchAttention:
        config = getattr(model, "config", None)
        heads, layers = getattr(config, "num_attention_heads", None), getattr(config, "num_hidden_layers", None)
        usable = eager and heads and layers and hasattr(model, "set_attn_implementation")
        return cls(heads * layers if usable else 0)

    def choose(self, rows: int, queries: int, keys: int) -> str | None:
        """"eager" where this forward's saved probabilities (float32 and a copy in the autocast dtype: at most
        8 bytes each) fit the budget; None: the model's own."""
        if not self.cells_per_token_pair:
            return None
        return "eager" if rows * queries * keys * self.cells_per_token_pair * 8 <= EAGER_ATTENTION_BYTES else None


@torch.inference_mode()
def measure_decode(model: torch.nn.Module, batch: int, context: int, *, budget_s: float = _MEASURE_BUDGET_S) -> dict[str, float]:
    """Seconds of one decode step of `model` (the engine's, in its dtype) at `batch` rows over `context` cached tokens, per attention."""
    device = next(model.parameters()).device
    # The cache's values do not change a step's time: one row's prefill, repeated for every row (a prefill of every
    # row would take seconds at batch 32).
    one = model(input_ids=torch.ones((1, context), dtype=torch.long, device=device), use_cache=True).past_key_values
    one.batch_repeat_interleave(batch)
    token = torch.ones((batch, 1), dtype=torch.long, device=device)

    def step() -> None:
        model(input_ids=token, past_key_values=one, use_cache=True)
        one.crop(-1)  # every step sees the same context

    runs = {implementation: _using(model, implementation, step) for implementation in IMPLEMENTATIONS}
    return _alternate(runs, budget_s, device)


def hidden_states(backbone: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  prompt: torch.Tensor | None = None) -> torch.Tensor:
    """The backbone's last hidden states of a micro batch. With `prompt` ((1, prompt tokens), every row's): its
    forward once, its keys and values repeated for every row (the backward sums their gradients), then `input_ids`
    (the completions only) on top; the prompt's last state, which predicts each completion's first token, is put in
    front of theirs. `attention_mask` covers the prompt and the row's tokens."""
    if prompt is None:
        return backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    ran = backbone(input_ids=prompt, use_cache=True)
    cache = ran.past_key_values
    rows = input_ids.shape[0]
    cache.batch_repeat_interleave(rows)
    tail = backbone(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=False)
    return torch.cat([ran.last_hidden_state[:, -1:].expand(rows, -1, -1), tail.last_hidden_state], dim=1)


def _training_copy(model: torch.nn.Module, layers: int = _TRAIN_LAYERS) -> torch.nn.Module:
    """A fresh copy of `model`'s architecture with its first `layers` only (random weights: the time does not depend on
    them), on its device and dtype, in training mode."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    parameter = next(model.parameters())
    return type(model)(config).to(device=parameter.device, dtype=parameter.dtype).train()


def _backward_timer(small: torch.nn.Module, autocast_dtype: torch.dtype | None, implementation: str | None,
                    forward: Callable[[torch.nn.Module], torch.Tensor]) -> Callable[[], None]:
    """One timed forward (`forward(backbone)`: its hidden states) and backward of `small` with attention
    `implementation` (None: its own), synchronized on a GPU."""
    backbone = getattr(small, small.base_model_prefix)
    device = next(small.parameters()).device

    def step() -> None:
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            hidden = forward(backbone)
        hidden.float().square().mean().backward()
        small.zero_grad(set_to_none=True)
        synchronize(device)

    return _using(small, implementation, step)


def _random_ids(small: torch.nn.Module, rows: int, tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, small.config.vocab_size, (rows, tokens), generator=generator).to(next(small.parameters()).device)


def measure_training(
    model: torch.nn.Module, rows: int, tokens: int, autocast_dtype: torch.dtype | None, *, budget_s: float = _MEASURE_BUDGET_S
) -> dict[str, float]:
    """Seconds of a forward and backward of `rows` x `tokens` through the first layers of a fresh copy of `model`'s
    architecture, per attention, under `autocast_dtype`."""
    small = _training_copy(model)
    ids = _random_ids(small, rows, tokens)
    mask = torch.ones_like(ids)
    mask[1:, tokens * 3 // 4 :] = 0  # padded rows, as a micro batch of unequal lengths has: the mask is materialized
    runs = {implementation: _backward_timer(small, autocast_dtype, implementation, lambda b: hidden_states(b, ids, mask))
            for implementation in IMPLEMENTATIONS}
    return _alternate(runs, budget_s, next(small.parameters()).device)


SHARING_RUNS = ("whole-1", "whole-2", "shared-1", "shared-2")
# The per-layer cost is a difference of two timings, taken 29 times over for SmolLM2-135M: three rounds instead of two
# narrowed the predicted ratio of 8 completions on the 2-core EPYC from 0.54-0.80x (five measurements) to 0.59-0.69x (four),
# for about 0.7 s more once per machine.
_SHARING_BUDGET_S = 1.5


def measure_shared_prompt(
    model: torch.nn.Module, rows: int, packed: int, prompt_tokens: int, completion_tokens: int,
    autocast_dtype: torch.dtype | None, eager: bool, *, budget_s: float = _SHARING_BUDGET_S,
) -> dict[str, float]:
    """Seconds of a forward and backward through fresh copies of `model`'s architecture with 1 and 2 layers
    (`SHARING_RUNS`), each way as a round's micro batches run it: every row whole, `packed` rows of a
    `prompt_tokens + completion_tokens` sequence (whole rows fill a micro batch whatever their prompts), and the
    prompt once, `rows` completions of one prompt (`hidden_states`; a shared micro batch holds one prompt's samples),
    under `autocast_dtype`, each with the attention its micro batch runs (`eager`: where the trainer may run eager). Two
    depths, because the shared way's costs outside the layers (a second embedding lookup, the keys' repeat) weigh on a
    2-layer copy as they do not on the whole model: `predicted_seconds` takes the cost per layer from their difference."""
    kernel = MicroBatchAttention.for_model(model, eager=eager)
    whole_kernel = kernel.choose(packed, prompt_tokens + completion_tokens, prompt_tokens + completion_tokens)
    shared_kernel = kernel.choose(rows, completion_tokens, prompt_tokens + completion_tokens)
    runs = {}
    for layers in (1, 2):
        small = _training_copy(model, layers)
        whole = _random_ids(small, packed, prompt_tokens + completion_tokens)
        whole_mask = torch.ones_like(whole)
        whole_mask[1:, prompt_tokens + completion_tokens * 3 // 4 :] = 0  # completions of unequal lengths, padded
        group = whole[:rows]
        prompt, completions, mask = group[:1, :prompt_tokens], group[:, prompt_tokens:], whole_mask[:rows]
        runs[f"whole-{layers}"] = _backward_timer(small, autocast_dtype, whole_kernel,
                                                  lambda b, w=whole, m=whole_mask: hidden_states(b, w, m))
        runs[f"shared-{layers}"] = _backward_timer(small, autocast_dtype, shared_kernel,
                                                   lambda b, c=completions, m=mask, p=prompt: hidden_states(b, c, m, p))
    return _alternate(runs, budget_s, next(model.parameters()).device)


def predicted_seconds(seconds: dict[str, float], way: str, layers: int) -> float:
    """A forward and backward of `way` through `layers` layers, from its 1- and 2-layer timings: the time outside the
    layers plus `layers` times the cost of one (at least 0: timing noise can make the difference negative)."""
    one, two = seconds[f"{way}-1"], seconds[f"{way}-2"]
    per_layer = max(0.0, two - one)
    return one + (layers - 1) * per_layer


def _verdict(role: str, seconds: dict[str, float], cached: bool, what: str) -> AttentionChoice:
    eager = seconds["eager"] <= MARGIN * seconds["sdpa"]
    reason = f"{what}: sdpa {seconds['sdpa'] * 1e3:.1f} ms, eager {seconds['eager'] * 1e3:.1f} ms; {cpu_facts()['cpu']}"
    return AttentionChoice(role, eager, "cached" if cached else "measured", reason)


def _fixed(role: str, requested: Requested, model: torch.nn.Module, device: str) -> AttentionChoice | None:
    """The choice where nothing is measured: explicit, not a CPU, or a model that does not run SDPA."""
    if requested != "auto":
        return AttentionChoice(role, requested == "eager", "explicit", "model.attention in the config")
    own = getattr(model.config, "_attn_implementation", None)
    if torch.device(device).type != "cpu":
        return AttentionChoice(role, own == "eager", "device", f"{device}: the model's own ({own})")
    if own != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return AttentionChoice(role, own == "eager", "device", f"the model runs {own} attention")
    return None


def decide_engine(
    requested: Requested, model: torch.nn.Module, *, device: str, batch: int, context: int, threads: int, cache: Path | None
) -> AttentionChoice:
    """The engine's attention (see the module docstring); `model` is the engine's, in its dtype."""
    fixed = _fixed("engine", requested, model, device)
    if fixed is not None:
        return fixed
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    seconds, cached = cached_measurement(
        f"attention-decode-{dtype}-{context}", ModelShape.of(model.config), batch, threads, cache,
        lambda: measure_decode(model, batch, context), names=IMPLEMENTATIONS,
    )
    return _verdict("engine", seconds, cached, f"a decode step of {batch} rows over {context} tokens, {threads} thread(s)")


def decide_trainer(
    requested: Requested, model: torch.nn.Module, *, device: str, rows: int, tokens: int, autocast_dtype: torch.dtype | None,
    threads: int, cache: Path | None,
) -> AttentionChoice:
    """Whether the trainer may run eager attention (see the module docstring); `model` is the trainer's."""
    fixed = _fixed("trainer", requested, model, device)
    if fixed is not None:
        return fixed
    autocast = str(autocast_dtype).removeprefix("torch.") if autocast_dtype is not None else "off"
    seconds, cached = cached_measurement(
        f"attention-train-{autocast}-{tokens}", ModelShape.of(model.config), rows, threads, cache,
        lambda: measure_training(model, rows, tokens, autocast_dtype), names=IMPLEMENTATIONS,
    )
    what = f"forward+backward of {rows} x {tokens} tokens through {_TRAIN_LAYERS} layers, autocast {autocast}, {threads} thread(s)"
    return _verdict("trainer", seconds, cached, what)


@dataclass(frozen=True)
class SharingChoice:
    """Whether the trainer runs a group's prompt once (`hidden_states` with a prompt), and why."""

    share: bool
    source: str  # explicit, measured or cached
    reason: str

    def describe(self) -> str:
        way = "a group's prompt once" if self.share else "every row whole"
        return f"trainer runs {way} ({self.source}: {self.reason})"


def decide_shared_prompts(
    requested: bool | Literal["auto"], model: torch.nn.Module, *, device: str, rows: int, packed: int, prompt_tokens: int,
    completion_tokens: int, autocast_dtype: torch.dtype | None, eager: bool, threads: int, cache: Path | None,
) -> SharingChoice:
    """Whether the trainer shares a group's prompt (see the module docstring), measured on this device per sample as a
    round's micro batches run: `rows` samples of one prompt (at least SHARED_PROMPT_MIN_SAMPLES) a micro batch with
    the prompt once, against `packed` (at least `rows`) whole rows of any prompts a micro batch. Shared where a sample
    takes at most MARGIN of a whole row's time. `model` is the trainer's; `eager`: the trainer may run eager attention.

    Per sample, because a shared micro batch holds one prompt's samples and whole rows fill the micro batch: with
    groups of 4 and micro batches of 8, a round runs twice as many micro batches the shared way. On the 2-core Xeon
    with AMX a group of 4 alone trained at 0.935-0.973x of every row whole with the prompt once, the demo's round of
    4 x 4 at 1.000x; on an H200 that round at 4.68x (`bench/train_step.py` prints both and whether this agrees)."""
    if requested != "auto":
        return SharingChoice(bool(requested), "explicit", "train.share_prompts in the config")
    rows = max(rows, SHARED_PROMPT_MIN_SAMPLES)
    packed = max(packed, rows)
    autocast = str(autocast_dtype).removeprefix("torch.") if autocast_dtype is not None else "off"
    attention = "eager" if MicroBatchAttention.for_model(model, eager=eager).cells_per_token_pair else "own"
    place = torch.device(device)
    machine = torch.cuda.get_device_name(place) if place.type == "cuda" else cpu_facts()["cpu"]
    shape = ModelShape.of(model.config)
    seconds, cached = cached_measurement(
        f"shared-prompt-{place.type}-{machine}-{autocast}-{attention}-{prompt_tokens}-{completion_tokens}-packed{packed}",
        shape, rows, threads, cache, names=SHARING_RUNS,
        measure=lambda: measure_shared_prompt(model, rows, packed, prompt_tokens, completion_tokens, autocast_dtype, eager),
    )
    layers = shape.layers
    whole = predicted_seconds(seconds, "whole", layers) / packed
    shared = predicted_seconds(seconds, "shared", layers) / rows
    where = machine if place.type == "cuda" else f"{threads} thread(s); {machine}"
    reason = (f"forward+backward per sample of {completion_tokens}-token completions of {prompt_tokens}-token prompts, "
              f"autocast {autocast}, timed through 1 and 2 layers and taken to {layers}: every row whole in micro batches "
              f"of {packed} {whole * 1e3:.0f} ms, the prompt once for {rows} of a prompt {shared * 1e3:.0f} ms; {where}")
    return SharingChoice(shared <= MARGIN * whole, "cached" if cached else "measured", reason)


@dataclass(frozen=True)
class AttentionPlan:
    """What `model.attention` and `train.share_prompts` became for a node, with each choice's reason."""

    engine: AttentionChoice | None  # None: no native engine (vLLM runs its own)
    trainer: AttentionChoice
    sharing: SharingChoice

    def describe(self) -> tuple[str, ...]:
        return tuple(choice.describe() for choice in (self.engine, self.trainer, self.sharing) if choice is not None)


def resolve_attention(
    config: NodeConfig, trainer_model: torch.nn.Module, engine_model: torch.nn.Module, *, threads: int, cache: Path | None,
    autocast_dtype: torch.dtype | None, requested: tuple[Requested, bool | Literal["auto"]] | None = None,
) -> AttentionPlan:
    """Every choice of a node (see the module docstring), as `build_node` and `hivespec doctor` ask for them: the
    native engine's attention on its model (`engine_model`, not switched here; none for vLLM), the trainer's at a micro
    batch, and the shared prompt at a group of the node's completions against a micro batch of whole rows. `requested` (model.attention,
    train.share_prompts) replaces the config's: doctor asks what "auto" would pick."""
    model, rollout = config.model, config.rollout
    attention, share_prompts = requested or (model.attention, config.train.share_prompts)
    micro_batch_size = config.train.micro_batch_size
    engine = None
    if model.engine == "native":
        engine = decide_engine(attention, engine_model, device=model.device, threads=threads, cache=cache,
                               batch=rollout.decode_batch,
                               context=PROMPT_TOKENS + rollout.max_completion_length // 2)
    trainer = decide_trainer(attention, trainer_model, device=model.device, threads=threads, cache=cache, rows=micro_batch_size,
                             tokens=PROMPT_TOKENS + rollout.max_completion_length, autocast_dtype=autocast_dtype)
    sharing = decide_shared_prompts(share_prompts, trainer_model, device=model.device, threads=threads, cache=cache,
                                    rows=min(rollout.num_generations, micro_batch_size), packed=micro_batch_size, prompt_tokens=PROMPT_TOKENS,
                                    completion_tokens=rollout.max_completion_length, autocast_dtype=autocast_dtype, eager=trainer.eager)
    return AttentionPlan(engine, trainer, sharing)
