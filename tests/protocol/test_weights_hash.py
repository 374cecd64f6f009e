"""The weights hash v2: the definition in the module docstring, the same on one thread and many, and every bit counts."""

import hashlib

import numpy as np
import pytest

from hivespec.protocol import weights_hash
from hivespec.protocol.delta import TensorBits
from hivespec.protocol.weights_hash import PIECE_BYTES, state_hash


def _state() -> dict[str, TensorBits]:
    rng = np.random.default_rng(0)
    big = rng.integers(0, 2**16, size=PIECE_BYTES + PIECE_BYTES // 2 + 3, dtype=np.uint16).reshape(-1, 1)  # 3 pieces, the last odd-sized
    return {
        "model.embed_tokens.weight": TensorBits("bfloat16", big),
        "model.norm.weight": TensorBits("bfloat16", rng.integers(0, 2**16, size=(576,), dtype=np.uint16)),
        "lm_head.bias": TensorBits("float32", rng.integers(0, 2**32, size=(7, 3), dtype=np.uint32)),
        "empty": TensorBits("float16", np.zeros((0, 4), dtype=np.uint16)),
    }


def _reference(state: dict[str, TensorBits]) -> bytes:
    """The module docstring's definition, written out with hashlib alone."""
    outer = hashlib.sha256(b"hivespec/weights/v2\0")
    for name in sorted(state):
        tensor = state[name]
        header = f"{name}\0{tensor.dtype}\0{','.join(map(str, tensor.bits.shape))}\0".encode()
        outer.update(len(header).to_bytes(4, "little") + header)
        data = tensor.bits.tobytes()
        for start in range(0, max(len(data), 1), PIECE_BYTES):
            outer.update(hashlib.sha256(data[start:start + PIECE_BYTES]).digest())
    return outer.digest()


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_the_hash_is_the_documented_one_on_any_number_of_threads(workers):
    state = _state()
    assert state_hash(state, workers=workers) == _reference(state)


def test_a_window_smaller_than_the_state_gives_the_same_hash(monkeypatch):
    """Pieces wait for a core at most WINDOW_BYTES at a time; the order they are fed in never changes."""
    state = _state()
    monkeypatch.setattr(weights_hash, "WINDOW_BYTES", PIECE_BYTES)
    assert state_hash(state, workers=3) == _reference(state)


def test_one_bit_a_name_or_a_shape_changes_the_hash():
    state = _state()
    before = state_hash(state, workers=2)
    flipped = state["model.embed_tokens.weight"].bits.copy()
    flipped[-1, 0] ^= 1  # the last piece's last element
    assert state_hash({**state, "model.embed_tokens.weight": TensorBits("bfloat16", flipped)}, workers=2) != before
    norm = state.pop("model.norm.weight")
    assert state_hash({**state, "model.norm.weights": norm}, workers=2) != before
    assert state_hash({**state, "model.norm.weight": TensorBits("bfloat16", norm.bits.reshape(2, 288))}, workers=2) != before
    assert state_hash({**state, "model.norm.weight": TensorBits("float16", norm.bits)}, workers=2) != before
