"""Vectorized entropy coding in numpy: interleaved rANS over small alphabets, and bit-plane packing.

Deltas carry millions of symbols per step, so nothing here loops over symbols in Python.

rANS (Duda's asymmetric numeral systems, the "32-bit state, 16-bit words" variant) codes a
symbol of probability f / 2**SCALE_BITS in -log2(f / 2**SCALE_BITS) bits, so a static model
measured on the data itself lands within a fraction of a percent of the empirical entropy.
`lanes` independent coders are interleaved: symbol i belongs to lane i % lanes and step
i // lanes, and numpy advances all lanes of one step at once. Each symbol carries a context
(which frequency table codes it), so one stream holds symbols of several distributions.

Stream layout: the final state of every lane (uint32 LE each), then the renormalisation words
(uint16 LE) in the order the decoder reads them. Decoding a valid stream ends with every lane
back at the initial state and every word consumed; anything else is a corrupt stream.

Bit planes: a run of n unsigned fields of `width` bits is stored as `width` packed bit planes
(least significant first), each ceil(n / 8) bytes, so packing is `width` vector passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SCALE_BITS = 15
SCALE = 1 << SCALE_BITS
_RANS_L = 1 << 16  # lower bound of a normalised state; states live in [L, 2**32)
_WORD_BITS = 16
# A state x can take symbol s without overflow while x < ((L >> SCALE_BITS) << WORD_BITS) * f_s.
_X_MAX_SHIFT = 16 - SCALE_BITS + _WORD_BITS
_STATE_BYTES = 4
MAX_LANES = 8192
_SYMBOLS_PER_LANE = 1024  # fewer lanes for short streams: each lane costs 32 bits of final state
MAX_ALPHABET = 256


class CodingError(ValueError):
    """Encoded bytes are inconsistent (truncated, corrupt or hostile); the message says where."""


@dataclass(frozen=True)
class FrequencyTable:
    """Symbol frequencies quantised to sum to SCALE; every symbol that occurs has frequency >= 1."""

    freqs: np.ndarray  # uint32, one per symbol of the alphabet

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> FrequencyTable:
        """Quantise raw symbol counts (any positive total) to a table that sums to SCALE."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.ndim != 1 or not 0 < counts.size <= MAX_ALPHABET:
            raise ValueError(f"counts must be 1-D with 1..{MAX_ALPHABET} entries, got shape {counts.shape}")
        total = counts.sum()
        if total <= 0:
            freqs = np.zeros(counts.size, np.int64)
            freqs[0] = SCALE
            return cls(freqs.astype(np.uint32))
        present = counts > 0
        freqs = np.where(present, np.maximum(1, np.floor(counts * SCALE / total)), 0).astype(np.int64)
        # Hand the rounding surplus or deficit to the most frequent symbols, where it costs least.
        order = np.argsort(-counts, kind="stable")
        diff = SCALE - int(freqs.sum())
        i = 0
        while diff != 0:
            symbol = order[i % int(present.sum())]
            step = 1 if diff > 0 else -1
            if freqs[symbol] + step >= 1:
                freqs[symbol] += step
                diff -= step
            i += 1
        return cls(freqs.astype(np.uint32))

    def to_bytes(self) -> bytes:
        """uint16 LE per symbol, up to the last symbol with a nonzero frequency."""
        used = int(np.flatnonzero(self.freqs)[-1]) + 1
        return self.freqs[:used].astype("<u2").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, alphabet: int) -> FrequencyTable:
        """Parse and check a table written by `to_bytes`; raises CodingError when it is not one."""
        if not 1 <= alphabet <= MAX_ALPHABET:
            raise CodingError(f"alphabet size {alphabet} outside 1..{MAX_ALPHABET}")
        if not 2 <= len(data) <= 2 * alphabet or len(data) % 2:
            raise CodingError(f"frequency table is {len(data)} bytes, expected 2..{2 * alphabet} (even) for {alphabet} symbols")
        freqs = np.zeros(alphabet, np.uint32)
        freqs[: len(data) // 2] = np.frombuffer(data, "<u2")
        if int(freqs.sum()) != SCALE:
            raise CodingError(f"frequencies sum to {int(freqs.sum())}, not {SCALE}")
        return cls(freqs)

    def cost_bits(self, counts: np.ndarray) -> float:
        """Bits rANS spends coding symbols with these counts under this table (inf if one is missing)."""
        counts = np.asarray(counts, dtype=np.float64)
        used = counts > 0
        if (self.freqs[used] == 0).any():
            return float("inf")
        return float(-(counts[used] * np.log2(self.freqs[used] / SCALE)).sum())


def entropy_bits(counts: np.ndarray) -> float:
    """Empirical entropy of a sample with these symbol counts, in bits for the whole sample."""
    counts = np.asarray(counts, dtype=np.float64)
    counts = counts[counts > 0]
    total = counts.sum()
    if total == 0:
        return 0.0
    return float(-(counts * np.log2(counts / total)).sum())


def lanes_for(count: int) -> int:
    """Interleaved lanes for a stream of `count` symbols (encoder and decoder both derive it)."""
    return int(min(MAX_LANES, max(1, count // _SYMBOLS_PER_LANE)))


def _tables(tables: list[FrequencyTable]) -> tuple[np.ndarray, np.ndarray, int]:
    width = max(t.freqs.size for t in tables)
    freq = np.zeros((len(tables), width), np.uint32)
    for i, t in enumerate(tables):
        freq[i, : t.freqs.size] = t.freqs
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1, dtype=np.uint32)[:, :-1]
    return freq.reshape(-1), cum.reshape(-1), width


def rans_encode(symbols: np.ndarray, contexts: np.ndarray, tables: list[FrequencyTable]) -> bytes:
    """Code `symbols[i]` with table `contexts[i]`; every symbol must have a nonzero frequency there."""
    symbols = np.asarray(symbols, dtype=np.intp)
    contexts = np.asarray(contexts, dtype=np.intp)
    n = symbols.size
    if contexts.size != n:
        raise ValueError(f"{n} symbols but {contexts.size} contexts")
    if n == 0:
        return b""
    freq, cum, width = _tables(tables)
    flat = contexts * width + symbols
    lanes = lanes_for(n)
    steps = -(-n // lanes)
    # Pad to whole steps; padded slots are never coded (only the first n - lo lanes of the last step).
    f_all = np.ones(steps * lanes, np.uint32)
    c_all = np.zeros(steps * lanes, np.uint32)
    f_all[:n], c_all[:n] = freq[flat], cum[flat]
    if (f_all[:n] == 0).any():
        bad = int(np.flatnonzero(f_all[:n] == 0)[0])
        raise ValueError(f"symbol {int(symbols[bad])} has frequency 0 in table {int(contexts[bad])}")
    f_all, c_all = f_all.reshape(steps, lanes), c_all.reshape(steps, lanes)
    # Every lane's low word and whether it was emitted, per step; the stream is the emitted words
    # in (step, lane) order, which is the order the decoder reads them in.
    low = np.empty((steps, lanes), np.uint16)
    emitted = np.zeros((steps, lanes), bool)
    state = np.full(lanes, _RANS_L, np.uint32)
    x_shift, scale_bits, word_bits = np.uint32(_X_MAX_SHIFT), np.uint32(SCALE_BITS), np.uint32(_WORD_BITS)
    last = n - (steps - 1) * lanes
    for step in range(steps - 1, -1, -1):
        active = lanes if step < steps - 1 else last
        x = state[:active]
        f, c = f_all[step, :active], c_all[step, :active]
        renorm = (x >> x_shift) >= f  # x >= f << 17 without overflowing 32 bits
        emitted[step, :active] = renorm
        low[step, :active] = x
        x = x >> (renorm.astype(np.uint32) * word_bits)
        q, r = np.divmod(x, f)
        state[:active] = (q << scale_bits) + r + c
    return state.astype("<u4").tobytes() + low[emitted].astype("<u2").tobytes()


def rans_decode(data: bytes, contexts: np.ndarray, tables: list[FrequencyTable]) -> np.ndarray:
    """Decode one symbol per entry of `contexts` (the table each was coded with); raises CodingError."""
    contexts = np.asarray(contexts, dtype=np.intp)
    n = contexts.size
    if n == 0:
        if data:
            raise CodingError(f"{len(data)} bytes of symbol stream but no symbols to decode")
        return np.zeros(0, np.int64)
    lanes = lanes_for(n)
    if len(data) < lanes * _STATE_BYTES or (len(data) - lanes * _STATE_BYTES) % 2:
        raise CodingError(f"symbol stream of {len(data)} bytes cannot hold {lanes} lane states and 16-bit words")
    state = np.frombuffer(data, "<u4", count=lanes).astype(np.uint32)
    if (state < _RANS_L).any():
        raise CodingError("a lane's final state is below the rANS lower bound")
    words = np.frombuffer(data, "<u2", offset=lanes * _STATE_BYTES).astype(np.uint32)
    # Per (table, slot): the symbol, and its frequency and slot - cumulative start packed in 32 bits.
    slot_symbol = np.zeros((len(tables), SCALE), np.uint8)
    slot_step = np.zeros((len(tables), SCALE), np.uint32)
    slots = np.arange(SCALE, dtype=np.uint32)
    for i, t in enumerate(tables):
        sym = np.repeat(np.arange(t.freqs.size, dtype=np.uint32), t.freqs.astype(np.int64))
        starts = np.concatenate(([0], np.cumsum(t.freqs, dtype=np.uint32)[:-1])).astype(np.uint32)
        slot_symbol[i] = sym
        slot_step[i] = t.freqs[sym].astype(np.uint32) | ((slots - starts[sym]) << np.uint32(16))
    slot_symbol, slot_step = slot_symbol.reshape(-1), slot_step.reshape(-1)
    out = np.empty(n, np.uint8)
    slot_base = contexts * SCALE
    mask, scale_bits, word_bits = np.uint32(SCALE - 1), np.uint32(SCALE_BITS), np.uint32(_WORD_BITS)
    low16, low = np.uint32(0xFFFF), np.uint32(_RANS_L)
    pointer = 0
    steps = -(-n // lanes)
    for step in range(steps):
        lo = step * lanes
        hi = min(n, lo + lanes)
        x = state[: hi - lo]
        where = slot_base[lo:hi] + (x & mask)
        out[lo:hi] = slot_symbol[where]
        packed = slot_step[where]
        x = (packed & low16) * (x >> scale_bits) + (packed >> word_bits)
        renorm = np.flatnonzero(x < low)
        if renorm.size:
            if pointer + renorm.size > words.size:
                raise CodingError("symbol stream ends early")
            x[renorm] = (x[renorm] << word_bits) | words[pointer : pointer + renorm.size]
            pointer += renorm.size
        state[: hi - lo] = x
    if pointer != words.size or (state != _RANS_L).any():
        raise CodingError("symbol stream does not decode cleanly (corrupt, or coded with other tables)")
    return out.astype(np.int64)


def pack_planes(values: np.ndarray, width: int) -> bytes:
    """`width` bit planes (LSB first) of unsigned `values`, each ceil(n / 8) bytes."""
    values = np.asarray(values, dtype=np.uint64)
    if width == 0 or values.size == 0:
        return b""
    return b"".join(np.packbits(((values >> np.uint64(j)) & np.uint64(1)).astype(np.uint8)).tobytes() for j in range(width))


def unpack_planes(data: bytes | memoryview, count: int, width: int) -> np.ndarray:
    """Inverse of `pack_planes`; raises CodingError on a wrong length or nonzero padding bits."""
    plane_bytes = -(-count // 8)
    if len(data) != plane_bytes * width:
        raise CodingError(f"bit planes are {len(data)} bytes, expected {plane_bytes * width} ({width} x {count} bits)")
    out = np.zeros(count, np.uint64)
    if width == 0 or count == 0:
        return out
    raw = np.frombuffer(data, np.uint8).reshape(width, plane_bytes)
    if count % 8 and (raw[:, -1] & np.uint8((1 << (8 - count % 8)) - 1)).any():
        raise CodingError("nonzero padding bits after a bit plane")
    for j in range(width):
        out |= np.unpackbits(raw[j], count=count).astype(np.uint64) << np.uint64(j)
    return out


def planes_size(count: int, width: int) -> int:
    """Bytes `pack_planes` writes for `count` values of `width` bits."""
    return -(-count // 8) * width
