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
    # Sparse deltas travel as chunks, each one gossip body under the 4 MiB message cap (room for
    # the envelope). A chunk decodes at most max_delta_chunk_elements positions or listed
    # class members (the decode-time and memory bound: a few uint64 arrays of that length),
    # scans at most max_delta_chunk_scan base elements to find magnitude classes (one compare
    # pass each), holds at most max_delta_tensors tensor pieces; a delta has at most
    # max_delta_chunks chunks.
    max_delta_chunk_bytes: int = 4 * MIB - 128 * KIB
    max_delta_chunk_elements: int = 1 << 24
    max_delta_chunk_scan: int = 1 << 28
    max_delta_chunks: int = 4096
    max_delta_tensors: int = 4096
    max_tensor_rank: int = 8
    max_tensor_elements: int = 1 << 38


DEFAULT_LIMITS = Limits()
