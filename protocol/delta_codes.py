"""How one tensor piece of a sparse delta becomes symbols and bits, and back (pure numpy).

A piece is a flat range [start, stop) of one tensor with k changed elements.

Positions, whichever of three is smallest:
- "gaps": the gaps g >= 0 between changed positions (g = p_i - p_{i-1} - 1), split as
  g = q * 2**rice + r. The low `rice` bits r are nearly uniform and go out raw as bit planes;
  the quotient q (mean about 8-16 by the choice of `rice`) is entropy coded with rANS, so the
  whole costs close to the entropy of the gap distribution (log2 C(n, k) for iid positions)
  without assuming it is geometric. q >= 255 codes as symbol 255 plus a uint64 escape.
- "complement": the same, over the unchanged positions (for ranges that mostly changed).
- "bitmap": one bit per element of the range.

Values, whichever is smaller:
- "ulp": c = zigzag(new - base, as integers of the value width) - 1, so a 1-ulp move either
  way costs codes 0 or 1. c < 16 is its own symbol; a larger c is symbol 16 + (bit_length - 5)
  followed by its bit_length - 1 low bits (bit planes), which keeps fp32 moves of thousands of
  ulps cheap without an alphabet of 2**32.
- "raw": the new bit patterns as they are.

Everything here raises `CodingError` on malformed input (`OutOfRange` for positions past the
range); protocol/delta.py turns that into a verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .entropy import CodingError, entropy_bits, pack_planes, planes_size, unpack_planes

Q_ALPHABET = 256
Q_ESCAPE = Q_ALPHABET - 1
DIRECT_CODES = 16  # value codes below this are symbols of their own
MAX_RICE = 40
POSITION_MODES = ("gaps", "complement", "bitmap")
VALUE_MODES = ("ulp", "raw")
# Table index in a chunk: 0 = gap quotients, then one value table per value width.
QUOTIENT_TABLE = 0
VALUE_TABLE = {16: 1, 32: 2}
_ESCAPE_BYTES = 8


class OutOfRange(CodingError):
    """A decoded position lies outside its piece's range."""


def value_alphabet(width: int) -> int:
    """Symbols for value codes of `width` bits: 16 direct codes, then one per bit length 5..width."""
    return DIRECT_CODES + width - 4


TABLE_ALPHABETS = (Q_ALPHABET, value_alphabet(16), value_alphabet(32))


def ulp_codes(new: np.ndarray, base: np.ndarray, width: int) -> np.ndarray:
    """zigzag(new - base) - 1 as uint64, the difference taken modulo 2**width; every new != base."""
    wide = np.uint64
    mask = wide((1 << width) - 1)
    d = (new.astype(wide) - base.astype(wide)) & mask
    sign = d >> wide(width - 1)
    zz = ((d << wide(1)) & mask) ^ ((wide(0) - sign) & mask)
    if (zz == 0).any():
        raise ValueError("a listed element equals its base value; a delta lists changed elements only")
    return zz - wide(1)


def apply_ulp_codes(codes: np.ndarray, base: np.ndarray, width: int) -> np.ndarray:
    """Inverse of `ulp_codes`: the new bit patterns (uint64) given the base ones."""
    wide = np.uint64
    mask = wide((1 << width) - 1)
    zz = codes.astype(wide) + wide(1)
    diff = (zz >> wide(1)) ^ ((wide(0) - (zz & wide(1))) & mask)
    return (base.astype(wide) + diff) & mask


def _bit_length(values: np.ndarray) -> np.ndarray:
    """Exact bit length of uint64 values below 2**53 (frexp is exact there)."""
    return np.frexp(values.astype(np.float64))[1].astype(np.int64)


@dataclass
class ValueCode:
    """Value symbols and their extra bits for one piece."""

    symbols: np.ndarray  # int64, one per changed element
    extra: bytes  # low bits of codes >= 16, bit planes over the elements that have them
    extra_bits: int


def code_values(codes: np.ndarray, width: int) -> ValueCode:
    """Symbols and extra bit planes for ulp codes (see the module docstring)."""
    codes = codes.astype(np.uint64)
    symbols = codes.astype(np.int64)
    large = np.flatnonzero(codes >= DIRECT_CODES)
    if large.size == 0:
        return ValueCode(symbols, b"", 0)
    big = codes[large]
    nbits = _bit_length(big)
    symbols[large] = DIRECT_CODES + nbits - 5
    extra_widths = nbits - 1
    planes = []
    for j in range(int(extra_widths.max())):
        planes.append(pack_planes(big[extra_widths > j] >> np.uint64(j), 1))
    return ValueCode(symbols, b"".join(planes), int(extra_widths.sum()))


def decode_values(symbols: np.ndarray, extra: bytes | memoryview, width: int) -> np.ndarray:
    """Ulp codes from value symbols and their extra bit planes; raises CodingError."""
    symbols = symbols.astype(np.int64)
    if symbols.size and int(symbols.max()) >= value_alphabet(width):
        raise CodingError(f"value symbol {int(symbols.max())} is outside the {width}-bit alphabet")
    codes = symbols.astype(np.uint64)
    large = np.flatnonzero(symbols >= DIRECT_CODES)
    if large.size == 0:
        if len(extra):
            raise CodingError(f"{len(extra)} bytes of value extra bits but no value needs them")
        return codes
    nbits = symbols[large] - DIRECT_CODES + 5
    extra_widths = nbits - 1
    big = np.uint64(1) << (extra_widths.astype(np.uint64))
    offset = 0
    view = memoryview(extra)
    for j in range(int(extra_widths.max())):
        members = np.flatnonzero(extra_widths > j)
        size = planes_size(members.size, 1)
        if offset + size > len(view):
            raise CodingError("value extra bits end early")
        big[members] |= unpack_planes(view[offset : offset + size], members.size, 1) << np.uint64(j)
        offset += size
    if offset != len(view):
        raise CodingError(f"{len(view) - offset} trailing bytes after the value extra bits")
    codes[large] = big
    return codes


