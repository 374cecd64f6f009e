"""Sparse delta codec on real GRPO steps of the embedded model: ours vs the entropy bounds, PULSE-like, COO, dense.

Each step: rollouts from the bf16 engine (TorchEngine, keyed sampling), rewards from the task
verifier, one AdamW GRPO step of the fp32 trainer (hivespec's Trainer, bf16 autocast), then the
bf16 bit diff between the engine and the trainer's cast, coded these ways:

- dense: every bf16 element (2 bytes each);
- COO: int32 index + bf16 value per changed element (6 bytes);
- PULSE (as shipped, one-covenant/grail `sparse_codec.encode_optimal`, format v3.1): per tensor,
  row deltas (uint8 or int32) and in-row column deltas (uint16 or int32) of the 2-D COO
  indices and the raw bf16 values, zstd level 1 over all;
- PULSE-best: the smallest of the PULSE-like variants {flat uint32 index deltas (PULSE v2),
  2-D COO deltas (v3.1)} x {values raw, values byte-shuffled} at zstd levels 1 and 3, and all
  bytes shuffled into byte planes (indices and values, as blosc does) at levels 1, 3 and
  --best-level (19; 12 in --quick, where 19 alone would take 17 s of CPU at the first step and
  saves another 5%). vs_pulse is measured against this one;
- ours: protocol/delta.py v3 (positions per magnitude class, values as sign flip + zigzag
  magnitude steps with tables chosen by the base exponent), chunked;
- bound: log2 C(N, k) + k * H(c), c the zigzag ulp steps of the changed values (the issue's
  unconditional bound; H empirical over the step);
- conditional bound: what the base weights tell the receiver, taken into account: per tensor
  and base exponent e, log2 C(N_e, k_e), plus H(c | e). Ours can go below the unconditional
  bound, not below this one (up to its own tables and side bits).

Our chunks are then decoded against the engine's weights and applied through the same path a
follower takes (`EngineWeights`): exact means the engine then equals the trainer's cast bit for
bit and hashes to the delta's result hash. Encode and decode are timed on the whole model
(given the extracted delta); CPU time of this process is reported as the best of 3 runs,
since the 2-core box is shared and wall time inflates with the load.

    python bench/delta_codec.py --quick                   # lr 1e-6, 2 steps, small rollouts (< 2 minutes CPU)
    python bench/delta_codec.py --steps 5 --lr 1e-6 2e-5  # PULSE's regime and the demo config's

Ends with one line ``RESULT {json}``: the worst case over all steps of every learning rate,
and the same per learning rate under "by_lr".
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch
import zstandard

from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
from hivespec.node.model.loader import (
    EMBEDDED_MODEL,
    configure_threads,
    load_model,
    load_tokenizer,
)
from hivespec.node.tasks import TaskSource
from hivespec.node.training.trainer import Trainer, TrainSample
from hivespec.node.weights.sync import WeightSync
from hivespec.protocol.delta import (
    State,
    WeightDelta,
    decode_delta,
)
from hivespec.protocol.delta_encode import encode_delta
from hivespec.protocol.entropy import entropy_bits
from hivespec.protocol.weights_hash import state_hash

CPU_REPEATS = 3


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lr 1e-6, 2 steps with small rollouts (under 2 minutes CPU)")
    parser.add_argument("--steps", type=int, help="GRPO steps per learning rate (default 5, quick 2)")
    parser.add_argument(
        "--lr", type=float, nargs="+",
        help="AdamW learning rates, each a fresh run from the base model (default 1e-6 2e-5: PULSE's regime "
        "and configs/*.yaml's demo; quick 1e-6)",
    )
    parser.add_argument("--prompts", type=int, help="prompts per step (default 4, quick 2)")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, help="default 48, quick 12")
    parser.add_argument("--best-level", type=int, help="zstd level of the strongest PULSE-like variant (default 19, quick 12)")
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: on the shared 2-core box, 2 threads spent 9x the CPU time on rollouts and training)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 5)
    args.best_level = args.best_level or (12 if args.quick else 19)
    args.lr = args.lr or ([1e-6] if args.quick else [1e-6, 2e-5])
    args.prompts = args.prompts or (2 if args.quick else 4)
    args.max_new_tokens = args.max_new_tokens or (12 if args.quick else 48)
    return args


def _rollouts(engine, tokenizer, tasks: TaskSource, args, step: int) -> list[TrainSample]:
    drawn = tasks.prompts(seed=args.seed, round=step, count=args.prompts)
    requests, owners = [], []
    for group, task in enumerate(drawn):
        prompt_ids = tuple(tasks.chat_prompt_ids(tokenizer, task))
        for i in range(args.generations):
            requests.append(GenerationRequest(prompt_ids=prompt_ids, seed=args.seed * 1000 + step, sample_index=group * args.generations + i))
            owners.append(task)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    samples = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop))
    out = []
    for task, sample in zip(owners, samples):
        text = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        out.append(TrainSample(sample.prompt_ids, sample.completion_ids, sample.logprobs, tasks.reward(task, text), task.prompt_id))
    # GRPO needs reward spread inside a group; a step with none would move no weight at all.
    if len({s.reward for s in out}) == 1:
        out[0] = TrainSample(out[0].prompt_ids, out[0].completion_ids, out[0].behaviour_logprobs, 1.0 - out[0].reward, out[0].group)
    return out


# ----- baselines and bounds ---------------------------------------------------------------------


def _byte_planes(array: np.ndarray) -> bytes:
    """The array's bytes regrouped as byte planes (all first bytes, then all second bytes, ...)."""
    return np.ascontiguousarray(array.view(np.uint8).reshape(-1, array.itemsize).T).tobytes()


