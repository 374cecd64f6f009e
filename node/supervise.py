"""Supervision inside a node: watchdogs and out-of-memory split-and-retry (gossip restarts: `swarm/supervisor.py`).

- `Watchdog`: every loop of the node beats (`beat("round", phase)`), and probe loops (the gossip
  event loop and its p2pd child) are beaten by a health probe the watchdog thread runs. A loop
  silent for `stall_after` seconds is reported once, with the stack of every thread, and again
  each further `stall_after` while it stays stuck; `status()` shows it to the dashboard.
- `generate_splitting_on_oom` / `train_step_with_oom_retry`: an out-of-memory error halves the
  batch (generation: the request list; training: the micro-batch size) and retries. Keyed
  sampling makes a completion independent of its batch, and the optimizer steps once over the
  same samples whatever the micro-batch size, so a retry changes no result.
- `MicroBatchFit`: before each training step of a CPU node, the micro batch that fits the memory
  available now (`model/footprint.py`): smaller while other programs hold memory, the config's again
  once they let it go. On a CPU a step past the machine's memory is no error to retry: the kernel
  stops the node. The same updates whatever the micro batch, as above.
- `HeapTrimmer`: between rounds, at most every `every_s`, hands the C heap's free pages back to the
  OS (glibc's `malloc_trim`): a round's activations and gradients are freed into the heaps of the
  threads that made them, and without a trim a node's RSS holds its largest round's peak for good.
  The resident memory right after a trim is the round report's `resident_mb_after_trim`: taken at
  the same point of every round, it is the floor that a leak raises and a round's swing does not.
  `process_memory.peak_resident_mb()` is the most the process has held (the round report's
  `peak_resident_mb`): what the machine must have free for a node, its largest training step included.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from hivespec.node.model.footprint import fit_micro_batch
from hivespec.node.process_memory import anonymous_bytes, available_bytes, resident_mb

if TYPE_CHECKING:
    from hivespec.node.config import NodeConfig
    from hivespec.node.model.footprint import ModelShape
    from hivespec.node.training.trainer import StepStats, Trainer, TrainSample

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


# ----- memory ------------------------------------------------------------------------------


class MicroBatchFit:
    """The micro batch a node's training step fits in, chosen again before every step (`fit`).

    The config's micro batch, or the largest smaller one whose step, its rows as long as the step's longest
    sample, fits beside what the node holds in the memory available now (`footprint.fit_micro_batch`). The choice is
    said in the log when it changes: a warning when the node leaves its own micro batch or where even one sample a
    micro batch may not fit, a line when it moves between smaller ones (rows' lengths differ from step to step) or
    grows back. `ceiling` is the config's until an out-of-memory retry lowers it (a GPU's: `train_step_with_oom_retry`),
    which then holds for later steps.
    `available` and `resident` read this process's memory (node/process_memory.py) and are swapped for fixed figures
    in tests of the choice.
    """

    def __init__(self, config: NodeConfig, shape: ModelShape, *, available: Callable[[], int] = available_bytes,
                 resident: Callable[[], int] = anonymous_bytes) -> None:
        self.config = config
        self.shape = shape
        self.ceiling = self.size = config.train.micro_batch_size
        self._available = available
        self._resident = resident
        self._fits = True  # the last choice's step fits the memory available (False: even one sample may not)

    def fit(self, trainer: Trainer, samples: Sequence[TrainSample] = ()) -> int:
        """Set `trainer.micro_batch_size` to what fits now (within `ceiling`) for a step of `samples` (rows as long as
        their longest; none: as the config's, before the node has any), say so where that changed; returns it."""
        if trainer.micro_batch_size < self.size:  # an out-of-memory retry lowered it since the last fit: it holds
            self.ceiling = self.size = trainer.micro_batch_size
        available = self._available()
        longest = max((len(s.prompt_ids) + len(s.completion_ids) for s in samples), default=None)
        choice = fit_micro_batch(self.config, self.shape, available=available, resident=self._resident(),
                                 wanted=self.ceiling, row_tokens=longest)
        if choice.why and (choice.size, choice.fits) != (self.size, self._fits):
            leaving = self.size >= self.ceiling or (self._fits and not choice.fits)
            log.log(logging.WARNING if leaving else logging.INFO, "memory: %s", choice.why)
        elif not choice.why and self.size != choice.size:
            log.info("memory: training in micro batches of %d samples again (%.1f GiB available)", choice.size,
                     available / (1 << 30))
        self.size, self._fits = choice.size, choice.fits
        trainer.micro_batch_size = choice.size
        return choice.size


# ----- the C heap ----------------------------------------------------------------------------


class HeapTrimmer:
    """`maybe_trim()` calls glibc's malloc_trim(0) if `every_s` has passed since the last; a no-op without glibc.

    `resident_mb` is this process's resident memory right after the last trim (None before the first).
    """

    def __init__(self, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self._last = clock()
        self._trim = _malloc_trim()
        self.resident_mb: float | None = None

    def maybe_trim(self) -> bool:
        """Trim if due; True when the heap was trimmed (something given back or not)."""
        if self._trim is None or self.clock() - self._last < self.every_s:
            return False
        started = time.perf_counter()
        self._trim(0)
        self._last = self.clock()
        self.resident_mb = resident_mb()
        log.debug("malloc_trim took %.3f s; resident %s MB", time.perf_counter() - started, self.resident_mb)
        return True


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim  # glibc only: musl and others have no malloc_trim
    except (OSError, AttributeError):
        return None


# ----- watchdog -----------------------------------------------------------------------------


@dataclass
class _Loop:
    phase: str
    last_beat: float
    stall_after: float
    reported_at: float | None = None
    stalls: int = 0


class Watchdog:
    """Reports loops that stop making progress; a daemon thread checks every `check_every` seconds."""

    def __init__(self, *, stall_after: float = 600.0, check_every: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_after <= 0 or check_every <= 0:
            raise ValueError(f"stall_after and check_every must be > 0, got {stall_after} and {check_every}")
        self.stall_after = stall_after
        self.check_every = check_every
        self._clock = clock
        self._loops: dict[str, _Loop] = {}
        self._probes: dict[str, tuple[Callable[[], bool], float]] = {}
        self._probed_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, loop: str, phase: str = "", *, stall_after: float | None = None) -> None:
        """Record progress of `loop` (now in `phase`); the first beat starts watching it."""
        now = self._clock()
        with self._lock:
            state = self._loops.get(loop)
            if state is None:
                self._loops[loop] = _Loop(phase, now, stall_after or self.stall_after)
                return
            if state.reported_at is not None:
                log.warning("watchdog: loop %r made progress again after %.0f s (now in %r)", loop, now - state.last_beat, phase)
            state.phase, state.last_beat, state.reported_at = phase, now, None
            if stall_after is not None:
                state.stall_after = stall_after

    def forget(self, loop: str) -> None:
        """Stop watching `loop` (it ended on purpose)."""
        with self._lock:
            self._loops.pop(loop, None)
            self._probes.pop(loop, None)

    def watch(self, loop: str, probe: Callable[[], bool], *, every: float, stall_after: float) -> None:
        """Beat `loop` whenever `probe()` returns True; the watchdog thread calls it every `every` seconds."""
        with self._lock:
            self._probes[loop] = (probe, every)
        self.beat(loop, "probe ok", stall_after=stall_after)

    def check(self) -> list[str]:
        """Run due probes and report stalled loops; returns the names of loops stalled now."""
        now = self._clock()
        with self._lock:
            due = [(name, probe) for name, (probe, every) in self._probes.items() if now - self._probed_at.get(name, -1e18) >= every]
        for name, probe in due:
            self._probed_at[name] = now
            try:
                healthy = probe()
            except Exception:  # a probe that raises is a failed probe, not a dead watchdog
                log.debug("watchdog probe %r raised", name, exc_info=True)
                healthy = False
            if healthy:
                self.beat(name, "probe ok")
        stalled = []
        now = self._clock()
        with self._lock:
            for name, state in self._loops.items():
                idle = now - state.last_beat
                if idle < state.stall_after:
                    continue
                stalled.append(name)
                if state.reported_at is None or now - state.reported_at >= state.stall_after:
                    state.reported_at = now
                    state.stalls += 1
                    log.error(
                        "watchdog: loop %r made no progress for %.0f s (last phase %r); thread stacks:\n%s",
                        name, idle, state.phase, _thread_stacks(),
                    )
        return stalled

    def status(self) -> dict[str, dict[str, float | str | bool | int]]:
        """Per loop: phase, seconds since its last beat, whether it is stalled now, stalls reported."""
        now = self._clock()
        with self._lock:
            return {
                name: {
                    "phase": s.phase,
                    "idle_s": round(now - s.last_beat, 1),
                    "stalled": now - s.last_beat >= s.stall_after,
                    "stalls": s.stalls,
                }
                for name, s in self._loops.items()
            }

    def stalls(self) -> int:
        with self._lock:
            return sum(s.stalls for s in self._loops.values())

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hivespec-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.check_every + 30)

    def _run(self) -> None:
        while not self._stop.wait(self.check_every):
            try:
                self.check()
            except Exception:  # the watchdog must outlive whatever it watches
                log.exception("watchdog check failed")


def _thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame, limit=12)))
    return "\n".join(parts)


