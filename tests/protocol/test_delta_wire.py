"""Delta wire format v4: bit-exact round trips (hypothesis), conditioning on the base, chunking, and every malformed delta rejected."""

import dataclasses
import tracemalloc
from math import lgamma, log

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivespec.protocol.codec import pack
from hivespec.protocol.delta import (
    DELTA_FORMAT_VERSION,
    PolicyHead,
    TensorBits,
    TensorDelta,
    WeightDelta,
    decode_delta,
    decode_head,
    dense_nbytes,
    encode_head,
    read_header,
)
from hivespec.protocol.delta_encode import encode_delta
from hivespec.protocol.entropy import (
    FrequencyTable,
    entropy_bits,
    rans_decode,
    rans_encode,
)
from hivespec.protocol.limits import DEFAULT_LIMITS
from hivespec.protocol.verdict import Reason
from hivespec.protocol.weights_hash import state_hash

WIDTH = {"bfloat16": 16, "float16": 16, "float32": 32}
NP = {16: np.uint16, 32: np.uint32}
EXPONENT = {"bfloat16": 0x7F80, "float16": 0x7C00, "float32": 0x7F800000}


def finite(bits, dtype):
    """Clear the top exponent bit of any NaN/inf pattern."""
    mask = EXPONENT[dtype]
    bad = (bits & mask) == mask
    bits[bad] ^= 1 << (WIDTH[dtype] - 2)
    return bits


def random_state(rng, shapes):
    state = {}
    for name, (shape, dtype) in shapes.items():
        bits = rng.integers(0, 1 << WIDTH[dtype], size=shape, dtype=np.uint64).astype(NP[WIDTH[dtype]])
        state[name] = TensorBits(dtype, finite(bits, dtype))
    return state


def random_delta(rng, base, density, *, big_moves=0.05):
    """A delta changing about `density` of each tensor: mostly +-1 ulp, some large moves, some raw patterns."""
    new, tensors = {}, []
    for name, t in base.items():
        width = WIDTH[t.dtype]
        flat = t.bits.reshape(-1).copy()
        idx = np.flatnonzero(rng.random(flat.size) < density)
        step = rng.choice([1, -1, 2, -2], size=idx.size).astype(np.int64)
        big = rng.random(idx.size) < big_moves
        step[big] = rng.integers(-(1 << (width - 3)), 1 << (width - 3), size=int(big.sum()))
        step[step == 0] = 3
        moved = finite(((flat[idx].astype(np.int64) + step) % (1 << width)).astype(flat.dtype), t.dtype)
        moved[moved == flat[idx]] ^= 1
        flat[idx] = moved
        new[name] = TensorBits(t.dtype, flat.reshape(t.bits.shape))
        if idx.size:
            tensors.append(TensorDelta(name, t.bits.shape, t.dtype, idx, flat[idx]))
    return WeightDelta(3, 4, state_hash(base), state_hash(new), tuple(tensors)), new