def values_size_bits(value_code: ValueCode, width: int) -> tuple[float, float]:
    """Estimated bits of the piece's values as (ulp, raw): entropy of the symbols + extra bits, or width * k."""
    k = value_code.symbols.size
    counts = np.bincount(value_code.symbols, minlength=value_alphabet(width))
    return entropy_bits(counts) + value_code.extra_bits + 8 * (value_code.extra_bits > 0), float(width * k)


@dataclass
class PositionCode:
    """One piece's positions as coded: mode, Rice parameter, rANS symbols and raw side bytes."""

    mode: str
    rice: int
    symbols: np.ndarray  # int64 quotient symbols ("gaps", "complement"), empty for "bitmap"
    low: bytes  # remainder bit planes, or the bitmap
    escapes: bytes  # uint64 LE quotients >= Q_ESCAPE, in order
    estimated_bits: float


def choose_rice(count: int, length: int) -> int:
    """Rice parameter for `count` gaps in a range of `length`: quotients then have mean 8-16."""
    if count == 0:
        return 0
    mean_gap = max(1.0, (length - count) / count)
    return int(min(MAX_RICE, max(0, int(np.floor(np.log2(mean_gap))) - 3)))


def _gap_code(positions: np.ndarray, length: int, mode: str) -> PositionCode:
    gaps = np.diff(positions, prepend=np.int64(-1)) - 1
    rice = choose_rice(positions.size, length)
    quotients = (gaps >> rice).astype(np.int64)
    symbols = np.minimum(quotients, Q_ESCAPE)
    escaped = quotients[quotients >= Q_ESCAPE]
    low = pack_planes(gaps.astype(np.uint64), rice)
    counts = np.bincount(symbols, minlength=Q_ALPHABET)
    bits = entropy_bits(counts) + rice * positions.size + 64 * escaped.size
    return PositionCode(mode, rice, symbols, low, escaped.astype("<u8").tobytes(), bits)


def code_positions(local: np.ndarray, length: int) -> PositionCode:
    """The cheapest coding of sorted, unique positions inside [0, length)."""
    k = local.size
    bitmap_bits = float(length)
    candidates = []
    if k <= length // 2:
        candidates.append(_gap_code(local, length, "gaps"))
    else:
        changed = np.zeros(length, bool)
        changed[local] = True
        candidates.append(_gap_code(np.flatnonzero(~changed), length, "complement"))
    best = min(candidates, key=lambda c: c.estimated_bits)
    # A bitmap wins only in the dense middle; build it only then (it is one bit per element).
    if bitmap_bits < best.estimated_bits:
        changed = np.zeros(length, bool)
        changed[local] = True
        return PositionCode("bitmap", 0, np.zeros(0, np.int64), np.packbits(changed).tobytes(), b"", bitmap_bits)
    return best


def position_symbol_count(mode: str, count: int, length: int) -> int:
    """How many quotient symbols a piece contributes to its chunk's stream."""
    if mode == "gaps":
        return count
    if mode == "complement":
        return length - count
    return 0


def decode_positions(
    mode: str, rice: int, symbols: np.ndarray, low: bytes | memoryview, escapes: bytes | memoryview, count: int, length: int
) -> np.ndarray:
    """Sorted unique int64 positions inside [0, length) from a piece's coding; raises CodingError (OutOfRange)."""
    if mode == "bitmap":
        if len(low) != -(-length // 8) or len(escapes) or symbols.size:
            raise CodingError(f"bitmap of {len(low)} bytes for a range of {length} elements (or stray gap data)")
        bits = np.unpackbits(np.frombuffer(low, np.uint8))
        if bits[length:].any():
            raise CodingError("nonzero padding bits after the bitmap")
        positions = np.flatnonzero(bits[:length])
        if positions.size != count:
            raise CodingError(f"bitmap marks {positions.size} elements, the piece declares {count}")
        return positions.astype(np.int64)
    if not 0 <= rice <= MAX_RICE:
        raise CodingError(f"rice parameter {rice} outside 0..{MAX_RICE}")
    n = symbols.size
    quotients = symbols.astype(np.uint64)
    escaped = np.flatnonzero(symbols == Q_ESCAPE)
    if len(escapes) != _ESCAPE_BYTES * escaped.size:
        raise CodingError(f"{len(escapes)} bytes of quotient escapes for {escaped.size} escaped gaps")
    if escaped.size:
        extra = np.frombuffer(escapes, "<u8")
        if (extra >= np.uint64(length)).any() or (extra < np.uint64(Q_ESCAPE)).any():
            raise OutOfRange(f"an escaped gap quotient does not fit a range of {length} elements")
        quotients[escaped] = extra
    remainders = unpack_planes(low, n, rice)
    if (quotients > np.uint64(length >> rice)).any():
        raise OutOfRange(f"a gap is longer than the range of {length} elements")
    gaps = ((quotients << np.uint64(rice)) | remainders).astype(np.int64)
    positions = np.cumsum(gaps + 1) - 1
    if n and int(positions[-1]) >= length:
        raise OutOfRange(f"position {int(positions[-1])} >= range length {length}")
    if mode == "gaps":
        if n != count:
            raise CodingError(f"{n} gaps for {count} changed elements")
        return positions
    if n != length - count:
        raise CodingError(f"{n} unchanged positions, but {length} - {count} declared")
    changed = np.ones(length, bool)
    changed[positions] = False
    return np.flatnonzero(changed).astype(np.int64)