def _coo_deltas(indices: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """PULSE v3.1's index form: row deltas, and column deltas within a row (absolute at a new row)."""
    cols_per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
    rows, cols = indices // cols_per_row, indices % cols_per_row
    row_deltas = np.diff(rows, prepend=0)
    new_row = np.ones(rows.size, bool)
    new_row[1:] = row_deltas[1:] != 0
    col_deltas = np.where(new_row, cols, np.diff(cols, prepend=0))
    row_dtype = "<u1" if row_deltas.max(initial=0) <= 0xFF else "<i4"
    col_dtype = "<u2" if col_deltas.max(initial=0) <= 0xFFFF else "<i4"
    return row_deltas.astype(row_dtype), col_deltas.astype(col_dtype)


def pulse_sizes(delta: WeightDelta, best_level: int) -> dict[str, int]:
    """Compressed bytes of each PULSE-like variant (see the module docstring)."""
    payloads: dict[str, bytes] = {}
    for shuffled in (False, True):
        flat, coo = [], []
        for t in delta.tensors:
            values = t.values.astype("<u2")
            values = _byte_planes(values) if shuffled else values.tobytes()
            flat += [np.diff(t.indices, prepend=0).astype("<i4").tobytes(), values]
            rows, cols = _coo_deltas(t.indices, t.shape)
            coo += [rows.tobytes(), cols.tobytes(), values]
        suffix = "+shuffled values" if shuffled else ""
        payloads["flat" + suffix] = b"".join(flat)
        payloads["coo" + suffix] = b"".join(coo)
    gaps = np.concatenate([np.diff(t.indices, prepend=0).astype("<u4") for t in delta.tensors])
    values = np.concatenate([t.values.astype("<u2") for t in delta.tensors])
    payloads["all byte planes"] = _byte_planes(gaps) + _byte_planes(values)
    sizes = {}
    for name, payload in payloads.items():
        levels = (1, 3, best_level) if name == "all byte planes" else (1, 3)
        for level in levels:
            sizes[f"{name} zstd-{level}"] = len(zstandard.ZstdCompressor(level=level).compress(payload))
    return sizes


def _log2_binomial(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    lgamma = np.vectorize(math.lgamma, otypes=[float])
    return (lgamma(n + 1.0) - lgamma(k + 1.0) - lgamma(n - k + 1.0)) / math.log(2)


def _ulp_codes(new: np.ndarray, base: np.ndarray) -> np.ndarray:
    """zigzag(new - base mod 2**16) - 1 of bf16 bit patterns: the issue's value codes."""
    d = (new.astype(np.int64) - base.astype(np.int64)) & 0xFFFF
    d = np.where(d >= 0x8000, d - 0x10000, d)
    return np.where(d > 0, 2 * d - 1, -2 * d) - 1


def bounds_bits(delta: WeightDelta, base: State) -> dict[str, float]:
    """The unconditional bound and the bound given the base exponents, split into positions and values."""
    total = sum(t.bits.size for t in base.values())
    k = delta.num_changed
    codes, exps = [], []
    positions_given_exponent = 0.0
    for t in delta.tensors:
        bits = base[t.name].bits.reshape(-1)
        exponent = (bits >> 7) & 0xFF
        changed = bits[t.indices]
        per_exponent = np.bincount(exponent, minlength=256)
        changed_per_exponent = np.bincount(exponent[t.indices], minlength=256)
        used = per_exponent > 0
        positions_given_exponent += float(_log2_binomial(per_exponent[used], changed_per_exponent[used]).sum())
        codes.append(_ulp_codes(t.values, changed))
        exps.append((changed >> 7) & 0xFF)
    codes, exps = np.concatenate(codes), np.concatenate(exps).astype(np.int64)
    _, counts = np.unique(codes, return_counts=True)
    _, joint = np.unique(exps * (1 << 17) + codes, return_counts=True)
    _, per_exponent = np.unique(exps, return_counts=True)
    return {
        "positions": float(_log2_binomial(np.array(float(total)), np.array(float(k)))),
        "values": entropy_bits(counts),
        "positions_given_exponent": positions_given_exponent,
        "values_given_exponent": entropy_bits(joint) - entropy_bits(per_exponent),
    }


# ----- one run ------------------------------------------------------------------------------------


def _best_cpu(fn, *args, repeats: int = CPU_REPEATS, **kwargs) -> tuple[object, float, float]:
    """fn(*args, **kwargs)'s result, its first wall time, and the least process CPU time over `repeats` calls."""
    best, result, wall = math.inf, None, 0.0
    for i in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        cpu = time.process_time() - c0
        if i == 0:
            wall = time.perf_counter() - t0
        best = min(best, cpu)
    return result, wall, best


def run_lr(args: argparse.Namespace, lr: float, tokenizer) -> list[dict]:
    torch.manual_seed(args.seed)
    trainer_model = load_model(args.model, dtype=torch.float32)
    engine_model = copy.deepcopy(trainer_model).to(torch.bfloat16).eval().requires_grad_(False)
    trainer_model.requires_grad_(True)
    engine = TorchEngine(engine_model, max_batch_size=16)
    sync = WeightSync(trainer_model, engine.sync_parameters())
    trainer = Trainer(trainer_model, learning_rate=lr, micro_batch_size=8, autocast_dtype=torch.bfloat16)
    tasks = TaskSource()
    state = sync.engine.state
    total = sum(t.bits.size for t in state.values())
    dense = sum(t.bits.nbytes for t in state.values())
    print(f"\nlr {lr:g}: {total:,} bf16 elements ({dense / 1e6:.1f} MB dense), {args.steps} steps", flush=True)
    print(
        f"{'step':>4} {'density':>8} {'COO MB':>7} {'PULSE':>7} {'P-best':>7} {'ours MB':>7} {'bound':>7} {'c-bound':>7} "
        f"{'ours/bnd':>8} {'ours/cbd':>8} {'Pbest/ours':>10} {'dense/ours':>10} {'b/chg':>6} {'enc s':>6} {'dec s':>6} "
        f"{'cpu s':>6} {'chunks':>6} {'exact':>5}",
        flush=True,
    )
    rows = []
    for step in range(1, args.steps + 1):
        c0 = time.process_time()
        trainer.step(_rollouts(engine, tokenizer, tasks, args, step))
        c_train = time.process_time() - c0
        t0 = time.perf_counter()
        delta = sync.build_delta(step)  # extract + hash of the target
        t_extract = time.perf_counter() - t0
        chunks, t_encode, c_encode = _best_cpu(encode_delta, delta, state)
        (verdict, decoded), t_decode, c_decode = _best_cpu(decode_delta, chunks, base=state, base_hash=sync.engine.hash)
        if not verdict.ok or decoded is None:
            print(f"decode rejected our own delta: {verdict}", file=sys.stderr)
            raise SystemExit(1)
        bound = bounds_bits(delta, state)
        pulse = pulse_sizes(delta, args.best_level)
        best_name = min(pulse, key=pulse.get)
        t0 = time.perf_counter()
        applied = sync.engine.apply(decoded)  # writes, hashes, checks the result hash
        t_apply = time.perf_counter() - t0
        exact = applied.ok and sync.mismatched_elements() == 0 and sync.engine.hash == delta.result_hash
        exact = exact and all(a == b for a, b in zip(decoded.tensors, delta.tensors))

        k = delta.num_changed
        ours = sum(map(len, chunks))
        row = {
            "lr": lr,
            "step": step,
            "density": k / total,
            "dense_bytes": dense,
            "coo_bytes": 6 * k,
            "pulse_bytes": pulse["coo zstd-1"],
            "pulse_best_bytes": pulse[best_name],
            "pulse_best_variant": best_name,
            "ours_bytes": ours,
            "bound_bytes": (bound["positions"] + bound["values"]) / 8,
            "conditional_bound_bytes": (bound["positions_given_exponent"] + bound["values_given_exponent"]) / 8,
            **{f"bound_{key}_bits_per_changed": v / max(1, k) for key, v in bound.items()},
            "encode_s": t_encode,
            "decode_s": t_decode,
            "encode_decode_cpu_s": c_encode + c_decode,
            "extract_and_hash_s": t_extract,
            "apply_and_hash_s": t_apply,
            "chunks": len(chunks),
            "exact": bool(exact),
        }
        rows.append(row)
        print(
            f"{step:>4} {row['density']:>8.4%} {row['coo_bytes'] / 1e6:>7.2f} {row['pulse_bytes'] / 1e6:>7.2f} "
            f"{row['pulse_best_bytes'] / 1e6:>7.2f} {ours / 1e6:>7.3f} {row['bound_bytes'] / 1e6:>7.2f} "
            f"{row['conditional_bound_bytes'] / 1e6:>7.2f} {ours / row['bound_bytes']:>8.3f} "
            f"{ours / row['conditional_bound_bytes']:>8.3f} {row['pulse_best_bytes'] / ours:>10.2f} {dense / ours:>10.1f} "
            f"{8 * ours / max(1, k):>6.2f} {t_encode:>6.2f} {t_decode:>6.2f} {c_encode + c_decode:>6.2f} {len(chunks):>6} {exact!s:>5}",
            flush=True,
        )
        print(
            f"      bits per changed element: bound {bound['positions'] / k:.2f} positions + {bound['values'] / k:.2f} values; "
            f"given the base exponent {bound['positions_given_exponent'] / k:.2f} + {bound['values_given_exponent'] / k:.2f}; "
            f"PULSE-best = {best_name}; extract+hash {t_extract:.2f} s, apply+hash {t_apply:.2f} s; "
            f"rollouts+train {c_train:.1f} s CPU",
            flush=True,
        )
    if state_hash(state) != sync.engine.hash:
        rows[-1]["exact"] = False
    return rows


def summarize(rows: list[dict]) -> dict:
    """Worst case over the rows for the ratios and times; mean density and dense ratio."""
    return {
        "density": round(float(np.mean([r["density"] for r in rows])), 5),
        "vs_bound": round(max(r["ours_bytes"] / r["bound_bytes"] for r in rows), 4),
        "vs_conditional_bound": round(max(r["ours_bytes"] / r["conditional_bound_bytes"] for r in rows), 4),
        "vs_pulse": round(min(r["pulse_best_bytes"] / r["ours_bytes"] for r in rows), 3),
        "vs_pulse_shipped": round(min(r["pulse_bytes"] / r["ours_bytes"] for r in rows), 3),
        "vs_dense": round(float(np.mean([r["dense_bytes"] / r["ours_bytes"] for r in rows])), 1),
        "vs_coo": round(float(np.mean([r["coo_bytes"] / r["ours_bytes"] for r in rows])), 2),
        "encode_decode_s": round(max(r["encode_s"] + r["decode_s"] for r in rows), 3),
        "encode_decode_cpu_s": round(max(r["encode_decode_cpu_s"] for r in rows), 3),
        "encode_mb_s": round(min(r["dense_bytes"] / 1e6 / r["encode_s"] for r in rows), 1),
        "decode_mb_s": round(min(r["dense_bytes"] / 1e6 / r["decode_s"] for r in rows), 1),
        "exact": all(r["exact"] for r in rows),
        "steps": len(rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    configure_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    print(f"model {args.model}, learning rates {args.lr}, {args.steps} steps each, zstd best level {args.best_level}", flush=True)
    by_lr = {f"{lr:g}": run_lr(args, lr, tokenizer) for lr in args.lr}
    result = summarize([r for rows in by_lr.values() for r in rows])
    result["by_lr"] = {lr: summarize(rows) for lr, rows in by_lr.items()}
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
