"""Trackers users already have (``report_to: [tensorboard, wandb]``): each round's figures, by step.

The figures are the round row's (`RoundReport.to_dict`, node/report.py `EVENT_FIELDS`): every
number in it, ``seconds`` as ``seconds/<phase>``, booleans and text left out (`round_scalars`,
pure). The step is the node's round. One file per idea would be two tiny files, so both
trackers live here behind the same two methods, `log(step, scalars)` and `close()`.

- tensorboard: `torch.utils.tensorboard.SummaryWriter` into ``<home>/tensorboard``;
- wandb: one run per node start in ``<home>/wandb`` (project ``hivespec`` unless
  ``WANDB_PROJECT`` says otherwise; ``WANDB_MODE=offline`` writes only the local run folder),
  named after the node, with the resolved config.

Both libraries are optional (``pip install hivespec[trackers]``) and imported only when
named; a missing one is a `TrackerUnavailable` (a `UserError`) at build time. A tracker that
fails while logging is logged once and dropped: it never stops training.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from hivespec.protocol.errors import UserError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'hivespec[trackers]'"


class TrackerUnavailable(UserError):
    """``report_to`` names a tracker whose library is not installed."""


class Tracker(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def round_scalars(event: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a "round" event by name (``seconds`` as ``seconds/<phase>``); None, booleans and text left out."""
    scalars: dict[str, float] = {}
    for key, value in event.items():
        if key in ("round", "node"):
            continue
        if key == "seconds" and isinstance(value, Mapping):
            scalars.update({f"seconds/{phase}": float(s) for phase, s in value.items() if _number(s)})
        elif _number(value):
            scalars[key] = float(value)
    return scalars


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it and says so less clearly)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrackerUnavailable(f"report_to names tensorboard, which is not installed; {INSTALL_HINT}, "
                                     "or drop it from report_to") from None
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, directory: Path, *, name: str, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise TrackerUnavailable(f"report_to names wandb, which is not installed; {INSTALL_HINT}, "
                                     "or drop it from report_to") from None
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hivespec"), dir=str(directory), name=name or None, config=dict(config),
                               reinit="create_new")
        self.run_dir = Path(self._run.dir).parent  # <directory>/wandb/<offline-|>run-<time>-<id>

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


class RoundTrackers:
    """The trackers of one node: `log_round(event)` after each round, `close()` when the run ends."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)

    @classmethod
    def from_config(cls, config, home: Path) -> RoundTrackers | None:
        if not config.report_to:
            return None
        built: list[Tracker] = []
        for name in dict.fromkeys(config.report_to):
            if name == "tensorboard":
                built.append(TensorBoardTracker(home / "tensorboard"))
            else:
                built.append(WandbTracker(home, name=config.name or "", config=config.to_dict()))
        return cls(built)

    def log_round(self, event: Mapping[str, Any]) -> None:
        scalars = round_scalars(event)
        for tracker in list(self.trackers):
            try:
                tracker.log(int(event["round"]), scalars)
            except Exception as exc:  # noqa: BLE001 - a tracker (its disk, its network) never stops training
                log.warning("tracker %s failed and is dropped: %s", type(tracker).__name__, exc)
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - the run is over; its figures were already flushed
                log.warning("closing tracker %s failed: %s", type(tracker).__name__, exc)
