"""Sparse indexed weight delta, wire format v2: near the entropy bound, chunked, hash-bound to its base.

A delta moves a model from `base_version` (whose weights hash to `base_hash`) to `version`
(hashing to `result_hash`). Per tensor it lists the flat (row-major) positions that changed and
their new bit patterns (uint16 for bfloat16/float16, uint32 for float32), so applying it is
bit-exact. Values are coded relative to the base (see `delta_codes`), so a delta only decodes
against the exact weights it was made from: the base hash is checked first, and `state_hash`
of the result must equal `result_hash` after applying.

Wire form: a list of chunks, each a msgpack map that is one gossip body (under the 4 MiB
message cap) and decodes on its own given the base:

    {"format": 2, "base_version": int, "version": int, "base_hash": bin32, "result_hash": bin32,
     "chunk": int, "chunks": int, "tables": [bin, bin, bin], "symbols": bin,
     "pieces": [{"name": str, "shape": [int], "dtype": str, "start": int, "stop": int,
                 "count": int, "positions": "gaps" | "complement" | "bitmap", "rice": int,
                 "low": bin, "escapes": bin, "values": "ulp" | "raw", "value_bits": bin}, ...]}

A piece covers the flat range [start, stop) of one tensor (large tensors are split over
chunks). "tables" are the rANS frequency tables (gap quotients, 16-bit values, 32-bit values);
"symbols" is one interleaved rANS stream holding, piece after piece, the piece's gap quotients
then its value symbols. Decoding validates everything before returning, and a whole delta is
accepted only if every chunk is, the chunks agree on their header, and no two pieces overlap.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import delta_codes as dc
from .codec import Reject, check_keys, pack, safe_unpack
from .entropy import CodingError, FrequencyTable, rans_decode, rans_encode
from .limits import DEFAULT_LIMITS, Limits
from .verdict import Reason, Verdict

DELTA_FORMAT_VERSION = 2
HASH_BYTES = 32
# Wire dtype name -> dtype of the bit patterns carried for it.
VALUE_DTYPES: Mapping[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float16": np.dtype("<u2"),
    "float32": np.dtype("<u4"),
}
_EXPONENT_MASK = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000}
_CHUNK_KEYS = frozenset(
    {"format", "base_version", "version", "base_hash", "result_hash", "chunk", "chunks", "tables", "symbols", "pieces"}
)
_PIECE_KEYS = frozenset(
    {"name", "shape", "dtype", "start", "stop", "count", "positions", "rice", "low", "escapes", "values", "value_bits"}
)
# Room a chunk needs beyond its pieces' estimated payload: frequency tables and header, plus a
# margin for rANS lane states (32 bits per 1024 symbols) and the rANS cost above entropy.
_CHUNK_OVERHEAD = 2048
_BUDGET_FRACTION = 0.97
_PIECE_OVERHEAD = 96


@dataclass(frozen=True)
class TensorBits:
    """A local tensor as the codec sees it: its float dtype name and its bit patterns in its shape."""

    dtype: str  # "bfloat16" | "float16" | "float32"
    bits: np.ndarray  # uint16 (bf16/fp16) or uint32 (fp32), C-contiguous

    @property
    def width(self) -> int:
        return VALUE_DTYPES[self.dtype].itemsize * 8


State = Mapping[str, TensorBits]


def state_hash(state: State) -> bytes:
    """sha256 over every tensor's name, dtype, shape and bit patterns, in name order (~1.5 GB/s)."""
    hasher = hashlib.sha256(b"hivespec/weights/v1\0")
    for name in sorted(state):
        tensor = state[name]
        header = f"{name}\0{tensor.dtype}\0{','.join(map(str, tensor.bits.shape))}\0".encode()
        hasher.update(len(header).to_bytes(4, "little") + header)
        hasher.update(memoryview(np.ascontiguousarray(tensor.bits)).cast("B"))
    return hasher.digest()


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
    base_hash: bytes
    result_hash: bytes
    tensors: tuple[TensorDelta, ...]

    __hash__ = None  # type: ignore[assignment]

    @property
    def num_changed(self) -> int:
        """Total number of changed elements."""
        return sum(int(t.indices.size) for t in self.tensors)


