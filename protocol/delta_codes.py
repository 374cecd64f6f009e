"""How one tensor piece of a sparse delta becomes symbols and bits, and back (pure numpy).

A piece is a flat range [start, stop) of one tensor with k changed elements. The receiver holds
the base weights, so the coding is conditioned on them: how likely an element is to change,
and by how much, depends mostly on its magnitude. An Adam step moves every weight by about
the learning rate, so a weight whose ulp is far below it (|w| tiny) changes at every step, by
many ulps, while a large weight changes only when its fp32 master crosses a rounding
boundary, and then by one ulp.

Positions. The piece's elements are split into up to MAX_CLASSES magnitude classes by base
exponent thresholds (the encoder picks them per piece from the data; none when splitting does
not pay), and the changed elements of each class are coded as ranks among that class's
elements. For one class, whichever of three is smallest:
- "gaps": the gaps g >= 0 between changed ranks (g = r_i - r_{i-1} - 1), split as
  g = q * 2**rice + r. The low `rice` bits go out raw as bit planes; the quotient q (mean
  about 8-16 by the choice of `rice`) is rANS coded, so the whole costs close to the entropy
  of the gap distribution. q >= 255 codes as symbol 255 plus a uint64 escape.
- "complement": the same, over the unchanged ranks (for classes that mostly changed).
- "bitmap": one bit per element of the class.
Finding the members of a class costs a pass over the base range. One class (the largest) is
"implicit": only the other, usually small, classes are listed, and a rank in the implicit
class is turned into a position by a binary search over the listed ones.

Values, whichever is smaller:
- "ulp": the sign flip f (new sign != base sign) and c = zigzag(|new| - |base|) - (1 - f),
  magnitudes taken as the bit patterns without the sign (so a move that crosses zero stays
  small). A value context may instead name a reference magnitude R, and then
  c = zigzag(|new| - R): weights far below the step size (exact zeros at the first step) all
  land near |new| = lr whatever their base. c < 16 is its own symbol; a larger c is one symbol per (bit length, next 3 bits;
  2 for fp32) followed by its remaining low bits (bit planes). The symbol is 2 * s + f, and the chunk
  codes it with a table chosen by the base value's exponent (protocol/delta.py).
- "raw": the new bit patterns as they are.

Everything here raises `CodingError` on malformed input (`OutOfRange` for positions past the
range); protocol/delta.py turns that into a verdict.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .entropy import CodingError, entropy_bits, pack_planes, planes_size, unpack_planes

Q_ALPHABET = 256
Q_ESCAPE = Q_ALPHABET - 1
DIRECT_CODES = 16  # value codes below this are symbols of their own
# Bits after the leading one that a large value code's symbol carries (as many as fit 256 symbols).
LEAD_BITS = {16: 3, 32: 2}
MAX_RICE = 40
MAX_CLASSES = 3
POSITION_MODES = ("gaps", "complement", "bitmap")
VALUE_MODES = ("ulp", "raw")
# (bit width, mantissa bits) of each float dtype's bit pattern.
FLOAT_LAYOUT = {"bfloat16": (16, 7), "float16": (16, 10), "float32": (32, 23)}
_ESCAPE_BYTES = 8
# Splitting into classes costs a pass over the base range on both sides, and listing the
# explicit classes' members; a split is taken only if it saves more than this many bits per
# listed element, plus the bytes a class adds to the piece.
_SPLIT_BITS_PER_LISTED = 0.25
_CLASS_OVERHEAD_BITS = 8 * 40
_SAMPLE = 1 << 16  # base elements sampled to estimate class sizes when choosing a split
_BLOCK = 1 << 18  # elements per block when scanning a base range for its classes
_MIN_SPLIT = 4096  # smaller ranges are not split: the saving would not pay for the work


class OutOfRange(CodingError):
    """A decoded position lies outside its piece's range."""


class OverLimit(CodingError):
    """A base range has more elements outside its implicit class than the caller allows to list."""


def max_exponent(dtype: str) -> int:
    width, mantissa = FLOAT_LAYOUT[dtype]
    return (1 << (width - 1 - mantissa)) - 1


