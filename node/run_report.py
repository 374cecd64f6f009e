"""`hivespec report RUN_DIR`: a run's round events as PNG plots (matplotlib) and a short Markdown summary.

A run directory is what `hivespec demo` writes (``<dir>/node-<i>/events.jsonl``), or any folder
that holds, itself or in its subfolders, an ``events.jsonl`` of ``hivespec join --events``. Each
"round" event (node/report.py `EVENT_FIELDS`) is one step of one node; a round logged twice (re-run
after a crash) counts once, as its last event.

`write_report(run_dir, out)` writes into ``out`` (default ``<RUN_DIR>/report``):

- ``reward.png``: mean reward of each node's own rollouts per step, and the mean over nodes;
- ``foreign.png``: the share of each step's samples that came from peers, and the importance
  weights of those foreign samples (mean and max per step; 1 = on-policy);
- ``phases.png``: seconds per phase (generating, gossip, training, weight sync, the rest) per
  step, stacked, one panel per node;
- ``heldout.png``, only when some node scored itself (``eval.every_rounds``): greedy accuracy on
  held-out questions per step (the rows' ``heldout_accuracy``);
- ``summary.md``: one table row per node (steps, reward at the start and the end, foreign
  samples, accepted and rejected peer rollouts, importance weights, round time, where its policy
  is), the plots, and the command that exports a node's policy.

Reading is `load_run` and `summarize` (pure: events in, text out); only the plot functions touch
matplotlib, through its object API (no pyplot state), imported when a plot is drawn.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hivespec.node.config import InputError

EVENTS_FILE = "events.jsonl"
PHASES = (("rollout", "generating"), ("gossip", "gossip and peers"), ("train", "training"), ("sync", "weight sync"))
PLOTS = ("reward.png", "foreign.png", "phases.png")
_LEGEND_MAX = 12  # more nodes than this: no per-node legend


@dataclass
class NodeRun:
    """One node's steps in a run, in round order."""

    name: str
    home: Path
    rounds: list[dict] = field(default_factory=list)
    peer_id: str = ""
    finished: bool = False  # a "done" event: the node ran to its last round

    def series(self, key: str) -> list[float | None]:
        return [r.get(key) for r in self.rounds]

    @property
    def steps(self) -> list[int]:
        return [r["round"] for r in self.rounds]

    def heldout_curve(self) -> list[tuple[int, float]]:
        """(step, held-out accuracy) of each step the node scored itself on held-out questions."""
        return [(r["round"], r["heldout_accuracy"]) for r in self.rounds if r.get("heldout_accuracy") is not None]

    def foreign_share(self) -> list[float | None]:
        """Foreign samples / all samples of each step (own rollouts made + foreign samples used)."""
        shares: list[float | None] = []
        for r in self.rounds:
            total = (r.get("made") or 0) + (r.get("foreign_used") or 0)
            shares.append((r.get("foreign_used") or 0) / total if total else None)
        return shares


def _read_events(path: Path) -> tuple[dict[int, dict], dict]:
    rounds: dict[int, dict] = {}
    info: dict = {}
    with path.open(errors="replace") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a torn last line of a running node
            if not isinstance(event, dict):
                continue
            kind = event.get("event")
            if kind == "round" and isinstance(event.get("round"), int):
                rounds[event["round"]] = event
            elif kind == "ready":
                info["name"], info["peer_id"] = event.get("name", ""), event.get("peer_id", "")
            elif kind == "done":
                info["done"] = True
    return rounds, info


def load_run(run_dir: Path) -> list[NodeRun]:
    """Every node of the run in ``run_dir`` that logged at least one round, by name; InputError when there is none."""
    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "does not exist"
        raise InputError(f"run directory {run_dir} {what}; pass the folder `hivespec demo` printed (runs/demo-<time>)")
    logs = sorted({*run_dir.glob(EVENTS_FILE), *run_dir.glob(f"*/{EVENTS_FILE}")})
    nodes = []
    for path in logs:
        rounds, info = _read_events(path)
        if not rounds:
            continue
        name = next((r["node"] for r in rounds.values() if r.get("node")), "") or info.get("name") or path.parent.name
        nodes.append(NodeRun(name, path.parent, [rounds[k] for k in sorted(rounds)], info.get("peer_id", ""), bool(info.get("done"))))
    if not nodes:
        found = f"{len(logs)} events file(s) without a round" if logs else f"no {EVENTS_FILE}"
        raise InputError(f"{run_dir} holds no round events ({found}); pass a demo run directory (it has node-<i>/{EVENTS_FILE}) "
                         "or a folder of `hivespec join --events FILE` logs")
    return sorted(nodes, key=lambda n: (len(n.name), n.name))