def structured(rng, shape, dtype, density):
    """Base weights as a trained model has them (normal, some tiny, some exact zeros) and an
    Adam-like step: tiny weights and zeros move to about the step size, the rest by 1 ulp at a
    rate that falls with their magnitude. Exercises magnitude classes and reference contexts."""
    np_float = {"bfloat16": None, "float16": np.float16, "float32": np.float32}[dtype]
    w = rng.normal(0, 0.02, size=shape)
    w[rng.random(shape) < 0.05] *= 1e-5
    w[rng.random(shape) < 0.02] = 0.0
    if dtype == "bfloat16":
        bits = (np.asarray(w, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        bits = np.asarray(w, np_float).view(NP[WIDTH[dtype]])
    base = TensorBits(dtype, finite(bits.copy(), dtype))
    flat = base.bits.reshape(-1)
    width = WIDTH[dtype]
    magnitude = flat.astype(np.int64) & ((1 << (width - 1)) - 1)
    tiny = magnitude < np.percentile(magnitude, 8)
    move = (rng.random(flat.size) < density) | (tiny & (rng.random(flat.size) < 0.9))
    step = rng.choice([-1, 1], size=flat.size)
    new = flat.astype(np.int64) + step
    lr_like = int(np.percentile(magnitude, 5))
    new[tiny] = (lr_like + rng.integers(-40, 40, size=int(tiny.sum()))) | (rng.integers(0, 2, size=int(tiny.sum())) << (width - 1))
    new = finite((new % (1 << width)).astype(flat.dtype), dtype)
    idx = np.flatnonzero(move & (new != flat))
    after = flat.copy()
    after[idx] = new[idx]
    return base, TensorDelta("w", shape, dtype, idx, new[idx]), TensorBits(dtype, after.reshape(shape))


SHAPES = {"embed.weight": ((64, 24), "bfloat16"), "norm.weight": ((24,), "float32"), "head.weight": ((7, 9), "float16")}


def make(seed=0, density=0.05):
    rng = np.random.default_rng(seed)
    base = random_state(rng, SHAPES)
    delta, new = random_delta(rng, base, density)
    return base, delta, new


def check(chunks, reason, base=None, base_hash=None, **kwargs):
    base = base if base is not None else make()[0]
    verdict, delta = decode_delta(chunks, base=base, base_hash=base_hash or state_hash(base), **kwargs)
    assert verdict.reason is reason, verdict
    assert delta is None and verdict.detail
    return verdict


def mutate_chunk(data: bytes, edit) -> bytes:
    chunk = msgpack.unpackb(data, raw=False)
    edit(chunk)
    return pack(chunk)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 0.7, 0.97, 1.0]),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    rows=st.integers(1, 300),
    cols=st.integers(1, 70),
)
@pytest.mark.parametrize("kind", ["random", "structured"])
def test_round_trip_is_bit_exact(kind, seed, density, dtype, rows, cols):
    rng = np.random.default_rng(seed)
    if kind == "random":
        base = random_state(rng, {"a": ((rows, cols), dtype), "b": ((cols,), "bfloat16")})
        delta, new = random_delta(rng, base, density)
    else:
        a, tensor, after = structured(rng, (rows * 40, cols), dtype, density)
        base, new = {"a": a}, {"a": after}
        delta = WeightDelta(3, 4, state_hash(base), state_hash(new), (dataclasses.replace(tensor, name="a"),) if tensor.indices.size else ())
    chunks = encode_delta(delta, base)
    verdict, out = decode_delta(chunks, base=base, base_hash=delta.base_hash)
    assert verdict.ok, verdict
    assert (out.base_version, out.version, out.base_hash, out.result_hash) == (3, 4, delta.base_hash, delta.result_hash)
    assert {t.name: t for t in out.tensors} == {t.name: t for t in delta.tensors}
    for t in out.tensors:  # writable, the receiving dtypes, and applying them gives `new` exactly
        assert t.indices.dtype == np.int64 and t.values.dtype == NP[WIDTH[t.dtype]] and t.values.flags.writeable
        applied = base[t.name].bits.reshape(-1).copy()
        applied[t.indices] = t.values
        assert np.array_equal(applied, new[t.name].bits.reshape(-1))


def unconditional_bound_bits(delta, base, n):
    """log2 C(n, k) + k * H(zigzag ulp steps): the bound that knows nothing of the base."""
    k = delta.num_changed
    steps = []
    for t in delta.tensors:
        d = (t.values.astype(np.int64) - base[t.name].bits.reshape(-1)[t.indices].astype(np.int64)) % (1 << 16)
        d = np.where(d >= 1 << 15, d - (1 << 16), d)
        steps.append(np.where(d > 0, 2 * d, -2 * d + 1))
    _, counts = np.unique(np.concatenate(steps), return_counts=True)
    return (lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1)) / log(2) + entropy_bits(counts)


def test_size_tracks_the_entropy_bound():
    rng = np.random.default_rng(5)
    base = random_state(rng, {"w": ((1000, 2000), "bfloat16")})
    delta, _ = random_delta(rng, base, 0.02, big_moves=0.0)
    size = sum(map(len, encode_delta(delta, base)))  # ~50 KB: fixed overhead (header, tables) is ~1%
    assert size * 8 < 1.03 * unconditional_bound_bits(delta, base, 2_000_000)
    assert size < 6 * delta.num_changed / 3  # COO is 6 bytes per changed element


