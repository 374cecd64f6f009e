"""Sparse delta codec on real GRPO steps of the embedded model: ours vs the entropy bound, PULSE-like, COO, dense.

Each step: rollouts from the bf16 engine (TorchEngine, keyed sampling), rewards from the task
verifier, one GRPO step of the fp32 trainer (hivespec's Trainer, bf16 autocast), then the
bf16 bit diff between the engine and the trainer's cast, coded five ways:

- dense: every bf16 element (2 bytes each);
- COO: int32 index + bf16 value per changed element (6 bytes);
- PULSE-like: per tensor, delta-coded uint32 indices and raw bf16 values, zstd level 1 over all;
- ours: protocol/delta.py v2 (rANS-coded gap quotients + Rice low bits, zigzag ulp steps), chunked;
- bound: log2 C(N, k) + k * H(ulp codes), H the empirical entropy of this step's value codes.

Our chunks are then decoded against the engine's weights and applied through the same path a
follower takes (`EngineWeights`): exact means the engine then equals the trainer's cast bit for
bit and hashes to the delta's result hash. Timings: encode and decode of the whole model (given
the extracted delta), extract, hash and apply reported apart.

    python bench/delta_codec.py --quick      # 2 steps, small rollouts (< 2 minutes)
    python bench/delta_codec.py --steps 5 --lr 1e-6

Ends with one line ``RESULT {json}``.
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
from hivespec.node.engine import GenerationRequest, SamplingParams, TorchEngine
from hivespec.node.model import (
    EMBEDDED_MODEL,
    configure_threads,
    load_model,
    load_tokenizer,
)
from hivespec.node.sync import WeightSync
from hivespec.node.tasks import TaskSource
from hivespec.node.trainer import Trainer, TrainSample
from hivespec.protocol.delta import WeightDelta, decode_delta, encode_delta, state_hash
from hivespec.protocol.delta_codes import ulp_codes
from hivespec.protocol.entropy import entropy_bits


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps with small rollouts (under 2 minutes)")
    parser.add_argument("--steps", type=int, help="GRPO steps (default 5, quick 2)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (PULSE's regime is ~1e-6)")
    parser.add_argument("--prompts", type=int, help="prompts per step (default 4, quick 2)")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, help="default 48, quick 12")
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 5)
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


def _pulse_bytes(delta: WeightDelta) -> int:
    parts = []
    for t in delta.tensors:
        gaps = np.diff(t.indices, prepend=np.int64(0)).astype("<u4")
        parts += [gaps.tobytes(), t.values.astype("<u2").tobytes()]
    return len(zstandard.ZstdCompressor(level=1).compress(b"".join(parts)))


def _bound_bits(delta: WeightDelta, base, total_elements: int) -> tuple[float, float]:
    k = delta.num_changed
    positions = (math.lgamma(total_elements + 1) - math.lgamma(k + 1) - math.lgamma(total_elements - k + 1)) / math.log(2)
    codes = np.concatenate([ulp_codes(t.values, base[t.name].bits.reshape(-1)[t.indices], 16) for t in delta.tensors])
    _, counts = np.unique(codes, return_counts=True)
    return positions, entropy_bits(counts)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    configure_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model)
    trainer_model = load_model(args.model, dtype=torch.float32)
    engine_model = copy.deepcopy(trainer_model).to(torch.bfloat16).eval()
    for p in engine_model.parameters():
        p.requires_grad_(False)
    trainer_model.requires_grad_(True)
    engine = TorchEngine(engine_model, max_batch_size=16)
    sync = WeightSync(trainer_model, engine.sync_parameters())
    trainer = Trainer(trainer_model, learning_rate=args.lr, micro_batch_size=8, autocast_dtype=torch.bfloat16)
    tasks = TaskSource()
    state = sync.engine.state
    total = sum(t.bits.size for t in state.values())
    dense = sum(t.bits.nbytes for t in state.values())
    print(f"model {args.model}: {total:,} bf16 elements ({dense / 1e6:.1f} MB dense), lr {args.lr:g}, {args.steps} steps", flush=True)
    header = (
        f"{'step':>4} {'density':>8} {'COO MB':>8} {'PULSE MB':>9} {'ours MB':>8} {'bound MB':>9} {'ours/bnd':>8} "
        f"{'PULSE/ours':>10} {'dense/ours':>10} {'b/chg':>6} {'enc s':>6} {'dec s':>6} {'enc MB/s':>8} {'dec MB/s':>8} {'chunks':>6} {'exact':>5}"
    )
    print(header, flush=True)
    rows = []
    for step in range(1, args.steps + 1):
        samples = _rollouts(engine, tokenizer, tasks, args, step)
        trainer.step(samples)

        t0 = time.perf_counter()
        delta = sync.build_delta(step)  # extract + hash of the target
        t_extract = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), time.process_time()
        chunks = encode_delta(delta, state)
        t_encode, c_encode = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        verdict, decoded = decode_delta(chunks, base=state, base_hash=sync.engine.hash)
        t_decode, c_decode = time.perf_counter() - t0, time.process_time() - c0
        if not verdict.ok or decoded is None:
            print(f"decode rejected our own delta: {verdict}", file=sys.stderr)
            return 1
        positions_bits, value_bits = _bound_bits(delta, state, total)
        t0 = time.perf_counter()
        applied = sync.engine.apply(decoded)  # writes, hashes, checks the result hash
        t_apply = time.perf_counter() - t0
        exact = applied.ok and sync.mismatched_elements() == 0 and sync.engine.hash == delta.result_hash
        exact = exact and all(a == b for a, b in zip(decoded.tensors, delta.tensors))

        k = delta.num_changed
        ours = sum(map(len, chunks))
        bound = (positions_bits + value_bits) / 8
        row = {
            "step": step,
            "density": k / total,
            "dense_bytes": dense,
            "coo_bytes": 6 * k,
            "pulse_bytes": _pulse_bytes(delta),
            "ours_bytes": ours,
            "bound_bytes": bound,
            "bound_positions_bits_per_changed": positions_bits / max(1, k),
            "bound_value_bits_per_changed": value_bits / max(1, k),
            "encode_s": t_encode,
            "decode_s": t_decode,
            "encode_decode_cpu_s": c_encode + c_decode,  # this process's CPU time: less inflated by other load
            "extract_and_hash_s": t_extract,
            "apply_and_hash_s": t_apply,
            "chunks": len(chunks),
            "exact": bool(exact),
        }
        rows.append(row)
        print(
            f"{step:>4} {row['density']:>8.4%} {row['coo_bytes'] / 1e6:>8.2f} {row['pulse_bytes'] / 1e6:>9.2f} {ours / 1e6:>8.2f} "
            f"{bound / 1e6:>9.2f} {ours / bound:>8.3f} {row['pulse_bytes'] / ours:>10.2f} {dense / ours:>10.1f} "
            f"{8 * ours / max(1, k):>6.2f} {t_encode:>6.2f} {t_decode:>6.2f} {dense / 1e6 / t_encode:>8.0f} "
            f"{dense / 1e6 / t_decode:>8.0f} {len(chunks):>6} {exact!s:>5}",
            flush=True,
        )
        print(
            f"      bound per changed element: positions {row['bound_positions_bits_per_changed']:.2f} b + values "
            f"{row['bound_value_bits_per_changed']:.2f} b; encode+decode CPU {c_encode + c_decode:.2f} s; "
            f"extract+hash {t_extract:.2f} s, apply+hash {t_apply:.2f} s",
            flush=True,
        )
    result = {
        "density": round(float(np.mean([r["density"] for r in rows])), 5),
        "vs_bound": round(max(r["ours_bytes"] / r["bound_bytes"] for r in rows), 4),
        "vs_pulse": round(min(r["pulse_bytes"] / r["ours_bytes"] for r in rows), 3),
        "vs_dense": round(float(np.mean([r["dense_bytes"] / r["ours_bytes"] for r in rows])), 1),
        "vs_coo": round(float(np.mean([r["coo_bytes"] / r["ours_bytes"] for r in rows])), 2),
        "encode_decode_s": round(max(r["encode_s"] + r["decode_s"] for r in rows), 3),
        "encode_decode_cpu_s": round(max(r["encode_decode_cpu_s"] for r in rows), 3),
        "encode_mb_s": round(min(r["dense_bytes"] / 1e6 / r["encode_s"] for r in rows), 1),
        "decode_mb_s": round(min(r["dense_bytes"] / 1e6 / r["decode_s"] for r in rows), 1),
        "exact": all(r["exact"] for r in rows) and state_hash(state) == sync.engine.hash,
        "steps": len(rows),
        "lr": args.lr,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