@dataclass(frozen=True)
class DeltaHeader:
    """What every chunk of one delta repeats: which delta it is and where it sits."""

    base_version: int
    version: int
    base_hash: bytes
    result_hash: bytes
    chunk: int
    chunks: int

    def same_delta(self, other: DeltaHeader) -> bool:
        return (self.base_version, self.version, self.base_hash, self.result_hash, self.chunks) == (
            other.base_version, other.version, other.base_hash, other.result_hash, other.chunks
        )


@dataclass(frozen=True)
class DeltaChunk:
    """One decoded, validated chunk: its header and its pieces as (tensor, start, stop, indices, values)."""

    header: DeltaHeader
    pieces: tuple[tuple[TensorDelta, int, int], ...] = field(repr=False)


def dense_nbytes(state: State | WeightDelta) -> int:
    """Bytes the tensors take dense, from a state or from the tensors a delta names."""
    if isinstance(state, WeightDelta):
        return sum(math.prod(t.shape) * VALUE_DTYPES[t.dtype].itemsize for t in state.tensors)
    return sum(t.bits.nbytes for t in state.values())


# ----- encoding ---------------------------------------------------------------------------------


@dataclass
class _Piece:
    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    stop: int
    count: int
    positions: dc.PositionCode
    value_mode: str
    values: dc.ValueCode | None
    raw: bytes
    estimated_bytes: int
    elements: int  # decode work: positions for "gaps", the range length otherwise


def _plan_piece(t: TensorDelta, width: int, start: int, stop: int, codes: np.ndarray, values: np.ndarray) -> _Piece:
    lo, hi = np.searchsorted(t.indices, [start, stop])
    local = t.indices[lo:hi] - start
    positions = dc.code_positions(local, stop - start)
    value_code = dc.code_values(codes[lo:hi], width)
    ulp_bits, raw_bits = dc.values_size_bits(value_code, width)
    if raw_bits < ulp_bits:
        value_mode, value_code, raw, value_bits = "raw", None, values[lo:hi].astype(VALUE_DTYPES[t.dtype]).tobytes(), raw_bits
    else:
        value_mode, raw, value_bits = "ulp", b"", ulp_bits
    count = int(hi - lo)
    elements = count if positions.mode == "gaps" else stop - start
    estimated = int((positions.estimated_bits + value_bits) / 8) + _PIECE_OVERHEAD + len(t.name)
    return _Piece(t.name, tuple(t.shape), t.dtype, start, stop, count, positions, value_mode, value_code, raw, estimated, elements)


def _check_local(t: TensorDelta, base: State) -> tuple[np.ndarray, np.ndarray, int]:
    if t.dtype not in VALUE_DTYPES:
        raise ValueError(f"tensor {t.name!r}: dtype {t.dtype!r} not in {sorted(VALUE_DTYPES)}")
    if t.name not in base:
        raise ValueError(f"tensor {t.name!r} is not in the base state; a delta can only name base tensors")
    local = base[t.name]
    if local.dtype != t.dtype or tuple(local.bits.shape) != tuple(t.shape):
        raise ValueError(
            f"tensor {t.name!r}: delta says {t.dtype} {tuple(t.shape)}, base has {local.dtype} {tuple(local.bits.shape)}"
        )
    width = VALUE_DTYPES[t.dtype].itemsize * 8
    indices, values = np.asarray(t.indices), np.asarray(t.values)
    if indices.ndim != 1 or values.ndim != 1 or indices.size != values.size:
        raise ValueError(f"tensor {t.name!r}: indices {indices.shape} and values {values.shape} must be 1-D and the same length")
    if indices.size and indices.dtype.kind not in "iu":
        raise ValueError(f"tensor {t.name!r}: indices must be integers, got {indices.dtype}")
    if values.size and (values.dtype.kind not in "iu" or values.dtype.itemsize * 8 != width):
        raise ValueError(
            f"tensor {t.name!r}: values must be {width}-bit bit patterns for {t.dtype}, got {values.dtype}; "
            "pass tensor.view(torch.int16/int32).numpy() or similar"
        )
    indices = indices.astype(np.int64, copy=False)
    numel = math.prod(t.shape)
    if indices.size and (indices[0] < 0 or indices[-1] >= numel or (np.diff(indices) <= 0).any()):
        raise ValueError(f"tensor {t.name!r}: indices must be strictly increasing inside [0, {numel})")
    values = values.astype(VALUE_DTYPES[t.dtype], copy=False)
    codes = dc.ulp_codes(values, local.bits.reshape(-1)[indices], width)
    return codes, values, width