# ----- out of memory ------------------------------------------------------------------------


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate_splitting_on_oom(
    generate: Callable[[list[T]], list[R]], items: Sequence[T], *, on_split: Callable[[int], None] | None = None
) -> list[R]:
    """`generate(items)`, or on out-of-memory the two halves separately (recursively), in order.

    Re-raises the error when a single item does not fit. `on_split(size)` is told each split.
    """
    items = list(items)
    try:
        return generate(items)
    except BaseException as exc:
        if not is_out_of_memory(exc) or len(items) <= 1:
            raise
        log.warning("out of memory generating %d completions (%s); retrying as two batches of %d and %d",
                    len(items), type(exc).__name__, len(items) // 2, len(items) - len(items) // 2)
    _release_memory()
    if on_split is not None:
        on_split(len(items))
    half = len(items) // 2
    return generate_splitting_on_oom(generate, items[:half], on_split=on_split) + generate_splitting_on_oom(
        generate, items[half:], on_split=on_split
    )


def _optimizer_steps(optimizer: torch.optim.Optimizer) -> float:
    return sum(float(state.get("step", 0)) for state in optimizer.state.values())


def train_step_with_oom_retry(
    trainer: Trainer, samples: Sequence[TrainSample], *, on_retry: Callable[[int], None] | None = None
) -> StepStats:
    """`trainer.step(samples)`, halving `trainer.micro_batch_size` after each out-of-memory error.

    The lowered micro-batch size stays for later steps (the memory pressure is likely to come
    back). An error raised after the optimizer started updating, or at micro-batch size 1, is
    re-raised: retrying then would apply a partial update twice.
    """
    while True:
        steps_before = _optimizer_steps(trainer.optimizer)
        try:
            return trainer.step(samples)
        except BaseException as exc:
            if not is_out_of_memory(exc) or trainer.micro_batch_size <= 1:
                raise
            if _optimizer_steps(trainer.optimizer) != steps_before:
                raise
            smaller = max(1, trainer.micro_batch_size // 2)
            log.warning("out of memory in a training step at micro_batch_size %d (%s); retrying with %d",
                        trainer.micro_batch_size, type(exc).__name__, smaller)
            trainer.micro_batch_size = smaller
        trainer.optimizer.zero_grad(set_to_none=True)
        _release_memory()
        if on_retry is not None:
            on_retry(trainer.micro_batch_size)
