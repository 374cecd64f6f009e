"""The vLLM rollout engine (the `gpu` extra): the `RolloutEngine` interface on vLLM, CUDA only.

Written against vLLM 0.32.0, the version the `gpu` extra pins (V1 engine; API read from
vllm-project/vllm: `LLM`, `SamplingParams`, `SpeculativeConfig`, the V1 `Sampler` and
`RejectionSampler`). NOT EXECUTED against a real vLLM yet: no GPU was lent when it was written.
Everything that does not need vLLM is a pure function here and is tested on the CPU; the GPU
contract test in tests/node/test_vllm_engine.py is what a GPU session must run.

How our contract maps onto vLLM:

- **Behaviour log-probs**: `logprobs_mode="processed_logprobs"` with `logprobs=0` (the sampled
  token only). "processed" is the log-softmax of the logits after temperature and top-k/top-p
  masking, i.e. the log-prob of each token under exactly the distribution it was drawn from;
  that is what `kernels.sampling.sample_tokens` returns and what the trainer's importance
  weights divide by. "raw_logprobs" (vLLM's default) is the log-softmax of the untempered
  logits: wrong by a factor of T in the exponent whenever temperature != 1, and it ignores the
  nucleus. vLLM's rejection sampler reports the same processed log-probs for accepted draft
  tokens. Greedy decoding (temperature 0) is reported as 0.0, as the native engine does (vLLM
  would report the untempered log-softmax).
- **Seeds**: each request gets `SamplingParams.seed = request_seed(seed, sample_index)`, the
  per-(seed, sample) key the native sampler derives (the first two splitmix64 stages of
  `kernels.sampling._row_keys`) cut to 63 bits. vLLM then draws with a per-request
  `torch.Generator`, so a completion does not depend on its batch neighbours' random draws.
  vLLM's draws are not the native engine's keyed draws: the same request gives different
  tokens on the two engines (same distribution).
- **Stop tokens**: `ignore_eos=True` and `stop_token_ids`, so only our stop ids end a
  completion (as in the native engine); vLLM keeps the stop token in `token_ids`.
- **Speculative decoding**: `speculative_config` method "suffix" (SuffixDecoding, needs the
  `arctic-inference` package) where the installed vLLM lists it and arctic-inference imports,
  else "ngram". Detected from `vllm.config.speculative.SpeculativeMethod`, never guessed.
  vLLM verifies by rejection sampling, which is lossless in distribution; unlike the native
  engine it is token-identical to plain decoding only under greedy decoding. vLLM's suffix
  cache learns from this process's completions only; our `SuffixDrafter` (fed by the swarm) is
  not used on this path.
- **Weights**: the engine keeps a CPU copy of the weights in the engine dtype
  (`sync_parameters()`, what `WeightSync` decodes deltas against and writes into, exactly as
  for the native engine). `weights_updated(names)` sends the full tensors the delta touched to
  vLLM's workers through `LLM.collective_rpc` into `model.load_weights` (the worker method comes
  from `VllmWeightLoader`, mixed into vLLM's worker by `worker_extension_cls`), in buckets, then
  resets vLLM's prefix cache (its KV blocks were computed by the old weights).

vllm is imported only when a `VllmEngine` is built (`require_vllm`); importing this module or
running the native engine never imports it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import time
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from hivespec.node.model.engine import (
    GenerationRequest,
    Sample,
    SamplingParams,
    SpeculationStats,
    unique_parameters,
)
from hivespec.protocol.errors import UserError

if TYPE_CHECKING:
    from hivespec.node.config import NodeConfig, SpeculationConfig

__all__ = [
    "VllmEngine",
    "VllmUnavailable",
    "VllmWeightLoader",
    "build_vllm_engine",
    "literal_values",
    "pick_speculative_method",
    "request_seed",
    "require_vllm",
    "spec_counter_totals",
    "speculative_config",
    "to_sample",
    "vllm_sampling_kwargs",
    "weight_buckets",
    "weights_for_load",
]

SpeculativeMethod = Literal["suffix", "ngram"]
INSTALL_HINT = (
    "pip install 'hivespec[gpu]' on a Linux machine with an NVIDIA GPU and a CUDA driver "
    "(vLLM runs on CUDA only), or set model.engine: native"
)
WORKER_EXTENSION = "hivespec.node.model.vllm_engine.VllmWeightLoader"
_LOAD_METHOD = "hivespec_load_weights"
# vLLM's V1 spec-decode counters (cumulative over the engine's life), read via LLM.get_metrics().
DRAFT_TOKENS_METRIC = "vllm:spec_decode_num_draft_tokens"
ACCEPTED_TOKENS_METRIC = "vllm:spec_decode_num_accepted_tokens"
_NGRAM_LOOKUP = (2, 4)  # prompt_lookup_min, prompt_lookup_max: vLLM's documented n-gram example range
_SUFFIX_TREE_DEPTH = 64  # SuffixDecoding's paper setting (vLLM defaults to 24)
_BUCKET_BYTES = 256 << 20

_MASK64 = (1 << 64) - 1
_GAMMA64 = 0x9E3779B97F4A7C15
_MIX64_A = 0xBF58476D1CE4E5B9
_MIX64_B = 0x94D049BB133111EB


class VllmUnavailable(UserError):
    """vLLM cannot run here (not installed, broken, or no CUDA device); the message says what to do."""


def require_vllm() -> ModuleType:
    """Import vllm, or raise `VllmUnavailable` naming the install command and the CUDA requirement."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise VllmUnavailable(f"model.engine is 'vllm' but vLLM is not installed ({exc}); {INSTALL_HINT}") from exc
    if not torch.cuda.is_available():
        raise VllmUnavailable(
            f"model.engine is 'vllm' but no CUDA device is visible (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); vLLM needs an NVIDIA GPU with a CUDA build of torch: {INSTALL_HINT}"
        )
    return vllm


