"""The verify-cost curve: what a K-token speculative step costs on this machine, measured once and cached.

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

Owns the measurement and its cache file; never decides a step's width (`policy.py` does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from hivespec.node.file_lock import flock_within

__all__ = [
    "VerifyCostCurve",
    "calibrate_verify_cost",
    "calibration_batches",
    "curve_location",
    "device_verify_cost",
    "load_cached_curve",
    "load_or_calibrate",
    "measuring_alone",
    "model_identity",
    "wider_pays",
    "write_cached_curve",
]

log = logging.getLogger(__name__)


CALIBRATION_BATCHES = (1, 2, 4, 8, 16)  # what a bench measures; a node measures `calibration_batches`
CALIBRATION_WIDTHS = (1, 2, 3, 5, 9, 17)
CALIBRATION_CONTEXT = 16  # cached tokens per row while timing: the prefill is a third of the cost at 32 (batch 16)
_CURVE_FORMAT = 6  # 6: timed by the work clock (`work_clock`); 5: ratios non-decreasing in the batch; 4: steps include the keyed sampling; 3: raw per-width ratios


@dataclass(frozen=True)
class VerifyCostCurve:
    """Measured forward time T(B, W) of W new tokens per row at batch B, as ratios to T(B, 1).

    `ratios[i][j]` belongs to batches[i] and widths[j]; widths[0] is 1 (ratio 1.0). Between
    measured points the ratio is interpolated linearly in the width and taken from the next
    larger measured batch (the conservative side); beyond the largest width it grows linearly from
    it (as for widths the calibration skipped): a W-token forward costs at most W / widest forwards
    of the widest, and an extrapolated segment that slopes down (noise, or a widest width that
    happened to be fast) would price a 129-token verify like a plain step.
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
        if width > self.widths[-1]:
            return row[-1] * width / self.widths[-1]
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
    Across batches they are: a width's ratio at a batch is at least its ratio at every smaller
    batch (`_never_cheaper_at_larger_batches`). `on_progress` is told each batch as it is timed
    (a line for the log or the demo).
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
    return VerifyCostCurve(tuple(batches), tuple(widths), _never_cheaper_at_larger_batches(ratios), tuple(base), key)


def _never_cheaper_at_larger_batches(ratios: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    """Each width's ratio raised to its ratio at every smaller batch (rows in increasing batch order).

    A W-token forward is W times a plain step's work on top of the same weights: the more rows a
    step has, the more of its time is that work and the less the weights' fixed cost, so T(B, W) /
    T(B, 1) only grows with B (from about 1 where the weights' reads dominate towards W where the
    arithmetic does). A measurement that says otherwise caught the plain step of the larger batch in
    a busy moment, which makes every width there look cheap: a demo node on a 2-core EPYC, timing
    while its two peers trained, got T(16, 9) / T(16, 1) = 3.0 against 11.6 at batch 4 (its batch-16
    plain step 2.7x what its start-up had measured) and T(16, 3) below T(16, 2). Timed alone on that
    machine (`bench/spec_rollout.py`, bf16, 1 thread) every width's ratio grew with the batch (3
    tokens: 1.02, 1.07, 1.14, 1.18, 1.31 from batch 1 to 16). Raising a ratio errs towards plain
    decoding.
    """
    monotone = [tuple(ratios[0])] if ratios else []
    for row in ratios[1:]:
        monotone.append(tuple(max(r, below) for r, below in zip(row, monotone[-1], strict=True)))
    return tuple(monotone)


def curve_key(model_identity: str, dtype: str, device: str, threads: int) -> str:
    """Cache key of a curve: what the timings depend on (model, dtype, device and its name, threads, torch)."""
    import torch

    from hivespec.node.model.precision import cpu_facts  # torch comes with it: lazy, as above

    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu_facts()["cpu"]
    blob = json.dumps([model_identity, dtype, device, device_name, threads, torch.__version__, _CURVE_FORMAT])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


def write_cached_curve(cache_folder: Path, curve: VerifyCostCurve) -> None:
    path = cache_folder / f"verify-cost-{curve.key}.json"
    cache_folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(curve.to_json())
    tmp.replace(path)  # atomic: nodes sharing the cache never read half a curve


MEASURING_WAIT_S = 120.0  # the longest a node waits for another one's measurement before timing its own


@contextmanager
def measuring_alone(cache_folder: Path, key: str, on_wait: Progress | None = None) -> Iterator[None]:
    """Hold the machine-wide lock of the curve `key` while measuring it: nodes on one machine take turns.

    Three demo nodes on a 2-core machine timing at once slow each other's runs and their peers'
    training; one that waits for the lock then finds the curve the other cached. `on_wait` is
    told every second while it waits (a stop request raises from it); after `MEASURING_WAIT_S`
    (a holder that hangs) the node measures without the lock. A holder that dies releases it.
    """
    cache_folder.mkdir(parents=True, exist_ok=True)
    with open(cache_folder / f"verify-cost-{key}.lock", "a+b") as handle:
        deadline = time.monotonic() + MEASURING_WAIT_S
        held = flock_within(handle.fileno(), 0, 0)
        while not held and time.monotonic() < deadline:
            if on_wait is not None:
                on_wait("waiting for another node on this machine to finish measuring it")
            held = flock_within(handle.fileno(), 1.0, 0.1)
        if not held:
            log.warning("the verify-cost curve's lock was held for %.0f s; measuring without it", MEASURING_WAIT_S)
        yield  # closing the lock file, its only descriptor, releases the lock


def load_or_calibrate(
    cache_folder: Path, key: str, time_forwards: TimeForwards, *, batches: Sequence[int] = CALIBRATION_BATCHES, **kwargs
) -> VerifyCostCurve:
    """The cached curve for `key` if it covers `batches`, else a fresh measurement written to the cache (atomically)."""
    curve, wanted = load_cached_curve(cache_folder, key, batches)
    if curve is not None:
        return curve
    log.info("measuring the verify-cost curve T(k)/T(1) once for this device, dtype and model")
    curve = calibrate_verify_cost(time_forwards, key=key, batches=wanted, **kwargs)
    write_cached_curve(cache_folder, curve)
    return curve


def model_identity(model_config: object, dtype: str) -> str:
    """What a model's forward cost depends on: its architecture config, dtype and attention kernel (weights do not matter)."""
    to_dict = getattr(model_config, "to_dict", None)
    config = to_dict() if callable(to_dict) else vars(model_config)
    shape = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("dtype", "torch_dtype", "transformers_version")}
    shape["attention"] = getattr(model_config, "_attn_implementation", None)
    return hashlib.sha256(json.dumps([shape, dtype], sort_keys=True, default=str).encode()).hexdigest()[:16]


def curve_location(model_config: object, dtype: str, device: str, cache_folder: Path | None) -> tuple[Path, str]:
    import torch

    from hivespec.node.model.loader import cache_dir

    key = curve_key(model_identity(model_config, dtype), dtype, device, torch.get_num_threads())
    return (cache_folder if cache_folder is not None else cache_dir() / "speculation"), key


class Timed(Protocol):
    """What the curve is measured on: an engine's `time_forwards` (`TorchEngine` has one); this module never imports the engine."""

    time_forwards: TimeForwards


def device_verify_cost(
    engine: Timed,
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
    folder, key = curve_location(model_config, dtype, device, cache_folder)
    return load_or_calibrate(folder, key, engine.time_forwards, batches=batches)
