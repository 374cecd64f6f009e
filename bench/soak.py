"""Soak: 3 nodes on loopback train for a long time; are memory, file descriptors and errors flat?

Every `--sample-every` seconds it records, per node, the resident memory and the open file
descriptors of the node process and of its p2pd child, apart. After a warm-up (the first 20 % of
the run, while caches and allocator pools fill) it reports the worst node's slope per hour of the
minimum RSS of each window of `--window-minutes` (default 5): a round's transient peaks (activations,
optimizer state, the allocator's free lists) swing RSS by hundreds of MB, so a plain fit of every
sample cannot tell a leak from where in the swing the run happened to end; the floor of each window
grows only when memory is kept. The plain least-squares slope of every sample is reported beside it.
A slope over few windows is noise: at 30 minutes there are 4 windows after the warm-up, and a
window's minimum still moves by hundreds of MB with the allocator; `windows` and each node's
`window_minima_mb` are in the RESULT, and every sample is written to `<dir>/soak_series.json`, so
a run can be read again without running it again. "Unhandled" counts tracebacks and CRITICAL lines in the node
logs, watchdog stall reports, and nodes that exited on their own. As a side-by-side ratio it
prints the worst node's RSS at the end over its RSS at the end of the warm-up.

    python bench/soak.py                    # 30 minutes, tiny model
    python bench/soak.py --quick            # 4 minutes
    python bench/soak.py --model smollm2-135m-instruct --minutes 30

Ends with one line `RESULT {json}` with `rss_slope_mb_per_h` (the robust figure: window minima of node + p2pd),
`python_rss_slope_mb_per_h` and `p2pd_rss_slope_mb_per_h` (the same, each process apart), `fit_rss_slope_mb_per_h`
(every sample), `fd_slope_per_h`, `unhandled`, and each node's robust slope with its standard error
(`rss_slopes_mb_per_h`, `rss_slope_se_mb_per_h`): at 120 minutes a window's minimum still moves by ~20 MB,
so each slope is known to about +-11 MB/h.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import psutil
from swarm_harness import SwarmNode, prepare_model, start_swarm

_UNHANDLED = re.compile(r"^Traceback \(most recent call last\)|\bCRITICAL\b|watchdog: loop .* made no progress", re.MULTILINE)


def _usage(node: SwarmNode) -> tuple[float, int, float] | None:
    """(RSS in MB of the node process plus its children, open fds, RSS in MB of the p2pd children alone)."""
    try:
        process = psutil.Process(node.process.pid)
        children = process.children(recursive=True)
        members = [process, *children]
        rss = sum(p.memory_info().rss for p in members) / 1e6
        fds = sum(p.num_fds() for p in members)
        p2pd = sum(c.memory_info().rss for c in children if "p2pd" in c.name()) / 1e6
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return rss, fds, p2pd


def _window_minima(points: list[tuple[float, float]], window_s: float) -> list[tuple[float, float]]:
    """(window middle, minimum) of each full window of `window_s` seconds: the floor a leak raises and a swing does not."""
    if not points:
        return []
    start = points[0][0]
    windows: dict[int, list[float]] = {}
    for t, y in points:
        windows.setdefault(int((t - start) // window_s), []).append(y)
    last = int((points[-1][0] - start) // window_s)
    return [(start + (i + 0.5) * window_s, min(ys)) for i, ys in sorted(windows.items()) if i < last or len(windows) == 1]


def _slope_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / var * 3600.0


def _slope_se_per_hour(points: list[tuple[float, float]]) -> float | None:
    """The standard error of `_slope_per_hour` (residual scatter over the spread of times): what a run can resolve."""
    if len(points) < 4:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    slope = sum((t - mean_t) * (y - mean_y) for t, y in points) / var
    residual = sum((y - mean_y - slope * (t - mean_t)) ** 2 for t, y in points) / (n - 2)
    return (residual / var) ** 0.5 * 3600.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 minutes instead of 30")
    parser.add_argument("--minutes", type=float, help="length of the run (default 30, quick 4)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--model", default="tiny", help="tiny (default) or smollm2-135m-instruct")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--window-minutes", type=float, default=None, help="window of the robust slope's minima (default 5, quick 1)")
    parser.add_argument("--dir", help="keep node homes here (default: a temp dir)")
    args = parser.parse_args()
    minutes = args.minutes or (4.0 if args.quick else 30.0)
    prepare_model()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hivespec-soak-"))
    sets = [
        f"model.name={args.model}",
        f"swarm.expected_peers={args.nodes - 1}",
        "swarm.round_timeout=30",
        "checkpoint.every_rounds=5",
        "status.enabled=false",
    ]
    print(f"soak: {args.nodes} nodes, model {args.model}, {minutes:.0f} min; homes in {root}", flush=True)
    nodes = start_swarm(root, args.nodes, sets)
    started = time.monotonic()
    series: dict[str, list[tuple[float, float, int, float]]] = {n.name: [] for n in nodes}
    exited = []
    next_print = started
    while time.monotonic() - started < minutes * 60:
        now = time.monotonic() - started
        for node in nodes:
            node.poll()
            if not node.alive():
                if node.name not in exited:
                    exited.append(node.name)
                    print(f"{node.name} exited with {node.process.returncode}", flush=True)
                continue
            usage = _usage(node)
            if usage is not None:
                series[node.name].append((now, *usage))
        if time.monotonic() >= next_print:
            next_print += 300
            row = "  ".join(
                f"{n.name}: {len(n.rounds())} rnd {series[n.name][-1][1]:.0f} MB {series[n.name][-1][2]} fd"
                for n in nodes if series[n.name]
            )
            print(f"[{now / 60:5.1f} min] {row}", flush=True)
        time.sleep(args.sample_every)
    for node in nodes:
        node.stop()
        node.poll()

    warmup = 0.2 * minutes * 60
    window_s = 60 * (args.window_minutes or (1.0 if args.quick else 5.0))
    rss_slopes, python_slopes, p2pd_slopes, fit_slopes, fd_slopes, growth, minima = {}, {}, {}, {}, {}, {}, {}
    (root / "soak_series.json").write_text(json.dumps({"columns": ["seconds", "rss_mb", "fds", "p2pd_rss_mb"], "warmup_s": warmup,
                                                       "series": series}))
    for name, points in series.items():
        steady = [p for p in points if p[0] >= warmup]
        minima[name] = _window_minima([(t, rss) for t, rss, _, _ in steady], window_s)
        rss_slopes[name] = _slope_per_hour(minima[name])
        python_slopes[name] = _slope_per_hour(_window_minima([(t, rss - p2pd) for t, rss, _, p2pd in steady], window_s))
        p2pd_slopes[name] = _slope_per_hour(_window_minima([(t, p2pd) for t, _, _, p2pd in steady], window_s))
        fit_slopes[name] = _slope_per_hour([(t, rss) for t, rss, _, _ in steady])
        fd_slopes[name] = _slope_per_hour([(t, fds) for t, _, fds, _ in steady])
        if steady:
            growth[name] = steady[-1][1] / steady[0][1]
    unhandled_lines = {n.name: len(_UNHANDLED.findall(n.log_text())) for n in nodes}
    unhandled = sum(unhandled_lines.values()) + len(exited)
    worst = max(rss_slopes, key=lambda k: abs(rss_slopes[k]))
    result = {
        "minutes": minutes,
        "model": args.model,
        "nodes": args.nodes,
        "rounds": {n.name: len(n.rounds()) for n in nodes},
        "rss_slope_mb_per_h": round(max(rss_slopes.values(), key=abs), 2),
        "python_rss_slope_mb_per_h": round(max(python_slopes.values(), key=abs), 2),
        "p2pd_rss_slope_mb_per_h": round(max(p2pd_slopes.values(), key=abs), 2),
        "fit_rss_slope_mb_per_h": round(max(fit_slopes.values(), key=abs), 2),
        "window_minutes": window_s / 60,
        "windows": min((len(m) for m in minima.values()), default=0),
        "window_minima_mb": {k: [round(y) for _, y in m] for k, m in minima.items()},
        "fd_slope_per_h": round(max(fd_slopes.values(), key=abs), 2),
        "unhandled": unhandled,
        "unhandled_by_node": unhandled_lines,
        "exited": exited,
        "rss_end_over_warm_ratio": round(growth.get(worst, 1.0), 4),
        "rss_mb_end": {k: round(v[-1][1], 1) for k, v in series.items() if v},
        "fds_end": {k: v[-1][2] for k, v in series.items() if v},
        "rss_slopes_mb_per_h": {k: round(v, 2) for k, v in rss_slopes.items()},
        # +- one standard error of each robust slope: a slope within about 2 of these of 0 is not shown to be a leak.
        "rss_slope_se_mb_per_h": {k: None if (se := _slope_se_per_hour(m)) is None else round(se, 2) for k, m in minima.items()},
        "fit_rss_slopes_mb_per_h": {k: round(v, 2) for k, v in fit_slopes.items()},
        "fd_slopes_per_h": {k: round(v, 2) for k, v in fd_slopes.items()},
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