# ----- the summary ----------------------------------------------------------------------------


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _edges(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean of the first and of the last quarter of the steps (at least one step each)."""
    k = max(1, len(values) // 4)
    return _mean(values[:k]), _mean(values[-k:])


def _node_row(node: NodeRun) -> str:
    start, end = _edges(node.series("reward_mean"))
    used = sum(r.get("foreign_used") or 0 for r in node.rounds)
    samples = used + sum(r.get("made") or 0 for r in node.rounds)
    accepted = sum(r.get("accepted") or 0 for r in node.rounds)
    rejected = sum(r.get("rejected") or 0 for r in node.rounds)
    peak = max((w for w in node.series("foreign_weight_max") if w is not None), default=None)
    seconds = [s["round"] for s in (r.get("seconds") or {} for r in node.rounds) if s.get("round") is not None]
    policy = "`policy.json`" if (node.home / "policy.json").is_file() else "-"
    share = f" ({used / samples:.0%})" if samples else ""
    return (f"| {node.name} | {len(node.rounds)} | {_fmt(start)} -> {_fmt(end)} | {used} of {samples}{share} | "
            f"{accepted} / {rejected} | {_fmt(_mean(node.series('foreign_weight_mean')), '.3f')} ({_fmt(peak)}) | "
            f"{_fmt(statistics.median(seconds) if seconds else None, '.1f')} | {policy} |")


def summarize(nodes: Sequence[NodeRun], run_dir: Path, plots: Sequence[str] = PLOTS) -> str:
    """The Markdown summary of a run (pure: reads only ``nodes``; `plots` are linked relative to the summary)."""
    steps = max(len(n.rounds) for n in nodes)
    lines = [
        f"# Run report: {run_dir.resolve().name or run_dir}",  # `hivespec report .`: the folder's own name
        "",
        f"{len(nodes)} node(s), up to {steps} step(s) each; from `{run_dir}`.",
        "",
        ("| node | steps | reward start -> end | foreign samples | peer rollouts accepted / rejected batches | "
         "foreign weight mean (max) | round s (median) | policy |"),
        "|---|---:|---|---:|---|---|---:|---|",
    ]
    lines += [_node_row(node) for node in nodes]
    first = _mean([n.rounds[0].get("reward_mean") for n in nodes])
    last = _mean([n.rounds[-1].get("reward_mean") for n in nodes])
    lines += [
        "",
        (f"Mean reward over nodes: {_fmt(first)} at their first step, {_fmt(last)} at their last. *Reward start -> end* is the "
         "mean over the first and the last quarter of a node's steps (own rollouts, the node's own verifier)."),
        ("*Foreign samples* are peers' rollouts in the node's training steps; their importance weights are min(pi/mu, C) after "
         "the filters (1 = as if on-policy)."),
        "",
        *[f"![{Path(p).stem}]({p})" for p in plots],
        "",
    ]
    homes = [n for n in nodes if (n.home / "policy.json").is_file()]
    if homes:
        lines += ["Export a node's policy as a Hugging Face model folder:", "",
                  f"    hivespec export --home {homes[0].home} --out {homes[0].home.parent / (homes[0].name + '-model')}", ""]
    return "\n".join(lines)


# ----- the plots -----------------------------------------------------------------------------


def _figure(rows: int = 1, cols: int = 1, *, width: float = 8.0, height: float = 4.5, **kwargs):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return figure, figure.subplots(rows, cols, squeeze=False, **kwargs)


def _save(figure, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in figure.axes:  # steps are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.savefig(path, format="png", metadata={"Software": None})
    return path


def _colors(count: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if count <= 10 else "viridis"]
    return [cmap(i if count <= 10 else i / max(1, count - 1)) for i in range(count)]


def plot_reward(nodes: Sequence[NodeRun], path: Path) -> Path:
    figure, axes = _figure()
    ax = axes[0][0]
    for node, color in zip(nodes, _colors(len(nodes)), strict=True):
        ax.plot(node.steps, node.series("reward_mean"), marker="o", markersize=3, linewidth=1.2, color=color, alpha=0.8, label=node.name)
    by_step: dict[int, list[float]] = {}
    for node in nodes:
        for step, reward in zip(node.steps, node.series("reward_mean"), strict=True):
            if reward is not None:
                by_step.setdefault(step, []).append(reward)
    if len(nodes) > 1:
        steps = sorted(by_step)
        ax.plot(steps, [statistics.fmean(by_step[s]) for s in steps], color="black", linewidth=2.5, label="mean over nodes")
    ax.set(title="Reward of own rollouts per step", xlabel="step (the node's round)", ylabel="mean reward")
    ax.grid(alpha=0.3)
    if len(nodes) <= _LEGEND_MAX:
        ax.legend(fontsize="small")
    return _save(figure, path)


def plot_foreign(nodes: Sequence[NodeRun], path: Path) -> Path:
    figure, axes = _figure(2, 1, height=6.5, sharex=True)
    share_ax, weight_ax = axes[0][0], axes[1][0]
    for node, color in zip(nodes, _colors(len(nodes)), strict=True):
        share_ax.plot(node.steps, node.foreign_share(), marker="o", markersize=3, color=color, label=node.name)
        weight_ax.plot(node.steps, node.series("foreign_weight_mean"), marker="o", markersize=3, color=color, label=f"{node.name} mean")
        weight_ax.plot(node.steps, node.series("foreign_weight_max"), linestyle=":", color=color, label=f"{node.name} max")
    share_ax.set(title="Foreign samples in each training step", ylabel="share of the step's samples", ylim=(-0.02, 1.02))
    weight_ax.axhline(1.0, color="gray", linewidth=0.8)
    weight_ax.set(title="Importance weights of foreign samples (mean, dotted: max)", xlabel="step (the node's round)",
                  ylabel="min(pi/mu, C)")
    for ax in (share_ax, weight_ax):
        ax.grid(alpha=0.3)
    if len(nodes) <= _LEGEND_MAX:
        share_ax.legend(fontsize="small")
    return _save(figure, path)


def plot_phases(nodes: Sequence[NodeRun], path: Path) -> Path:
    cols = min(3, len(nodes))
    rows = -(-len(nodes) // cols)
    figure, axes = _figure(rows, cols, width=4.0 * cols + 1, height=3.2 * rows + 0.6, sharey=True)
    colors = _colors(len(PHASES) + 1)
    for index, node in enumerate(nodes):
        ax = axes[index // cols][index % cols]
        bottom = [0.0] * len(node.rounds)
        seconds = [r.get("seconds", {}) for r in node.rounds]
        for (key, label), color in zip((*PHASES, ("other", "other")), colors, strict=True):
            if key == "other":
                values = [max(0.0, s.get("round", 0.0) - sum(s.get(k, 0.0) for k, _ in PHASES)) for s in seconds]
            else:
                values = [s.get(key, 0.0) for s in seconds]
            ax.bar(node.steps, values, bottom=bottom, color=color, label=label, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set(title=node.name, xlabel="step")
        ax.grid(alpha=0.3, axis="y")
    for index in range(len(nodes), rows * cols):
        axes[index // cols][index % cols].set_visible(False)
    axes[0][0].set_ylabel("seconds")
    axes[0][0].legend(fontsize="small")
    figure.suptitle("Time per phase of each step")
    return _save(figure, path)


def plot_heldout(nodes: Sequence[NodeRun], path: Path) -> Path:
    figure, axes = _figure()
    ax = axes[0][0]
    for node, color in zip(nodes, _colors(len(nodes)), strict=True):
        curve = node.heldout_curve()
        if curve:
            ax.plot([s for s, _ in curve], [a for _, a in curve], marker="o", markersize=4, color=color, label=node.name)
    ax.set(title="Greedy accuracy on held-out questions (never trained on)", xlabel="step (the node's round)",
           ylabel="accuracy", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    if len(nodes) <= _LEGEND_MAX:
        ax.legend(fontsize="small")
    return _save(figure, path)


def write_report(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Plots and summary of the run in ``run_dir`` into ``out`` (default ``<run_dir>/report``); the files written."""
    from hivespec.node.inputs import check_folder

    nodes = load_run(run_dir)
    where = "--out" if out is not None else "the report folder (change it with --out)"
    out = out if out is not None else run_dir / "report"
    check_folder(out, where)
    written = [plot_reward(nodes, out / "reward.png"), plot_foreign(nodes, out / "foreign.png"), plot_phases(nodes, out / "phases.png")]
    if any(node.heldout_curve() for node in nodes):
        written.append(plot_heldout(nodes, out / "heldout.png"))
    summary = out / "summary.md"
    summary.write_text(summarize(nodes, run_dir, [p.name for p in written]))
    return [*written, summary]
