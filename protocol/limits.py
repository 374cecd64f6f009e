"""Every hard limit on bytes that come from the network, in one place.

Decoders take a `Limits` so tests and private swarms can tighten them; nothing else in the
code base should hard-code a size, depth or length that bounds untrusted input.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Limits:
    """Hard bounds applied while decoding untrusted bytes; anything beyond them is rejected."""

    # hivemind/p2pd caps one P2P message at 4 MiB; 64 KiB of headroom for stream framing.
    max_envelope_bytes: int = 4 * MIB - 64 * KIB
    # Our messages nest at most 4 levels (envelope body -> batch -> rollouts -> rollout);
    # msgpack itself accepts depth 1000, so the codec enforces this.
    max_depth: int = 8
    max_rollouts_per_batch: int = 1024
    max_prompt_tokens: int = 4096
    max_completion_tokens: int = 8192
    # Bounds names, prompt ids, finish reasons, tensor names: anything a peer may put in a str.
    max_str_len: int = 256
    # Hex model fingerprints: sha256 hexdigest at most.
    max_fingerprint_len: int = 64
    # A generous bound on `Rollout.sample_index` (num_generations per prompt is tens, not millions).
    max_sample_index: int = 1 << 20
    # Envelopes timestamped further than this from our clock are dropped (replay and junk bound).
    max_clock_skew_s: float = 300.0
    # Largest signed sequence number / seed we accept: they are packed as uint64 for signing.
    max_uint64: int = (1 << 64) - 1
    # Sparse deltas: compressed input, decompressed payload (zip-bomb bound), tensors, rank.
    # 1 GiB raw covers a dense bf16 diff of a ~150M-parameter model with int64 indices.
    max_delta_bytes: int = 256 * MIB
    max_delta_raw_bytes: int = 1024 * MIB
    max_delta_tensors: int = 4096
    max_tensor_rank: int = 8


DEFAULT_LIMITS = Limits()
