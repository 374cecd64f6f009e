"""Sparse indexed weight delta, wire format v1: which elements of which tensors changed, and their new bits.

A delta moves a model from `base_version` to `version`. Per tensor it carries the flat
(row-major) indices of changed elements, strictly increasing, and the new values as raw bit
patterns (uint16 for bfloat16/float16, uint32 for float32), so applying it is bit-exact.

Wire form: an outer msgpack map ``{"format": 1, "compression": "zlib" | "none", "payload": bin}``;
the payload (zlib level 1 when compressed) is a msgpack map

    {"base_version": int, "version": int, "tensors": [
        {"name": str, "shape": [int, ...], "dtype": str, "index_coding": "gap_u32" | "i64",
         "indices": bin, "values": bin (little-endian bit patterns)}, ...]}

"gap_u32": uint32 LE, the first index then the difference to the previous one (smaller and
compresses well); "i64": int64 LE absolute indices, used when a gap does not fit in 32 bits.
`decode_delta` validates everything against the local model before returning, so a caller
can scatter the result without further checks.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .codec import Reject, check_keys, pack, safe_unpack
from .limits import DEFAULT_LIMITS, Limits
from .verdict import Reason, Verdict

DELTA_FORMAT_VERSION = 1
# Wire dtype name -> dtype of the bit patterns carried for it.
VALUE_DTYPES: Mapping[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float16": np.dtype("<u2"),
    "float32": np.dtype("<u4"),
}
_OUTER_KEYS = frozenset({"format", "compression", "payload"})
_INNER_KEYS = frozenset({"base_version", "version", "tensors"})
_TENSOR_KEYS = frozenset({"name", "shape", "dtype", "index_coding", "indices", "values"})
_GAP = np.dtype("<u4")
_I64 = np.dtype("<i8")
_ZLIB_LEVEL = 1  # deltas are produced every step; speed matters more than the last few percent

ExpectedTensors = Mapping[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True, eq=False)
class TensorDelta:
    """Changed elements of one tensor: flat int64 `indices` (strictly increasing) and their new bit patterns."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "bfloat16" | "float16" | "float32"
    indices: np.ndarray  # int64
    values: np.ndarray  # uint16 (bf16/fp16) or uint32 (fp32) bit patterns

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorDelta):
            return NotImplemented
        return (
            (self.name, tuple(self.shape), self.dtype) == (other.name, tuple(other.shape), other.dtype)
            and np.array_equal(self.indices, other.indices)
            and np.array_equal(self.values, other.values)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class WeightDelta:
    """The changes from weights `base_version` to `version`, one entry per changed tensor."""

    base_version: int
    version: int
    tensors: tuple[TensorDelta, ...]

    __hash__ = None  # type: ignore[assignment]

    @property
    def num_changed(self) -> int:
        """Total number of changed elements."""
        return sum(int(t.indices.size) for t in self.tensors)


def dense_nbytes(delta_or_expected: WeightDelta | ExpectedTensors) -> int:
    """Bytes the covered tensors take dense (to log a delta's size against), from a delta or an expected map."""
    if isinstance(delta_or_expected, WeightDelta):
        items = [(t.shape, t.dtype) for t in delta_or_expected.tensors]
    else:
        items = list(delta_or_expected.values())
    return sum(math.prod(shape) * VALUE_DTYPES[dtype].itemsize for shape, dtype in items)


def _tensor_to_wire(t: TensorDelta) -> dict[str, object]:
    if t.dtype not in VALUE_DTYPES:
        raise ValueError(f"tensor {t.name!r}: dtype {t.dtype!r} not in {sorted(VALUE_DTYPES)}")
    value_dtype = VALUE_DTYPES[t.dtype]
    indices = np.asarray(t.indices)
    values = np.asarray(t.values)
    if indices.ndim != 1 or values.ndim != 1 or indices.size != values.size:
        raise ValueError(
            f"tensor {t.name!r}: indices {indices.shape} and values {values.shape} must be 1-D and the same length"
        )
    if indices.size and indices.dtype.kind not in "iu":
        raise ValueError(f"tensor {t.name!r}: indices must be integers, got {indices.dtype}")
    if values.size and (values.dtype.kind not in "iu" or values.dtype.itemsize != value_dtype.itemsize):
        raise ValueError(
            f"tensor {t.name!r}: values must be {value_dtype.itemsize * 8}-bit bit patterns for {t.dtype}, "
            f"got {values.dtype}; pass tensor.view(torch.int16/int32).numpy() or similar"
        )
    indices = indices.astype(_I64, copy=False)
    gaps = np.diff(indices, prepend=np.int64(0))
    if indices.size and (indices[0] < 0 or (gaps[1:] <= 0).any()):
        raise ValueError(f"tensor {t.name!r}: indices must be non-negative and strictly increasing")
    if indices.size == 0 or int(gaps.max()) <= np.iinfo(_GAP).max:
        coding, index_bytes = "gap_u32", gaps.astype(_GAP).tobytes()
    else:
        coding, index_bytes = "i64", indices.tobytes()
    return {
        "name": t.name,
        "shape": [int(d) for d in t.shape],
        "dtype": t.dtype,
        "index_coding": coding,
        "indices": index_bytes,
        # Same-size integer cast keeps the bits (int16 -> uint16 wraps, which is the pattern).
        "values": values.astype(value_dtype, copy=False).tobytes(),
    }


def encode_delta(delta: WeightDelta, *, compress: bool = True) -> bytes:
    """Encode a delta (zlib level 1 unless `compress=False`); raises ValueError on malformed local data."""
    payload = pack(
        {
            "base_version": int(delta.base_version),
            "version": int(delta.version),
            "tensors": [_tensor_to_wire(t) for t in delta.tensors],
        }
    )
    if compress:
        return pack({"format": DELTA_FORMAT_VERSION, "compression": "zlib", "payload": zlib.compress(payload, _ZLIB_LEVEL)})
    return pack({"format": DELTA_FORMAT_VERSION, "compression": "none", "payload": payload})




def _int(value: object, what: str, limits: Limits) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Reject(Reason.BAD_TYPE, f"{what} must be int, got {type(value).__name__}")
    if not 0 <= value <= limits.max_uint64:
        raise Reject(Reason.BAD_VALUE, f"{what} = {value} is negative or too large")
    return value


def _decompress(compression: object, payload: object, limits: Limits) -> bytes:
    if not isinstance(compression, str):
        raise Reject(Reason.BAD_TYPE, f"compression must be str, got {type(compression).__name__}")
    if not isinstance(payload, bytes):
        raise Reject(Reason.BAD_TYPE, f"payload must be bin, got {type(payload).__name__}")
    if compression == "none":
        if len(payload) > limits.max_delta_raw_bytes:
            raise Reject(Reason.TOO_LARGE, f"payload {len(payload)} bytes > limit {limits.max_delta_raw_bytes}")
        return payload
    if compression != "zlib":
        raise Reject(Reason.BAD_VALUE, f"compression {compression[:32]!r} is not 'zlib' or 'none'")
    try:
        inflater = zlib.decompressobj()
        # Bounded output: a small zip bomb cannot expand past the raw limit.
        raw = inflater.decompress(payload, limits.max_delta_raw_bytes + 1)
    except zlib.error as exc:
        raise Reject(Reason.MALFORMED, f"zlib payload does not inflate: {exc}") from None
    if len(raw) > limits.max_delta_raw_bytes:
        raise Reject(Reason.TOO_LARGE, f"payload inflates past the limit of {limits.max_delta_raw_bytes} bytes")
    if not inflater.eof:
        raise Reject(Reason.MALFORMED, "zlib payload is truncated")
    if inflater.unused_data:
        raise Reject(Reason.MALFORMED, f"{len(inflater.unused_data)} trailing bytes after the zlib stream")
    return raw


def _packed(value: object, what: str, dtype: np.dtype) -> np.ndarray:
    if not isinstance(value, bytes):
        raise Reject(Reason.BAD_TYPE, f"{what} must be bin, got {type(value).__name__}")
    if len(value) % dtype.itemsize:
        raise Reject(Reason.BAD_LENGTH, f"{what} is {len(value)} bytes, not a multiple of {dtype.itemsize}")
    return np.frombuffer(value, dtype=dtype)


def _tensor_from_wire(obj: object, expected: ExpectedTensors, limits: Limits, where: str) -> TensorDelta:
    m = check_keys(obj, _TENSOR_KEYS, where)
    name = m["name"]
    if not isinstance(name, str):
        raise Reject(Reason.BAD_TYPE, f"{where}.name must be str, got {type(name).__name__}")
    if not 0 < len(name) <= limits.max_str_len:
        raise Reject(Reason.BAD_LENGTH, f"{where}.name has length {len(name)}, allowed 1..{limits.max_str_len}")
    if name not in expected:
        raise Reject(Reason.UNKNOWN_TENSOR, f"{where}: tensor {name!r} is not in the local model")
    where = f"tensor {name!r}"
    want_shape, want_dtype = expected[name]
    shape = m["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise Reject(Reason.BAD_TYPE, f"{where}: shape must be an array of ints")
    if len(shape) > limits.max_tensor_rank:
        raise Reject(Reason.BAD_SHAPE, f"{where}: rank {len(shape)} > limit {limits.max_tensor_rank}")
    if tuple(shape) != tuple(want_shape):
        raise Reject(Reason.BAD_SHAPE, f"{where}: shape {tuple(shape)}, local model has {tuple(want_shape)}")
    dtype = m["dtype"]
    if not isinstance(dtype, str):
        raise Reject(Reason.BAD_TYPE, f"{where}: dtype must be str, got {type(dtype).__name__}")
    if dtype not in VALUE_DTYPES or dtype != want_dtype:
        raise Reject(Reason.BAD_DTYPE, f"{where}: dtype {dtype[:32]!r}, local model has {want_dtype!r}")
    coding = m["index_coding"]
    if coding == "gap_u32":
        gaps = _packed(m["indices"], f"{where}.indices", _GAP)
        # Any index after the first must move forward: a zero gap is a duplicate.
        if gaps.size > 1 and not gaps[1:].all():
            raise Reject(Reason.UNSORTED, f"{where}: duplicate index (zero gap)")
        indices = np.cumsum(gaps, dtype=_I64)  # sums of < 2**28 uint32 gaps: no int64 overflow
    elif coding == "i64":
        indices = _packed(m["indices"], f"{where}.indices", _I64)
        if indices.size and indices[0] < 0:
            raise Reject(Reason.OUT_OF_RANGE, f"{where}: negative index {int(indices[0])}")
        if indices.size > 1 and not (np.diff(indices) > 0).all():
            raise Reject(Reason.UNSORTED, f"{where}: indices are not strictly increasing")
    elif isinstance(coding, str):
        raise Reject(Reason.BAD_VALUE, f"{where}: index_coding {coding[:32]!r} is not 'gap_u32' or 'i64'")
    else:
        raise Reject(Reason.BAD_TYPE, f"{where}: index_coding must be str, got {type(coding).__name__}")
    numel = math.prod(want_shape)
    if indices.size and int(indices[-1]) >= numel:
        raise Reject(Reason.OUT_OF_RANGE, f"{where}: index {int(indices[-1])} >= {numel} elements")
    values = _packed(m["values"], f"{where}.values", VALUE_DTYPES[dtype])
    if values.size != indices.size:
        raise Reject(Reason.BAD_LENGTH, f"{where}: {indices.size} indices but {values.size} values")
    if not _all_finite(values, dtype):
        raise Reject(Reason.NOT_FINITE, f"{where}: values contain NaN or infinity")
    # Owned, writable copies: torch.from_numpy warns on read-only views of message bytes.
    return TensorDelta(name, tuple(shape), dtype, np.array(indices, dtype=_I64), values.copy())


def _all_finite(bits: np.ndarray, dtype: str) -> bool:
    # A float is NaN or infinite exactly when all its exponent bits are set.
    exponent_mask = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000}[dtype]
    return not ((bits & exponent_mask) == exponent_mask).any()


def decode_delta(
    data: bytes, *, expected: ExpectedTensors, limits: Limits = DEFAULT_LIMITS
) -> tuple[Verdict, WeightDelta | None]:
    """Decode a delta and validate it against the local model; never raises.

    `expected` maps each tensor name to its (shape, dtype) in the local model. A delta may
    cover any subset of it. Rejects unknown tensors, wrong shape or dtype, out-of-range,
    unsorted or duplicate indices, count mismatches and non-finite values; an accepted delta
    can be scattered as is; its arrays are writable copies (int64 indices, uint16/uint32 bits).
    Whether `base_version` matches the local weights is the caller's check.
    """
    verdict, outer = safe_unpack(data, max_size=limits.max_delta_bytes, max_depth=limits.max_depth)
    if not verdict.ok:
        return verdict, None
    try:
        outer = check_keys(outer, _OUTER_KEYS, "delta")
        fmt = outer["format"]
        if isinstance(fmt, bool) or not isinstance(fmt, int):
            raise Reject(Reason.BAD_TYPE, f"format must be int, got {type(fmt).__name__}")
        if fmt != DELTA_FORMAT_VERSION:
            raise Reject(Reason.BAD_VERSION, f"delta format {fmt}, this node reads {DELTA_FORMAT_VERSION}; upgrade hivespec")
        raw = _decompress(outer["compression"], outer["payload"], limits)
        verdict, inner = safe_unpack(raw, max_size=limits.max_delta_raw_bytes, max_depth=limits.max_depth)
        if not verdict.ok:
            return verdict, None
        inner = check_keys(inner, _INNER_KEYS, "delta payload")
        base_version = _int(inner["base_version"], "base_version", limits)
        version = _int(inner["version"], "version", limits)
        if version <= base_version:
            raise Reject(Reason.BAD_VALUE, f"version {version} does not follow base_version {base_version}")
        items = inner["tensors"]
        if not isinstance(items, list):
            raise Reject(Reason.BAD_TYPE, f"tensors must be an array, got {type(items).__name__}")
        if len(items) > limits.max_delta_tensors:
            raise Reject(Reason.TOO_LARGE, f"{len(items)} tensors > limit {limits.max_delta_tensors}")
        tensors = tuple(_tensor_from_wire(t, expected, limits, f"tensors[{i}]") for i, t in enumerate(items))
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise Reject(Reason.BAD_VALUE, f"tensor {duplicate!r} appears more than once")
    except Reject as rejected:
        return rejected.verdict, None
    return Verdict.accept(), WeightDelta(base_version, version, tensors)
