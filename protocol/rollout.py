"""Rollout bodies: what a node generated for one prompt, and a batch of them for one round.

Wire format (msgpack; arrays as raw little-endian bytes, 4 bytes per element, to keep a
batch of thousands of tokens compact and to decode it with one `np.frombuffer`):

    batch   = {"round": int, "policy_version": int, "fingerprint": str, "rollouts": [rollout, ...]}
    rollout = {"prompt_id": str, "sample_index": int, "seed": int,
               "prompt_ids": bin (uint32 LE), "completion_ids": bin (uint32 LE),
               "behaviour_logprobs": bin (float32 LE, one per completion token),
               "reward": float, "finish_reason": "stop" | "length"}

`behaviour_logprobs[i]` is the log-probability, under the distribution the token was sampled
from, of `completion_ids[i]`; it must be finite and <= 0.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import numpy as np

from .codec import Reject, check_keys, pack, safe_unpack
from .limits import DEFAULT_LIMITS, Limits
from .verdict import Reason, Verdict

FINISH_REASONS = frozenset({"stop", "length"})
_TOKEN_DTYPE = np.dtype("<u4")
_LOGPROB_DTYPE = np.dtype("<f4")
_ROLLOUT_KEYS = frozenset(
    {"prompt_id", "sample_index", "seed", "prompt_ids", "completion_ids", "behaviour_logprobs", "reward", "finish_reason"}
)
_BATCH_KEYS = frozenset({"round", "policy_version", "fingerprint", "rollouts"})
_HEX = frozenset("0123456789abcdef")
_HASH_TAG = b"hivespec/rollout-content/v1\0"


@dataclass(frozen=True, eq=False)
class Rollout:
    """One sampled completion of one prompt, with the behaviour log-prob of every completion token.

    Arrays decoded from the wire are read-only views. Equality compares array contents.
    """

    prompt_id: str
    sample_index: int
    seed: int
    prompt_ids: np.ndarray  # uint32
    completion_ids: np.ndarray  # uint32
    behaviour_logprobs: np.ndarray  # float32, len == len(completion_ids)
    reward: float
    finish_reason: str  # "stop" | "length"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rollout):
            return NotImplemented
        return (
            (self.prompt_id, self.sample_index, self.seed, self.reward, self.finish_reason)
            == (other.prompt_id, other.sample_index, other.seed, other.reward, other.finish_reason)
            and np.array_equal(self.prompt_ids, other.prompt_ids)
            and np.array_equal(self.completion_ids, other.completion_ids)
            and np.array_equal(self.behaviour_logprobs, other.behaviour_logprobs)
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays; use rollout_content_hash


@dataclass(frozen=True)
class RolloutBatch:
    """The rollouts one node produced in one round under one policy version and model fingerprint."""

    round: int
    policy_version: int
    fingerprint: str
    rollouts: tuple[Rollout, ...]

    __hash__ = None  # type: ignore[assignment]


def _array_bytes(values: np.ndarray, dtype: np.dtype, what: str) -> bytes:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if dtype.kind == "u" and arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or int(arr.max()) > np.iinfo(dtype).max):
        raise ValueError(f"{what} must be integers in [0, 2**32), got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _rollout_to_wire(r: Rollout) -> dict[str, object]:
    if len(r.completion_ids) != len(r.behaviour_logprobs):
        raise ValueError(
            f"rollout {r.prompt_id!r}/{r.sample_index}: {len(r.completion_ids)} completion tokens but "
            f"{len(r.behaviour_logprobs)} behaviour log-probs; they must be one per token"
        )
    return {
        "prompt_id": r.prompt_id,
        "sample_index": int(r.sample_index),
        "seed": int(r.seed),
        "prompt_ids": _array_bytes(r.prompt_ids, _TOKEN_DTYPE, "prompt_ids"),
        "completion_ids": _array_bytes(r.completion_ids, _TOKEN_DTYPE, "completion_ids"),
        "behaviour_logprobs": _array_bytes(r.behaviour_logprobs, _LOGPROB_DTYPE, "behaviour_logprobs"),
        "reward": float(r.reward),
        "finish_reason": r.finish_reason,
    }


def encode_rollout(rollout: Rollout) -> bytes:
    """Encode one rollout (for the local journal); raises ValueError on arrays that cannot be encoded."""
    return pack(_rollout_to_wire(rollout))


def encode_batch(batch: RolloutBatch) -> bytes:
    """Encode a batch as an envelope body; raises ValueError on arrays that cannot be encoded."""
    return pack(
        {
            "round": int(batch.round),
            "policy_version": int(batch.policy_version),
            "fingerprint": batch.fingerprint,
            "rollouts": [_rollout_to_wire(r) for r in batch.rollouts],
        }
    )




def _int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Reject(Reason.BAD_TYPE, f"{what} must be int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise Reject(Reason.BAD_VALUE, f"{what} = {value} outside [{lo}, {hi}]")
    return value


def _str(value: object, what: str, limits: Limits) -> str:
    if not isinstance(value, str):
        raise Reject(Reason.BAD_TYPE, f"{what} must be str, got {type(value).__name__}")
    if not 0 < len(value) <= limits.max_str_len:
        raise Reject(Reason.BAD_LENGTH, f"{what} has length {len(value)}, allowed 1..{limits.max_str_len}")
    if not value.isprintable():
        raise Reject(Reason.BAD_VALUE, f"{what} {value!r} contains control characters")
    return value


def _packed(value: object, what: str, dtype: np.dtype, max_len: int) -> np.ndarray:
    if not isinstance(value, bytes):
        raise Reject(Reason.BAD_TYPE, f"{what} must be bin, got {type(value).__name__}")
    if len(value) % dtype.itemsize:
        raise Reject(Reason.BAD_LENGTH, f"{what} is {len(value)} bytes, not a multiple of {dtype.itemsize}")
    n = len(value) // dtype.itemsize
    if n > max_len:
        raise Reject(Reason.TOO_LARGE, f"{what} has {n} elements > limit {max_len}")
    return np.frombuffer(value, dtype=dtype)  # read-only view of the message bytes


def _rollout_from_wire(obj: object, limits: Limits, vocab_size: int | None, where: str) -> Rollout:
    m = check_keys(obj, _ROLLOUT_KEYS, where)
    prompt_id = _str(m["prompt_id"], f"{where}.prompt_id", limits)
    sample_index = _int(m["sample_index"], f"{where}.sample_index", 0, limits.max_sample_index)
    seed = _int(m["seed"], f"{where}.seed", 0, limits.max_uint64)
    prompt = _packed(m["prompt_ids"], f"{where}.prompt_ids", _TOKEN_DTYPE, limits.max_prompt_tokens)
    completion = _packed(m["completion_ids"], f"{where}.completion_ids", _TOKEN_DTYPE, limits.max_completion_tokens)
    logprobs = _packed(m["behaviour_logprobs"], f"{where}.behaviour_logprobs", _LOGPROB_DTYPE, limits.max_completion_tokens)
    if prompt.size == 0:
        raise Reject(Reason.BAD_LENGTH, f"{where}.prompt_ids is empty")
    if logprobs.size != completion.size:
        raise Reject(
            Reason.BAD_LENGTH,
            f"{where}: {completion.size} completion tokens but {logprobs.size} behaviour log-probs",
        )
    if vocab_size is not None:
        for name, ids in (("prompt_ids", prompt), ("completion_ids", completion)):
            if ids.size and int(ids.max()) >= vocab_size:
                raise Reject(Reason.OUT_OF_RANGE, f"{where}.{name} has token id {int(ids.max())} >= vocab size {vocab_size}")
    if logprobs.size:
        if not np.isfinite(logprobs).all():
            raise Reject(Reason.NOT_FINITE, f"{where}.behaviour_logprobs contains NaN or infinity")
        if (logprobs > 0).any():
            raise Reject(
                Reason.BAD_VALUE, f"{where}.behaviour_logprobs has a positive log-prob {float(logprobs.max())!r}"
            )
    reward = m["reward"]
    if not isinstance(reward, float):
        raise Reject(Reason.BAD_TYPE, f"{where}.reward must be float, got {type(reward).__name__}")
    if not math.isfinite(reward):
        raise Reject(Reason.NOT_FINITE, f"{where}.reward = {reward!r}")
    finish = m["finish_reason"]
    if not isinstance(finish, str):
        raise Reject(Reason.BAD_TYPE, f"{where}.finish_reason must be str, got {type(finish).__name__}")
    if finish not in FINISH_REASONS:
        raise Reject(Reason.BAD_VALUE, f"{where}.finish_reason {finish[:32]!r} not in {sorted(FINISH_REASONS)}")
    return Rollout(prompt_id, sample_index, seed, prompt, completion, logprobs, reward, finish)


def _fingerprint(value: object, limits: Limits) -> str:
    if not isinstance(value, str):
        raise Reject(Reason.BAD_TYPE, f"fingerprint must be str, got {type(value).__name__}")
    if not 0 < len(value) <= limits.max_fingerprint_len:
        raise Reject(Reason.BAD_LENGTH, f"fingerprint has length {len(value)}, allowed 1..{limits.max_fingerprint_len}")
    if not _HEX.issuperset(value):
        raise Reject(Reason.BAD_VALUE, f"fingerprint {value!r} is not lowercase hex")
    return value


def decode_batch(
    body: bytes, *, limits: Limits = DEFAULT_LIMITS, vocab_size: int | None = None
) -> tuple[Verdict, RolloutBatch | None]:
    """Decode and validate a rollout batch body from a peer; never raises.

    Pass `vocab_size` to reject token ids the local model cannot embed. Semantic checks that
    need local state (fingerprint match, staleness, reward recompute, dedupe) are the intake's.
    """
    # The batch map, its rollouts list, and per rollout its list entry, its map and the map's entries: anything
    # beyond is refused while decoding (a stranger signs its own body, so its bytes are as hostile as any).
    max_items = 2 + len(_BATCH_KEYS) + limits.max_rollouts_per_batch * (2 + len(_ROLLOUT_KEYS))
    verdict, obj = safe_unpack(body, max_size=limits.max_envelope_bytes, max_depth=limits.max_depth, max_items=max_items)
    if not verdict.ok:
        return verdict, None
    try:
        m = check_keys(obj, _BATCH_KEYS, "batch")
        round_ = _int(m["round"], "round", 0, limits.max_uint64)
        policy_version = _int(m["policy_version"], "policy_version", 0, limits.max_uint64)
        fingerprint = _fingerprint(m["fingerprint"], limits)
        items = m["rollouts"]
        if not isinstance(items, list):
            raise Reject(Reason.BAD_TYPE, f"rollouts must be an array, got {type(items).__name__}")
        if len(items) > limits.max_rollouts_per_batch:
            raise Reject(Reason.TOO_LARGE, f"{len(items)} rollouts > limit {limits.max_rollouts_per_batch}")
        rollouts = tuple(_rollout_from_wire(item, limits, vocab_size, f"rollouts[{i}]") for i, item in enumerate(items))
    except Reject as rejected:
        return rejected.verdict, None
    return Verdict.accept(), RolloutBatch(round_, policy_version, fingerprint, rollouts)


def decode_rollout(
    data: bytes, *, limits: Limits = DEFAULT_LIMITS, vocab_size: int | None = None
) -> tuple[Verdict, Rollout | None]:
    """Decode and validate one rollout written by `encode_rollout`; never raises."""
    verdict, obj = safe_unpack(data, max_size=limits.max_envelope_bytes, max_depth=limits.max_depth)
    if not verdict.ok:
        return verdict, None
    try:
        return Verdict.accept(), _rollout_from_wire(obj, limits, vocab_size, "rollout")
    except Reject as rejected:
        return rejected.verdict, None


def rollout_content_hash(rollout: Rollout) -> bytes:
    """sha256 identifying a rollout's content, for dedupe.

    Covers prompt_id, sample_index, seed, prompt token ids and completion token ids (not the
    log-probs or the claimed reward, so a resent copy with altered numbers is still a duplicate).
    """
    prompt_id = rollout.prompt_id.encode("utf-8")
    prompt = np.ascontiguousarray(rollout.prompt_ids, dtype=_TOKEN_DTYPE).tobytes()
    completion = np.ascontiguousarray(rollout.completion_ids, dtype=_TOKEN_DTYPE).tobytes()
    h = hashlib.sha256(_HASH_TAG)
    # Length prefixes make the concatenation unambiguous.
    h.update(struct.pack("<I", len(prompt_id)))
    h.update(prompt_id)
    h.update(struct.pack("<QQ", rollout.sample_index, rollout.seed))
    h.update(struct.pack("<I", len(prompt)))
    h.update(prompt)
    h.update(struct.pack("<I", len(completion)))
    h.update(completion)
    return h.digest()
