"""Trainer -> engine weight sync through the encoded sparse delta, bit-exact and hash-checked.

After each optimizer step the trainer's master weights are cast to the engine's dtype and
compared bit for bit with the engine's copy. Only the changed elements travel, coded by
protocol's delta format (v2: entropy-coded positions and ulp steps, chunked, bound to the hash
of the weights it applies to), and are written into the engine in place. The engine side
decodes the very bytes a follower would receive over the network, applies them, and checks the
hash of the result, so the leader's own engine and every follower go through one code path.

`EngineWeights` is that receiving side on its own (also used by `node/follower.py`): a set of
engine tensors viewed as the codec's `State`, with the version and hash of what they hold.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hivespec.kernels.delta import apply_delta, extract_delta
from hivespec.protocol.delta import (
    TensorBits,
    TensorDelta,
    WeightDelta,
    decode_delta,
    state_hash,
)
from hivespec.protocol.delta_encode import encode_delta
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits
from hivespec.protocol.verdict import Reason, Verdict

_BITS = {torch.bfloat16: (torch.int16, np.uint16), torch.float16: (torch.int16, np.uint16), torch.float32: (torch.int32, np.uint32)}
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def tensor_bits(tensor: torch.Tensor) -> TensorBits:
    """A zero-copy codec view of a contiguous CPU tensor (writes to the tensor show through)."""
    if tensor.dtype not in _BITS:
        raise ValueError(f"tensor has dtype {tensor.dtype}; sparse deltas support {list(_NAMES.values())}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"tensor must be contiguous on the CPU for the delta codec, got {tensor.device}, contiguous={tensor.is_contiguous()}")
    int_dtype, np_dtype = _BITS[tensor.dtype]
    return TensorBits(_NAMES[tensor.dtype], tensor.detach().view(int_dtype).numpy().view(np_dtype))


def tensor_delta(name: str, base: torch.Tensor, new: torch.Tensor) -> TensorDelta | None:
    """The codec's TensorDelta for new vs base (same shape and dtype), or None when no bit differs."""
    indices, values = extract_delta(base, new)
    if indices.numel() == 0:
        return None
    int_dtype, np_dtype = _BITS[base.dtype]
    return TensorDelta(
        name=name,
        shape=tuple(base.shape),
        dtype=_NAMES[base.dtype],
        indices=indices.cpu().numpy(),
        values=values.contiguous().view(int_dtype).cpu().numpy().view(np_dtype),
    )


class EngineWeights:
    """Engine tensors as a codec state, with the version and `state_hash` of what they hold.

    Deltas are decoded against these exact weights (validated in full before any write), applied
    in place, and the result is hashed: a mismatch rolls every write back and rejects the delta.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, version: int = 0, limits: Limits = DEFAULT_LIMITS) -> None:
        self.params = dict(params)
        self.state = {name: tensor_bits(t) for name, t in self.params.items()}
        self.version = version
        self.limits = limits
        self.hash = state_hash(self.state)

    def snapshot_bits(self) -> dict[str, np.ndarray]:
        """A copy of every tensor's bit patterns (to restore later with `restore`)."""
        return {name: t.bits.copy() for name, t in self.state.items()}

    def restore(self, bits: Mapping[str, np.ndarray], *, version: int, digest: bytes) -> None:
        """Overwrite every tensor with saved bit patterns of weights `version` hashing to `digest`."""
        for name, t in self.state.items():
            np.copyto(t.bits, bits[name])
        self.version, self.hash = version, digest

    def decode(self, chunks: Sequence[bytes], *, base: Mapping[str, TensorBits] | None = None, base_hash: bytes | None = None) -> tuple[Verdict, WeightDelta | None]:
        """Decode and validate chunks against our weights (or the given base); writes nothing."""
        return decode_delta(
            chunks,
            base=self.state if base is None else base,
            base_hash=self.hash if base_hash is None else base_hash,
            limits=self.limits,
        )

    def apply(self, delta: WeightDelta) -> Verdict:
        """Write a decoded delta (decoded against our current weights), then check the result hash.

        On a hash mismatch every written element is restored and the verdict says so; the
        weights, version and hash are then as before.
        """
        if delta.base_hash != self.hash:
            return Verdict.reject(Reason.BASE_MISMATCH, f"delta applies to {delta.base_hash.hex()[:16]}, weights are {self.hash.hex()[:16]}")
        undo = []
        with torch.no_grad():
            for t in delta.tensors:
                target = self.params[t.name]
                int_dtype, _ = _BITS[target.dtype]
                indices = torch.from_numpy(t.indices)
                values = torch.from_numpy(t.values.view(np.int16 if int_dtype == torch.int16 else np.int32)).view(target.dtype)
                undo.append((target, indices, apply_delta(target, indices, values)))
        digest = state_hash(self.state)
        if digest != delta.result_hash:
            with torch.no_grad():
                for target, indices, previous in undo:
                    apply_delta(target, indices, previous)
            return Verdict.reject(
                Reason.RESULT_MISMATCH,
                f"weights after the delta to version {delta.version} hash to {digest.hex()[:16]}, "
                f"the delta promised {delta.result_hash.hex()[:16]}",
            )
        self.version, self.hash = delta.version, digest
        return Verdict.accept()

    def apply_chunks(self, chunks: Sequence[bytes]) -> tuple[Verdict, WeightDelta | None]:
        """`decode` then `apply`; the verdict says why a rejected delta changed nothing."""
        verdict, delta = self.decode(chunks)
        if not verdict.ok or delta is None:
            return verdict, None
        verdict = self.apply(delta)
        return (verdict, delta) if verdict.ok else (verdict, None)


