"""Peak memory and time of per-token log-probs with backward: chunked kernel vs the naive full-logits path.

The workload is the trainer's LM-head step at SmolLM2-135M's shape: hidden [4 x 1024, 576],
lm_head [49152, 576] (both float32, both requiring grad), one target per row; forward
log_softmax(hidden @ W.T)[target], then backward. The naive path is what
``model(...).logits.log_softmax(-1).gather(...)`` does: it materialises [4096 x 49152] float32
logits (805 MB), the log-softmax output (another 805 MB) and their gradients.

Method: every variant runs in its own fresh Python process (``--variant``), so allocator state
and caches cannot leak between them. The process builds its inputs, resets the kernel's
high-water mark of resident pages to what is resident now (Linux: ``/proc/self/clear_refs``),
reads that resident set size, runs forward + backward, and reads the high-water mark
(``VmHWM``); the difference is the step's peak extra memory, gradients of hidden and W
included. (The mark is reset because building the inputs raised it above what stays resident:
scaling W made a W-sized temporary, which a mark read without the reset took off every
variant's figure.) torch's CPU allocator hands large tensors
straight to malloc/mmap, so resident pages follow live tensors closely; tracemalloc cannot see
them (it only traces Python's allocator) and torch has no CPU peak counter. Time is the best of
``--repeats`` forward + backward runs in that process.

    python bench/logprob_memory.py            # 4 x 1024 tokens, 49152 vocabulary
    python bench/logprob_memory.py --quick    # 1 x 1024 tokens

Ends with ``RESULT {json}``: peak MB per variant and the naive / chunked ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

VARIANTS = ("naive", "chunked_1024", "chunked_256", "chunked_1024_bf16_grad")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 x 1024 tokens instead of 4 x 1024")
    parser.add_argument("--batch", type=int, help="sequences (default 4, quick 1)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, help="timed runs per variant (default 2, quick 1)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = 1 if args.quick else 4
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    return args


def _status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0  # reported in kB
    raise SystemExit(f"logprob_memory: no {field} in /proc/self/status; it measures on Linux only")


def _reset_peak_mb() -> float:
    """Reset the high-water mark of resident pages to the resident set now, and return that (MB)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        raise SystemExit(f"logprob_memory: cannot reset the peak resident set ({exc}); it needs Linux's /proc/self/clear_refs") from exc
    return _status_mb("VmRSS")


def _child(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from hivespec.kernels.logprobs import token_logprobs

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = args.batch * args.seq_len
    hidden = torch.randn(rows, args.hidden, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.05).requires_grad_()
    targets = torch.randint(0, args.vocab, (rows,), generator=gen)
    grad_out = torch.randn(rows, generator=gen)

    def run() -> torch.Tensor:
        hidden.grad = weight.grad = None
        if args.variant == "naive":
            out = F.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        else:
            chunk = 256 if args.variant == "chunked_256" else 1024
            grad_dtype = torch.bfloat16 if args.variant.endswith("bf16_grad") else None
            out = token_logprobs(hidden, weight, targets, chunk_size=chunk, grad_dtype=grad_dtype)
        (out * grad_out).sum().backward()
        return out.detach()

    before = _reset_peak_mb()
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - started)
    peak = _status_mb("VmHWM") - before
    return {"variant": args.variant, "peak_extra_mb": round(peak, 1), "seconds": round(min(seconds), 3),
            "logp_checksum": float(out.double().sum()), "grad_w_norm": float(weight.grad.norm())}


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.variant is not None:
        print(json.dumps(_child(args)))
        return
    rows = args.batch * args.seq_len
    logits_mb = rows * args.vocab * 4 / 2**20
    print(f"{args.batch} x {args.seq_len} tokens, vocab {args.vocab}, hidden {args.hidden}, {args.threads} threads; "
          f"one float32 [tokens x vocab] tensor is {logits_mb:.0f} MB")
    results = {}
    for variant in VARIANTS:
        command = [sys.executable, "-P", __file__, "--variant", variant, "--batch", str(args.batch),
                   "--seq-len", str(args.seq_len), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                   "--threads", str(args.threads), "--repeats", str(args.repeats)]
        line = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[variant] = json.loads(line)
        r = results[variant]
        print(f"  {variant:<24} peak extra {r['peak_extra_mb']:>8.1f} MB   fwd+bwd {r['seconds']:>7.3f} s")
    naive = results["naive"]
    chunked = results["chunked_1024"]
    same = abs(naive["logp_checksum"] - chunked["logp_checksum"]) <= 1e-3 * abs(naive["logp_checksum"])
    print(f"  chunked log-probs equal the naive ones (checksum): {same}")
    result = {
        "tokens": rows,
        "vocab": args.vocab,
        "naive_peak_mb": naive["peak_extra_mb"],
        "chunked_peak_mb": chunked["peak_extra_mb"],
        "chunked_256_peak_mb": results["chunked_256"]["peak_extra_mb"],
        "memory_ratio": round(naive["peak_extra_mb"] / max(chunked["peak_extra_mb"], 1e-9), 2),
        "time_ratio_chunked_vs_naive": round(chunked["seconds"] / naive["seconds"], 3),
        "time_ratio_chunk256_vs_1024": round(results["chunked_256"]["seconds"] / chunked["seconds"], 3),
        "time_ratio_bf16_grad_vs_fp32": round(results["chunked_1024_bf16_grad"]["seconds"] / chunked["seconds"], 3),
        "values_match": same,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
