"""Soak: 3 nodes on loopback train for a long time; are memory, file descriptors and errors flat?

A round's activations, gradients and the allocator's free lists swing a node's RSS by hundreds of MB,
so where in that swing a sample lands says nothing about a leak. The robust figure is read at one
fixed point instead: a node trims its C heap between rounds (at most every 30 s) and reports its
resident memory right after (`resident_mb_after_trim` in the round event). Now and then a floor
still holds a transient of the round (about one fp32 copy of the model) that the next does not, so
the lowest floor of each `--window-minutes` window is what the node keeps. After a warm-up (the
first 20 % of the run, while caches and allocator pools fill) `rss_slope_mb_per_h` is the worst
node's least-squares slope per hour of those window floors, each node's slope with its standard
error beside it (`rss_slopes_mb_per_h`, `rss_slope_se_mb_per_h`: what the run can resolve).

Measured from outside as well, every `--sample-every` seconds: RSS and open file descriptors of the
node process with its children, its p2pd child apart, and the anonymous part (what a leak grows;
the rest is pages of libraries and the model). Those give the slopes of each `--window-minutes`
window's minimum (`window_rss_slope_mb_per_h`, `python_`, `p2pd_`, `anon_rss_slope_mb_per_h`) and
of every sample (`fit_rss_slope_mb_per_h`): at 120 minutes a window's minimum still moves by ~20 MB
with the sampling phase, so they resolve only about +-11 MB/h. Every sample is written to
`<dir>/soak_series.json`. "Unhandled" counts tracebacks and CRITICAL lines in the node logs,
watchdog stall reports, and nodes that exited on their own. As a side-by-side ratio it prints the
worst node's RSS at the end over its RSS at the end of the warm-up.

    python bench/soak.py                    # 30 minutes, tiny model
    python bench/soak.py --quick            # 4 minutes
    python bench/soak.py --model smollm2-135m-instruct --minutes 120

Ends with one line `RESULT {json}`: `rss_slope_mb_per_h` (the robust figure), `fd_slope_per_h`,
`unhandled`, `rounds` and `trims` per node, and the figures above.
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


def _usage(node: SwarmNode) -> tuple[float, int, float, float] | None:
    """(RSS in MB of the node process plus its children, open fds, RSS in MB of the p2pd children alone, anonymous RSS in MB).

    The anonymous part is what a leak grows; the rest is pages of files (libraries, the model) the kernel maps in and out.
    """
    try:
        process = psutil.Process(node.process.pid)
        children = process.children(recursive=True)
        members = [process, *children]
        rss = sum(p.memory_info().rss for p in members) / 1e6
        fds = sum(p.num_fds() for p in members)
        p2pd = sum(c.memory_info().rss for c in children if "p2pd" in c.name()) / 1e6
        anon = sum(_anonymous_rss(p.pid) for p in members) / 1e6
    except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
        return None
    return rss, fds, p2pd, anon


def _anonymous_rss(pid: int) -> int:
    """Bytes of anonymous resident memory (`RssAnon` in /proc/PID/status; 0 where the kernel has no such line)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _trim_floors(node: SwarmNode, started_wall: float, warmup_s: float) -> list[tuple[float, float]]:
    """(seconds since the start, the node's resident MB right after a heap trim) of each round after the warm-up that ended with one."""
    return [
        (e["t"] - started_wall, e["resident_mb_after_trim"]) for e in node.rounds()
        if e.get("resident_mb_after_trim") is not None and e["t"] - started_wall >= warmup_s
    ]


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
    started, started_wall = time.monotonic(), time.time()
    series: dict[str, list[tuple[float, float, int, float, float]]] = {n.name: [] for n in nodes}
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
    rss_slopes, python_slopes, p2pd_slopes, anon_slopes, fit_slopes, fd_slopes, growth, minima = {}, {}, {}, {}, {}, {}, {}, {}
    (root / "soak_series.json").write_text(json.dumps({"columns": ["seconds", "rss_mb", "fds", "p2pd_rss_mb", "anon_rss_mb"], "warmup_s": warmup,
                                                       "series": series}))
    # A floor now and then still holds a round's transient (~0.5 GB at 135M parameters) that a later one does not:
    # the lowest floor of each window is what the node keeps.
    trims = {n.name: _trim_floors(n, started_wall, warmup) for n in nodes}
    floors = {name: _window_minima(points, window_s) for name, points in trims.items()}
    floor_slopes = {name: _slope_per_hour(points) for name, points in floors.items()}
    for name, points in series.items():
        steady = [p for p in points if p[0] >= warmup]
        minima[name] = _window_minima([(t, rss) for t, rss, _, _, _ in steady], window_s)
        rss_slopes[name] = _slope_per_hour(minima[name])
        python_slopes[name] = _slope_per_hour(_window_minima([(t, rss - p2pd) for t, rss, _, p2pd, _ in steady], window_s))
        p2pd_slopes[name] = _slope_per_hour(_window_minima([(t, p2pd) for t, _, _, p2pd, _ in steady], window_s))
        anon_slopes[name] = _slope_per_hour(_window_minima([(t, anon) for t, _, _, _, anon in steady], window_s))
        fit_slopes[name] = _slope_per_hour([(t, rss) for t, rss, _, _, _ in steady])
        fd_slopes[name] = _slope_per_hour([(t, fds) for t, _, fds, _, _ in steady])
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
        "rss_slope_mb_per_h": round(max(floor_slopes.values(), key=abs), 2),
        "rss_slopes_mb_per_h": {k: round(v, 2) for k, v in floor_slopes.items()},
        # +- one standard error of each slope: a slope within about 2 of these of 0 is not shown to be a leak.
        "rss_slope_se_mb_per_h": {k: None if (se := _slope_se_per_hour(f)) is None else round(se, 2) for k, f in floors.items()},
        "trims": {name: len(points) for name, points in trims.items()},
        "floor_minima_mb": {k: [round(y, 1) for _, y in f] for k, f in floors.items()},
        "window_rss_slope_mb_per_h": round(max(rss_slopes.values(), key=abs), 2),
        "python_rss_slope_mb_per_h": round(max(python_slopes.values(), key=abs), 2),
        "p2pd_rss_slope_mb_per_h": round(max(p2pd_slopes.values(), key=abs), 2),
        "anon_rss_slope_mb_per_h": round(max(anon_slopes.values(), key=abs), 2),
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
        "window_rss_slopes_mb_per_h": {k: round(v, 2) for k, v in rss_slopes.items()},
        "window_rss_slope_se_mb_per_h": {k: None if (se := _slope_se_per_hour(m)) is None else round(se, 2) for k, m in minima.items()},
        "fit_rss_slopes_mb_per_h": {k: round(v, 2) for k, v in fit_slopes.items()},
        "fd_slopes_per_h": {k: round(v, 2) for k, v in fd_slopes.items()},
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
