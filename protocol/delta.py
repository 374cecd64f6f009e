"""Sparse indexed weight delta, wire format v4: near the entropy bound, chunked, hash-bound to its base.

A delta moves a model from `base_version` (whose weights hash to `base_hash`) to `version`
(hashing to `result_hash`). Per tensor it lists the flat (row-major) positions that changed and
their new bit patterns (uint16 for bfloat16/float16, uint32 for float32), so applying it is
bit-exact. The coding is conditioned on the base weights (see `delta_codes`): positions per
magnitude class, values relative to the base with tables chosen by the base exponent. So a
delta only decodes against the exact weights it was made from: the base hash is checked first,
and the weights hash of the result (`weights_hash.state_hash`) must equal `result_hash` after applying.
Format 4 is format 3's layout with v2 weights hashes (`weights_hash`), so nodes of the two versions
refuse each other's deltas by their format, not as a base mismatch: a format-3 node says "upgrade
hivespec", and this one names the side that is older.

Wire form: a list of chunks, each a msgpack map that is one gossip body (under the 4 MiB
message cap) and decodes on its own given the base:

    {"format": 4, "base_version": int, "version": int, "base_hash": bin32, "result_hash": bin32,
     "chunk": int, "chunks": int,
     "position_table": bin, "position_symbols": bin,
     "value_contexts": [[dtype, exponent, reference | nil], ...], "value_tables": [bin, ...],
     "value_symbols": bin,
     "pieces": [{"name": str, "shape": [int], "dtype": str, "start": int, "stop": int,
                 "split": [exponent, ...], "implicit": int,
                 "classes": [[count, "gaps" | "complement" | "bitmap", rice, low, escapes], ...],
                 "values": "ulp" | "raw", "value_bits": bin}, ...]}

A piece covers the flat range [start, stop) of one tensor (large tensors are split over
chunks); its elements fall into len(split) + 1 magnitude classes by base exponent, and each
class's changed ranks are coded on their own. "position_symbols" is one rANS stream with every
class's gap quotients (piece after piece, class after class), coded with "position_table".
"value_symbols" is one rANS stream with the value symbols of the "ulp" pieces, grouped by dtype
name, then in piece order; each symbol is coded with the table of the last context of its dtype
whose exponent is <= the base element's exponent, and that context's reference magnitude (if
any) replaces the base magnitude the step is taken from. Decoding validates everything before
returning, and a whole delta is accepted only if every chunk is, the chunks agree on their
header, and no two pieces overlap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import delta_codes as dc
from .codec import Reject, check_keys, pack, safe_unpack
from .entropy import CodingError, FrequencyTable, rans_decode
from .limits import DEFAULT_LIMITS, Limits
from .verdict import Reason, Verdict

DELTA_FORMAT_VERSION = 4  # 4: format 3 with v2 weights hashes
HASH_BYTES = 32
# Wire dtype name -> dtype of the bit patterns carried for it.
VALUE_DTYPES: Mapping[str, np.dtype] = {
    "bfloat16": np.dtype("<u2"),
    "float16": np.dtype("<u2"),
    "float32": np.dtype("<u4"),
}
_EXPONENT_MASK = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000}
_CHUNK_KEYS = frozenset(
    {
        "format", "base_version", "version", "base_hash", "result_hash", "chunk", "chunks", "position_table",
        "position_symbols", "value_contexts", "value_tables", "value_symbols", "pieces",
    }
)
_PIECE_KEYS = frozenset({"name", "shape", "dtype", "start", "stop", "split", "implicit", "classes", "values", "value_bits"})
# Value tables (contexts) per dtype in a chunk.
MAX_VALUE_CONTEXTS = 8


@dataclass(frozen=True)
class TensorBits:
    """A local tensor as the codec sees it: its float dtype name and its bit patterns in its shape."""

    dtype: str  # "bfloat16" | "float16" | "float32"
    bits: np.ndarray  # uint16 (bf16/fp16) or uint32 (fp32), C-contiguous

    @property
    def width(self) -> int:
        return VALUE_DTYPES[self.dtype].itemsize * 8


State = Mapping[str, TensorBits]


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


def _list(value: object, what: str, max_len: int) -> list:
    if not isinstance(value, list):
        raise Reject(Reason.BAD_TYPE, f"{what} must be an array, got {type(value).__name__}")
    if len(value) > max_len:
        raise Reject(Reason.TOO_LARGE, f"{what} has {len(value)} entries > limit {max_len}")
    return value


def _header(m: dict, limits: Limits) -> DeltaHeader:
    fmt = m["format"]
    if isinstance(fmt, bool) or not isinstance(fmt, int):
        raise Reject(Reason.BAD_TYPE, f"format must be int, got {type(fmt).__name__}")
    if fmt != DELTA_FORMAT_VERSION:
        older = "its sender runs an older hivespec" if fmt < DELTA_FORMAT_VERSION else "this node runs an older hivespec"
        raise Reject(Reason.BAD_VERSION, f"delta format {fmt}, this node reads {DELTA_FORMAT_VERSION}: {older}; "
                                         "a leader and its followers must run the same version")
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
class _WireClass:
    count: int
    mode: str
    rice: int
    low: bytes
    escapes: bytes


@dataclass
class _WirePiece:
    name: str
    local: TensorBits
    start: int
    stop: int
    split: dc.ClassSplit
    classes: list[_WireClass]
    values: str
    value_bits: bytes

    @property
    def dtype(self) -> str:
        return self.local.dtype

    @property
    def width(self) -> int:
        return self.local.width

    @property
    def count(self) -> int:
        return sum(c.count for c in self.classes)


def _class(obj: object, where: str, limits: Limits) -> _WireClass:
    entry = _list(obj, where, 5)
    if len(entry) != 5:
        raise Reject(Reason.BAD_LENGTH, f"{where} has {len(entry)} fields, expected [count, mode, rice, low, escapes]")
    return _WireClass(
        _int(entry[0], f"{where}.count", limits),
        _str(entry[1], f"{where}.mode", dc.POSITION_MODES),
        _int(entry[2], f"{where}.rice", limits),
        _bin(entry[3], f"{where}.low"),
        _bin(entry[4], f"{where}.escapes"),
    )


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
    thresholds = tuple(_int(x, f"{where}.split", limits) for x in _list(m["split"], f"{where}.split", dc.MAX_CLASSES - 1))
    split = dc.ClassSplit(thresholds, _int(m["implicit"], f"{where}.implicit", limits))
    try:
        dc.check_split(split, dtype)
    except CodingError as exc:
        raise Reject(Reason.MALFORMED, f"{where}: {exc}") from None
    classes = [_class(c, f"{where}.classes[{i}]", limits) for i, c in enumerate(_list(m["classes"], f"{where}.classes", dc.MAX_CLASSES))]
    if len(classes) != len(thresholds) + 1:
        raise Reject(Reason.BAD_LENGTH, f"{where}: {len(classes)} classes for {len(thresholds)} thresholds")
    return _WirePiece(
        name, local, start, stop, split, classes,
        _str(m["values"], f"{where}.values", dc.VALUE_MODES),
        _bin(m["value_bits"], f"{where}.value_bits"),
    )


def _value_lookup(raw_contexts: object, raw_tables: object) -> tuple[dict[str, np.ndarray], list[FrequencyTable], np.ndarray]:
    """Per dtype, exponent -> value table index; the tables; each table's reference magnitude (-1: the base's)."""
    contexts = _list(raw_contexts, "value_contexts", MAX_VALUE_CONTEXTS * len(VALUE_DTYPES))
    tables_raw = _list(raw_tables, "value_tables", MAX_VALUE_CONTEXTS * len(VALUE_DTYPES))
    if len(contexts) != len(tables_raw):
        raise Reject(Reason.BAD_LENGTH, f"{len(contexts)} value contexts but {len(tables_raw)} value tables")
    cuts: dict[str, list[tuple[int, int]]] = {}
    tables, references = [], np.full(len(contexts), -1, np.int64)
    for i, (entry, table) in enumerate(zip(contexts, tables_raw)):
        if not isinstance(entry, list) or len(entry) != 3:
            raise Reject(Reason.BAD_TYPE, f"value_contexts[{i}] must be [dtype, exponent, reference or nil]")
        dtype = _str(entry[0], f"value_contexts[{i}].dtype", tuple(VALUE_DTYPES))
        exponent, reference = entry[1], entry[2]
        if isinstance(exponent, bool) or not isinstance(exponent, int) or not 0 <= exponent <= dc.max_exponent(dtype):
            raise Reject(Reason.BAD_VALUE, f"value_contexts[{i}]: exponent {exponent!r:.20} outside 0..{dc.max_exponent(dtype)}")
        width = VALUE_DTYPES[dtype].itemsize * 8
        if reference is not None:
            if isinstance(reference, bool) or not isinstance(reference, int) or not 0 <= reference < 1 << (width - 1):
                raise Reject(Reason.BAD_VALUE, f"value_contexts[{i}]: reference {reference!r:.20} is not a {dtype} magnitude")
            references[i] = reference
        mine = cuts.setdefault(dtype, [])
        if (not mine and exponent != 0) or (mine and exponent <= mine[-1][0]) or len(mine) >= MAX_VALUE_CONTEXTS:
            raise Reject(Reason.MALFORMED, f"value contexts of {dtype} must start at 0, increase, and number at most {MAX_VALUE_CONTEXTS}")
        mine.append((exponent, i))
        try:
            tables.append(FrequencyTable.from_bytes(_bin(table, f"value_tables[{i}]"), dc.value_alphabet(width)))
        except CodingError as exc:
            raise Reject(Reason.MALFORMED, f"value table {i}: {exc}") from None
    lookup = {}
    for dtype, entries in cuts.items():
        table_of = np.zeros(dc.max_exponent(dtype) + 1, np.int64)
        for exponent, i in entries:
            table_of[exponent:] = i
        lookup[dtype] = table_of
    return lookup, tables, references


def _value_order(pieces: Sequence) -> list[int]:
    """Piece indices in value-stream order: by dtype name, then chunk order."""
    return sorted(range(len(pieces)), key=lambda i: pieces[i].dtype)


def _decode_chunk(data: bytes, base: State, base_hash: bytes, limits: Limits) -> DeltaChunk:
    m = _unpack_chunk(data, limits)
    header = _header(m, limits)
    if header.base_hash != base_hash:
        raise Reject(
            Reason.BASE_MISMATCH,
            f"delta to version {header.version} applies to weights {header.base_hash.hex()[:16]} (version "
            f"{header.base_version}), ours are {base_hash.hex()[:16]}",
        )
    try:
        position_table = FrequencyTable.from_bytes(_bin(m["position_table"], "position_table"), dc.Q_ALPHABET)
    except CodingError as exc:
        raise Reject(Reason.MALFORMED, f"position table: {exc}") from None
    value_lookup, value_tables, references = _value_lookup(m["value_contexts"], m["value_tables"])
    items = _list(m["pieces"], "pieces", limits.max_delta_tensors)
    pieces = [_piece(obj, base, limits, f"pieces[{i}]") for i, obj in enumerate(items)]
    scan = sum(p.stop - p.start for p in pieces if p.split.thresholds)
    if scan > limits.max_delta_chunk_scan:
        raise Reject(Reason.TOO_LARGE, f"chunk scans {scan} base elements > limit {limits.max_delta_chunk_scan}")

    # Positions: class membership from the base, then one stream of gap quotients for every class.
    structure, counts, work = [], [], 0
    for p in pieces:
        try:
            cls = dc.classes(p.local.bits.reshape(-1)[p.start : p.stop], p.dtype, p.split,
                             max_listed=limits.max_delta_chunk_elements - work)
        except dc.OverLimit as exc:
            raise Reject(Reason.TOO_LARGE, f"tensor {p.name!r}: {exc} (chunk decode limit "
                                           f"{limits.max_delta_chunk_elements})") from None
        work += cls.listed.size
        for c, size in zip(p.classes, cls.sizes):
            if c.count > size:
                raise Reject(Reason.OUT_OF_RANGE, f"tensor {p.name!r}: {c.count} changed elements in a class of {size}")
            counts.append(dc.position_symbol_count(c.mode, c.count, size))
            work += dc.decoded_positions(c.mode, c.count, size)
        if work > limits.max_delta_chunk_elements:
            raise Reject(Reason.TOO_LARGE, f"chunk decodes {work}+ elements > limit {limits.max_delta_chunk_elements}")
        structure.append(cls)
    try:
        quotients = rans_decode(_bin(m["position_symbols"], "position_symbols"), np.zeros(sum(counts), np.int64), [position_table])
    except CodingError as exc:
        raise Reject(Reason.MALFORMED, f"position stream: {exc}") from None
    offsets = np.cumsum([0] + counts)
    indices, base_values, k = [], [], 0
    for p, cls in zip(pieces, structure):
        where = f"tensor {p.name!r} [{p.start}, {p.stop})"
        ranks = []
        for c, size in zip(p.classes, cls.sizes):
            try:
                ranks.append(dc.decode_positions(c.mode, c.rice, quotients[offsets[k] : offsets[k + 1]], c.low, c.escapes, c.count, size))
            except dc.OutOfRange as exc:
                raise Reject(Reason.OUT_OF_RANGE, f"{where}: {exc}") from None
            except CodingError as exc:
                raise Reject(Reason.MALFORMED, f"{where}: positions: {exc}") from None
            k += 1
        index = dc.positions_from_ranks(ranks, cls) + p.start
        indices.append(index)
        base_values.append(p.local.bits.reshape(-1)[index])

    # Values: contexts from the base values at the decoded positions, then one stream.
    order = [i for i in _value_order(pieces) if pieces[i].values == "ulp"]
    contexts = []
    for i in order:
        lookup = value_lookup.get(pieces[i].dtype)
        if lookup is None:
            raise Reject(Reason.MALFORMED, f"tensor {pieces[i].name!r}: no value context for dtype {pieces[i].dtype}")
        contexts.append(lookup[dc.exponents(base_values[i], pieces[i].dtype)])
    try:
        symbols = rans_decode(
            _bin(m["value_symbols"], "value_symbols"), np.concatenate(contexts) if contexts else np.zeros(0, np.int64), value_tables
        )
    except CodingError as exc:
        raise Reject(Reason.MALFORMED, f"value stream: {exc}") from None
    value_symbols, offset = {}, 0
    for i, context in zip(order, contexts):
        value_symbols[i] = (symbols[offset : offset + pieces[i].count], references[context])
        offset += pieces[i].count
    out = [
        (_decode_values(p, indices[i], base_values[i], *value_symbols.get(i, (None, None))), p.start, p.stop)
        for i, p in enumerate(pieces)
    ]
    return DeltaChunk(header, tuple(out))


def _decode_values(
    p: _WirePiece, indices: np.ndarray, base_values: np.ndarray, symbols: np.ndarray | None, references: np.ndarray | None
) -> TensorDelta:
    where = f"tensor {p.name!r} [{p.start}, {p.stop})"
    value_dtype = VALUE_DTYPES[p.dtype]
    if symbols is not None:
        try:
            codes, flips = dc.decode_values(symbols, p.value_bits, p.width)
            reference = references if (references >= 0).any() else None
            values = dc.apply_value_codes(codes, flips, base_values, p.width, reference).astype(value_dtype)
        except CodingError as exc:
            raise Reject(Reason.MALFORMED, f"{where}: values: {exc}") from None
    else:
        if len(p.value_bits) != p.count * value_dtype.itemsize:
            raise Reject(Reason.BAD_LENGTH, f"{where}: {len(p.value_bits)} bytes of raw values for {p.count} elements")
        values = np.frombuffer(p.value_bits, value_dtype).copy()
    if (values == base_values).any():  # raw patterns, or steps from a reference, can land on the base
        raise Reject(Reason.BAD_VALUE, f"{where}: a listed element keeps its base value")
    mask = _EXPONENT_MASK[p.dtype]
    if ((values & mask) == mask).any():
        raise Reject(Reason.NOT_FINITE, f"{where}: new values contain NaN or infinity")
    return TensorDelta(p.name, tuple(p.local.bits.shape), p.dtype, indices, values)


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

    `base` is the local state (every tensor's dtype and bits) and `base_hash` its weights hash (`weights_hash.state_hash`).
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
