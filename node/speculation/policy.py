"""When and how much to speculate: the verify-cost curve and the length-aware budget policy.

A speculative step feeds K + 1 tokens per row instead of one, so it pays only when the tokens
it expects to emit outgrow what the wider forward costs. That cost ratio, T(B, K + 1) / T(B, 1)
for a batch of B rows, depends on the device, dtype, model and thread count (on this 2-core
CPU in fp32: ~1.5x for 8 drafts at B = 1, ~3x at B = 8), so it is measured once per machine
(`calibrate_verify_cost`) and cached on disk under the model cache dir, keyed by all of those
(`load_or_calibrate`). The measurement is small (the node's own batch sizes only: 1, a quarter
of its batch and its batch; one timed pass over a short context; seconds, not minutes) and it
never holds up start-up: a node without a cached curve decodes plainly and measures it later,
when it would otherwise sit idle (`CurveCalibration`, run by the node while it waits for peers'
batches), then turns speculation on. Plain and speculative decoding give the same completions,
so when speculation switches on changes no result beyond fp32 rounding. It is not monotone in K: 2- and 3-token forwards cost ~1.7-2x here (slow
small-matrix GEMMs) against ~1.3x for 5, so a step runs the cheapest forward at least as wide as
it needs (`VerifyCostCurve.cover`; the engine pads the extra slots).

`LengthAwarePolicy` (DAS, "Beat the long tail") then decides each step:
- each request gets a draft cap from its prompt's length class, predicted from the completion
  lengths of that prompt's recent rollouts against all recent ones: long prompts set the
  makespan, so they get the full budget, medium half, short a quarter;
- the step's width K is the one that maximises expected emitted tokens per unit verify cost,
  weighting long rows up. A row's chance to get its j-th draft token accepted is the smaller of
  the drafter's own estimate (the draft prefix's empirical probability) and alpha^j, where alpha
  is the per-token acceptance the target has actually shown (a decaying count of accepted drafts
  against rejections): a window of one or two rollouts makes the drafter sure of everything, the
  target is not. While speculation is off, one step in `probe_every` still verifies two tokens
  so alpha keeps tracking the drafts;
- K = 0 (no drafting at all) wherever the batch is compute-bound, i.e. no K could pay even if
  every draft were accepted.
`UniformPolicy` drafts a fixed budget for every row (the baseline the length-aware one is
measured against, and what tests use to force speculation).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hivespec.protocol.rollout import decode_rollout

if TYPE_CHECKING:
    from hivespec.node.config import SpeculationConfig
    from hivespec.node.model.engine import TorchEngine
    from hivespec.node.speculation.drafter import Draft, SuffixDrafter
    from hivespec.node.training.store import RolloutStore

__all__ = [
    "CurveCalibration",
    "LengthAwarePolicy",
    "RowPlan",
    "SpeculationPolicy",
    "UniformPolicy",
    "VerifyCostCurve",
    "build_speculation",
    "calibrate_verify_cost",
    "calibration_batches",
    "device_verify_cost",
    "length_class",
    "load_or_calibrate",
    "model_identity",
    "rebuild_drafter",
    "wider_pays",
]

log = logging.getLogger(__name__)

CALIBRATION_BATCHES = (1, 2, 4, 8, 16)  # what a bench measures; a node measures `calibration_batches`
CALIBRATION_WIDTHS = (1, 2, 3, 5, 9, 17)
CALIBRATION_CONTEXT = 16  # cached tokens per row while timing: the prefill is a third of the cost at 32 (batch 16)
_CURVE_FORMAT = 4  # 4: steps include the keyed sampling; 3: raw per-width ratios (2 forced them monotone)

# Draft cap and objective weight per length class (DAS's hard / medium / easy budgets 16 / 8 / 4).
_CLASS_CAP_SHARE = {"long": 1.0, "medium": 0.5, "short": 0.25}
_CLASS_WEIGHT = {"long": 2.0, "medium": 1.0, "short": 0.5}


@dataclass(frozen=True)
class VerifyCostCurve:
    """Measured forward time T(B, W) of W new tokens per row at batch B, as ratios to T(B, 1).

    `ratios[i][j]` belongs to batches[i] and widths[j]; widths[0] is 1 (ratio 1.0). Between
    measured points the ratio is interpolated linearly in the width and taken from the next
    larger measured batch (the conservative side); beyond the largest width it is extrapolated
    along the last segment.
    """

    batches: tuple[int, ...]
    widths: tuple[int, ...]
    ratios: tuple[tuple[float, ...], ...]
    base_seconds: tuple[float, ...]  # T(B, 1) per batch, for reports
    key: str = ""

    def __post_init__(self) -> None:
        if not self.batches or list(self.batches) != sorted(set(self.batches)):
            raise ValueError(f"batches must be increasing and non-empty, got {self.batches}")
        if len(self.widths) < 2 or self.widths[0] != 1 or list(self.widths) != sorted(set(self.widths)):
            raise ValueError(f"widths must be increasing, start at 1 and have >= 2 entries, got {self.widths}")
        if len(self.ratios) != len(self.batches) or any(len(row) != len(self.widths) for row in self.ratios):
            raise ValueError(f"ratios must be [{len(self.batches)}][{len(self.widths)}], got {self.ratios}")

    def ratio(self, batch: int, width: int) -> float:
        """T(batch, width) / T(batch, 1) for a forward of exactly `width` tokens per row."""
        if width <= 1:
            return 1.0
        row = self.ratios[min(bisect_left(self.batches, batch), len(self.batches) - 1)]
        j = min(max(bisect_left(self.widths, width), 1), len(self.widths) - 1)
        if self.widths[j] == width:
            return row[j]
        w0, w1 = self.widths[j - 1], self.widths[j]
        r0, r1 = row[j - 1], row[j]
        return max(1.0, r0 + (r1 - r0) * (width - w0) / (w1 - w0))

    def cover(self, batch: int, width: int) -> tuple[int, float]:
        """The cheapest forward width >= `width` (`width` itself or a wider measured one) and its ratio.

        Forward cost is not monotone in the width: on this CPU in fp32 at batch 1, 2- and 3-token
        forwards take the slow small-matrix GEMM path and cost ~1.7-2.0x a 1-token one while 5
        tokens cost ~1.3x. A step that wants K drafts may run a wider forward instead (the
        engine pads the extra slots, masked and never accepted), so this is what K really costs.
        """
        if width <= 1:
            return 1, 1.0
        best_width, best = width, self.ratio(batch, width)
        for wider in self.widths:
            if wider > width and self.ratio(batch, wider) < best:
                best_width, best = wider, self.ratio(batch, wider)
        return best_width, best

    def to_json(self) -> str:
        return json.dumps({"format": _CURVE_FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> VerifyCostCurve:
        data = json.loads(text)
        if data.pop("format", None) != _CURVE_FORMAT:
            raise ValueError("verify-cost cache has an old format; it will be re-measured")
        return cls(
            batches=tuple(data["batches"]),
            widths=tuple(data["widths"]),
            ratios=tuple(tuple(float(r) for r in row) for row in data["ratios"]),
            base_seconds=tuple(float(s) for s in data["base_seconds"]),
            key=str(data.get("key", "")),
        )


TimeForwards = Callable[[int, Sequence[int]], list[float]]
Progress = Callable[[str], None]


def wider_pays(width: int, ratio: float) -> bool:
    """Whether to time forwards wider than `width`, whose cost is `ratio` x a plain step.

    Once a width costs more than the tokens it would emit at the per-token acceptance the
    policy starts from (0.8), the batch is compute-bound there and every wider forward costs
    at least about proportionally more: they are not timed, and the curve prices them linearly
    from this one (`calibrate_verify_cost`). At batch 16 in fp32 on a 2-core CPU this skips the
    17-token forward, half of that batch's timing.
    """
    return width <= 1 or (1.0 - 0.8**width) / 0.2 > ratio


def calibration_batches(max_batch_size: int) -> list[int]:
    """The batch sizes a node times: 1, a quarter of its batch and its batch.

    Rows leave a batch as they finish, so a node decodes at every size up to its batch; the
    curve prices a size by the next larger measured one (the conservative side), so these
    three points bound every step it runs at a fraction of the cost of timing each size.
    """
    return sorted({1, max(1, max_batch_size // 4), max_batch_size})


def calibrate_verify_cost(
    time_forwards: TimeForwards,
    *,
    batches: Sequence[int] = CALIBRATION_BATCHES,
    widths: Sequence[int] = CALIBRATION_WIDTHS,
    key: str = "",
    repeats: int = 1,
    on_progress: Progress | None = None,
) -> VerifyCostCurve:
    """Measure the curve with `time_forwards(batch, widths) -> seconds` (e.g. `TorchEngine.time_forwards`).

    Each batch is timed `repeats` times, spread over the whole calibration, and every width keeps
    its fastest time: the curve is cached for good, so one busy moment on a shared machine must
    not inflate it. Ratios are kept per width as measured, not forced monotone: a narrow width
    that measures slower than a wider one usually really is (see `VerifyCostCurve.cover`).
    `on_progress` is told each batch as it is timed (a line for the log or the demo).
    """
    seconds_by_batch = {batch: [float("inf")] * len(widths) for batch in batches}
    total, done = max(1, repeats) * len(batches), 0
    for _ in range(max(1, repeats)):
        for batch in batches:
            if on_progress is not None:
                on_progress(f"timing batch {batch} ({done + 1}/{total})")
            timed = time_forwards(batch, list(widths))
            seconds_by_batch[batch] = [min(a, b) for a, b in zip(seconds_by_batch[batch], timed, strict=True)]
            done += 1
    ratios, base = [], []
    for batch in batches:
        seconds = seconds_by_batch[batch]
        base.append(seconds[0])
        row = [1.0]
        for j in range(1, len(widths)):
            if seconds[j] == float("inf"):  # not timed (see `wider_pays`): at least linear from the last timed width
                row.append(round(row[-1] * widths[j] / widths[j - 1], 4))
            else:
                row.append(round(max(1.0, seconds[j] / seconds[0]), 4))
        ratios.append(tuple(row))
    return VerifyCostCurve(tuple(batches), tuple(widths), tuple(ratios), tuple(base), key)


def curve_key(model_identity: str, dtype: str, device: str, threads: int) -> str:
    """Cache key of a curve: what the timings depend on (model, dtype, device and its name, threads, torch)."""
    import torch

    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else _cpu_name()
    blob = json.dumps([model_identity, dtype, device, device_name, threads, torch.__version__, _CURVE_FORMAT])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_cached_curve(cache_folder: Path, key: str, batches: Sequence[int]) -> tuple[VerifyCostCurve | None, list[int]]:
    """The cached curve for `key` if it covers `batches` (else None), and the batches a fresh one must measure.

    A cached curve measured for fewer batch sizes (another max_batch_size) is re-measured for
    the union, so a curve taken at batch 1 is never stretched to price batch 16.
    """
    path = cache_folder / f"verify-cost-{key}.json"
    wanted = set(batches)
    try:
        curve = VerifyCostCurve.from_json(path.read_text())
        if curve.key == key and wanted <= set(curve.batches):
            return curve, sorted(curve.batches)
        if curve.key == key:
            log.info("re-measuring verify cost: the cache covers batches %s, %s wanted", list(curve.batches), sorted(wanted))
            wanted |= set(curve.batches)
    except (OSError, ValueError, KeyError, TypeError) as error:
        if path.exists():
            log.info("re-measuring verify cost: %s unreadable (%s)", path, error)
    return None, sorted(wanted)


def _write_cache(cache_folder: Path, curve: VerifyCostCurve) -> None:
    path = cache_folder / f"verify-cost-{curve.key}.json"
    cache_folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(curve.to_json())
    tmp.replace(path)  # atomic: nodes sharing the cache never read half a curve


def load_or_calibrate(
    cache_folder: Path, key: str, time_forwards: TimeForwards, *, batches: Sequence[int] = CALIBRATION_BATCHES, **kwargs
) -> VerifyCostCurve:
    """The cached curve for `key` if it covers `batches`, else a fresh measurement written to the cache (atomically)."""
    curve, wanted = load_cached_curve(cache_folder, key, batches)
    if curve is not None:
        return curve
    log.info("measuring the verify-cost curve T(k)/T(1) once for this device, dtype and model")
    curve = calibrate_verify_cost(time_forwards, key=key, batches=wanted, **kwargs)
    _write_cache(cache_folder, curve)
    return curve


@dataclass
class CurveCalibration:
    """A verify-cost curve still to measure: `run()` times it, caches it and gives it to the policy.

    The node runs it while it would otherwise sit idle (waiting for peers' batches), not at
    start-up: until then the policy is inactive and the engine decodes plainly.
    """

    policy: LengthAwarePolicy
    time_forwards: TimeForwards
    cache_folder: Path
    key: str
    batches: Sequence[int]

    def run(self, on_progress: Progress | None = None) -> VerifyCostCurve:
        """Measure the curve (or take the one another node on this machine cached since start-up), cache it, activate the policy."""
        cached, _ = load_cached_curve(self.cache_folder, self.key, self.batches)
        if cached is not None:  # e.g. a demo's first node measured it while this one generated
            log.info("verify-cost curve found in %s (measured by another node on this machine)", self.cache_folder)
            self.policy.set_curve(cached)
            return cached
        started = time.perf_counter()
        log.info("measuring the verify-cost curve for batches %s (once per machine; decoding plainly until then)", list(self.batches))
        curve = calibrate_verify_cost(self.time_forwards, key=self.key, batches=self.batches, on_progress=on_progress)
        _write_cache(self.cache_folder, curve)
        self.policy.set_curve(curve)
        log.info("verify-cost curve measured in %.1fs; %s", time.perf_counter() - started, describe_curve(self.policy))
        return curve


def describe_curve(policy: LengthAwarePolicy) -> str:
    """One log line: the measured cost of a 9-token verify per batch and where drafting pays."""
    curve = policy.curve
    if curve is None:
        return "no verify-cost curve yet: decoding plainly"
    paying = [b for b in curve.batches if policy.wants_drafts(b)]
    return (
        f"verify cost T(9)/T(1) = {[curve.ratio(b, 9) for b in curve.batches]} for batches {list(curve.batches)}; "
        f"drafting pays at batch sizes {paying or 'none'}"
    )


def model_identity(model_config: object, dtype: str) -> str:
    """What a model's forward cost depends on: its architecture config and dtype (weights do not matter)."""
    to_dict = getattr(model_config, "to_dict", None)
    config = to_dict() if callable(to_dict) else vars(model_config)
    shape = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("dtype", "torch_dtype", "transformers_version")}
    return hashlib.sha256(json.dumps([shape, dtype], sort_keys=True, default=str).encode()).hexdigest()[:16]