def test_conditioning_on_the_base_beats_the_unconditional_bound():
    rng = np.random.default_rng(6)
    base, tensor, after = structured(rng, (1000, 1000), "bfloat16", 0.002)
    delta = WeightDelta(0, 1, state_hash({"w": base}), state_hash({"w": after}), (tensor,))
    [chunk] = encode_delta(delta, {"w": base})
    wire = msgpack.unpackb(chunk, raw=False)
    assert wire["pieces"][0]["split"], "the tiny weights should form a class of their own"
    assert any(ref is not None for _, _, ref in wire["value_contexts"]), "zeros and tiny weights step from a reference"
    assert len(chunk) * 8 < 0.6 * unconditional_bound_bits(delta, {"w": base}, 1_000_000)
    verdict, out = decode_delta([chunk], base={"w": base}, base_hash=delta.base_hash)
    assert verdict.ok and out.tensors == (tensor,)


def test_chunks_stay_under_the_cap_and_decode_in_any_order():
    base, delta, _ = make(1, density=0.4)
    limits = dataclasses.replace(DEFAULT_LIMITS, max_delta_chunk_bytes=1000)
    chunks = encode_delta(delta, base, limits=limits)
    assert len(chunks) >= 2 and max(map(len, chunks)) <= 1000
    headers = [read_header(c, limits=limits)[1] for c in chunks]
    assert [h.chunk for h in headers] == list(range(len(chunks))) and {h.chunks for h in headers} == {len(chunks)}
    verdict, out = decode_delta(chunks[::-1], base=base, base_hash=delta.base_hash, limits=limits)
    assert verdict.ok and {t.name: t for t in out.tensors} == {t.name: t for t in delta.tensors}
    check(chunks[:-1], Reason.BAD_LENGTH, base=base, limits=limits)  # a chunk missing
    check(chunks + chunks[:1], Reason.BAD_LENGTH, base=base, limits=limits)  # a chunk twice
    other = encode_delta(dataclasses.replace(delta, version=9), base, limits=limits)
    check(chunks[:-1] + other[-1:], Reason.BAD_VALUE, base=base, limits=limits)  # chunks of two deltas
    check([], Reason.BAD_LENGTH, base=base)


def test_a_large_tensor_splits_into_pieces_and_overlapping_pieces_are_rejected():
    rng = np.random.default_rng(2)
    base = random_state(rng, {"w": ((200, 100), "bfloat16")})
    delta, _ = random_delta(rng, base, 0.5)
    limits = dataclasses.replace(DEFAULT_LIMITS, max_delta_chunk_bytes=3000)
    chunks = encode_delta(delta, base, limits=limits)
    pieces = [p for c in chunks for p in msgpack.unpackb(c, raw=False)["pieces"]]
    assert len(pieces) > 1 and {p["name"] for p in pieces} == {"w"}
    assert decode_delta(chunks, base=base, base_hash=delta.base_hash, limits=limits)[0].ok
    # Chunk 1 re-labelled to cover chunk 0's range: the same positions twice.
    first = msgpack.unpackb(chunks[0], raw=False)

    def overlap(chunk):
        for key in ("pieces", "position_table", "position_symbols", "value_contexts", "value_tables", "value_symbols"):
            chunk[key] = first[key]

    check([chunks[0], mutate_chunk(chunks[1], overlap)] + chunks[2:], Reason.UNSORTED, base=base, limits=limits)


def test_base_hash_and_local_model_mismatches():
    base, delta, _ = make()
    chunks = encode_delta(delta, base)
    check(chunks, Reason.BASE_MISMATCH, base=base, base_hash=b"\x00" * 32)
    renamed = {("lm_head.weight" if n == "embed.weight" else n): t for n, t in base.items()}
    check(chunks, Reason.UNKNOWN_TENSOR, base=renamed, base_hash=state_hash(base))
    reshaped = dict(base, **{"embed.weight": TensorBits("bfloat16", base["embed.weight"].bits.reshape(24, 64))})
    check(chunks, Reason.BAD_SHAPE, base=reshaped, base_hash=state_hash(base))
    retyped = dict(base, **{"embed.weight": TensorBits("float16", base["embed.weight"].bits)})
    check(chunks, Reason.BAD_DTYPE, base=retyped, base_hash=state_hash(base))