def _split(t: TensorDelta, width: int, codes: np.ndarray, values: np.ndarray, start: int, stop: int, budget: int, limits: Limits) -> list[_Piece]:
    piece = _plan_piece(t, width, start, stop, codes, values)
    if piece.count == 0:
        return []
    if (piece.estimated_bytes <= budget and piece.elements <= limits.max_delta_chunk_elements) or stop - start <= 1:
        return [piece]
    middle = (start + stop) // 2
    return _split(t, width, codes, values, start, middle, budget, limits) + _split(t, width, codes, values, middle, stop, budget, limits)


def _encode_chunk(header: dict, pieces: list[_Piece]) -> bytes:
    symbols, contexts, wire_pieces = [], [], []
    counts = [np.zeros(a, np.int64) for a in dc.TABLE_ALPHABETS]
    for p in pieces:
        if p.positions.symbols.size:
            symbols.append(p.positions.symbols)
            contexts.append(np.full(p.positions.symbols.size, dc.QUOTIENT_TABLE, np.int64))
            counts[dc.QUOTIENT_TABLE] += np.bincount(p.positions.symbols, minlength=dc.Q_ALPHABET)
        if p.values is not None and p.count:
            table = dc.VALUE_TABLE[VALUE_DTYPES[p.dtype].itemsize * 8]
            symbols.append(p.values.symbols)
            contexts.append(np.full(p.count, table, np.int64))
            counts[table] += np.bincount(p.values.symbols, minlength=dc.TABLE_ALPHABETS[table])
        wire_pieces.append(
            {
                "name": p.name,
                "shape": list(p.shape),
                "dtype": p.dtype,
                "start": p.start,
                "stop": p.stop,
                "count": p.count,
                "positions": p.positions.mode,
                "rice": p.positions.rice,
                "low": p.positions.low,
                "escapes": p.positions.escapes,
                "values": p.value_mode,
                "value_bits": p.values.extra if p.values is not None else p.raw,
            }
        )
    tables = [FrequencyTable.from_counts(c) for c in counts]
    stream = b""
    if symbols:
        stream = rans_encode(np.concatenate(symbols), np.concatenate(contexts), tables)
    return pack({**header, "tables": [t.to_bytes() for t in tables], "symbols": stream, "pieces": wire_pieces})