def rebuild_drafter(drafter: SuffixDrafter, store: RolloutStore, limit: int, *, up_to_rowid: int | None = None) -> int:
    """Replay the `limit` most recent stored rollouts (own and accepted foreign) into the drafter, oldest first.

    `up_to_rowid` stops at that journal row (see `build_speculation`). Returns how many were replayed; rows whose payload no longer decodes are skipped (logged).
    """
    replayed = 0
    for row in reversed(store.recent(limit, up_to_rowid=up_to_rowid)):
        verdict, rollout = decode_rollout(row.payload)
        if rollout is None:
            log.debug("drafter rebuild: skipping a stored rollout that does not decode (%s)", verdict.reason)
            continue
        drafter.observe(rollout.prompt_ids.tolist(), rollout.completion_ids.tolist())
        replayed += 1
    return replayed


def build_speculation(
    config: SpeculationConfig,
    engine: TorchEngine,
    store: RolloutStore | None,
    *,
    model_config: object,
    dtype: str,
    device: str,
    max_batch_size: int,
    cache_folder: Path | None = None,
    journal_rowid: int | None = None,
) -> tuple[SuffixDrafter, LengthAwarePolicy, CurveCalibration | None]:
    """The drafter (replayed from the store), the length-aware policy, and the curve's calibration if not cached.

    The policy starts on the cached verify-cost curve (`cache_folder`, default
    `<model cache dir>/speculation`) when there is one for this model, dtype, device and
    thread count; otherwise it starts inactive (plain decoding) and the returned
    `CurveCalibration` measures the curve when the caller runs it.
    A resuming node passes its checkpoint's `journal_rowid`: the drafter then holds what it held
    at the checkpoint, not the interrupted round's rollouts, which the node is about to make
    again (with them it would draft differently, and fp32 log-probs differ by forward width).
    """
    from hivespec.node.speculation.drafter import SuffixDrafter

    drafter = SuffixDrafter(
        window=config.window,
        global_max_tokens=config.global_max_tokens,
        max_prompts=config.max_prompts,
        min_prob=config.min_prob,
        spec_factor=config.spec_factor,
    )
    if store is not None and config.rebuild_rollouts:
        replayed = rebuild_drafter(drafter, store, config.rebuild_rollouts, up_to_rowid=journal_rowid)
        log.info("drafter rebuilt from %d stored rollouts%s", replayed, "" if journal_rowid is None else " (up to the checkpoint)")
    folder, key = _curve_location(model_config, dtype, device, cache_folder)
    curve, wanted = load_cached_curve(folder, key, calibration_batches(max_batch_size))
    policy = LengthAwarePolicy(curve, drafter, max_budget=config.num_speculative_tokens)
    calibration = None
    if curve is None:
        # One timed pass after a warm-up of the plain step (whose time, the ratios' divisor, is
        # then the better of two), over a short cache, stopping where the batch is compute-bound.
        timer = partial(engine.time_forwards, context=CALIBRATION_CONTEXT, rounds=1, warm_up=(1,), wider_pays=wider_pays)
        calibration = CurveCalibration(policy, timer, folder, key, wanted)
    log.info("speculation: %s", describe_curve(policy))
    return drafter, policy, calibration