def test_a_delta_of_another_format_names_the_side_that_is_older():
    """Format 4 changed the weights hash (v2), not the layout: a format-3 delta would fail as a base mismatch."""
    base, delta, _ = make()
    [chunk] = encode_delta(delta, base)
    for fmt, older in ((DELTA_FORMAT_VERSION - 1, "its sender runs an older"), (DELTA_FORMAT_VERSION + 1, "this node runs an older")):
        verdict, out = decode_delta([mutate_chunk(chunk, lambda c, fmt=fmt: c.update(format=fmt))], base=base, base_hash=delta.base_hash)
        assert out is None and verdict.reason is Reason.BAD_VERSION
        assert older in verdict.detail and "same version" in verdict.detail


def piece_edit(key, value, index=0):
    def edit(chunk):
        chunk["pieces"][index][key] = value
    return edit


def class_edit(field, value, index=0):
    """Set field (0 count, 1 mode, 2 rice, 3 low, 4 escapes) of piece `index`'s first class."""
    def edit(chunk):
        chunk["pieces"][index]["classes"][0][field] = value
    return edit


def test_malformed_pieces_are_rejected():
    base, delta, _ = make()
    [chunk] = encode_delta(delta, base)
    n = base["embed.weight"].bits.size
    cases = [
        (piece_edit("stop", n + 1), Reason.OUT_OF_RANGE),
        (piece_edit("start", n), Reason.OUT_OF_RANGE),
        (class_edit(0, n + 1), Reason.OUT_OF_RANGE),
        (class_edit(0, 1), Reason.MALFORMED),
        (class_edit(1, "varint"), Reason.BAD_VALUE),
        (class_edit(2, 99), Reason.MALFORMED),
        (class_edit(3, b"", index=2), Reason.MALFORMED),
        (class_edit(3, 5), Reason.BAD_TYPE),
        (piece_edit("classes", [[1, "gaps", 0, b"", b""]] * 2), Reason.BAD_LENGTH),
        (piece_edit("classes", [[1, "gaps", 0, b""]]), Reason.BAD_LENGTH),
        (piece_edit("split", [300]), Reason.MALFORMED),
        (piece_edit("split", [9, 3]), Reason.MALFORMED),
        (piece_edit("split", [1, 2, 3]), Reason.TOO_LARGE),
        (piece_edit("implicit", 1), Reason.MALFORMED),
        (piece_edit("values", 7), Reason.BAD_TYPE),
        (piece_edit("name", 5), Reason.BAD_TYPE),
        (piece_edit("shape", [1] * 9), Reason.BAD_SHAPE),
        (piece_edit("dtype", "int8"), Reason.BAD_DTYPE),
        (lambda c: c["pieces"][0].pop("classes"), Reason.BAD_KEYS),
        (lambda c: c.update(position_symbols=c["position_symbols"][:-2]), Reason.MALFORMED),
        (lambda c: c.update(value_symbols=flip_byte(c["value_symbols"])), Reason.MALFORMED),
        (lambda c: c.update(position_table=b"\x00" * len(c["position_table"])), Reason.MALFORMED),
        (lambda c: c.update(value_tables=c["value_tables"][:-1]), Reason.BAD_LENGTH),
        (lambda c: c.update(value_tables=[b"\x00" * len(t) for t in c["value_tables"]]), Reason.MALFORMED),
        (lambda c: c["value_contexts"][0].__setitem__(1, 3), Reason.MALFORMED),
        (lambda c: c["value_contexts"][0].__setitem__(2, 1 << 20), Reason.BAD_VALUE),
        (lambda c: c["value_contexts"][0].pop(), Reason.BAD_TYPE),
        (lambda c: c.update(value_contexts=[x for x in c["value_contexts"] if x[0] != "float32"]), Reason.BAD_LENGTH),
        (lambda c: c.update(format=2), Reason.BAD_VERSION),
        (lambda c: c.update(version=c["base_version"]), Reason.BAD_VALUE),
        (lambda c: c.update(chunk=1), Reason.BAD_VALUE),
        (lambda c: c.update(result_hash=b"short"), Reason.BAD_LENGTH),
        (lambda c: c.update(pieces={}), Reason.BAD_TYPE),
    ]
    for edit, reason in cases:
        verdict, out = decode_delta([mutate_chunk(chunk, edit)], base=base, base_hash=delta.base_hash)
        assert not verdict.ok and out is None and verdict.detail, (reason, verdict)
        assert verdict.reason is reason, (reason, verdict)
    check([chunk[:-1]], Reason.MALFORMED, base=base)
    check([chunk + b"\x00"], Reason.MALFORMED, base=base)
    check([chunk], Reason.TOO_LARGE, base=base, limits=dataclasses.replace(DEFAULT_LIMITS, max_delta_chunk_bytes=100))
    check([chunk], Reason.TOO_LARGE, base=base, limits=dataclasses.replace(DEFAULT_LIMITS, max_delta_chunk_elements=10))