def encode_delta(delta: WeightDelta, base: State, *, limits: Limits = DEFAULT_LIMITS) -> list[bytes]:
    """Encode a delta against the `base` state it applies to, as chunks of at most `limits.max_delta_chunk_bytes`.

    Raises ValueError on malformed local data (unknown tensor, unsorted indices, wrong value
    width, a listed value equal to its base, ...). Tensors with no changes are left out.
    """
    for what, digest in (("base_hash", delta.base_hash), ("result_hash", delta.result_hash)):
        if not isinstance(digest, bytes) or len(digest) != HASH_BYTES:
            raise ValueError(f"{what} must be {HASH_BYTES} bytes (state_hash), got {digest!r:.80}")
    if not 0 <= delta.base_version < delta.version:
        raise ValueError(f"version {delta.version} must follow base_version {delta.base_version} >= 0")
    names = [t.name for t in delta.tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names repeat in the delta: {sorted(n for n in set(names) if names.count(n) > 1)[:5]}")
    checked = [(t, *_check_local(t, base)) for t in delta.tensors]
    header = {
        "format": DELTA_FORMAT_VERSION,
        "base_version": int(delta.base_version),
        "version": int(delta.version),
        "base_hash": delta.base_hash,
        "result_hash": delta.result_hash,
    }
    # Sizes are estimated from empirical entropies; a chunk that still comes out too large
    # (tables, lane states, a skewed split) is redone with a tighter budget.
    budget = int(limits.max_delta_chunk_bytes * _BUDGET_FRACTION) - min(_CHUNK_OVERHEAD, limits.max_delta_chunk_bytes // 4)
    while True:
        pieces: list[_Piece] = []
        for t, codes, values, width in checked:
            if codes.size:
                pieces += _split(t, width, codes, values, 0, math.prod(t.shape), budget, limits)
        groups = _group(pieces, budget, limits)
        if len(groups) > limits.max_delta_chunks:
            raise ValueError(f"delta needs {len(groups)} chunks, over the limit of {limits.max_delta_chunks}")
        chunks = [_encode_chunk({**header, "chunks": len(groups), "chunk": i}, g) for i, g in enumerate(groups)]
        if max(map(len, chunks)) <= limits.max_delta_chunk_bytes:
            return chunks
        budget = int(budget * 0.8)
        if budget < 64:
            raise ValueError(f"cannot fit the delta into chunks of {limits.max_delta_chunk_bytes} bytes")


def _group(pieces: list[_Piece], budget: int, limits: Limits) -> list[list[_Piece]]:
    """Pieces in order, cut into chunks under the byte budget, the element and the piece limits."""
    groups: list[list[_Piece]] = [[]]
    size = elements = 0
    for p in pieces:
        full = groups[-1] and (
            size + p.estimated_bytes > budget
            or elements + p.elements > limits.max_delta_chunk_elements
            or len(groups[-1]) >= limits.max_delta_tensors
        )
        if full:
            groups.append([])
            size = elements = 0
        groups[-1].append(p)
        size += p.estimated_bytes
        elements += p.elements
    return groups


# ----- decoding ---------------------------------------------------------------------------------


def _int(value: object, what: str, limits: Limits) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Reject(Reason.BAD_TYPE, f"{what} must be int, got {type(value).__name__}")
    if not 0 <= value <= limits.max_uint64:
        raise Reject(Reason.BAD_VALUE, f"{what} = {value} is negative or too large")
    return value


def _bin(value: object, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise Reject(Reason.BAD_TYPE, f"{what} must be bin, got {type(value).__name__}")
    return value


def _str(value: object, what: str, allowed: Sequence[str]) -> str:
    if not isinstance(value, str):
        raise Reject(Reason.BAD_TYPE, f"{what} must be str, got {type(value).__name__}")
    if value not in allowed:
        raise Reject(Reason.BAD_VALUE, f"{what} {value[:32]!r} is not one of {list(allowed)}")
    return value


def _header(m: dict, limits: Limits) -> DeltaHeader:
    fmt = m["format"]
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        raise Reject(Reason.BAD_TYPE, f"format must be int, got {type(fmt).__name__}")
    if fmt != DELTA_FORMAT_VERSION:
        raise Reject(Reason.BAD_VERSION, f"delta format {fmt}, this node reads {DELTA_FORMAT_VERSION}; upgrade hivespec")
    base_version = _int(m["base_version"], "base_version", limits)
    version = _int(m["version"], "version", limits)
    if version <= base_version:
        raise Reject(Reason.BAD_VALUE, f"version {version} does not follow base_version {base_version}")
    hashes = []
    for key in ("base_hash", "result_hash"):
        digest = _bin(m[key], key)
        if len(digest) != HASH_BYTES:
            raise Reject(Reason.BAD_LENGTH, f"{key} is {len(digest)} bytes, expected {HASH_BYTES}")
        hashes.append(digest)
    chunks = _int(m["chunks"], "chunks", limits)
    if not 1 <= chunks <= limits.max_delta_chunks:
        raise Reject(Reason.BAD_VALUE, f"chunks = {chunks}, allowed 1..{limits.max_delta_chunks}")
    chunk = _int(m["chunk"], "chunk", limits)
    if chunk >= chunks:
        raise Reject(Reason.BAD_VALUE, f"chunk index {chunk} >= chunks {chunks}")
    return DeltaHeader(base_version, version, hashes[0], hashes[1], chunk, chunks)


def _unpack_chunk(data: bytes, limits: Limits) -> dict:
    verdict, obj = safe_unpack(data, max_size=limits.max_delta_chunk_bytes, max_depth=limits.max_depth)
    if not verdict.ok:
        raise Reject(verdict.reason, verdict.detail)
    return check_keys(obj, _CHUNK_KEYS, "delta chunk")


def read_header(data: bytes, *, limits: Limits = DEFAULT_LIMITS) -> tuple[Verdict, DeltaHeader | None]:
    """The header of one chunk (which delta, which chunk, how many), without decoding its pieces."""
    try:
        return Verdict.accept(), _header(_unpack_chunk(data, limits), limits)
    except Reject as rejected:
        return rejected.verdict, None


@dataclass
class _WirePiece:
    name: str
    local: TensorBits
    start: int
    stop: int
    count: int
    positions: str
    rice: int
    low: bytes
    escapes: bytes
    values: str
    value_bits: bytes

    @property
    def width(self) -> int:
        return self.local.width


def _piece(obj: object, base: State, limits: Limits, where: str) -> _WirePiece:
    m = check_keys(obj, _PIECE_KEYS, where)
    name = m["name"]
    if not isinstance(name, str):
        raise Reject(Reason.BAD_TYPE, f"{where}.name must be str, got {type(name).__name__}")
    if not 0 < len(name) <= limits.max_str_len:
        raise Reject(Reason.BAD_LENGTH, f"{where}.name has length {len(name)}, allowed 1..{limits.max_str_len}")
    if name not in base:
        raise Reject(Reason.UNKNOWN_TENSOR, f"{where}: tensor {name!r} is not in the local model")
    where = f"tensor {name!r}"
    local = base[name]
    shape = m["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise Reject(Reason.BAD_TYPE, f"{where}: shape must be an array of ints")
    if len(shape) > limits.max_tensor_rank:
        raise Reject(Reason.BAD_SHAPE, f"{where}: rank {len(shape)} > limit {limits.max_tensor_rank}")
    if tuple(shape) != tuple(local.bits.shape):
        raise Reject(Reason.BAD_SHAPE, f"{where}: shape {tuple(shape)}, local model has {tuple(local.bits.shape)}")
    dtype = m["dtype"]
    if not isinstance(dtype, str):
        raise Reject(Reason.BAD_TYPE, f"{where}: dtype must be str, got {type(dtype).__name__}")
    if dtype != local.dtype:
        raise Reject(Reason.BAD_DTYPE, f"{where}: dtype {dtype[:32]!r}, local model has {local.dtype!r}")
    numel = local.bits.size
    if numel > limits.max_tensor_elements:
        raise Reject(Reason.TOO_LARGE, f"{where}: {numel} elements > limit {limits.max_tensor_elements}")
    start, stop = _int(m["start"], f"{where}.start", limits), _int(m["stop"], f"{where}.stop", limits)
    if not start < stop <= numel:
        raise Reject(Reason.OUT_OF_RANGE, f"{where}: range [{start}, {stop}) is not inside [0, {numel})")
    count = _int(m["count"], f"{where}.count", limits)
    if count > stop - start:
        raise Reject(Reason.OUT_OF_RANGE, f"{where}: {count} changed elements in a range of {stop - start}")
    return _WirePiece(
        name, local, start, stop, count,
        _str(m["positions"], f"{where}.positions", dc.POSITION_MODES),
        _int(m["rice"], f"{where}.rice", limits),
        _bin(m["low"], f"{where}.low"),
        _bin(m["escapes"], f"{where}.escapes"),
        _str(m["values"], f"{where}.values", dc.VALUE_MODES),
        _bin(m["value_bits"], f"{where}.value_bits"),
    )


def _decode_piece(p: _WirePiece, quotients: np.ndarray, value_symbols: np.ndarray | None) -> TensorDelta:
    where = f"tensor {p.name!r} [{p.start}, {p.stop})"
    try:
        local = dc.decode_positions(p.positions, p.rice, quotients, p.low, p.escapes, p.count, p.stop - p.start)
    except dc.OutOfRange as exc:
        raise Reject(Reason.OUT_OF_RANGE, f"{where}: {exc}") from None
    except CodingError as exc:
        raise Reject(Reason.MALFORMED, f"{where}: positions: {exc}") from None
    indices = local + p.start
    value_dtype = VALUE_DTYPES[p.local.dtype]
    base_values = p.local.bits.reshape(-1)[indices]
    if value_symbols is not None:
        try:
            codes = dc.decode_values(value_symbols, p.value_bits, p.width)
        except CodingError as exc:
            raise Reject(Reason.MALFORMED, f"{where}: values: {exc}") from None
        values = dc.apply_ulp_codes(codes, base_values, p.width).astype(value_dtype)
    else:
        if len(p.value_bits) != p.count * value_dtype.itemsize:
            raise Reject(Reason.BAD_LENGTH, f"{where}: {len(p.value_bits)} bytes of raw values for {p.count} elements")
        values = np.frombuffer(p.value_bits, value_dtype).copy()
        if (values == base_values).any():
            raise Reject(Reason.BAD_VALUE, f"{where}: a listed element keeps its base value")
    mask = _EXPONENT_MASK[p.local.dtype]
    if ((values & mask) == mask).any():
        raise Reject(Reason.NOT_FINITE, f"{where}: new values contain NaN or infinity")
    return TensorDelta(p.name, tuple(p.local.bits.shape), p.local.dtype, indices, values)


def _decode_chunk(data: bytes, base: State, base_hash: bytes, limits: Limits) -> DeltaChunk:
    m = _unpack_chunk(data, limits)
    header = _header(m, limits)
    if header.base_hash != base_hash:
        raise Reject(
            Reason.BASE_MISMATCH,
            f"delta to version {header.version} applies to weights {header.base_hash.hex()[:16]} (version "
            f"{header.base_version}), ours are {base_hash.hex()[:16]}",
        )
    tables_raw = m["tables"]
    if not isinstance(tables_raw, list) or len(tables_raw) != len(dc.TABLE_ALPHABETS):
        raise Reject(Reason.BAD_TYPE, f"tables must be an array of {len(dc.TABLE_ALPHABETS)} bin")
    try:
        tables = [FrequencyTable.from_bytes(_bin(t, f"tables[{i}]"), a) for i, (t, a) in enumerate(zip(tables_raw, dc.TABLE_ALPHABETS))]
    except CodingError as exc:
        raise Reject(Reason.MALFORMED, f"frequency table: {exc}") from None
    items = m["pieces"]
    if not isinstance(items, list):
        raise Reject(Reason.BAD_TYPE, f"pieces must be an array, got {type(items).__name__}")
    if len(items) > limits.max_delta_tensors:
        raise Reject(Reason.TOO_LARGE, f"{len(items)} pieces > limit {limits.max_delta_tensors}")
    pieces = [_piece(obj, base, limits, f"pieces[{i}]") for i, obj in enumerate(items)]
    work = sum(p.count if p.positions == "gaps" else p.stop - p.start for p in pieces)
    if work > limits.max_delta_chunk_elements:
        raise Reject(Reason.TOO_LARGE, f"chunk decodes {work} elements > limit {limits.max_delta_chunk_elements}")
    sizes, contexts = [], []
    for p in pieces:
        n_q = dc.position_symbol_count(p.positions, p.count, p.stop - p.start)
        n_v = p.count if p.values == "ulp" else 0
        sizes.append((n_q, n_v))
        contexts.append(np.full(n_q, dc.QUOTIENT_TABLE, np.int64))
        contexts.append(np.full(n_v, dc.VALUE_TABLE[p.width], np.int64))
    symbols_data = _bin(m["symbols"], "symbols")
    try:
        symbols = rans_decode(symbols_data, np.concatenate(contexts) if contexts else np.zeros(0, np.int64), tables)
    except CodingError as exc:
        raise Reject(Reason.MALFORMED, f"symbol stream: {exc}") from None
    out, offset = [], 0
    for p, (n_q, n_v) in zip(pieces, sizes):
        quotients = symbols[offset : offset + n_q]
        values = symbols[offset + n_q : offset + n_q + n_v] if p.values == "ulp" else None
        offset += n_q + n_v
        out.append((_decode_piece(p, quotients, values), p.start, p.stop))
    return DeltaChunk(header, tuple(out))


def decode_chunk(data: bytes, *, base: State, base_hash: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[Verdict, DeltaChunk | None]:
    """Decode and validate one chunk against the local `base` state hashing to `base_hash`; never raises."""
    try:
        return Verdict.accept(), _decode_chunk(data, base, base_hash, limits)
    except Reject as rejected:
        return rejected.verdict, None


def decode_delta(
    chunks: Sequence[bytes], *, base: State, base_hash: bytes, limits: Limits = DEFAULT_LIMITS
) -> tuple[Verdict, WeightDelta | None]:
    """Decode all chunks of one delta and validate them against the local model; never raises.

    `base` is the local state (every tensor's dtype and bits) and `base_hash` its `state_hash`.
    Rejects: a base hash other than ours, unknown tensors, wrong shape or dtype, positions out of
    range, pieces that overlap (duplicate positions), malformed streams, non-finite values,
    chunks of different deltas, missing or repeated chunks. An accepted delta can be scattered
    as is; its arrays are writable (int64 indices, uint16/uint32 bit patterns).
    """
    if not chunks:
        return Verdict.reject(Reason.BAD_LENGTH, "no chunks"), None
    if len(chunks) > limits.max_delta_chunks:
        return Verdict.reject(Reason.TOO_LARGE, f"{len(chunks)} chunks > limit {limits.max_delta_chunks}"), None
    decoded = []
    for data in chunks:
        verdict, chunk = decode_chunk(data, base=base, base_hash=base_hash, limits=limits)
        if not verdict.ok:
            return verdict, None
        decoded.append(chunk)
    try:
        return Verdict.accept(), assemble(decoded)
    except Reject as rejected:
        return rejected.verdict, None


def assemble(chunks: Sequence[DeltaChunk]) -> WeightDelta:
    """Join validated chunks of one delta; raises Reject unless they are exactly chunks 0..n-1 and disjoint."""
    first = chunks[0].header
    for c in chunks:
        if not c.header.same_delta(first):
            raise Reject(Reason.BAD_VALUE, f"chunk {c.header.chunk} belongs to another delta than chunk {first.chunk}")
    indices = sorted(c.header.chunk for c in chunks)
    if indices != list(range(first.chunks)):
        raise Reject(Reason.BAD_LENGTH, f"chunks {indices[:8]} do not make up all {first.chunks} chunks exactly once")
    by_name: dict[str, list[tuple[TensorDelta, int, int]]] = {}
    for c in chunks:
        for piece in c.pieces:
            by_name.setdefault(piece[0].name, []).append(piece)
    tensors = []
    for name, pieces in by_name.items():
        pieces.sort(key=lambda p: p[1])
        for (_, _, prev_stop), (_, start, _) in itertools.pairwise(pieces):
            if start < prev_stop:
                raise Reject(Reason.UNSORTED, f"tensor {name!r}: pieces overlap at {start} (duplicate positions)")
        t0 = pieces[0][0]
        tensors.append(
            TensorDelta(
                name, t0.shape, t0.dtype,
                np.concatenate([p[0].indices for p in pieces]),
                np.concatenate([p[0].values for p in pieces]),
            )
        )
    return WeightDelta(first.base_version, first.version, first.base_hash, first.result_hash, tuple(tensors))


# ----- policy head ------------------------------------------------------------------------------

_HEAD_KEYS = frozenset({"version", "hash", "snapshot"})
_HEAD_MAX_BYTES = 256


@dataclass(frozen=True)
class PolicyHead:
    """A leader's latest policy `version` (weights hashing to `hash`) and its latest snapshot's version."""

    version: int
    hash: bytes
    snapshot: int


def encode_head(head: PolicyHead) -> bytes:
    """The small body a leader republishes after every step (gossip topic "head")."""
    if not 0 <= head.snapshot <= head.version or len(head.hash) != HASH_BYTES:
        raise ValueError(f"head needs 0 <= snapshot <= version and a {HASH_BYTES}-byte hash, got {head}")
    return pack({"version": head.version, "hash": head.hash, "snapshot": head.snapshot})


def decode_head(data: bytes, *, limits: Limits = DEFAULT_LIMITS) -> tuple[Verdict, PolicyHead | None]:
    """Decode and check a head body; never raises."""
    verdict, obj = safe_unpack(data, max_size=_HEAD_MAX_BYTES, max_depth=1)
    if not verdict.ok:
        return verdict, None
    try:
        m = check_keys(obj, _HEAD_KEYS, "policy head")
        version = _int(m["version"], "version", limits)
        snapshot = _int(m["snapshot"], "snapshot", limits)
        digest = _bin(m["hash"], "hash")
        if len(digest) != HASH_BYTES:
            raise Reject(Reason.BAD_LENGTH, f"hash is {len(digest)} bytes, expected {HASH_BYTES}")
        if snapshot > version:
            raise Reject(Reason.BAD_VALUE, f"snapshot {snapshot} is newer than version {version}")
    except Reject as rejected:
        return rejected.verdict, None
    return Verdict.accept(), PolicyHead(version, digest, snapshot)