def _curve_location(model_config: object, dtype: str, device: str, cache_folder: Path | None) -> tuple[Path, str]:
    import torch

    from hivespec.node.model.loader import cache_dir

    key = curve_key(model_identity(model_config, dtype), dtype, device, torch.get_num_threads())
    return (cache_folder if cache_folder is not None else cache_dir() / "speculation"), key


def device_verify_cost(
    engine: TorchEngine,
    model_config: object,
    dtype: str,
    device: str,
    max_batch_size: int,
    cache_folder: Path | None = None,
) -> VerifyCostCurve:
    """The verify-cost curve of this model, dtype, device and torch thread count for batches up to
    `max_batch_size` (every size of `CALIBRATION_BATCHES`, for benches): cached under
    `cache_folder` (default `<model cache dir>/speculation`), else measured now.
    """
    batches = sorted({b for b in CALIBRATION_BATCHES if b <= max_batch_size} | {max_batch_size})
    folder, key = _curve_location(model_config, dtype, device, cache_folder)
    return load_or_calibrate(folder, key, engine.time_forwards, batches=batches)


def length_class(history: Sequence[int], population: Sequence[int]) -> str:
    """'long', 'medium' or 'short': the mean of a prompt's past lengths against all recent lengths' terciles.

    A prompt with no history is 'medium'.
    """
    if not history or len(population) < 3:
        return "medium"
    ordered = sorted(population)
    low, high = ordered[len(ordered) // 3], ordered[(2 * len(ordered)) // 3]
    mean = sum(history) / len(history)
    if mean > high:
        return "long"
    if mean < low:
        return "short"
    return "medium"


@dataclass(frozen=True)
class RowPlan:
    """A request's speculation plan: its draft cap per step and its weight in the width choice."""

    cap: int
    weight: float = 1.0
    length_class: str = "medium"


class SpeculationPolicy(Protocol):
    """What the engine asks each batch and each step."""

    def plan(self, prompt_ids: Sequence[int]) -> RowPlan:
        """The plan of a request of this prompt (cap 0: never draft for it)."""
        ...

    def width(self, drafts: Sequence[Draft], plans: Sequence[RowPlan]) -> int:
        """The step's draft width K (0: a plain step) for these rows' drafts."""
        ...

    def wants_drafts(self, batch: int) -> bool:
        """False when a batch this large is compute-bound: skip drafting altogether."""
        ...

    @property
    def active(self) -> bool:
        """False while the policy cannot price drafts yet (no verify-cost curve): the engine decodes plainly."""
        ...

    def observe(self, drafted: int, accepted: int, rejections: int) -> None:
        """A step's outcome: draft tokens verified, accepted, and rows whose draft was cut by a rejection."""
        ...


@dataclass
class UniformPolicy:
    """Draft up to `budget` tokens for every row at every step, whatever it costs."""

    budget: int

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"budget must be >= 0, got {self.budget}")

    def plan(self, prompt_ids: Sequence[int]) -> RowPlan:
        return RowPlan(self.budget)

    def width(self, drafts: Sequence[Draft], plans: Sequence[RowPlan]) -> int:
        return max((len(d.tokens) for d in drafts), default=0)

    def wants_drafts(self, batch: int) -> bool:
        return self.budget > 0

    @property
    def active(self) -> bool:
        return True

    def observe(self, drafted: int, accepted: int, rejections: int) -> None:
        return None


