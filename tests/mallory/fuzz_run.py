"""Mutation fuzzing of every receive-path target at scale (the closing note's numbers).

Usage: python -P tests/mallory/fuzz_run.py [--inputs 100000] [--seed 1]
Prints per target: inputs, crashes (escaped exceptions), hangs (> 1 s), accepted forgeries, and
the peak RSS growth; ends with `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_targets import TARGETS, mutate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs per target")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results = {}
    for target in TARGETS:
        crashes = hangs = accepted = 0
        examples: list[str] = []
        slowest = 0.0
        t0 = time.perf_counter()
        for i in range(args.inputs):
            data = mutate(rng.choice(target.seeds), rng) if i % 10 else rng.randbytes(rng.randrange(0, 4096))
            start = time.perf_counter()
            try:
                verdict = target.run(data)
            except Exception as exc:  # noqa: BLE001 - this is what we count
                crashes += 1
                if len(examples) < 3:
                    examples.append(f"{type(exc).__name__}: {exc}"[:200])
                verdict = "ok"
            took = time.perf_counter() - start
            slowest = max(slowest, took)
            hangs += took > 1.0
            accepted += verdict == "accepted"
        results[target.name] = {
            "inputs": args.inputs, "crashes": crashes, "hangs": hangs, "accepted": accepted,
            "us_per_input": round((time.perf_counter() - t0) / args.inputs * 1e6, 1), "slowest_ms": round(slowest * 1e3, 2),
        }
        print(f"{target.name:<28} {results[target.name]}", *examples, flush=True)
    rss_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    total = {k: sum(r[k] for r in results.values()) for k in ("inputs", "crashes", "hangs", "accepted")}
    print(f"total {total}, peak RSS +{rss_mib:.0f} MiB")
    print("RESULT " + json.dumps({"targets": results, **total, "peak_rss_growth_mib": round(rss_mib, 1)}))
    return 0 if total["crashes"] == total["hangs"] == total["accepted"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
