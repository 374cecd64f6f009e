"""When and how much to speculate: the length-aware budget policy over the measured verify-cost curve (`curve.py`).

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

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hivespec.node.speculation.curve import (
    CALIBRATION_CONTEXT,
    Progress,
    TimeForwards,
    VerifyCostCurve,
    calibrate_verify_cost,
    calibration_batches,
    curve_location,
    load_cached_curve,
    measuring_alone,
    wider_pays,
    write_cached_curve,
)

if TYPE_CHECKING:
    from hivespec.node.config import SpeculationConfig
    from hivespec.node.speculation.drafter import Draft, SuffixDrafter
    from hivespec.node.training.store import RolloutStore

__all__ = [
    "CurveCalibration",
    "LengthAwarePolicy",
    "RowPlan",
    "SpeculationPolicy",
    "UniformPolicy",
    "build_speculation",
    "calibration_timer",
    "drafting_batches",
    "length_class",
    "where_drafting_pays",
]

log = logging.getLogger(__name__)


# Draft cap and objective weight per length class (DAS's hard / medium / easy budgets 16 / 8 / 4).
_CLASS_CAP_SHARE = {"long": 1.0, "medium": 0.5, "short": 0.25}
_CLASS_WEIGHT = {"long": 2.0, "medium": 1.0, "short": 0.5}


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
    measured: bool = False  # set by run(): this node timed the curve (False: another node on this machine had)

    def run(self, on_progress: Progress | None = None) -> VerifyCostCurve:
        """Measure the curve (or take the one another node on this machine cached since start-up), cache it, activate the policy.

        Nodes on one machine measure it one at a time (`measuring_alone`): a demo node that finds
        another one measuring waits and takes its curve.
        """
        with measuring_alone(self.cache_folder, self.key, on_progress):
            cached, _ = load_cached_curve(self.cache_folder, self.key, self.batches)
            if cached is not None:  # e.g. a demo's first node measured it while this one generated
                log.info("verify-cost curve found in %s (measured by another node on this machine)", self.cache_folder)
                self.policy.set_curve(cached)
                return cached
            self.measured = True
            started = time.perf_counter()
            log.info("measuring the verify-cost curve for batches %s (once per machine; decoding plainly until then)", list(self.batches))
            curve = calibrate_verify_cost(self.time_forwards, key=self.key, batches=self.batches, on_progress=on_progress)
            write_cached_curve(self.cache_folder, curve)
        self.policy.set_curve(curve)
        log.info("verify-cost curve measured in %.1fs; %s", time.perf_counter() - started, describe_curve(self.policy))
        return curve


def describe_curve(policy: LengthAwarePolicy) -> str:
    """One log line: the measured cost of a 9-token verify per batch and where drafting pays."""
    curve = policy.curve
    if curve is None:
        return "no verify-cost curve yet: decoding plainly"
    return f"verify cost T(9)/T(1) = {[curve.ratio(b, 9) for b in curve.batches]} for batches {list(curve.batches)}; {where_drafting_pays(policy)}"


def drafting_batches(policy: LengthAwarePolicy) -> list[int]:
    """The curve's batch sizes at which drafting could pay (`wants_drafts`); none without a curve."""
    curve = policy.curve
    return [b for b in curve.batches if policy.wants_drafts(b)] if curve is not None else []


def where_drafting_pays(policy: LengthAwarePolicy) -> str:
    """The verdict a user reads: the batch sizes at which drafting pays on this machine's curve."""
    paying = drafting_batches(policy)
    return f"drafting pays at batch sizes {paying}" if paying else "drafting pays at no batch size here: decoding plainly"


class ForwardTimer(Protocol):
    """What calibration needs of an engine: `TorchEngine.time_forwards` (named here so speculation never imports the engine)."""

    def time_forwards(
        self,
        batch: int,
        widths: Sequence[int],
        *,
        context: int = ...,
        rounds: int = ...,
        warm_up: Sequence[int] | None = ...,
        wider_pays: Callable[[int, float], bool] | None = ...,
        clock: Callable[[], float] | None = ...,
    ) -> list[float]: ...


CALIBRATION_ROUNDS = 3


def calibration_timer(engine: ForwardTimer, **overrides: object) -> TimeForwards:
    """How a node times its curve with `engine`: `CALIBRATION_ROUNDS` timed passes after a warm-up of
    the plain step (the ratios' divisor), over a short cache, each width keeping its fastest, stopping
    where the batch is compute-bound (`wider_pays`); `overrides` for benches (e.g. `clock`).

    Three passes, not one: timed alone on a 2-core EPYC (bf16, one thread, by the work clock) five
    one-pass curves were up to 33 % off their median at some point, five three-pass ones at most 7 %
    (4.5-4.8 s against 2.6-2.8 s, once per machine, in a wait).
    """
    timer_options = {"context": CALIBRATION_CONTEXT, "rounds": CALIBRATION_ROUNDS, "warm_up": (1,), "wider_pays": wider_pays}
    return partial(engine.time_forwards, **(timer_options | overrides))


def build_speculation(
    config: SpeculationConfig,
    engine: ForwardTimer,
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
    from hivespec.node.speculation.feed import DrafterFeed

    drafter = SuffixDrafter(
        window=config.window,
        global_max_tokens=config.global_max_tokens,
        max_prompts=config.max_prompts,
        min_prob=config.min_prob,
        spec_factor=config.spec_factor,
    )
    if store is not None and config.rebuild_rollouts:
        replayed = DrafterFeed(drafter).replay(store, config.rebuild_rollouts, up_to_rowid=journal_rowid)
        log.info("drafter rebuilt from %d stored rollouts%s", replayed, "" if journal_rowid is None else " (up to the checkpoint)")
    folder, key = curve_location(model_config, dtype, device, cache_folder)
    curve, wanted = load_cached_curve(folder, key, calibration_batches(max_batch_size))
    policy = LengthAwarePolicy(curve, drafter, max_budget=config.num_speculative_tokens)
    calibration = None
    if curve is None:
        calibration = CurveCalibration(policy, calibration_timer(engine), folder, key, wanted)
    log.info("speculation: %s", describe_curve(policy))
    return drafter, policy, calibration


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
