"""What a node's verify-cost calibration costs: the curve a node measures on first use, timed.

Loads the embedded model (or --model) in --dtype on --threads torch threads and runs exactly the
calibration `build_speculation` hands a node without a cached curve (`calibration_batches` of
--batch, `calibration_timer`: three passes over a short cache, compute-bound widths skipped), into
a temporary cache. Reports the seconds per batch and in all, and the measured curve (how far it moves
beside training peers: `bench/calibration_load.py`).

    python bench/calibration.py [--quick] [--batch 16] [--dtype float32] [--threads 1] [--repeats 3]

--quick measures once (default: --repeats times, reporting each). Ends with one line `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one calibration instead of --repeats")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=16, help="the node's rollout.max_batch_size (demo: 16)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a demo node on 2 cores gets 1)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    from hivespec.node.config import SpeculationConfig
    from hivespec.node.model.engine import TorchEngine
    from hivespec.node.model.loader import load_model
    from hivespec.node.model.precision import cpu_facts
    from hivespec.node.speculation.policy import build_speculation, drafting_batches

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).eval().requires_grad_(False)
    engine = TorchEngine(model, max_batch_size=args.batch)
    runs = []
    for _ in range(1 if args.quick else args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            _, policy, calibration = build_speculation(
                SpeculationConfig(rebuild_rollouts=0), engine, None, model_config=model.config, dtype=args.dtype,
                device="cpu", max_batch_size=args.batch, cache_folder=Path(cache),
            )
            assert calibration is not None
            marks: list[tuple[str, float]] = []
            started = time.perf_counter()
            curve = calibration.run(on_progress=lambda text, marks=marks: marks.append((text, time.perf_counter())))
            total = time.perf_counter() - started
        ends = [t for _, t in marks[1:]] + [started + total]
        per_batch = {text.split()[2]: round(end - t, 2) for (text, t), end in zip(marks, ends, strict=True)}
        paying = drafting_batches(policy)
        runs.append({"seconds": round(total, 2), "per_batch_s": per_batch, "paying_batches": paying,
                     "ratios": {str(b): list(r) for b, r in zip(curve.batches, curve.ratios, strict=True)}})
        print(json.dumps(runs[-1]), flush=True)
    result = {"cpu": cpu_facts()["cpu"], "torch": torch.__version__, "model": args.model, "dtype": args.dtype, "threads": args.threads,
              "batch": args.batch, "widths": list(curve.widths), "calibration_s": [r["seconds"] for r in runs], "runs": runs}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
