"""A new user's first `hivespec demo`, timed: empty cache and home dirs, the embedded model.

Runs `hivespec demo --rounds N` (N = 5, or 2 with --quick) as a subprocess with fresh
HIVESPEC_CACHE_DIR, HIVESPEC_HOME, XDG_CACHE_HOME and XDG_DATA_HOME (so the GGUF conversion and
the verify-cost calibration run as on a fresh machine), stamps every line it prints, and reports
the wall time, the time to the first round row, each round's slowest node, each node's
calibration time (from its phase events) and the longest silence. Extra arguments after `--`
go to `hivespec demo` (e.g. `-- --set model.engine_dtype=float32`).

    python bench/first_run.py [--quick] [--rounds N] [--keep DIR] [-- DEMO ARGS...]

Ends with one line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({os.cpu_count()} cpus; {' '.join(wanted)})"


def longest_silence(times: list[float], wall: float) -> float:
    """The longest stretch without a line: from the start to the first line, between lines, and from the last line to
    the demo's exit (a demo gone quiet before it exits is as silent as one quiet between rounds)."""
    edges = [0.0, *times, wall]
    return max(b - a for a, b in itertools.pairwise(edges))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--rounds", type=int, help="rounds (default 5, 2 with --quick)")
    parser.add_argument("--keep", help="run in this directory and keep it (default: a temp dir, removed)")
    parser.add_argument("demo_args", nargs="*", help="extra `hivespec demo` arguments (after --)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="hivespec-first-run-") as scratch:
        root = Path(args.keep) if args.keep else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for name in ("HIVESPEC_CACHE_DIR", "HIVESPEC_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
            env[name] = str(root / name.lower())
        command = [sys.executable, "-P", "-m", "hivespec.node.cli", "demo", "--rounds", str(rounds), "--dir", str(root / "demo"),
                   *args.demo_args]
        print("$ " + " ".join(command[3:]), flush=True)
        started = time.monotonic()
        stamps: list[tuple[float, str]] = []
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True) as demo:
            assert demo.stdout is not None
            for line in demo.stdout:
                stamps.append((time.monotonic() - started, line.rstrip("\n")))
                print(f"{stamps[-1][0]:7.1f}  {stamps[-1][1]}", flush=True)
        wall = time.monotonic() - started
        rows = [(t, line) for t, line in stamps if re.match(r"^\s*\d+ node-\d", line)]
        rounds_s = [float(m.group(1)) for _, line in stamps if (m := re.match(r"^\s+round \d+:\s+([\d.]+)s", line))]
        calibration = {}
        for events in sorted((root / "demo").glob("node-*/events.jsonl")):
            for event in map(json.loads, events.read_text().splitlines()):
                detail = event.get("detail", "")
                if event.get("phase") == "calibrating" and (m := re.match(r"done in ([\d.]+)s", detail)):
                    calibration[events.parent.name] = float(m.group(1))
        result = {
            "cpu": _cpu(),
            "command": " ".join(["hivespec", *command[4:]]),
            "exit_code": demo.returncode,
            "rounds": rounds,
            "wall_s": round(wall, 1),
            "first_row_s": round(rows[0][0], 1) if rows else None,
            "round_s": rounds_s,
            "calibration_s": calibration,
            "longest_silence_s": round(longest_silence([t for t, _ in stamps], wall), 1),
        }
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if demo.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
