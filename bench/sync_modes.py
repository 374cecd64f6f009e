"""Trainer -> engine weight sync on the embedded model: written directly vs coded for followers.

A node without followers writes the changed elements of the trainer's cast straight into its
engine (`WeightSync.sync(..., encode=False)`: changed positions, or a whole-tensor copy where
most elements moved); a leader codes the delta, then applies those very bytes as its followers
will (`encode=True`). Both end with the engine equal to the trainer's cast bit for bit and the
same weights hash. This times both, side by side in one process, for a bfloat16 and a float32
engine, after one AdamW step of the float32 trainer (gradients drawn at random with a fixed
seed: the sync's cost depends on how many elements move, not on why).

    python bench/sync_modes.py --quick   # the model cut to 4 of its 30 layers, 1 thread
    python bench/sync_modes.py           # the whole model (the coded float32 sync takes ~2 minutes)

Ends with ``RESULT {json}``: seconds per mode and dtype, the speedup of the direct write
(`direct_speedup_bf16`, `direct_speedup_fp32`), and whether both modes ended on the same weights.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hivespec.node.model.loader import configure_threads, load_model
from hivespec.node.model.precision import cpu_facts
from hivespec.node.weights.sync import WeightSync


def time_sync(trainer: torch.nn.Module, dtype: torch.dtype, encode: bool, learning_rate: float) -> dict:
    """One AdamW step from the same start, then one sync into a fresh engine copy in ``dtype``."""
    start = {name: p.detach().clone() for name, p in trainer.named_parameters()}
    engine = {name: p.to(dtype).clone() for name, p in start.items()}
    sync = WeightSync(trainer, engine)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=learning_rate)
    generator = torch.Generator().manual_seed(0)
    for p in trainer.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    optimizer.step()
    mark = time.perf_counter()
    stats, chunks = sync.sync(1, encode=encode)
    seconds = time.perf_counter() - mark
    assert sync.mismatched_elements() == 0, "the engine must equal the trainer's cast after a sync"
    digest = sync.engine.hash.hex()
    with torch.no_grad():  # back to the start for the next measurement
        for name, p in trainer.named_parameters():
            p.copy_(start[name])
            p.grad = None
    return {"seconds": round(seconds, 3), "density": round(stats.density, 4), "coded_bytes": stats.delta_bytes,
            "chunks": len(chunks), "hash": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the model cut to its first 4 layers (embeddings included)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a demo node on 2 cores with 3 nodes has 1)")
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (the demo config's)")
    args = parser.parse_args()
    configure_threads(args.threads)
    trainer = load_model().float()
    if args.quick:
        trainer.model.layers = trainer.model.layers[:4]
    elements = sum(p.numel() for p in trainer.parameters())
    cpu = cpu_facts()["cpu"]
    print(f"{elements / 1e6:.1f}M parameters, {args.threads} thread(s), {cpu}, torch {torch.__version__}", flush=True)
    rows = {}
    for dtype in (torch.bfloat16, torch.float32):
        for encode in (False, True):
            key = f"{'coded' if encode else 'direct'}_{str(dtype).removeprefix('torch.')}"
            rows[key] = time_sync(trainer, dtype, encode, args.lr)
            print(f"{key:>17}: {rows[key]['seconds']:8.2f} s  density {rows[key]['density']:.3f}  "
                  f"coded {rows[key]['coded_bytes'] / 1e6:8.1f} MB", flush=True)
    for name in ("bfloat16", "float32"):
        assert rows[f"direct_{name}"]["hash"] == rows[f"coded_{name}"]["hash"], f"{name}: both modes must end on the same weights"
    result = {
        "parameters": elements, "threads": args.threads, "cpu": cpu,
        **{f"{key}_s": row["seconds"] for key, row in rows.items()},
        "direct_speedup_bf16": round(rows["coded_bfloat16"]["seconds"] / rows["direct_bfloat16"]["seconds"], 1),
        "direct_speedup_fp32": round(rows["coded_float32"]["seconds"] / rows["direct_float32"]["seconds"], 1),
        "same_weights": True,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
