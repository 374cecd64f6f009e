"""Outcome of validating untrusted input: decoders return a `Verdict` instead of raising."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    """Why a message was accepted or rejected; stable strings, safe to use as metric labels."""

    OK = "ok"
    TOO_LARGE = "too_large"  # byte size, decompressed size or an element count over a limit
    MALFORMED = "malformed"  # not decodable: truncated, trailing bytes, invalid msgpack or zlib
    TOO_DEEP = "too_deep"  # nesting beyond Limits.max_depth
    BAD_TYPE = "bad_type"  # a field or value has the wrong Python/msgpack type
    BAD_KEYS = "bad_keys"  # a map is missing required keys or carries unknown ones
    BAD_LENGTH = "bad_length"  # a length is wrong: key size, array size, mismatched counts
    NOT_FINITE = "not_finite"  # NaN or infinity where a finite number is required
    BAD_VALUE = "bad_value"  # a well-typed value outside its allowed set or range
    OUT_OF_RANGE = "out_of_range"  # token id >= vocab size, delta index >= tensor size
    BAD_VERSION = "bad_version"  # a wire format version we do not speak
    UNKNOWN_KIND = "unknown_kind"  # envelope kind not in `Kind`
    WRONG_KIND = "wrong_kind"  # a valid kind, but not the one the caller expected
    BAD_SIGNATURE = "bad_signature"  # Ed25519 signature does not verify for the claimed author
    CLOCK_SKEW = "clock_skew"  # timestamp too far from our clock
    UNKNOWN_TENSOR = "unknown_tensor"  # delta names a tensor the model does not have
    BAD_SHAPE = "bad_shape"  # delta tensor shape differs from the model's
    BAD_DTYPE = "bad_dtype"  # delta tensor dtype differs from the model's or is unsupported
    UNSORTED = "unsorted"  # delta indices not strictly increasing (unsorted or duplicate)
    BASE_MISMATCH = "base_mismatch"  # delta applies to weights other than ours (base hash or version)
    RESULT_MISMATCH = "result_mismatch"  # weights after applying a delta do not hash to its result hash


@dataclass(frozen=True)
class Verdict:
    """Result of a validation step; `detail` says what was wrong, with the offending value."""

    reason: Reason
    detail: str = ""

    @property
    def ok(self) -> bool:
        """True when the input was accepted."""
        return self.reason is Reason.OK

    @classmethod
    def accept(cls) -> Verdict:
        """The accepting verdict."""
        return _ACCEPT

    @classmethod
    def reject(cls, reason: Reason, detail: str = "") -> Verdict:
        """A rejecting verdict; `reason` must not be `Reason.OK`."""
        if reason is Reason.OK:
            raise ValueError("Verdict.reject needs a failure reason, got Reason.OK; use Verdict.accept()")
        return cls(reason, detail)

    def __str__(self) -> str:
        return self.reason.value if not self.detail else f"{self.reason.value}: {self.detail}"


_ACCEPT = Verdict(Reason.OK)