def _mix64(z: int) -> int:
    """splitmix64's finaliser on unsigned 64-bit ints (kernels.sampling._mix64 in Python integers)."""
    z ^= z >> 30
    z = (z * _MIX64_A) & _MASK64
    z ^= z >> 27
    z = (z * _MIX64_B) & _MASK64
    return z ^ (z >> 31)


def request_key(seed: int, sample_index: int) -> int:
    """The native sampler's unsigned 64-bit key of (seed, sample_index), before the position is mixed in."""
    key = _mix64((seed + _GAMMA64) & _MASK64)
    return _mix64((key + (sample_index + 1) * _GAMMA64) & _MASK64)


def request_seed(seed: int, sample_index: int) -> int:
    """vLLM's per-request seed: `request_key` cut to 63 bits, a non-negative int64 every vLLM code path accepts."""
    return request_key(seed, sample_index) & ((1 << 63) - 1)


def vllm_sampling_kwargs(request: GenerationRequest, params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one request, with our engine's semantics.

    One completion, our temperature/top_p/length, stop only on our stop ids (the model's EOS
    is not implied), the sampled token's log-prob only, no detokenisation (we work on ids).
    """
    return {
        "n": 1,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,
        "seed": request_seed(request.seed, request.sample_index),
        "logprobs": 0,
        "detokenize": False,
    }


def to_sample(
    request: GenerationRequest, token_ids: Sequence[int], logprobs: Sequence[float], finish_reason: str | None, params: SamplingParams
) -> Sample:
    """A `Sample` from one vLLM completion (its token ids, their processed log-probs and finish reason)."""
    if finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a completion with reason {finish_reason!r}; expected 'stop' or 'length'")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(token_ids)} tokens; was logprobs=0 set?")
    if params.temperature == 0.0:
        values = [0.0] * len(token_ids)  # a point mass, as the native engine reports greedy tokens
    else:
        values = [float(v) for v in logprobs]
        bad = [v for v in values if not (math.isfinite(v) and v <= 1e-4)]
        if bad:
            raise RuntimeError(f"vLLM returned behaviour log-probs {bad[:3]} (not finite or > 0); check logprobs_mode")
        values = [min(v, 0.0) for v in values]
    return Sample(list(request.prompt_ids), list(token_ids), values, finish_reason)


def literal_values(hint: Any) -> frozenset[str]:
    """Every string in a (possibly nested, possibly Optional) `Literal` type, e.g. vLLM's `SpeculativeMethod`."""
    if isinstance(hint, str):
        return frozenset({hint})
    values: set[str] = set()
    for arg in typing.get_args(hint):
        values |= literal_values(arg)
    return frozenset(values)


def pick_speculative_method(methods: Collection[str], *, suffix_backend: bool) -> SpeculativeMethod:
    """'suffix' when vLLM lists it and its backend (arctic-inference) imports, else 'ngram'."""
    if "suffix" in methods and suffix_backend:
        return "suffix"
    if "ngram" in methods:
        return "ngram"
    raise VllmUnavailable(
        f"this vLLM offers speculative methods {sorted(methods)}, neither 'suffix' nor 'ngram'; install the "
        "pinned version (pip install 'hivespec[gpu]') or set speculation.enabled: false"
    )


def speculative_config(method: SpeculativeMethod, speculation: SpeculationConfig) -> dict[str, Any]:
    """vLLM's `speculative_config` for our speculation settings (names map to their vLLM twins)."""
    if method == "suffix":
        return {
            "method": "suffix",
            "num_speculative_tokens": speculation.num_speculative_tokens,
            "suffix_decoding_max_tree_depth": max(_SUFFIX_TREE_DEPTH, speculation.num_speculative_tokens),
            "suffix_decoding_max_spec_factor": speculation.spec_factor,
            "suffix_decoding_min_token_prob": speculation.min_prob,
        }
    low, high = _NGRAM_LOOKUP
    return {
        "method": "ngram",
        "num_speculative_tokens": speculation.num_speculative_tokens,
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
    }


def weights_for_load(params: Mapping[str, Tensor], names: Iterable[str] | None = None) -> list[tuple[str, Tensor]]:
    """(name, full tensor) pairs for vLLM's `load_weights`: the named tensors of `params` (None: all), in its order.

    Names are the Hugging Face checkpoint names `load_weights` maps onto vLLM's fused layers
    (q/k/v -> qkv_proj, gate/up -> gate_up_proj); a tied lm_head is absent from `params` (see
    `unique_parameters`) and vLLM ties it to the embedding itself.
    """
    wanted = set(params) if names is None else set(names)
    unknown = sorted(wanted - set(params))
    if unknown:
        raise ValueError(f"weights {unknown[:5]} are not engine tensors; expected names from sync_parameters()")
    return [(name, tensor.contiguous()) for name, tensor in params.items() if name in wanted]


def weight_buckets(weights: Sequence[tuple[str, Tensor]], max_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Split (name, tensor) pairs, in order, into runs of at most `max_bytes` (a bigger tensor goes alone)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    buckets: list[list[tuple[str, Tensor]]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def spec_counter_totals(metrics: Iterable[tuple[str, float]]) -> tuple[int, int]:
    """(draft tokens, accepted tokens) summed over vLLM's spec-decode counters (name, value); 0 where absent."""
    drafted = accepted = 0.0
    for name, value in metrics:
        if name == DRAFT_TOKENS_METRIC:
            drafted += value
        elif name == ACCEPTED_TOKENS_METRIC:
            accepted += value
    return int(drafted), int(accepted)


class VllmWeightLoader:
    """Mixed into vLLM's GPU worker class by `worker_extension_cls`; its methods run in the worker process."""

    def hivespec_load_weights(self, weights: Sequence[Sequence[Any]]) -> int:
        """Copy full tensors into the worker's model through the model's own `load_weights`; returns how many."""
        pairs = [(str(name), tensor) for name, tensor in weights]
        # The worker's get_model() unwraps vLLM's CUDA-graph wrappers around the model.
        self.get_model().load_weights(pairs)  # type: ignore[attr-defined]
        return len(pairs)


class VllmEngine:
    """`RolloutEngine` on vLLM's offline `LLM`: batched generation, vLLM speculative decoding, sparse-delta weight sync.

    `model_dir` is a local Hugging Face folder vLLM loads the architecture (and first weights)
    from; `params` is the engine's CPU weight copy in the engine dtype, contiguous, named like
    the trainer's parameters. It is pushed to vLLM at construction, so vLLM starts from exactly
    these bits. `speculation=None` builds a plain engine; vLLM fixes speculative decoding at
    construction, so it cannot be switched per call.
    """

    def __init__(
        self,
        model_dir: str | Path,
        params: Mapping[str, Tensor],
        *,
        dtype: Literal["bfloat16", "float32"] = "bfloat16",
        max_batch_size: int = 16,
        speculation: SpeculationConfig | None = None,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        bad = [name for name, t in params.items() if t.device.type != "cpu" or not t.is_contiguous()]
        if bad:
            raise ValueError(f"engine weights {bad[:3]} must be contiguous CPU tensors (the sync decodes deltas against them)")
        vllm = require_vllm()
        self.drafter = None  # the runtime feeds a native drafter when there is one; vLLM drafts by itself
        self.speculative_method: SpeculativeMethod | None = None
        spec_config = None
        if speculation is not None:
            speculative = importlib.import_module("vllm.config.speculative")
            self.speculative_method = pick_speculative_method(
                literal_values(speculative.SpeculativeMethod),
                suffix_backend=importlib.util.find_spec("arctic_inference") is not None,
            )
            spec_config = speculative_config(self.speculative_method, speculation)
        self._vllm = vllm
        self._params = dict(params)
        self._llm = vllm.LLM(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            skip_tokenizer_init=True,  # we send and receive token ids only
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            max_num_seqs=max_batch_size,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            speculative_config=spec_config,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=False,  # get_metrics() carries the spec-decode counters
        )
        self.weights_updated(None)

    def sync_parameters(self) -> dict[str, Tensor]:
        """The CPU weight copy a sync decodes deltas against and writes into; `weights_updated` pushes it to vLLM."""
        return self._params

    def weights_updated(self, names: Sequence[str] | None = None) -> None:
        """Push the named tensors (None: all) of the CPU copy into vLLM's model, then drop its stale prefix cache."""
        for bucket in weight_buckets(weights_for_load(self._params, names), _BUCKET_BYTES):
            self._llm.collective_rpc(_LOAD_METHOD, args=(bucket,))
        self._llm.reset_prefix_cache()

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_tokens: Callable[[int], None] | None = None,
        speculative: bool | None = None,
        stats: SpeculationStats | None = None,
    ) -> list[Sample]:
        """Completions for the requests, in request order (the native engine's signature).

        `speculative` may only confirm how the engine was built; `on_tokens` is called once, at
        the end, with every token generated (vLLM's offline `generate` blocks until all finish).
        """
        built = self.speculative_method is not None
        if speculative is not None and speculative != built:
            raise ValueError(
                f"this vLLM engine was built with speculative decoding {'on' if built else 'off'}; vLLM fixes it at "
                "construction, so build another VllmEngine to compare"
            )
        started = time.perf_counter()
        drafted_before, accepted_before = self._spec_counters()
        outputs = self._llm.generate(
            [{"prompt_token_ids": list(r.prompt_ids)} for r in requests],
            [self._vllm.SamplingParams(**vllm_sampling_kwargs(r, params)) for r in requests],
            use_tqdm=False,
        )
        samples = []
        for request, output in zip(requests, outputs, strict=True):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs or [], tokens)]
            samples.append(to_sample(request, tokens, logprobs, completion.finish_reason, params))
        drafted_after, accepted_after = self._spec_counters()
        run = SpeculationStats(sequences=len(samples), tokens=sum(len(s.completion_ids) for s in samples))
        run.drafted = run.proposed = drafted_after - drafted_before
        run.accepted = accepted_after - accepted_before
        run.target_forwards = run.tokens - run.accepted  # each forward emits one token plus its accepted drafts
        run.generate_seconds = time.perf_counter() - started
        if on_tokens is not None:
            on_tokens(run.tokens)
        if stats is not None:
            stats.add(run)
        return samples

    def _spec_counters(self) -> tuple[int, int]:
        if self.speculative_method is None:
            return 0, 0
        return spec_counter_totals((m.name, float(getattr(m, "value", 0.0))) for m in self._llm.get_metrics())


def build_vllm_engine(config: NodeConfig, engine_model: torch.nn.Module, *, home: Path) -> VllmEngine:
    """The node's vLLM engine: `engine_model` (the trainer's cast) becomes the CPU weight copy and, for 'tiny', the folder."""
    from hivespec.node.model.loader import EMBEDDED_MODEL, TINY_MODEL, ensure_embedded_cache

    name = config.model.name
    if name == TINY_MODEL:  # random init exists only in memory: write it where vLLM's loader can read it
        model_dir = home / "vllm-model"
        engine_model.save_pretrained(model_dir)  # type: ignore[operator]
    elif name == EMBEDDED_MODEL:
        model_dir = ensure_embedded_cache()
    else:
        model_dir = Path(name).expanduser()
    params = {n: t.to("cpu").contiguous() for n, t in unique_parameters(engine_model).items()}
    return VllmEngine(
        model_dir,
        params,
        dtype=config.model.engine_dtype,  # type: ignore[arg-type]  # config validation rules out float64
        max_batch_size=config.rollout.max_batch_size,
        speculation=config.speculation if config.speculation.enabled else None,
        gpu_memory_utilization=config.model.vllm_gpu_memory_utilization,
    )
