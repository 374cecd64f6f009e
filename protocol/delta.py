"""Sparse indexed weight delta, wire format v3: near the entropy bound, chunked, hash-bound to its base.

A delta moves a model from `base_version` (whose weights hash to `base_hash`) to `version`
(hashing to `result_hash`). Per tensor it lists the flat (row-major) positions that changed and
their new bit patterns (uint16 for bfloat16/float16, uint32 for float32), so applying it is
bit-exact. The coding is conditioned on the base weights (see `delta_codes`): positions per
magnitude class, values relative to the base with tables chosen by the base exponent. So a
delta only decodes against the exact weights it was made from: the base hash is checked first,
and `state_hash` of the result must equal `result_hash` after applying.

Wire form: a list of chunks, each a msgpack map that is one gossip body (under the 4 MiB
message cap) and decodes on its own given the base:

    {"format": 3, "base_version": int, "version": int, "base_hash": bin32, "result_hash": bin32,
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

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import delta_codes as dc
from .codec import Reject, check_keys, pack, safe_unpack
from .entropy import CodingError, FrequencyTable, entropy_bits, rans_decode, rans_encode
from .limits import DEFAULT_LIMITS, Limits
from .verdict import Reason, Verdict

DELTA_FORMAT_VERSION = 3
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
# Value tables per dtype in a chunk, and how many exponent bins the encoder considers for them.
MAX_VALUE_CONTEXTS = 8
_VALUE_CONTEXT_BINS = 48
# A value context whose base-relative steps cost more than this per element tries a reference magnitude.
_REFERENCE_MIN_BITS = 6.0
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
    split: dc.ClassSplit
    classes: list[dc.PositionCode]
    value_mode: str
    values: dc.ValueCode | None
    value_exponents: np.ndarray  # base exponent of each changed element (value context)
    new_values: np.ndarray  # the changed elements' new and base bit patterns
    base_values: np.ndarray
    raw: bytes
    estimated_bytes: int
    elements: int  # decode work: positions decoded (ranks, or a class's size) plus listed class members
    scan: int  # base elements scanned for the classes: the range length when split, else 0


def _plan_piece(t: TensorDelta, base: np.ndarray, start: int, stop: int, values: np.ndarray, base_values: np.ndarray) -> _Piece:
    width = VALUE_DTYPES[t.dtype].itemsize * 8
    lo, hi = np.searchsorted(t.indices, [start, stop])
    local = t.indices[lo:hi] - start
    changed_base = base_values[lo:hi]
    range_bits = base[start:stop]
    exps = dc.exponents(changed_base, t.dtype)
    split = dc.choose_split(range_bits, t.dtype, exps)
    cls = dc.classes(range_bits, t.dtype, split)
    which = dc.class_of(changed_base, t.dtype, cls) if split.thresholds else np.zeros(local.size, np.int64)
    codes = [dc.code_positions(r, size) for r, size in zip(dc.ranks_in_classes(local, which, cls), cls.sizes)]
    value_code = dc.code_values(*dc.value_codes(values[lo:hi], changed_base, width), width)
    ulp_bits, raw_bits = dc.values_size_bits(value_code, width)
    if raw_bits < ulp_bits:
        value_mode, value_code, raw, value_bits = "raw", None, values[lo:hi].astype(VALUE_DTYPES[t.dtype]).tobytes(), raw_bits
    else:
        value_mode, raw, value_bits = "ulp", b"", ulp_bits
    count = int(hi - lo)
    work = sum(_decoded(c.mode, c.count, size) for c, size in zip(codes, cls.sizes)) + cls.listed.size
    estimated = int((sum(c.estimated_bits for c in codes) + value_bits) / 8) + _PIECE_OVERHEAD * len(codes) + len(t.name)
    return _Piece(
        t.name, tuple(t.shape), t.dtype, start, stop, count, split, codes, value_mode, value_code, exps,
        values[lo:hi], changed_base, raw, estimated, work, stop - start if split.thresholds else 0,
    )


def _decoded(mode: str, count: int, size: int) -> int:
    """Positions a class makes the decoder produce: its ranks for "gaps", its whole size otherwise."""
    return count if mode == "gaps" else size


def _check_local(t: TensorDelta, base: State) -> tuple[np.ndarray, np.ndarray]:
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
    base_values = local.bits.reshape(-1)[indices]
    if (values == base_values).any():
        raise ValueError(f"tensor {t.name!r}: a listed element equals its base value; a delta lists changed elements only")
    return values, base_values


def _plan_tensor(t: TensorDelta, base: State, values: np.ndarray, base_values: np.ndarray, budget: int, limits: Limits) -> list[_Piece]:
    """Pieces for one tensor: ranges halved while over the byte budget or a chunk's decode limits."""
    flat = base[t.name].bits.reshape(-1)
    numel = flat.size
    parts = -(-numel // limits.max_delta_chunk_scan)
    edges = [numel * i // parts for i in range(parts + 1)]
    todo = list(itertools.pairwise(edges))
    pieces = []
    while todo:
        start, stop = todo.pop(0)
        piece = _plan_piece(t, flat, start, stop, values, base_values)
        if piece.count == 0:
            continue
        fits = piece.estimated_bytes <= budget and piece.elements <= limits.max_delta_chunk_elements
        if fits or stop - start <= 1:
            pieces.append(piece)
        else:
            middle = (start + stop) // 2
            todo[:0] = [(start, middle), (middle, stop)]
    return pieces


def _segment_cost(cum: np.ndarray) -> np.ndarray:
    """[i, j]: bits to code bins [i, j) with one static table (entropy plus the table's bytes)."""
    counts = cum[None, :, :] - cum[:, None, :]  # (B+1, B+1, A)
    with np.errstate(divide="ignore", invalid="ignore"):
        clog = np.where(counts > 0, counts * np.log2(np.where(counts > 0, counts, 1)), 0.0).sum(axis=2)
        total = counts.sum(axis=2)
        tlog = np.where(total > 0, total * np.log2(np.where(total > 0, total, 1)), 0.0)
    used = counts > 0
    last = np.where(used.any(axis=2), counts.shape[2] - np.argmax(used[:, :, ::-1], axis=2), 1)
    cost = tlog - clog + 16.0 * last
    upper = np.arange(cum.shape[0])[None, :] > np.arange(cum.shape[0])[:, None]
    return np.where(upper, cost, np.inf)


def _value_contexts(exps: np.ndarray, symbols: np.ndarray, alphabet: int, limit: int = MAX_VALUE_CONTEXTS) -> list[int]:
    """Exponent cut points (first 0) of the value contexts for one dtype: optimal contiguous
    exponent ranges under the entropy + table cost, at most `limit`. Zeros and subnormals
    (exponent 0) get a context of their own: they all move to about the step size."""
    zero = exps == 0
    if zero.any() and not zero.all() and limit > 1:
        return [0] + [max(1, c) for c in _value_contexts(exps[~zero], symbols[~zero], alphabet, limit - 1)]
    present = np.flatnonzero(np.bincount(exps))
    bin_of = np.zeros(int(present[-1]) + 1, np.int64)
    bin_of[present] = np.arange(present.size)
    bins = bin_of[exps]
    if present.size > _VALUE_CONTEXT_BINS:  # merge neighbouring exponents into bins of about equal counts
        cum = np.cumsum(np.bincount(bins, minlength=present.size))
        group = np.minimum(_VALUE_CONTEXT_BINS - 1, (cum - 1) * _VALUE_CONTEXT_BINS // cum[-1])
        keep = np.concatenate(([True], np.diff(group) > 0))
        bins = np.cumsum(keep)[bins] - 1
        present = present[keep]
    counts = np.bincount(bins * alphabet + symbols, minlength=present.size * alphabet).reshape(present.size, alphabet)
    cum = np.concatenate((np.zeros((1, alphabet)), np.cumsum(counts, axis=0, dtype=np.float64)))
    cost = _segment_cost(cum)
    b = present.size
    best, back = [cost[0]], []
    for _ in range(1, min(limit, b)):
        total = best[-1][:, None] + cost
        back.append(np.argmin(total, axis=0))
        best.append(total[back[-1], np.arange(b + 1)])
    segments = int(np.argmin([row[b] for row in best]))
    cuts, j = [], b
    for s in range(segments, 0, -1):
        j = int(back[s - 1][j])
        cuts.append(j)
    return [0] + [int(present[c]) for c in sorted(cuts)]


def _encode_chunk(header: dict, pieces: list[_Piece]) -> bytes:
    position_symbols = [c.symbols for p in pieces for c in p.classes if c.symbols.size]
    positions = np.concatenate(position_symbols) if position_symbols else np.zeros(0, np.int64)
    position_table = FrequencyTable.from_counts(np.bincount(positions, minlength=dc.Q_ALPHABET))
    position_stream = rans_encode(positions, np.zeros(positions.size, np.int64), [position_table]) if positions.size else b""

    ulp = [p for p in pieces if p.values is not None]
    contexts: list[list] = []
    tables: list[FrequencyTable] = []
    value_symbols, value_contexts = [], []
    for dtype in sorted({p.dtype for p in ulp}):
        mine = [p for p in ulp if p.dtype == dtype]
        width = VALUE_DTYPES[dtype].itemsize * 8
        exps = np.concatenate([p.value_exponents for p in mine])
        symbols = np.concatenate([p.values.symbols for p in mine])
        alphabet = dc.value_alphabet(width)
        cuts = _value_contexts(exps, symbols, alphabet)
        table_of = np.zeros(dc.max_exponent(dtype) + 1, np.int64)
        for c, cut in enumerate(cuts):
            table_of[cut:] = c
        which = table_of[exps]
        references = _references(mine, which, symbols, width, len(cuts))
        if (references >= 0).any():
            offset = 0
            for p in mine:
                ref = references[which[offset : offset + p.count]]
                p.values = dc.code_values(*dc.value_codes(p.new_values, p.base_values, width, ref), width)
                offset += p.count
            symbols = np.concatenate([p.values.symbols for p in mine])
        per_table = np.bincount(which * alphabet + symbols, minlength=len(cuts) * alphabet).reshape(len(cuts), alphabet)
        for c, cut in enumerate(cuts):
            contexts.append([dtype, cut, None if references[c] < 0 else int(references[c])])
            tables.append(FrequencyTable.from_counts(per_table[c]))
        value_symbols.append(symbols)
        value_contexts.append(which + len(contexts) - len(cuts))
    # The value stream holds the dtypes' symbols in sorted-dtype order, pieces in chunk order.
    value_stream = b""
    if value_symbols:
        value_stream = rans_encode(np.concatenate(value_symbols), np.concatenate(value_contexts), tables)
    wire_pieces = [
        {
            "name": p.name,
            "shape": list(p.shape),
            "dtype": p.dtype,
            "start": p.start,
            "stop": p.stop,
            "split": list(p.split.thresholds),
            "implicit": p.split.implicit,
            "classes": [[c.count, c.mode, c.rice, c.low, c.escapes] for c in p.classes],
            "values": p.value_mode,
            "value_bits": p.values.extra if p.values is not None else p.raw,
        }
        for p in pieces
    ]
    return pack(
        {
            **header,
            "position_table": position_table.to_bytes(),
            "position_symbols": position_stream,
            "value_contexts": contexts,
            "value_tables": [t.to_bytes() for t in tables],
            "value_symbols": value_stream,
            "pieces": wire_pieces,
        }
    )


def _references(pieces: list[_Piece], which: np.ndarray, symbols: np.ndarray, width: int, count: int) -> np.ndarray:
    """Per value context, the reference magnitude its steps are taken from, or -1 for the base's.

    Only contexts whose base-relative steps are long (weights far below the step size) are
    tried; the reference is the median new magnitude, kept where it codes smaller.
    """
    references = np.full(count, -1, np.int64)
    alphabet = dc.value_alphabet(width)
    extra = dc.extra_bits_of_symbols(width)
    counts = np.bincount(which * alphabet + symbols, minlength=count * alphabet).reshape(count, alphabet)
    relative = np.array([entropy_bits(row) for row in counts]) + counts @ extra
    sizes = counts.sum(axis=1)
    candidates = np.flatnonzero(relative > _REFERENCE_MIN_BITS * np.maximum(sizes, 1))
    if candidates.size == 0:
        return references
    new = np.concatenate([p.new_values for p in pieces]).astype(np.int64)
    base = np.concatenate([p.base_values for p in pieces])
    magnitude = new & ((1 << (width - 1)) - 1)
    for c in candidates:
        members = np.flatnonzero(which == c)
        reference = np.full(members.size, int(np.median(magnitude[members])), np.int64)
        trial = dc.code_values(*dc.value_codes(new[members], base[members], width, reference), width)
        bits = entropy_bits(np.bincount(trial.symbols, minlength=alphabet)) + trial.extra_bits
        if bits < relative[c]:
            references[c] = reference[0]
    return references


def _value_order(pieces: Sequence) -> list[int]:
    """Piece indices in value-stream order: by dtype name, then chunk order."""
    return sorted(range(len(pieces)), key=lambda i: pieces[i].dtype)


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
        for t, values, base_values in checked:
            if values.size:
                pieces += _plan_tensor(t, base, values, base_values, budget, limits)
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
    size = elements = scan = 0
    for p in pieces:
        full = groups[-1] and (
            size + p.estimated_bytes > budget
            or elements + p.elements > limits.max_delta_chunk_elements
            or scan + p.scan > limits.max_delta_chunk_scan
            or len(groups[-1]) >= limits.max_delta_tensors
        )
        if full:
            groups.append([])
            size = elements = scan = 0
        groups[-1].append(p)
        size += p.estimated_bytes
        elements += p.elements
        scan += p.scan
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
        cls = dc.classes(p.local.bits.reshape(-1)[p.start : p.stop], p.dtype, p.split)
        work += cls.listed.size
        for c, size in zip(p.classes, cls.sizes):
            if c.count > size:
                raise Reject(Reason.OUT_OF_RANGE, f"tensor {p.name!r}: {c.count} changed elements in a class of {size}")
            counts.append(dc.position_symbol_count(c.mode, c.count, size))
            work += _decoded(c.mode, c.count, size)
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