def exponents(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The exponent field of float bit patterns, as int64."""
    mantissa = FLOAT_LAYOUT[dtype][1]
    return (bits.astype(np.int64) >> mantissa) & max_exponent(dtype)


def value_alphabet(width: int) -> int:
    """Value symbols for `width`-bit patterns: (16 direct codes + 4 per bit length 5..width) x sign flip."""
    return 2 * (DIRECT_CODES + (width - 4) * (1 << LEAD_BITS[width]))


# ----- values ------------------------------------------------------------------------------------


def value_codes(
    new: np.ndarray, base: np.ndarray, width: int, reference: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(c, f) for changed elements, both int64: f = sign flip (new sign != base sign) and
    c = zigzag(|new| - |base|) - (1 - f). Where `reference` is >= 0, the magnitude step is taken
    from that magnitude instead of the base's, and c = zigzag(|new| - reference).

    Every element must differ from its base (the encoder checks that for the whole delta first).
    """
    new, base = new.astype(np.int64), base.astype(np.int64)
    mag = (1 << (width - 1)) - 1
    flip = ((new ^ base) >> (width - 1)) & 1
    if reference is None:
        d = (new & mag) - (base & mag)
        return np.where(d > 0, 2 * d - 1, -2 * d) - (1 - flip), flip
    absolute = reference >= 0
    d = (new & mag) - np.where(absolute, reference, base & mag)
    return np.where(d > 0, 2 * d - 1, -2 * d) - np.where(absolute, 0, 1 - flip), flip


def apply_value_codes(
    codes: np.ndarray, flip: np.ndarray, base: np.ndarray, width: int, reference: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of `value_codes`: the new bit patterns (int64); raises CodingError on a magnitude out of range."""
    base = base.astype(np.int64)
    mag = (1 << (width - 1)) - 1
    if reference is None:
        zz, origin = codes + (1 - flip), base & mag
    else:
        absolute = reference >= 0
        zz, origin = codes + np.where(absolute, 0, 1 - flip), np.where(absolute, reference, base & mag)
    d = np.where(zz & 1, (zz + 1) >> 1, -(zz >> 1))
    magnitude = origin + d
    if magnitude.size and (int(magnitude.min()) < 0 or int(magnitude.max()) > mag):
        raise CodingError("a value step leaves the range of the dtype's magnitudes")
    return magnitude | ((base ^ (flip << (width - 1))) & ~mag)


def extra_bits_of_symbols(width: int) -> np.ndarray:
    """Raw extra bits that each value symbol carries."""
    lead_bits = LEAD_BITS[width]
    s = np.arange(value_alphabet(width)) >> 1
    return np.where(s < DIRECT_CODES, 0, ((s - DIRECT_CODES) >> lead_bits) + 4 - lead_bits)


def _bit_length(values: np.ndarray) -> np.ndarray:
    """Exact bit length of non-negative int64 values below 2**53 (frexp is exact there)."""
    return np.frexp(values.astype(np.float64))[1].astype(np.int64)


@dataclass
class ValueCode:
    """Value symbols (flip included) and the extra low bits of the large codes, for one piece."""

    symbols: np.ndarray  # int64, one per changed element
    extra: bytes  # bit planes over the elements whose code is >= DIRECT_CODES
    extra_bits: int


def code_values(codes: np.ndarray, flip: np.ndarray, width: int) -> ValueCode:
    """Symbols and extra bit planes for value codes of `width`-bit patterns (see the module docstring)."""
    lead_bits = LEAD_BITS[width]
    symbols = codes.copy()
    large = np.flatnonzero(codes >= DIRECT_CODES)
    if large.size == 0:
        return ValueCode(2 * symbols + flip, b"", 0)
    big = codes[large]
    nbits = _bit_length(big)
    extra_widths = nbits - 1 - lead_bits
    lead = (big >> extra_widths) & ((1 << lead_bits) - 1)
    symbols[large] = DIRECT_CODES + ((nbits - 5) << lead_bits) + lead
    planes = [pack_planes(big[extra_widths > j] >> j, 1) for j in range(int(extra_widths.max()))]
    return ValueCode(2 * symbols + flip, b"".join(planes), int(extra_widths.sum()))


def decode_values(symbols: np.ndarray, extra: bytes | memoryview, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, flips) from value symbols and their extra bit planes; raises CodingError."""
    if symbols.size and int(symbols.max()) >= value_alphabet(width):
        raise CodingError(f"value symbol {int(symbols.max())} is outside the {width}-bit alphabet")
    flip = symbols & 1
    codes = symbols >> 1
    large = np.flatnonzero(codes >= DIRECT_CODES)
    view = memoryview(extra)
    if large.size == 0:
        if len(view):
            raise CodingError(f"{len(view)} bytes of value extra bits but no value needs them")
        return codes, flip
    s = codes[large] - DIRECT_CODES
    lead_bits = LEAD_BITS[width]
    nbits = (s >> lead_bits) + 5
    extra_widths = nbits - 1 - lead_bits
    big = (np.int64(1) << (nbits - 1)) | ((s & ((1 << lead_bits) - 1)) << extra_widths)
    offset = 0
    for j in range(int(extra_widths.max())):
        members = np.flatnonzero(extra_widths > j)
        size = planes_size(members.size, 1)
        if offset + size > len(view):
            raise CodingError("value extra bits end early")
        big[members] |= unpack_planes(view[offset : offset + size], members.size, 1).astype(np.int64) << j
        offset += size
    if offset != len(view):
        raise CodingError(f"{len(view) - offset} trailing bytes after the value extra bits")
    codes[large] = big
    return codes, flip


def values_size_bits(value_code: ValueCode, width: int) -> tuple[float, float]:
    """Estimated bits of a piece's values as (ulp, raw): symbol entropy + extra bits, or width * k."""
    k = value_code.symbols.size
    counts = np.bincount(value_code.symbols, minlength=value_alphabet(width))
    return entropy_bits(counts) + value_code.extra_bits + 8 * (value_code.extra_bits > 0), float(width * k)


# ----- positions ---------------------------------------------------------------------------------


@dataclass
class PositionCode:
    """One class's changed ranks as coded: mode, Rice parameter, rANS symbols and raw side bytes."""

    mode: str
    rice: int
    count: int
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


def _gap_code(positions: np.ndarray, length: int, mode: str, count: int) -> PositionCode:
    gaps = np.diff(positions, prepend=np.int64(-1)) - 1
    rice = choose_rice(positions.size, length)
    quotients = gaps >> rice
    symbols = np.minimum(quotients, Q_ESCAPE)
    escaped = quotients[quotients >= Q_ESCAPE]
    low = pack_planes(gaps, rice)
    bits = entropy_bits(np.bincount(symbols, minlength=Q_ALPHABET)) + rice * positions.size + 64 * escaped.size
    return PositionCode(mode, rice, count, symbols, low, escaped.astype("<u8").tobytes(), bits)


def code_positions(local: np.ndarray, length: int) -> PositionCode:
    """The cheapest coding of sorted, unique ranks inside [0, length)."""
    k = local.size
    if k <= length // 2:
        best = _gap_code(local, length, "gaps", k)
    else:
        changed = np.zeros(length, bool)
        changed[local] = True
        best = _gap_code(np.flatnonzero(~changed), length, "complement", k)
    # A bitmap wins only in the dense middle; build it only then (it is one bit per element).
    if length < best.estimated_bits:
        changed = np.zeros(length, bool)
        changed[local] = True
        return PositionCode("bitmap", 0, k, np.zeros(0, np.int64), np.packbits(changed).tobytes(), b"", float(length))
    return best


def position_symbol_count(mode: str, count: int, length: int) -> int:
    """How many quotient symbols a class contributes to its chunk's position stream."""
    if mode == "gaps":
        return count
    if mode == "complement":
        return length - count
    return 0


def decoded_positions(mode: str, count: int, size: int) -> int:
    """Positions a class makes the decoder produce (its decode work): its ranks for "gaps", its whole size otherwise."""
    return count if mode == "gaps" else size


def decode_positions(
    mode: str, rice: int, symbols: np.ndarray, low: bytes | memoryview, escapes: bytes | memoryview, count: int, length: int
) -> np.ndarray:
    """Sorted unique int64 ranks inside [0, length) from a class's coding; raises CodingError (OutOfRange)."""
    if mode == "bitmap":
        if len(low) != -(-length // 8) or len(escapes) or symbols.size:
            raise CodingError(f"bitmap of {len(low)} bytes for {length} elements (or stray gap data)")
        bits = np.unpackbits(np.frombuffer(low, np.uint8))
        if bits[length:].any():
            raise CodingError("nonzero padding bits after the bitmap")
        positions = np.flatnonzero(bits[:length])
        if positions.size != count:
            raise CodingError(f"bitmap marks {positions.size} elements, the class declares {count}")
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
        if (extra >= np.uint64(max(length, 1))).any() or (extra < np.uint64(Q_ESCAPE)).any():
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


# ----- magnitude classes -------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassSplit:
    """Exponent `thresholds` (strictly increasing) cut a piece into len + 1 classes; class
    `implicit` is not listed (its ranks are mapped to positions around the listed ones)."""

    thresholds: tuple[int, ...] = ()
    implicit: int = 0


@dataclass
class Classes:
    """Which elements of a base range fall in which class (what both sides derive from the base)."""

    split: ClassSplit
    magnitude_limits: np.ndarray  # int64 thresholds on the sign-less bit pattern
    listed: np.ndarray  # int64 sorted positions of every element outside the implicit class
    members: list[np.ndarray | None]  # sorted positions per class, None for the implicit one
    sizes: list[int]


def check_split(split: ClassSplit, dtype: str) -> None:
    """Raise CodingError unless the split is well formed for `dtype`."""
    t = split.thresholds
    if len(t) >= MAX_CLASSES:
        raise CodingError(f"{len(t)} class thresholds, at most {MAX_CLASSES - 1}")
    if any(not 0 < x <= max_exponent(dtype) for x in t) or any(a >= b for a, b in itertools.pairwise(t)):
        raise CodingError(f"class thresholds {list(t)[:4]} are not increasing inside 1..{max_exponent(dtype)}")
    if not 0 <= split.implicit <= len(t):
        raise CodingError(f"implicit class {split.implicit} of {len(t) + 1}")


def classes(bits: np.ndarray, dtype: str, split: ClassSplit, *, max_listed: int | None = None) -> Classes:
    """Class membership of a flat base range under `split` (one pass over the range, then the listed elements).

    With `max_listed`, raises `OverLimit` as soon as more elements than that fall outside the implicit
    class, before they are all listed: a split a peer chose can make that nearly the whole range.
    """
    n = bits.size
    if not split.thresholds:
        return Classes(split, np.zeros(0, np.int64), np.zeros(0, np.int64), [None], [n])
    width, mantissa = FLOAT_LAYOUT[dtype]
    limits = np.array(split.thresholds, np.int64) << mantissa
    j = split.implicit
    sign = bits.dtype.type(1 << (width - 1))
    # The implicit class is [lo, hi) in magnitude (one side open at the ends); list everything
    # outside it. Blocks keep the scratch arrays in cache.
    lo = bits.dtype.type(limits[j - 1]) if j > 0 else None
    hi = bits.dtype.type(limits[j]) if j < limits.size else None
    magnitude = np.empty(min(n, _BLOCK), bits.dtype)
    below, above = np.empty(magnitude.size, bool), np.empty(magnitude.size, bool)
    parts, listed_size = [], 0
    for a in range(0, n, _BLOCK):
        b = min(n, a + _BLOCK)
        m, lt, ge = magnitude[: b - a], below[: b - a], above[: b - a]
        np.bitwise_and(bits[a:b], sign - bits.dtype.type(1), out=m)
        if lo is not None:
            np.less(m, lo, out=lt)
        if hi is not None:
            np.greater_equal(m, hi, out=ge)
            if lo is not None:
                np.logical_or(lt, ge, out=ge)
        parts.append(np.flatnonzero(ge if hi is not None else lt) + a)
        listed_size += parts[-1].size
        if max_listed is not None and listed_size > max_listed:
            raise OverLimit(f"more than {max_listed} elements outside the implicit class")
    listed = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    which = np.searchsorted(limits, bits[listed].astype(np.int64) & (int(sign) - 1), side="right")
    members: list[np.ndarray | None] = [None if c == j else listed[which == c] for c in range(limits.size + 1)]
    sizes = [n - listed.size if m is None else m.size for m in members]
    return Classes(split, limits, listed, members, sizes)


def class_of(bits: np.ndarray, dtype: str, cls: Classes) -> np.ndarray:
    """The class of each given base bit pattern."""
    width, _ = FLOAT_LAYOUT[dtype]
    return np.searchsorted(cls.magnitude_limits, bits.astype(np.int64) & ((1 << (width - 1)) - 1), side="right")


def ranks_in_classes(local: np.ndarray, which: np.ndarray, cls: Classes) -> list[np.ndarray]:
    """Per class, the sorted ranks (within the class) of the changed local positions in it."""
    out = []
    for c, members in enumerate(cls.members):
        p = local[which == c]
        if members is None:
            out.append(p - np.searchsorted(cls.listed, p))
        else:
            out.append(np.searchsorted(members, p))
    return out


def positions_from_ranks(ranks: Sequence[np.ndarray], cls: Classes) -> np.ndarray:
    """Sorted local positions from per-class ranks (each inside its class, as `decode_positions` ensures)."""
    parts = []
    for r, members in zip(ranks, cls.members):
        if members is None:
            parts.append(r + np.searchsorted(cls.listed - np.arange(cls.listed.size), r, side="right"))
        else:
            parts.append(members[r])
    if len(parts) == 1:
        return parts[0]
    return np.sort(np.concatenate(parts), kind="stable")  # timsort merges the sorted runs in linear time


def _binary_entropy_bits(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """n * h(k / n): about log2 C(n, k), vectorized (0 where n == 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0) + np.where(p < 1, (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)), 0))
    return n * h


def choose_split(bits: np.ndarray, dtype: str, changed_exponents: np.ndarray) -> ClassSplit:
    """The exponent split of a base range that minimises the estimated position bits (or no split).

    Class sizes are estimated from a sample of the range; the changed elements' counts are exact.
    """
    n, k = bits.size, changed_exponents.size
    if k == 0 or k == n or n < _MIN_SPLIT:
        return ClassSplit()
    top = max_exponent(dtype) + 1
    stride = max(1, n // _SAMPLE)
    sampled = np.bincount(exponents(bits[::stride], dtype), minlength=top) * (n / -(-n // stride))
    changed = np.bincount(changed_exponents, minlength=top)
    present = np.flatnonzero((sampled > 0) | (changed > 0))
    sizes = np.maximum(sampled[present], changed[present]).astype(np.float64)
    cum_n = np.concatenate(([0.0], np.cumsum(sizes)))
    cum_k = np.concatenate(([0.0], np.cumsum(changed[present]))).astype(np.float64)
    total_n, bins = cum_n[-1], present.size
    best_cost = float(_binary_entropy_bits(np.array(total_n), np.array(float(k))))
    best = ClassSplit()
    if bins < 2:
        return best
    # One cut at bin i: classes [0, i) and [i, bins).
    i = np.arange(1, bins)
    n1, k1 = cum_n[i], cum_k[i]
    n2, k2 = total_n - n1, k - k1
    cost = _binary_entropy_bits(n1, k1) + _binary_entropy_bits(n2, k2)
    listed = total_n - np.maximum(n1, n2)
    score = cost + _SPLIT_BITS_PER_LISTED * listed + _CLASS_OVERHEAD_BITS
    a = int(np.argmin(score))
    if score[a] < best_cost:
        best_cost = float(score[a])
        best = ClassSplit((int(present[i[a]]),), 0 if n1[a] >= n2[a] else 1)
    if MAX_CLASSES >= 3 and bins >= 3:
        # Two cuts i < j: classes [0, i), [i, j), [j, bins).
        ii, jj = np.triu_indices(bins - 1, k=1)
        ii, jj = ii + 1, jj + 1
        n1, n2 = cum_n[ii], cum_n[jj] - cum_n[ii]
        n3 = total_n - cum_n[jj]
        k1, k2 = cum_k[ii], cum_k[jj] - cum_k[ii]
        k3 = k - cum_k[jj]
        cost = _binary_entropy_bits(n1, k1) + _binary_entropy_bits(n2, k2) + _binary_entropy_bits(n3, k3)
        largest = np.argmax(np.stack([n1, n2, n3]), axis=0)
        listed = total_n - np.maximum(np.maximum(n1, n2), n3)
        score = cost + _SPLIT_BITS_PER_LISTED * listed + 2 * _CLASS_OVERHEAD_BITS
        a = int(np.argmin(score))
        if score[a] < best_cost:
            best = ClassSplit((int(present[ii[a]]), int(present[jj[a]])), int(largest[a]))
    return best
