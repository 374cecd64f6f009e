"""The verify-cost calibration beside training peers: timed by the wall against timed by the work clock.

A demo node times its verify-cost curve while its two peers train on the same cores. This bench
times the curve exactly as a node does (`calibration_batches`, `calibration_timer`) alone on the
machine, then `--repeats` times beside `--peers` processes that train the same model (forward and
backward of 4 x 128 tokens under bf16 autocast, one thread each, as a demo trainer), each time once
by the wall (`time.perf_counter`) and once by the node's `work_clock` (the thread's CPU time with one
torch thread), in alternating order, then alone again.
Everything else alone on the machine, please (`../shared/tools/heavy`).

    python bench/calibration_load.py [--quick] [--peers 2] [--repeats 3] [--batch 16] [--rounds N] [--dtype bfloat16]

Ends with one line `RESULT {json}`: `quiet_verdict` (the batch sizes where drafting pays on the quiet
curve), `verdicts_wall` and `verdicts_work` (the same, per loaded repeat), `max_ratio_error_wall` and
`max_ratio_error_work` (over repeats, batches and widths: |loaded ratio / quiet ratio - 1|), and
`quiet_ratio_error` (the quiet curve timed again at the end against the first: the noise floor).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Sequence
from typing import Any


def _train(model_name: str, ready: Any, stop: Any) -> None:  # multiprocessing events
    """A peer's training load: forward and backward of 4 x 128 tokens under bf16 autocast until `stop`."""
    import torch

    from hivespec.node.model.loader import configure_threads, load_model

    configure_threads(1)
    model = load_model(model_name, dtype=torch.float32).train()
    ids = torch.randint(0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    while not stop.is_set():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        ready.set()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 loaded repeats")
    parser.add_argument("--peers", type=int, default=2, help="training processes beside the calibration (a demo node has 2)")
    parser.add_argument("--repeats", type=int, default=3, help="loaded calibrations per clock (quick: 2)")
    parser.add_argument("--batch", type=int, default=16, help="the node's max batch size (it times 1, a quarter and this)")
    parser.add_argument("--rounds", type=int, help="timed passes per calibration (default: the node's, CALIBRATION_ROUNDS)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats

    import torch

    from hivespec.node.model.device import work_clock
    from hivespec.node.model.engine import TorchEngine
    from hivespec.node.model.loader import configure_threads, load_model
    from hivespec.node.model.precision import cpu_facts
    from hivespec.node.speculation.curve import VerifyCostCurve, calibrate_verify_cost, calibration_batches
    from hivespec.node.speculation.drafter import SuffixDrafter
    from hivespec.node.speculation.policy import CALIBRATION_ROUNDS, LengthAwarePolicy, calibration_timer, drafting_batches

    configure_threads(1)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).requires_grad_(False)
    model.set_attn_implementation(args.attention)
    engine = TorchEngine(model, max_batch_size=args.batch)
    clocks = {"wall": time.perf_counter, "work": work_clock("cpu")}
    print(f"{args.model} {args.dtype}, {args.attention} attention, 1 thread, work clock {clocks['work'].__name__}, "
          f"{args.rounds or CALIBRATION_ROUNDS} timed pass(es); "
          f"{cpu_facts()['cpu']}", flush=True)

    def calibrate(clock_name: str) -> VerifyCostCurve:
        timer = calibration_timer(engine, clock=clocks[clock_name], **({"rounds": args.rounds} if args.rounds else {}))
        return calibrate_verify_cost(timer, batches=calibration_batches(args.batch))

    def verdict(curve: VerifyCostCurve) -> list[int]:
        return drafting_batches(LengthAwarePolicy(curve, SuffixDrafter()))

    def error(curve: VerifyCostCurve, reference: VerifyCostCurve) -> float:
        return max(abs(r / q - 1) for row, quiet in zip(curve.ratios, reference.ratios, strict=True)
                   for r, q in zip(row, quiet, strict=True))

    def show(label: str, curve: VerifyCostCurve) -> None:
        rows = "; ".join(f"B{b}: {list(r[1:])} ({1000 * s:.1f} ms)" for b, r, s in zip(curve.batches, curve.ratios, curve.base_seconds, strict=True))
        print(f"{label:>12}: drafting pays at {verdict(curve)}; {rows}", flush=True)

    calibrate("work")  # warm-up
    quiet = calibrate("work")
    show("quiet, work", quiet)
    show("quiet, wall", calibrate("wall"))

    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    readies = [context.Event() for _ in range(args.peers)]
    peers = [context.Process(target=_train, args=(args.model, ready, stop), daemon=True) for ready in readies]
    for peer in peers:
        peer.start()
    started = time.perf_counter()
    for peer, ready in zip(peers, readies, strict=True):
        while not ready.wait(timeout=1):
            if not peer.is_alive():
                stop.set()
                raise SystemExit(f"a training peer exited with code {peer.exitcode} before its first step")
    print(f"{args.peers} training peers up after {time.perf_counter() - started:.0f} s", flush=True)
    loaded: dict[str, list[VerifyCostCurve]] = {"wall": [], "work": []}
    try:
        for repeat in range(repeats):
            for name in ("wall", "work") if repeat % 2 == 0 else ("work", "wall"):
                loaded[name].append(calibrate(name))
                show(f"loaded, {name}", loaded[name][-1])
    finally:
        stop.set()
        for peer in peers:
            peer.join(timeout=60)
    again = calibrate("work")
    show("quiet again", again)
    result = {
        "cpu": cpu_facts()["cpu"], "dtype": args.dtype, "peers": args.peers, "repeats": repeats,
        "rounds": args.rounds or CALIBRATION_ROUNDS,
        "quiet_verdict": verdict(quiet),
        "verdicts_wall": [verdict(c) for c in loaded["wall"]],
        "verdicts_work": [verdict(c) for c in loaded["work"]],
        "max_ratio_error_wall": round(max(error(c, quiet) for c in loaded["wall"]), 3),
        "max_ratio_error_work": round(max(error(c, quiet) for c in loaded["work"]), 3),
        "quiet_ratio_error": round(error(again, quiet), 3),
        "base_ms_quiet": [round(1000 * s, 1) for s in quiet.base_seconds],
        "base_ms_loaded_wall": [round(1000 * max(c.base_seconds[i] for c in loaded["wall"]), 1) for i in range(len(quiet.batches))],
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