def test_a_class_split_listing_a_whole_tensor_is_refused_before_it_is_listed():
    # A few hundred bytes naming one big tensor, with a split whose implicit class is empty: every element is "listed"
    # (int64 positions, their classes, their members). Refused only after listing, it took 16x the tensor in memory
    # (1 GiB for a 64-MiB one) to decode a chunk that could never pass the decode limit.
    n = 1 << 22
    base = {"w": TensorBits("bfloat16", np.full(n, 0x3F80, np.uint16))}  # 1.0 everywhere: exponent 127 >= the threshold
    base_hash = state_hash(base)
    limits = dataclasses.replace(DEFAULT_LIMITS, max_delta_chunk_elements=1 << 12)
    nothing = [0, "gaps", 0, b"", b""]
    chunk = pack({
        "format": DELTA_FORMAT_VERSION, "base_version": 0, "version": 1, "base_hash": base_hash, "result_hash": base_hash,
        "chunk": 0, "chunks": 1, "position_table": FrequencyTable.from_counts(np.ones(1)).to_bytes(), "position_symbols": b"",
        "value_contexts": [], "value_tables": [], "value_symbols": b"",
        "pieces": [{"name": "w", "shape": [n], "dtype": "bfloat16", "start": 0, "stop": n, "split": [1], "implicit": 0,
                    "classes": [nothing, nothing], "values": "raw", "value_bits": b""}],
    })
    assert len(chunk) < 512
    tracemalloc.start()
    try:
        verdict, delta = decode_delta([chunk], base=base, base_hash=base_hash, limits=limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert verdict.reason is Reason.TOO_LARGE and delta is None, verdict
    assert peak < n * 2  # under the tensor's own size; listing it all took 8 bytes per element for the positions alone


def flip_byte(data: bytes) -> bytes:
    return data[:-2] + bytes([data[-2] ^ 0x55, data[-1]])


def test_a_reference_context_that_lands_on_the_base_is_rejected():
    rng = np.random.default_rng(8)
    base, tensor, _ = structured(rng, (400, 100), "bfloat16", 0.01)
    delta = WeightDelta(0, 1, state_hash({"w": base}), b"\x01" * 32, (tensor,))
    [chunk] = encode_delta(delta, {"w": base})
    assert decode_delta([chunk], base={"w": base}, base_hash=delta.base_hash)[0].ok
    contexts = msgpack.unpackb(chunk, raw=False)["value_contexts"]
    i = next(i for i, (_, _, ref) in enumerate(contexts) if ref is not None)
    low, high = contexts[i][1], contexts[i + 1][1] if i + 1 < len(contexts) else 256
    old = base.bits.reshape(-1)[tensor.indices].astype(np.int64)
    new = tensor.values.astype(np.int64)
    exponent = (old >> 7) & 0xFF
    members = np.flatnonzero((exponent >= low) & (exponent < high) & ((old ^ new) >> 15 == 0))
    # Moving the reference down by |new| - |base| of one element decodes that element to its
    # base; taking the smallest such step keeps every other magnitude in range.
    steps = (new[members] & 0x7FFF) - (old[members] & 0x7FFF)
    shift = -int(steps.min())
    edited = mutate_chunk(chunk, lambda c: c["value_contexts"][i].__setitem__(2, c["value_contexts"][i][2] + shift))
    check([edited], Reason.BAD_VALUE, base={"w": base}, base_hash=delta.base_hash)


def test_raw_values_are_checked_for_finiteness_and_change():
    rng = np.random.default_rng(3)
    base = random_state(rng, {"w": ((4, 4), "bfloat16")})
    flat = base["w"].bits.reshape(-1)
    # Values far from their base (tiny to huge magnitudes): raw coding is smaller than steps.
    flat[:2] = [0x0001, 0x8002]
    target = np.array([0x7E11, 0xDE22], np.uint16)
    delta = WeightDelta(0, 1, state_hash(base), b"\x02" * 32, (TensorDelta("w", (4, 4), "bfloat16", np.array([0, 1]), target),))
    [chunk] = encode_delta(delta, base)
    assert msgpack.unpackb(chunk, raw=False)["pieces"][0]["values"] == "raw"
    assert decode_delta([chunk], base=base, base_hash=delta.base_hash)[0].ok
    inf = np.array([0x7F80, target[1]], "<u2").tobytes()
    check([mutate_chunk(chunk, piece_edit("value_bits", inf))], Reason.NOT_FINITE, base=base)
    same = flat[:2].astype("<u2").tobytes()
    check([mutate_chunk(chunk, piece_edit("value_bits", same))], Reason.BAD_VALUE, base=base)
    check([mutate_chunk(chunk, piece_edit("value_bits", b"\x00" * 6))], Reason.BAD_LENGTH, base=base)


def test_encode_refuses_invalid_local_data():
    base, _, _ = make()
    h = state_hash(base)
    bad = [
        TensorDelta("norm.weight", (24,), "float32", np.array([2, 1]), np.array([1, 2], np.uint32)),
        TensorDelta("norm.weight", (24,), "float32", np.array([1, 1]), np.array([1, 2], np.uint32)),
        TensorDelta("norm.weight", (24,), "float32", np.array([24]), np.array([1], np.uint32)),
        TensorDelta("norm.weight", (24,), "float32", np.array([1]), np.array([1], np.uint16)),
        TensorDelta("norm.weight", (24,), "float16", np.array([1]), np.array([1], np.uint16)),
        TensorDelta("norm.weight", (24,), "float32", np.array([1]), base["norm.weight"].bits[1:2]),  # unchanged value
        TensorDelta("nope", (24,), "float32", np.array([1]), np.array([1], np.uint32)),
    ]
    for t in bad:
        with pytest.raises(ValueError):
            encode_delta(WeightDelta(0, 1, h, h, (t,)), base)
    with pytest.raises(ValueError, match="32 bytes"):
        encode_delta(WeightDelta(0, 1, b"x", h, ()), base)


def test_state_hash_covers_names_shapes_dtypes_and_bits():
    base, _, _ = make()
    h = state_hash(base)
    flipped = {n: TensorBits(t.dtype, t.bits.copy()) for n, t in base.items()}
    flipped["norm.weight"].bits[3] ^= 1
    reshaped = dict(base, **{"embed.weight": TensorBits("bfloat16", base["embed.weight"].bits.reshape(24, 64))})
    retyped = dict(base, **{"embed.weight": TensorBits("float16", base["embed.weight"].bits)})
    assert len({h, state_hash(flipped), state_hash(reshaped), state_hash(retyped)}) == 4
    assert dense_nbytes(base) == 64 * 24 * 2 + 24 * 4 + 63 * 2


def test_policy_head_round_trip_and_checks():
    head = PolicyHead(7, b"\x05" * 32, 4)
    assert decode_head(encode_head(head)) == (decode_head(encode_head(head))[0], head)
    assert decode_head(pack({"version": 3, "hash": b"\x05" * 32, "snapshot": 4}))[0].reason is Reason.BAD_VALUE
    assert decode_head(pack({"version": 3, "hash": b"\x05", "snapshot": 1}))[0].reason is Reason.BAD_LENGTH
    assert decode_head(pack({"version": 3}))[0].reason is Reason.BAD_KEYS


def test_rans_is_exact_and_near_entropy():
    rng = np.random.default_rng(4)
    for n in (1, 7, 5000, 300_000):
        symbols = rng.choice(6, size=n, p=[0.5, 0.3, 0.1, 0.05, 0.04, 0.01])
        contexts = (rng.random(n) < 0.3).astype(np.int64)
        tables = [FrequencyTable.from_counts(np.bincount(symbols[contexts == c], minlength=8)) for c in (0, 1)]
        data = rans_encode(symbols, contexts, tables)
        assert np.array_equal(rans_decode(data, contexts, tables), symbols)
    ideal = sum(entropy_bits(np.bincount(symbols[contexts == c])) for c in (0, 1))
    assert len(data) * 8 < ideal + 32 * (n // 1024) + 0.01 * ideal  # lane states: 32 bits per 1024 symbols
