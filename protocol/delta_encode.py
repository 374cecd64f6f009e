"""Encoding a sparse weight delta into wire format v4 chunks (see `delta` for the format).

Per tensor the encoder plans pieces (flat ranges under a chunk's byte and decode-work limits),
codes each piece's positions per magnitude class and its values (`delta_codes`), then groups
pieces into chunks. Per chunk it picks the value contexts: contiguous base-exponent ranges
chosen by dynamic programming over the step's own statistics (entropy plus table bytes), and
for contexts of weights far below the step size a reference magnitude to step from. Sizes are
planned from empirical entropies, so a chunk that still comes out too large is redone with a
tighter budget.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from . import delta_codes as dc
from .codec import pack
from .delta import (
    DELTA_FORMAT_VERSION,
    HASH_BYTES,
    MAX_VALUE_CONTEXTS,
    VALUE_DTYPES,
    State,
    TensorDelta,
    WeightDelta,
)
from .entropy import FrequencyTable, entropy_bits, rans_encode
from .limits import DEFAULT_LIMITS, Limits

_VALUE_CONTEXT_BINS = 32  # exponent bins the context search considers per dtype
# A value context whose base-relative steps cost more than this per element tries a reference magnitude.
_REFERENCE_MIN_BITS = 6.0
# Room a chunk needs beyond its pieces' estimated payload: frequency tables and header, plus a
# margin for rANS lane states (32 bits per 1024 symbols) and the rANS cost above entropy.
_CHUNK_OVERHEAD = 2048
_BUDGET_FRACTION = 0.97
_PIECE_OVERHEAD = 96



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
    work = sum(dc.decoded_positions(c.mode, c.count, size) for c, size in zip(codes, cls.sizes)) + cls.listed.size
    estimated = int((sum(c.estimated_bits for c in codes) + value_bits) / 8) + _PIECE_OVERHEAD * len(codes) + len(t.name)
    return _Piece(
        t.name, tuple(t.shape), t.dtype, start, stop, count, split, codes, value_mode, value_code, exps,
        values[lo:hi], changed_base, raw, estimated, work, stop - start if split.thresholds else 0,
    )


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


def _value_contexts(histogram: np.ndarray, limit: int = MAX_VALUE_CONTEXTS) -> list[int]:
    """Exponent cut points (first 0) of the value contexts for one dtype, from its (exponent x
    symbol) histogram: optimal contiguous exponent ranges under the entropy + table cost, at most
    `limit`. Zeros and subnormals (exponent 0) get a context of their own: they all move to
    about the step size."""
    per_exponent = histogram.sum(axis=1)
    if per_exponent[0] and per_exponent[1:].any() and limit > 1:
        rest = histogram.copy()
        rest[0] = 0
        return [0] + [max(1, c) for c in _value_contexts(rest, limit - 1)]
    present = np.flatnonzero(per_exponent)
    counts = histogram[present]
    if present.size > _VALUE_CONTEXT_BINS:  # merge neighbouring exponents into bins of about equal counts
        cum = np.cumsum(per_exponent[present])
        group = np.minimum(_VALUE_CONTEXT_BINS - 1, (cum - 1) * _VALUE_CONTEXT_BINS // cum[-1])
        keep = np.concatenate(([True], np.diff(group) > 0))
        counts = np.add.reduceat(counts, np.flatnonzero(keep), axis=0)
        present = present[keep]
    cum = np.concatenate((np.zeros((1, counts.shape[1])), np.cumsum(counts, axis=0, dtype=np.float64)))
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
        exponents = dc.max_exponent(dtype) + 1
        histogram = np.bincount(exps * alphabet + symbols, minlength=exponents * alphabet).reshape(exponents, alphabet)
        cuts = _value_contexts(histogram)
        table_of = np.zeros(exponents, np.int64)
        for c, cut in enumerate(cuts):
            table_of[cut:] = c
        which = table_of[exps]
        per_table = np.add.reduceat(histogram, cuts, axis=0)
        references = _references(mine, which, per_table, width)
        if (references >= 0).any():
            offset = 0
            for p in mine:
                ref = references[which[offset : offset + p.count]]
                if (ref >= 0).any():
                    p.values = dc.code_values(*dc.value_codes(p.new_values, p.base_values, width, ref), width)
                    symbols[offset : offset + p.count] = p.values.symbols
                offset += p.count
            retabled = np.flatnonzero(references >= 0)
            for c in retabled:
                per_table[c] = np.bincount(symbols[which == c], minlength=alphabet)
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


def _references(pieces: list[_Piece], which: np.ndarray, counts: np.ndarray, width: int) -> np.ndarray:
    """Per value context, the reference magnitude its steps are taken from, or -1 for the base's.

    Only contexts whose base-relative steps are long (weights far below the step size) are
    tried; the reference is the median new magnitude, kept where it codes smaller.
    """
    references = np.full(counts.shape[0], -1, np.int64)
    relative = np.array([entropy_bits(row) for row in counts]) + counts @ dc.extra_bits_of_symbols(width)
    candidates = np.flatnonzero(relative > _REFERENCE_MIN_BITS * np.maximum(counts.sum(axis=1), 1))
    if candidates.size == 0:
        return references
    new = np.concatenate([p.new_values for p in pieces]).astype(np.int64)
    base = np.concatenate([p.base_values for p in pieces])
    magnitude = new & ((1 << (width - 1)) - 1)
    for c in candidates:
        members = np.flatnonzero(which == c)
        reference = np.full(members.size, int(np.median(magnitude[members])), np.int64)
        trial = dc.code_values(*dc.value_codes(new[members], base[members], width, reference), width)
        bits = entropy_bits(np.bincount(trial.symbols, minlength=counts.shape[1])) + trial.extra_bits
        if bits < relative[c]:
            references[c] = reference[0]
    return references


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
