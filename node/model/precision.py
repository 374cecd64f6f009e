"""Device-aware precision: which dtype the rollout engine samples in and whether the trainer autocasts.

bf16 is twice as fast as float32 on most CPUs with native bf16 (AVX512-BF16, AMX) and on a modern GPU,
and 3-20x slower on a CPU without it (AVX2 only: every bf16 matmul converts through float32); a flag is
not a speed: a 2-core Xeon model 207 exposing avx512_bf16 without AMX decoded in bf16 at float32's speed
and trained 1.8x slower under autocast (2026-11-29). A fixed default is therefore wrong somewhere. With ``model.engine_dtype: auto`` and
``model.autocast: auto`` the node decides at start-up, per role, from what this device does:

- CUDA: bfloat16 where ``torch.cuda.is_bf16_supported()``, else float32 (no measurement).
- CPU: a sub-second measurement of both dtypes on this model's matmul shapes at the thread count
  the node uses: for the engine one decode step at its real batch size (weights streamed from
  memory, as a decode step does), for the trainer a forward+backward of one layer's linears
  under autocast. A near tie goes to the cheaper choice for each role: the trainer autocasts
  only where bf16 measures at least 10% faster (``MARGIN``), while the engine stays bf16 unless
  float32 measures at least 10% faster, since a bf16 engine holds half the memory. With the
  round's shape known, the engine's choice weighs a whole round: the prompts' prefill (timed per
  token on the real model), its decode steps, and one trainer -> engine weight sync. For a leader (``sync.publish``) that sync entropy-codes the
  delta for its followers, and a float32 engine's delta is dense (every weight moves under
  AdamW): over a minute and gigabytes of RAM per step for a 135M model on a CPU, which keeps a
  leader bf16. A node without followers writes the changes directly (`WeightSync.sync(...,
  encode=False)`), about a second for either dtype, so there the decode speed decides. The
  result is cached per machine (CPU model, flags, torch version, threads, shapes) under the
  model cache dir, so later starts decide in milliseconds; delete ``precision.json`` there to
  re-measure. CPU flags (avx512_bf16, amx_bf16) and torch's CPU capability go into the reason
  as evidence, never into the decision.
- Any other device: float32, which every backend runs.

Explicit values (``bfloat16``, ``float32``, ``true``, ``false``) are honoured as given. Each
choice carries the reason, with the measured numbers, for the start-up log, ``hivespec doctor``
and the status snapshot. Peers need not agree: the behaviour log-probs a rollout carries come
from its author's engine, and the trainer's importance weights correct for whatever numerics
produced them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from hivespec.node.model.device import work_clock

log = logging.getLogger(__name__)

Role = Literal["engine", "trainer"]
MARGIN = 0.9  # the costlier choice must take at most this share of the other's time to be chosen
CACHE_FILE = "precision.json"
_CACHE_FORMAT = 3  # 3: timed by the work clock (`work_clock`); 2: the engine's decode step timed on the real model
_STREAM_BYTES = 48 << 20  # decode weights measured per step: past a CPU's last-level cache (the LM head adds more)
_TRAIN_ROWS_MAX = 64  # training rows measured: a real matmul shape, yet cheap where bf16 is 20x slower
_MEASURE_BUDGET_S = 0.4  # per role: repeats stop once both dtypes are timed and this is spent
_DECODE_CONTEXT = 16  # tokens in the KV cache when a real decode step is timed
_PREFILL_TOKENS = 16  # tokens of the prefill forward timed (one row: seconds per token scale linearly)
PROMPT_TOKENS = 64  # a typical prompt after the chat template, for estimates that need one
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX512-BF16 / AMX, aarch64 FEAT_BF16

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64", torch.float16: "float16"}
DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


@dataclass(frozen=True)
class PrecisionChoice:
    """One role's precision: ``dtype`` is the engine's weight dtype or the trainer's autocast dtype (None: off).

    ``source`` is "explicit" (the config named it), "measured", "cached" (a measurement of this
    machine read back), "device" (decided by the device's capability) or "fallback".
    """

    role: Role
    dtype: torch.dtype | None
    source: str
    reason: str

    @property
    def label(self) -> str:
        """Short form for headers: "bfloat16", "float32", or "float32 (no autocast)" for a trainer."""
        if self.role == "trainer":
            return "bfloat16 autocast" if self.dtype is not None else "float32"
        return _DTYPE_NAMES.get(self.dtype, str(self.dtype))  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"{self.role} {self.label} ({self.source}: {self.reason})"


@dataclass(frozen=True)
class PrecisionPlan:
    """The engine's and the trainer's choices, decided together at start-up."""

    engine: PrecisionChoice
    trainer: PrecisionChoice

    @property
    def engine_dtype_name(self) -> str:
        return _DTYPE_NAMES[self.engine.dtype]  # type: ignore[index]

    def describe(self) -> str:
        """Two clauses for the start-up log and `hivespec doctor`."""
        return f"{self.engine.describe()}; {self.trainer.describe()}"

    def applied_to(self, config: Any) -> Any:
        """`config` (a NodeConfig) with model.engine_dtype and model.autocast as this plan decided them."""
        model = replace(config.model, engine_dtype=self.engine_dtype_name, autocast=self.trainer.dtype is not None)
        return replace(config, model=model)


@dataclass(frozen=True)
class ModelShape:
    """What the measured matmuls need from a model's architecture."""

    hidden: int
    intermediate: int
    layers: int
    q_width: int  # heads * head_dim
    kv_width: int  # kv heads * head_dim
    vocab: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a transformers config; fields a non-Llama config lacks get the usual Llama relations."""
        hidden = int(config.hidden_size)
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(
            hidden=hidden,
            intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
            layers=int(getattr(config, "num_hidden_layers", 1) or 1),
            q_width=heads * head_dim,
            kv_width=kv_heads * head_dim,
            vocab=int(getattr(config, "vocab_size", 0) or 0),
        )

    def layer_linears(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's linears: q, k, v, o, gate, up, down."""
        h, i = self.hidden, self.intermediate
        return [(h, self.q_width), (h, self.kv_width), (h, self.kv_width), (self.q_width, h), (h, i), (h, i), (i, h)]

    def layer_params(self) -> int:
        return sum(a * b for a, b in self.layer_linears())


# ----- evidence -----------------------------------------------------------------------------


def cpu_facts() -> dict[str, Any]:
    """CPU model, its bf16 flags, torch's CPU capability and version: the machine part of the cache key."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:  # x86, aarch64
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16_flags": sorted(f for f in _BF16_FLAGS if f in flags),
        "avx512": "avx512f" in flags,
        "torch": torch.__version__,
    }


def _evidence(facts: dict[str, Any]) -> str:
    native = ", ".join(facts["native_bf16_flags"]) or "no avx512_bf16/amx_bf16"
    return f"CPU {facts['cpu']}, torch capability {facts['capability']}, {native}"


# ----- measurements -------------------------------------------------------------------------


def _best_of(float32: Callable[[], None], bfloat16: Callable[[], None], budget_s: float) -> dict[str, float]:
    """Best seconds of each dtype's run, cheap when one is far slower.

    float32 runs once to warm up, then the two alternate (spreading a shared machine's noise
    over both instead of skewing one; the minimum is kept since noise only adds time) until
    ``budget_s`` is spent, at most 4 rounds. bf16 gets no separate warm-up: a first call that
    includes one-time set-up and a second that does not both count, and when both take over 3x
    float32's time the verdict cannot change, so it stops there. That keeps the measurement
    sub-second on a CPU where bf16 is 20x slower.
    """
    float32()
    best = {"float32": math.inf, "bfloat16": math.inf}
    clock, started = work_clock("cpu"), time.perf_counter()
    for rounds in range(1, 5):
        for name, run in (("float32", float32), ("bfloat16", bfloat16)):
            mark = clock()
            run()
            best[name] = min(best[name], clock() - mark)
        clear = best["bfloat16"] > 3.0 * best["float32"] or best["float32"] > 3.0 * best["bfloat16"]
        if rounds >= 2 and (clear or time.perf_counter() - started > budget_s):
            break
    return best


@torch.inference_mode()
def measure_model_decode(model: torch.nn.Module, batch: int, *, budget_s: float = _MEASURE_BUDGET_S) -> dict[str, float]:
    """Seconds of one real decode step of ``model`` at ``batch`` rows: float32 weights vs a bfloat16 copy (CPU).

    The whole forward a rollout step runs (norms, rotary, attention over a short KV cache, the
    LM head), not just its matmuls: on a CPU without native bf16 those element-wise ops convert
    too, and at small batches they decide (on an AVX2 EPYC at batch 4 the matmuls alone tied
    while the bf16 engine generated 2.6x slower). Costs a bf16 copy of the weights while it runs
    and a few seconds at batch 16 where bf16 is slow; the result is cached.
    """
    import copy

    runs: dict[str, Callable[[], None]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        weights_dtype = next(model.parameters()).dtype
        copy_of = model if weights_dtype == dtype else copy.deepcopy(model).to(dtype)
        ids = torch.ones((batch, _DECODE_CONTEXT), dtype=torch.long)
        cache = copy_of(input_ids=ids, use_cache=True).past_key_values
        token = torch.ones((batch, 1), dtype=torch.long)

        def step(copy_of: torch.nn.Module = copy_of, cache: Any = cache, token: torch.Tensor = token) -> None:
            copy_of(input_ids=token, past_key_values=cache, use_cache=True)  # the cache grows by one token per call

        runs[_DTYPE_NAMES[dtype]] = step
    return _best_of(runs["float32"], runs["bfloat16"], budget_s)


@torch.inference_mode()
def measure_model_prefill(model: torch.nn.Module, *, budget_s: float = _MEASURE_BUDGET_S) -> dict[str, float]:
    """Seconds per prompt token of ``model``'s prefill (one forward over ``_PREFILL_TOKENS`` tokens): float32 vs bf16 (CPU).

    A rollout reads its prompts before it decodes: a forward over every prompt token, compute-bound
    like training, where bf16 without native support is many times slower. At a small decode batch
    with short completions this decides (on the AVX2 EPYC at batch 4 and 16 new tokens the decode
    steps measured 123 ms vs 137 ms while the bf16 engine's rollouts took 2.3x as long).
    """
    import copy

    ids = torch.ones((1, _PREFILL_TOKENS), dtype=torch.long)
    runs: dict[str, Callable[[], None]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        copy_of = model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
        runs[_DTYPE_NAMES[dtype]] = lambda copy_of=copy_of: copy_of(input_ids=ids, use_cache=False)
    return {name: seconds / _PREFILL_TOKENS for name, seconds in _best_of(runs["float32"], runs["bfloat16"], budget_s).items()}


@torch.inference_mode()
def measure_decode(shape: ModelShape, batch: int, *, budget_s: float = _MEASURE_BUDGET_S) -> dict[str, float]:
    """Estimated seconds of one decode step at ``batch`` rows, float32 vs bfloat16 weights (CPU), without the model.

    For callers that only have the model's config (a follower's guess); a node measures its real
    model (`measure_model_decode`). Runs every linear of as many distinct layers as fill ``_STREAM_BYTES`` (so weights come from
    memory, not cache, as in a real decode step) plus the LM head, then scales the layers to the
    model's depth. Attention over the KV cache and the norms are left out: at decode they are a
    small share, and both dtypes pay them alike.
    """
    copies = max(1, min(shape.layers, math.ceil(_STREAM_BYTES / (4 * shape.layer_params()))))
    runs: dict[str, Callable[[], None]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        layers = [[torch.full((out, inp), 0.01, dtype=dtype) for inp, out in shape.layer_linears()] for _ in range(copies)]
        head = torch.full((shape.vocab, shape.hidden), 0.01, dtype=dtype) if shape.vocab else None
        x = torch.full((batch, shape.hidden), 0.1, dtype=dtype)

        def step(layers: list = layers, head: torch.Tensor | None = head, x: torch.Tensor = x) -> None:
            h = x
            for q, k, v, o, gate, up, down in layers:
                attn = F.linear(h, q)
                F.linear(h, k), F.linear(h, v)
                h = F.linear(attn, o)
                h = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
            if head is not None:
                F.linear(h, head)

        runs[_DTYPE_NAMES[dtype]] = step
    best = _best_of(runs["float32"], runs["bfloat16"], budget_s)
    # Scale the streamed layers to the model's depth; the head ran once per step already.
    return {name: seconds * shape.layers / copies for name, seconds in best.items()}


def measure_training(shape: ModelShape, rows: int, *, budget_s: float = _MEASURE_BUDGET_S) -> dict[str, float]:
    """Estimated seconds of a training forward+backward over ``rows`` tokens: float32 vs bf16 autocast (CPU).

    Times one layer's linears on float32 master weights, the way the trainer runs them (autocast
    casts to bf16 in the forward, gradients return in float32), at ``min(rows, 64)`` rows, and
    scales to the model's depth and ``rows``.
    """
    measured_rows = max(1, min(rows, _TRAIN_ROWS_MAX))
    weights = [torch.full((out, inp), 0.01, requires_grad=True) for inp, out in shape.layer_linears()]
    x = torch.full((measured_rows, shape.hidden), 0.1, requires_grad=True)

    def step(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            q, k, v, o, gate, up, down = weights
            keys, values = F.linear(x, k), F.linear(x, v)
            h = F.linear(F.linear(x, q), o)
            h = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
        (h.float().sum() + keys.float().sum() + values.float().sum()).backward()
        for w in weights:
            w.grad = None
        x.grad = None

    best = _best_of(lambda: step(False), lambda: step(True), budget_s)
    return {name: seconds * shape.layers * rows / measured_rows for name, seconds in best.items()}


def weight_sample(model: torch.nn.Module, elements: int = 1 << 18) -> torch.Tensor:
    """About ``elements`` float32 weights strided over every parameter: the model's magnitude mix, for `measure_sync`."""
    params = [p.detach().float().flatten() for p in model.parameters()]
    stride = max(1, sum(p.numel() for p in params) // elements)
    return torch.cat([p[::stride] for p in params])[:elements].cpu()


def measure_sync(params: int, learning_rate: float, weights: torch.Tensor | None = None, *, encode: bool = True) -> dict[str, float]:
    """Estimated seconds of one trainer -> engine weight sync after an optimizer step: float32 vs bfloat16 engine.

    Runs the real `WeightSync` (``encode``: build, encode, decode, apply, hash, as a leader does;
    else the direct write of a node without followers) on a sample of the model's ``weights``
    (`weight_sample`; default 2**18 draws of N(0, 0.02)) after an Adam-sized step
    (``learning_rate`` on every element) and scales to ``params``. A float32 engine sees every
    element change, a bf16 one only those whose rounding moved: for a leader the delta codec's
    cost can outweigh bf16's slower decode on a CPU without native bf16.
    """
    from hivespec.node.weights.sync import WeightSync

    generator = torch.Generator().manual_seed(0)
    if weights is None:
        weights = torch.randn(1 << 18, generator=generator) * 0.02
    elements = weights.numel() // 512 * 512
    trainer = torch.nn.Linear(elements // 512, 512, bias=False)
    with torch.no_grad():
        trainer.weight.copy_(weights[:elements].reshape(trainer.weight.shape))
    base = trainer.weight.detach().clone()
    step = learning_rate * torch.sign(torch.randn(trainer.weight.shape, generator=generator))
    seconds = {}  # timed by the wall: the sync's hash runs on a thread pool, so the work is not this thread's alone
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            trainer.weight.copy_(base)
        sync = WeightSync(trainer, {"weight": base.to(dtype).clone()})
        with torch.no_grad():
            trainer.weight.add_(step)
        mark = time.perf_counter()
        sync.sync(1, encode=encode)
        seconds[_DTYPE_NAMES[dtype]] = (time.perf_counter() - mark) * params / elements
    return seconds


# ----- the cache ----------------------------------------------------------------------------


def measurement_key(role: str, shape: ModelShape, size: float, threads: int, facts: dict[str, Any]) -> str:
    """What a measurement depends on: role, shapes, batch (rows, learning rate), threads and the machine."""
    return json.dumps([_CACHE_FORMAT, role, asdict(shape), size, threads, facts], sort_keys=True)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached_measurement(
    role: str, shape: ModelShape, size: float, threads: int, cache: Path | None, measure: Callable[[], dict[str, float]],
    *, names: tuple[str, ...] = ("float32", "bfloat16"),
) -> tuple[dict[str, float], bool]:
    """``(seconds by name, from_cache)``: the cached timings for this key, else ``measure()`` written back.

    ``names`` are what is timed (dtypes here; attention implementations in `hivespec.node.model.attention`).

    Processes starting together take a file lock, so one measures (on an idle machine) and the
    others read its result; a corrupt or foreign cache file is measured over.
    """
    key = measurement_key(role, shape, size, threads, cpu_facts())
    if cache is None:
        return measure(), False

    def lookup() -> dict[str, float] | None:
        entry = _read_cache(cache).get(key)
        if isinstance(entry, dict) and all(isinstance(entry.get(n), (int, float)) for n in names):
            return {n: float(entry[n]) for n in names}
        return None

    found = lookup()
    if found is not None:
        return found, True
    from hivespec.node.model.loader import _exclusive_lock

    with _exclusive_lock(cache.with_suffix(".lock"), what="measuring this machine's precision"):
        found = lookup()
        if found is not None:
            return found, True
        seconds = measure()
        data = _read_cache(cache)
        data[key] = {**seconds, "measured_at": time.time()}
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(cache)
    return seconds, False


def default_cache_path() -> Path:
    """``<hivespec cache dir>/precision.json`` (``$HIVESPEC_CACHE_DIR`` moves it)."""
    from hivespec.node.model.loader import cache_dir

    return cache_dir() / CACHE_FILE


# ----- decisions ----------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _pick(seconds: dict[str, float]) -> bool:
    """True when bf16 autocast is worth it for the trainer: at most MARGIN of float32's time."""
    return seconds["bfloat16"] <= MARGIN * seconds["float32"]


def _pick_engine(seconds: dict[str, float]) -> bool:
    """True when the engine should stay bf16: unless float32 takes at most MARGIN of bf16's time.

    A tie goes to bf16: half the engine's memory, and a sparse per-step delta instead of a dense one.
    """
    return not seconds["float32"] <= MARGIN * seconds["bfloat16"]


def _cuda_bf16(device: torch.device) -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, f"{device} requested but CUDA is not available"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    supported = torch.cuda.is_bf16_supported()
    return supported, f"{name} (compute capability {major}.{minor}) {'supports' if supported else 'lacks'} bf16"


def decide_engine(
    requested: str, shape: ModelShape, *, device: str, batch: int, threads: int, cache: Path | None,
    steps: int = 0, learning_rate: float | None = None, weights: torch.Tensor | None = None, publish: bool = False,
    model: torch.nn.Module | None = None, prompt_tokens: int = 0,
) -> PrecisionChoice:
    """The engine's weight dtype: ``requested`` unless it is "auto" (see the module docstring).

    With ``steps`` (decode steps per round) and ``learning_rate`` (float32 master weights) a CPU
    compares whole rounds: decode steps plus one weight sync, as a leader does it (``publish``:
    entropy-coded, dense for a float32 engine) or as a node without followers does (direct
    writes), and, with ``model`` and ``prompt_tokens`` (per round), the prompts' prefill. Without
    them it compares one decode step: of ``model`` where given (`measure_model_decode`), else an
    estimate from the shapes' matmuls (`measure_decode`).
    """
    if requested != "auto":
        return PrecisionChoice("engine", DTYPES[requested], "explicit", "model.engine_dtype in the config")
    kind = torch.device(device)
    if kind.type == "cuda":
        supported, why = _cuda_bf16(kind)
        return PrecisionChoice("engine", torch.bfloat16 if supported else torch.float32, "device", why)
    if kind.type != "cpu":
        return PrecisionChoice("engine", torch.float32, "fallback", f"no measurement for device type {kind.type!r}; float32 runs everywhere")
    if model is not None:
        seconds, cached = cached_measurement("engine", shape, batch, threads, cache, lambda: measure_model_decode(model, batch))
    else:
        seconds, cached = cached_measurement("engine-linears", shape, batch, threads, cache, lambda: measure_decode(shape, batch))
    step = "decode step" if model is not None else "decode step's matmuls"
    reason = (f"{step} at batch {batch}, {threads} thread{'s' if threads != 1 else ''}: float32 {_ms(seconds['float32'])}, "
              f"bfloat16 {_ms(seconds['bfloat16'])}")
    if steps and learning_rate:
        params = shape.layers * shape.layer_params() + shape.vocab * shape.hidden
        sync, sync_cached = cached_measurement(
            "sync" if publish else "sync-local", shape, learning_rate, threads, cache,
            lambda: measure_sync(params, learning_rate, weights, encode=publish),
        )
        cached = cached and sync_cached
        prefill = {name: 0.0 for name in seconds}
        if model is not None and prompt_tokens:
            per_token, prefill_cached = cached_measurement(
                "prefill", shape, _PREFILL_TOKENS, threads, cache, lambda: measure_model_prefill(model)
            )
            cached = cached and prefill_cached
            prefill = {name: prompt_tokens * per_token[name] for name in seconds}
            reason += f"; prefill of {prompt_tokens} prompt tokens: float32 {_ms(prefill['float32'])}, bfloat16 {_ms(prefill['bfloat16'])}"
        seconds = {name: steps * seconds[name] + prefill[name] + sync[name] for name in seconds}
        reason += (f"; weight sync after a step{' (coded for followers)' if publish else ''}: float32 {_ms(sync['float32'])}, bfloat16 {_ms(sync['bfloat16'])}; "
                   f"a round of {steps} steps{' + prefill' if prompt_tokens and model is not None else ''} + sync: "
                   f"float32 {_ms(seconds['float32'])}, bfloat16 {_ms(seconds['bfloat16'])}")
    bf16 = _pick_engine(seconds)
    reason += f"; {_evidence(cpu_facts())}"
    return PrecisionChoice("engine", torch.bfloat16 if bf16 else torch.float32, "cached" if cached else "measured", reason)


def decide_trainer(
    requested: bool | str, train_dtype: str, shape: ModelShape, *, device: str, rows: int, threads: int, cache: Path | None
) -> PrecisionChoice:
    """The trainer's autocast dtype (None: off): ``requested`` unless it is "auto".

    Autocast only applies to float32 master weights; float64 training never autocasts.
    """
    if train_dtype != "float32":
        return PrecisionChoice("trainer", None, "explicit", f"model.train_dtype {train_dtype} trains without autocast")
    if requested != "auto":
        return PrecisionChoice("trainer", torch.bfloat16 if requested else None, "explicit", "model.autocast in the config")
    kind = torch.device(device)
    if kind.type == "cuda":
        supported, why = _cuda_bf16(kind)
        return PrecisionChoice("trainer", torch.bfloat16 if supported else None, "device", why)
    if kind.type != "cpu":
        return PrecisionChoice("trainer", None, "fallback", f"no measurement for device type {kind.type!r}; float32 runs everywhere")
    seconds, cached = cached_measurement("trainer", shape, rows, threads, cache, lambda: measure_training(shape, rows))
    bf16 = _pick(seconds)
    reason = (f"forward+backward of {rows} tokens, {threads} thread{'s' if threads != 1 else ''}: float32 {_ms(seconds['float32'])}, "
              f"bfloat16 autocast {_ms(seconds['bfloat16'])}; {_evidence(cpu_facts())}")
    return PrecisionChoice("trainer", torch.bfloat16 if bf16 else None, "cached" if cached else "measured", reason)


def train_rows(micro_batch_size: int, max_completion_length: int, prompt_tokens: int = PROMPT_TOKENS) -> int:
    """Tokens of one training micro batch: sequences times a typical prompt plus the longest completion."""
    return max(1, micro_batch_size * (prompt_tokens + max_completion_length))


def resolve_precision(
    model_config: Any,
    *,
    engine_dtype: str,
    autocast: bool | str,
    train_dtype: str,
    device: str,
    batch: int,
    rows: int,
    threads: int | None = None,
    cache: Path | None | Literal["default"] = "default",
    new_tokens: int = 0,
    sequences: int = 0,
    learning_rate: float | None = None,
    weights: torch.Tensor | None = None,
    publish: bool = False,
    model: torch.nn.Module | None = None,
) -> PrecisionPlan:
    """Decide both roles for a model (its transformers config) on ``device``; see the module docstring.

    ``batch`` is the engine's decode batch (`RolloutConfig.decode_batch`), ``rows`` the tokens of a training
    micro batch (`train_rows`), ``threads`` torch's intra-op threads (default: the current
    setting). With ``new_tokens`` (max completion length), ``sequences`` (per round) and
    ``learning_rate`` the engine's choice weighs a round's decoding plus its weight sync, measured
    on ``weights`` (`weight_sample` of the model; default: synthetic), coded for followers if
    ``publish`` (a leader). With ``model`` (the loaded trainer model) the engine's decode step is
    timed on it; without, estimated from the config's shapes. ``cache=None`` measures without reading or writing the cache.
    """
    shape = ModelShape.of(model_config)
    threads = threads if threads is not None else torch.get_num_threads()
    where = default_cache_path() if cache == "default" else cache
    steps = new_tokens * max(1, math.ceil(sequences / batch)) if new_tokens else 0
    engine = decide_engine(engine_dtype, shape, device=device, batch=batch, threads=threads, cache=where, steps=steps,
                           prompt_tokens=sequences * PROMPT_TOKENS,
                           learning_rate=learning_rate if train_dtype == "float32" else None, weights=weights, publish=publish,
                           model=model)
    trainer = decide_trainer(autocast, train_dtype, shape, device=device, rows=rows, threads=threads, cache=where)
    return PrecisionPlan(engine, trainer)


def resolve_node_precision(config: Any, model: torch.nn.Module, *, threads: int,
                           cache: Path | None | Literal["default"] = "default", engine_dtype: str | None = None,
                           autocast: bool | str | None = None) -> PrecisionPlan:
    """`resolve_precision` for a node of `config` (a NodeConfig) whose trainer model is `model` (loaded, float32): what
    `build_node` decides at start-up and `hivespec doctor` reports. `engine_dtype` and `autocast` replace the config's
    (the doctor asks what `auto` would pick beside what is set)."""
    settings, rollout = config.model, config.rollout
    return resolve_precision(
        model.config,
        engine_dtype=settings.engine_dtype if engine_dtype is None else engine_dtype,
        autocast=settings.autocast if autocast is None else autocast,
        train_dtype=settings.train_dtype,
        device=settings.device,
        batch=rollout.decode_batch,
        rows=_node_rows(config),
        threads=threads,
        cache=cache,
        new_tokens=rollout.max_completion_length,
        sequences=rollout.prompts_per_round * rollout.num_generations,
        learning_rate=config.train.learning_rate,
        weights=weight_sample(model),  # the sync estimate samples its real weights
        publish=config.sync.publish,
        model=model,  # the engine's decode step is timed on the real model
    )


def trainer_precision(config: Any, model_config: Any, *, threads: int,
                      cache: Path | None | Literal["default"] = "default") -> PrecisionChoice:
    """The trainer's half of `resolve_node_precision` for a node of `config` (a NodeConfig) at `threads`, from the model's
    transformers config alone (`loader.load_model_config`): the trainer's measurement times the shapes' matmuls, so it
    needs no weights. `hivespec demo` sizes its nodes' memory by it before any node has loaded the model; it is timed at
    `threads` and cached under the key each node's own start then reads back."""
    settings = config.model
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # the cache's key says `threads`: timed at them
    try:
        return decide_trainer(settings.autocast, settings.train_dtype, ModelShape.of(model_config), device=settings.device,
                              rows=_node_rows(config), threads=threads,
                              cache=default_cache_path() if cache == "default" else cache)
    finally:
        torch.set_num_threads(previous)


def _node_rows(config: Any) -> int:
    """The tokens of a training micro batch of a node of `config`, as its trainer's measurement is keyed (`train_rows`)."""
    return train_rows(config.train.micro_batch_size, config.rollout.max_completion_length)


def follower_engine_dtype(config: Any, model_config: Any) -> torch.dtype:
    """A follower's engine dtype: ``model.engine_dtype``, and for "auto" what a leader on this machine would pick.

    Deltas are bit patterns of the leader's engine dtype, so a follower only mirrors a leader of
    the same dtype; a leader on another machine may decide otherwise, so the log says so.
    """
    model, rollout = config.model, config.rollout
    choice = decide_engine(
        model.engine_dtype, ModelShape.of(model_config), device=model.device, threads=torch.get_num_threads(),
        batch=rollout.decode_batch, cache=default_cache_path(),
    )
    if choice.source != "explicit":
        log.warning("follower engine %s (model.engine_dtype auto: %s); it must equal the leader's engine dtype: "
                    "set model.engine_dtype to the leader's if its deltas are refused", choice.label, choice.reason)
    assert choice.dtype is not None
    return choice.dtype