@dataclass(frozen=True)
class SyncStats:
    version: int
    changed: int
    elements: int
    delta_bytes: int
    dense_bytes: int
    chunks: int
    seconds: float
    tensors: tuple[str, ...] = ()  # names of the tensors the delta wrote (what an engine with its own copy reloads)

    @property
    def density(self) -> float:
        return self.changed / max(1, self.elements)


class WeightSync:
    """Keeps an engine's weights equal to the trainer's, cast to the engine's dtype, bit for bit."""

    def __init__(self, trainer_model: torch.nn.Module, engine_params: Mapping[str, torch.Tensor], *, limits: Limits = DEFAULT_LIMITS) -> None:
        trainer_params = dict(trainer_model.named_parameters())
        missing = sorted(set(engine_params) - set(trainer_params))
        if missing:
            raise ValueError(f"engine tensors {missing[:5]} have no trainer counterpart; are both the same architecture?")
        for name, tensor in engine_params.items():
            if tensor.dtype not in _BITS:
                raise ValueError(f"engine tensor {name} has dtype {tensor.dtype}; sparse sync supports {list(_NAMES.values())}")
        self.trainer_params = trainer_params
        self.engine = EngineWeights(engine_params, limits=limits)
        self.limits = limits

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def engine_params(self) -> dict[str, torch.Tensor]:
        return self.engine.params

    def _target(self, name: str) -> torch.Tensor:
        engine_tensor = self.engine.params[name]
        # On the engine tensor's device: a CUDA trainer syncs into an engine's CPU copy (the vLLM engine's).
        return self.trainer_params[name].detach().to(device=engine_tensor.device, dtype=engine_tensor.dtype).contiguous()

    def build_delta(self, version: int) -> WeightDelta:
        """The delta taking the engine from its current weights to the trainer's cast."""
        tensors, target_state = [], {}
        with torch.no_grad():
            for name, engine_tensor in self.engine.params.items():
                target = self._target(name)
                target_state[name] = tensor_bits(target)
                delta = tensor_delta(name, engine_tensor, target)
                if delta is not None:
                    tensors.append(delta)
        return WeightDelta(self.engine.version, version, self.engine.hash, state_hash(target_state), tuple(tensors))

    def encode(self, delta: WeightDelta) -> list[bytes]:
        """The wire chunks of a delta built by `build_delta` (against the engine's current weights)."""
        return encode_delta(delta, self.engine.state, limits=self.limits)

    def apply(self, chunks: Sequence[bytes]) -> WeightDelta:
        """Decode, validate and apply encoded chunks to the engine; raises ValueError if rejected."""
        verdict, delta = self.engine.apply_chunks(chunks)
        if not verdict.ok or delta is None:
            raise ValueError(f"weight delta rejected: {verdict}")
        return delta

    def sync(self, version: int) -> tuple[SyncStats, list[bytes]]:
        """Build, encode and apply the delta for ``version``; returns stats and the wire chunks."""
        started = time.perf_counter()
        delta = self.build_delta(version)
        chunks = self.encode(delta)
        self.apply(chunks)
        elements = sum(t.numel() for t in self.engine.params.values())
        dense = sum(t.numel() * t.element_size() for t in self.engine.params.values())
        stats = SyncStats(
            version=version,
            changed=delta.num_changed,
            elements=elements,
            delta_bytes=sum(len(c) for c in chunks),
            dense_bytes=dense,
            chunks=len(chunks),
            seconds=time.perf_counter() - started,
            tensors=tuple(dict.fromkeys(t.name for t in delta.tensors)),
        )
        return stats, chunks

    def mismatched_elements(self) -> int:
        """Number of engine elements whose bits differ from the trainer's cast (0 after a sync)."""
        with torch.no_grad():
            return sum(extract_delta(t, self._target(name))[0].numel() for name, t in self.engine.params.items())
