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
Also per mode and dtype: the check a round makes after a sync that moved a weight (`*_check_s`,
`WeightSync.mismatched_elements`) and a sync that finds by diffing that nothing moved
(`*_no_update_s`; a node tells its sync instead, `trainer_moved=False`, and skips it: bench/flat_steps.py);
and `count_kernel`, the changed-element count a round's sync and check run: torch's count_nonzero
per tensor against `mismatch_counts` (numpy's, in pieces on torch's threads), side by side on the
model's tensors; and `weights_hash`, the hash every sync that moved a weight ends with, over the bfloat16 engine's bits: one sha256 over the whole stream (the v1 hash)
against v2's 4 MiB pieces on every core (`protocol/weights_hash.py`), best of 3 each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np
import torch

from hivespec.kernels.delta import mismatch_counts
from hivespec.node.model.loader import configure_threads, load_model
from hivespec.node.model.precision import cpu_facts
from hivespec.node.weights.sync import WeightSync, host_bits
from hivespec.protocol.weights_hash import hash_workers, state_hash


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
    mark = time.perf_counter()
    assert sync.mismatched_elements() == 0, "the engine must equal the trainer's cast after a sync"
    verify = time.perf_counter() - mark
    digest = sync.engine.hash.hex()
    # A step that trained nothing (no sample had an advantage) still syncs: nothing moves.
    mark = time.perf_counter()
    idle, _ = sync.sync(2, encode=encode)
    idle_seconds = time.perf_counter() - mark
    assert idle.changed == 0 and sync.engine.hash.hex() == digest, "a sync without an update must change nothing"
    with torch.no_grad():  # back to the start for the next measurement
        for name, p in trainer.named_parameters():
            p.copy_(start[name])
            p.grad = None
    return {"seconds": round(seconds, 3), "verify_seconds": round(verify, 3), "idle_seconds": round(idle_seconds, 3),
            "density": round(stats.density, 4), "coded_bytes": stats.delta_bytes, "chunks": len(chunks), "hash": digest}


def count_kernels(trainer: torch.nn.Module) -> dict:
    """Counting changed elements over the bf16 cast of every tensor after an update: torch's `count_nonzero(a != b)`,
    what a round's sync and check ran per tensor, against `mismatch_counts` (numpy on a CPU, in pieces on torch's
    threads), side by side, best of 3 each."""
    tensors = [(p.detach().to(torch.bfloat16).view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16).clone())
               for p in trainer.parameters()]
    for _, changed in tensors:
        changed.view(-1)[::15] += 1  # ~7 % of the elements move, about what one AdamW step of the demo moves

    def best(count) -> tuple[float, int]:
        times, total = [], 0
        for _ in range(3):
            mark = time.perf_counter()
            total = count()
            times.append(time.perf_counter() - mark)
        return min(times), total

    old_s, old_n = best(lambda: sum(int(torch.count_nonzero(a != b)) for a, b in tensors))
    new_s, new_n = best(lambda: sum(int(n) for n in mismatch_counts(tensors)))
    assert old_n == new_n, "both counts must agree"
    return {"torch_count_nonzero_s": round(old_s, 3), "mismatch_counts_s": round(new_s, 3), "speedup": round(old_s / new_s, 1)}


def hash_speed(trainer: torch.nn.Module) -> dict:
    """The weights hash of the bfloat16 engine: v1's one sha256 over the whole stream against v2's pieces on every core."""
    state = host_bits({name: p.detach().to(torch.bfloat16) for name, p in trainer.named_parameters()})

    def single_stream() -> bytes:
        hasher = hashlib.sha256(b"hivespec/weights/v1\0")
        for name in sorted(state):
            header = f"{name}\0{state[name].dtype}\0{','.join(map(str, state[name].bits.shape))}\0".encode()
            hasher.update(len(header).to_bytes(4, "little") + header)
            hasher.update(memoryview(state[name].bits.reshape(-1).view(np.uint8)))
        return hasher.digest()

    def best(run) -> float:
        times = []
        for _ in range(3):
            mark = time.perf_counter()
            run()
            times.append(time.perf_counter() - mark)
        return min(times)

    v1_s, v2_s = best(single_stream), best(lambda: state_hash(state))
    return {"bytes": sum(t.bits.nbytes for t in state.values()), "workers": hash_workers(),
            "single_stream_s": round(v1_s, 3), "pieces_s": round(v2_s, 3), "speedup": round(v1_s / v2_s, 2)}


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
                  f"coded {rows[key]['coded_bytes'] / 1e6:8.1f} MB  check {rows[key]['verify_seconds']:.2f} s  "
                  f"sync without an update {rows[key]['idle_seconds']:.2f} s", flush=True)
    kernels = count_kernels(trainer)
    print(f"counting changed elements (bf16): torch count_nonzero {kernels['torch_count_nonzero_s']:.3f} s, mismatch_counts "
          f"{kernels['mismatch_counts_s']:.3f} s ({kernels['speedup']}x)", flush=True)
    hashing = hash_speed(trainer)
    print(f"weights hash of the bfloat16 engine ({hashing['bytes'] / 1e6:.0f} MB): one stream {hashing['single_stream_s']:.3f} s, "
          f"4 MiB pieces on {hashing['workers']} thread(s) {hashing['pieces_s']:.3f} s ({hashing['speedup']}x)", flush=True)
    for name in ("bfloat16", "float32"):
        assert rows[f"direct_{name}"]["hash"] == rows[f"coded_{name}"]["hash"], f"{name}: both modes must end on the same weights"
    result = {
        "parameters": elements, "threads": args.threads, "cpu": cpu,
        **{f"{key}_s": row["seconds"] for key, row in rows.items()},
        **{f"{key}_check_s": row["verify_seconds"] for key, row in rows.items()},
        **{f"{key}_no_update_s": row["idle_seconds"] for key, row in rows.items()},
        "count_kernel": kernels,
        "weights_hash": hashing,
        "direct_speedup_bf16": round(rows["coded_bfloat16"]["seconds"] / rows["direct_bfloat16"]["seconds"], 1),
        "direct_speedup_fp32": round(rows["coded_float32"]["seconds"] / rows["direct_float32"]["seconds"], 1),
        "same_weights": True,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