class LengthAwarePolicy:
    """Budgets from the prompt's length class and the calibrated verify-cost curve (see the module docstring)."""

    def __init__(
        self,
        curve: VerifyCostCurve | None,
        drafter: SuffixDrafter,
        *,
        max_budget: int = 16,
        min_gain: float = 1.02,
        probe_every: int = 32,
    ) -> None:
        if max_budget < 1:
            raise ValueError(f"max_budget must be >= 1, got {max_budget}")
        if min_gain < 1.0:
            raise ValueError(f"min_gain must be >= 1 (a step must beat a plain one), got {min_gain}")
        self.curve = curve
        self.drafter = drafter
        self.max_budget = max_budget
        self.min_gain = min_gain
        self.probe_every = probe_every
        # Decaying counts behind alpha; the prior (0.8) lets a fresh node try its drafts.
        self._hits, self._misses = 4.0, 1.0
        self._since_probe = 0
        self._population: list[int] = []
        self._population_at = -1  # drafter.observed when _population was taken
        self._covers: dict[tuple[int, int], tuple[int, float]] = {}  # curve.cover, asked every step

    @property
    def active(self) -> bool:
        """True once the policy has a verify-cost curve; before that the engine decodes plainly."""
        return self.curve is not None

    def set_curve(self, curve: VerifyCostCurve) -> None:
        """Price drafts on `curve` from now on (a calibration finished)."""
        self.curve = curve
        self._covers.clear()

    @property
    def alpha(self) -> float:
        """Observed per-token acceptance: accepted drafts / (accepted drafts + rejections), decaying."""
        return self._hits / (self._hits + self._misses)

    def plan(self, prompt_ids: Sequence[int]) -> RowPlan:
        if self._population_at != self.drafter.observed:
            self._population = sorted(self.drafter.all_lengths())
            self._population_at = self.drafter.observed
        kind = length_class(self.drafter.length_history(prompt_ids), self._population)
        return RowPlan(max(1, round(self.max_budget * _CLASS_CAP_SHARE[kind])), _CLASS_WEIGHT[kind], kind)

    def wants_drafts(self, batch: int) -> bool:
        if self.curve is None:
            return False
        return any((1 + k) / self.curve.cover(batch, k + 1)[1] >= self.min_gain for k in range(1, self.max_budget + 1))

    def width(self, drafts: Sequence[Draft], plans: Sequence[RowPlan]) -> int:
        batch = len(drafts)
        longest = max((len(d.tokens) for d in drafts), default=0)
        if longest == 0:
            return 0
        alpha = self.alpha
        weights = [plan.weight for plan in plans]
        total_weight = sum(weights)
        # gain[k]: weighted expected tokens emitted per row by a width-k step (1 + accepted drafts).
        gain = [total_weight] * (longest + 1)
        for draft, weight in zip(drafts, weights, strict=True):
            running, power = 0.0, 1.0
            for k, prob in enumerate(draft.probs, start=1):
                power *= alpha
                running += min(prob, power)
                gain[k] += weight * running
            for k in range(len(draft.probs) + 1, longest + 1):
                gain[k] += weight * running
        # A width-k step runs the cheapest forward of >= k + 1 tokens; its extra slots verify
        # more of the longer drafts (or are padding), so it is worth gain[that width - 1].
        best, best_rate = 0, 1.0
        for k in range(1, longest + 1):
            forward, cost = self._cover(batch, k + 1)
            rate = gain[min(forward - 1, longest)] / (total_weight * cost)
            if rate > best_rate * (self.min_gain if best == 0 else 1.0):
                best, best_rate = forward - 1, rate
        self._since_probe = 0 if best else self._since_probe + 1
        if not best and self._since_probe >= self.probe_every:
            self._since_probe = 0
            return self._cover(batch, min(2, longest) + 1)[0] - 1
        return best

    def _cover(self, batch: int, width: int) -> tuple[int, float]:
        covered = self._covers.get((batch, width))
        if covered is None:
            assert self.curve is not None, "width() is only asked when wants_drafts() said yes"
            covered = self._covers[batch, width] = self.curve.cover(batch, width)
        return covered

    def state_dict(self) -> dict[str, float | int]:
        """The adaptive state a checkpoint keeps, so a resumed node picks the widths it would have."""
        return {"hits": self._hits, "misses": self._misses, "since_probe": self._since_probe}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        self._hits, self._misses = float(state["hits"]), float(state["misses"])
        self._since_probe = int(state["since_probe"])

    def observe(self, drafted: int, accepted: int, rejections: int) -> None:
        decay = 0.98
        self._hits = decay * self._hits + accepted
        self._misses = decay * self._misses + rejections
