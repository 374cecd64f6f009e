"""Trainer -> engine weight sync through the encoded sparse delta, bit-exact and hash-checked.

After each optimizer step the trainer's master weights are cast to the engine's dtype and
compared bit for bit with the engine's copy. Only the changed elements travel, coded by
protocol's delta format (v2: entropy-coded positions and ulp steps, chunked, bound to the hash
of the weights it applies to), and are written into the engine in place. A leader (a node with
followers) applies to its own engine the very bytes it publishes and checks the hash of the
result, so its engine and every follower go through one code path, every step.

A node without followers sends its delta nowhere, so it skips the wire coding (`sync(...,
encode=False)`): the changed elements are written straight from the trainer's cast, position by
position, or as a whole-tensor copy of each changed tensor where listing positions would cost
more than the tensor itself (a float32 engine after an Adam step: every element moves) or where
the engine is its own host mirror (a CPU engine, where the copy is the cheaper write). The same
invariant holds (engine bits == trainer cast, checked by `mismatched_elements` after each sync
that moved a weight, where the sync wrote positions: a tensor copied whole from the cast,
`SyncStats.copied`, equals it by that copy), at a fraction of the cost: 1.6 s instead of 107 s for a float32
SmolLM2-135M engine, 1.9 s instead of 5.2 s for a bfloat16 one (bench/sync_modes.py, 1 thread,
AVX2-only AMD EPYC, writing bfloat16 positions); 0.37 s instead of 3.6 s for a bfloat16 one with
whole-tensor copies (1 thread, AMD EPYC with AVX-512 and avx512_bf16), and 0.19 s since the casts
are written into a buffer kept between syncs and the weights hash runs on every core (with the
round's check, 0.53 -> 0.19 s; on an H100's host the sync took 0.37-0.46 s, 0.18-0.27 s with the
hash on every core). Counting changed elements with numpy's compare (`kernels.delta.mismatch_counts`) took the
sync of a bfloat16 engine from 0.48 to 0.35 s at 1 thread, 0.34 to 0.24 s at 2 (2-core Intel Xeon with AMX, side by
side). A step that moved no weight is synced without a look at the tensors.

`EngineWeights` is that receiving side on its own (also used by `node/weights/follower.py`): a set of
engine tensors viewed as the codec's `State`, with the version and hash of what they hold.

Devices: the engine tensors live on whatever device the model does. The codec and the hash are
host code (numpy, sha256) and need every base bit, so `EngineWeights` keeps a host mirror of the
engine's bits (on the CPU it is the engine's own storage, no copy). Diffing runs on the device;
the sparse indices and values cross to the host in one batched transfer (`to_host`), a decoded
delta is applied and hash-checked on the mirror first, and only a verified delta is written to
the device, again in one transfer (`to_device`). A rejected delta never touches the device. A node
without followers writes its own changes on the device where the diff found them, and patches the
mirror from the copy that came down.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hivespec.kernels.delta import extract_delta, mismatch_counts, write_delta
from hivespec.kernels.host_transfer import to_device, to_host
from hivespec.protocol.delta import (
    TensorBits,
    TensorDelta,
    WeightDelta,
    decode_delta,
)
from hivespec.protocol.delta_encode import encode_delta
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits
from hivespec.protocol.verdict import Reason, Verdict
from hivespec.protocol.weights_hash import state_hash

_BITS = {torch.bfloat16: (torch.int16, np.uint16), torch.float16: (torch.int16, np.uint16), torch.float32: (torch.int32, np.uint32)}
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_TORCH_OF_NAME = {name: dtype for dtype, name in _NAMES.items()}
_STAGE_BYTES = 512 << 20  # trainer casts staged on the device at once while diffing


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _BITS:
        raise ValueError(f"engine tensor {name} has dtype {tensor.dtype}; sparse deltas support {list(_NAMES.values())}")


def host_bits(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorBits]:
    """Codec views of the tensors' bits in host memory, read in one batched transfer from their device.

    CPU tensors are viewed in place (writes to them show through); device tensors are copied.
    """
    for name, tensor in tensors.items():
        _check_dtype(name, tensor)
    host = to_host([t.detach().contiguous() for t in tensors.values()])
    return {
        name: TensorBits(_NAMES[t.dtype], h.view(_BITS[t.dtype][0]).numpy().view(_BITS[t.dtype][1]))  # host data
        for (name, t), h in zip(tensors.items(), host, strict=True)
    }


def tensor_bits(tensor: torch.Tensor) -> TensorBits:
    """A codec view of one tensor's bits in host memory (zero-copy on the CPU, a copy from a device)."""
    return host_bits({"tensor": tensor})["tensor"]


class _PatchedState(Mapping[str, TensorBits]):
    """`state` with a delta applied, materialised one tensor at a time (what `state_hash` walks)."""

    def __init__(self, state: Mapping[str, TensorBits], tensors: Sequence[TensorDelta]) -> None:
        self._state, self._changes = state, {t.name: t for t in tensors}

    def __getitem__(self, name: str) -> TensorBits:
        base = self._state[name]
        change = self._changes.get(name)
        if change is None:
            return base
        bits = base.bits.copy()
        bits.reshape(-1)[change.indices] = change.values
        return TensorBits(base.dtype, bits)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class EngineWeights:
    """Engine tensors (any device) as a codec state, with the version and `state_hash` of what they hold.

    Deltas are decoded against these exact weights (validated in full before any write),
    applied to the host mirror and hashed; a mismatch rolls the mirror back and rejects the
    delta, a match writes the delta to the engine's tensors in one transfer.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, version: int = 0, limits: Limits = DEFAULT_LIMITS) -> None:
        self.params = dict(params)
        for name, tensor in self.params.items():
            if not tensor.is_contiguous():
                raise ValueError(f"engine tensor {name} is not contiguous; a delta writes flat positions into it")
        self.state = host_bits(self.params)
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
        self._push_all()
        self.version, self.hash = version, digest

    def reload(self, *, version: int) -> None:
        """Re-read the engine tensors after they were overwritten in place (a resume); rehash as `version`."""
        self.state = host_bits(self.params)
        self.version, self.hash = version, state_hash(self.state)

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
        for t in delta.tensors:
            flat = self.state[t.name].bits.reshape(-1)
            undo.append((flat, t.indices, flat[t.indices].copy()))
            flat[t.indices] = t.values
        digest = state_hash(self.state) if delta.tensors else self.hash  # an empty delta (a step that updated nothing) moved no bit
        if digest != delta.result_hash:
            for flat, indices, previous in undo:
                flat[indices] = previous
            return Verdict.reject(
                Reason.RESULT_MISMATCH,
                f"weights after the delta to version {delta.version} hash to {digest.hex()[:16]}, "
                f"the delta promised {delta.result_hash.hex()[:16]}",
            )
        self._push(delta.tensors)
        self.version, self.hash = delta.version, digest
        return Verdict.accept()

    def apply_chunks(self, chunks: Sequence[bytes]) -> tuple[Verdict, WeightDelta | None]:
        """`decode` then `apply`; the verdict says why a rejected delta changed nothing."""
        verdict, delta = self.decode(chunks)
        if not verdict.ok or delta is None:
            return verdict, None
        verdict = self.apply(delta)
        return (verdict, delta) if verdict.ok else (verdict, None)

    def mirror_mismatches(self) -> int:
        """Elements whose bits differ between the engine's tensors and the host mirror (0 unless broken).

        Moves the whole mirror to the device: a check for tests and `bench/gpu_check.py`, not a hot path.
        """
        by_device: dict[torch.device, list[str]] = {}
        for name, tensor in self.params.items():
            by_device.setdefault(tensor.device, []).append(name)
        counts = []
        for device, names in by_device.items():
            mirror = [torch.from_numpy(self.state[n].bits).view(self.params[n].dtype) for n in names]
            moved = to_device(mirror, device)
            counts.append(torch.stack(mismatch_counts([(self.params[n].detach(), m) for n, m in zip(names, moved, strict=True)])).sum())
        return sum(int(count) for count in to_host_all(counts))

    def mirrors_engine(self, name: str) -> bool:
        """True where the host mirror is the engine tensor's own storage (a CPU engine): a mirror write is the engine write."""
        return self.state[name].bits.ctypes.data == self.params[name].data_ptr()

    def _push(self, tensors: Sequence[TensorDelta]) -> None:
        """Write verified changes (already in the mirror) into the engine tensors: one transfer per device."""
        by_device: dict[torch.device, list[TensorDelta]] = {}
        for t in tensors:
            if t.indices.size and not self.mirrors_engine(t.name):
                by_device.setdefault(self.params[t.name].device, []).append(t)
        for device, group in by_device.items():
            host = []
            for t in group:
                target = self.params[t.name]
                host += [torch.from_numpy(t.indices), torch.from_numpy(t.values.view(_BITS[target.dtype][1])).view(target.dtype)]
            moved = to_device(host, device)
            with torch.no_grad():
                for i, t in enumerate(group):
                    write_delta(self.params[t.name], moved[2 * i], moved[2 * i + 1])

    def write_local(self, sparse: Sequence[TensorDelta], dense: Mapping[str, tuple[torch.Tensor, np.ndarray]]) -> None:
        """Write trusted changes (from this node's own trainer) to the engine and the mirror; no hash yet.

        ``sparse`` lists changed positions the caller has already written on the engine's device
        (from the diff it ran there: sending them back up would be a second transfer of the same
        data); they are patched into the mirror here. ``dense`` maps a tensor rewritten whole to its
        new value on the engine's device and a host copy of its bits (flat). Nothing is validated
        and the hash is stale until `commit`: never pass peer data here.
        """
        for t in sparse:
            self.state[t.name].bits.reshape(-1)[t.indices] = t.values
        with torch.no_grad():
            for name, (on_device, host_bits) in dense.items():
                self.params[name].copy_(on_device.view_as(self.params[name]))
                if not self.mirrors_engine(name):  # a device engine: the mirror is a copy
                    np.copyto(self.state[name].bits.reshape(-1), host_bits)

    def commit(self, version: int, *, rehash: bool = True) -> None:
        """Call the weights `version` and rehash them, after `write_local` (`rehash=False`: it wrote nothing, the hash stands)."""
        self.version = version
        if rehash:
            self.hash = state_hash(self.state)

    def _push_all(self) -> None:
        """Copy the whole mirror into the engine tensors (one transfer per device and bucket)."""
        by_device: dict[torch.device, list[str]] = {}
        for name, tensor in self.params.items():
            by_device.setdefault(tensor.device, []).append(name)
        with torch.no_grad():
            for device, on_device in by_device.items():
                mirror = [torch.from_numpy(self.state[n].bits).view(self.params[n].dtype) for n in on_device]
                for name, moved in zip(on_device, to_device(mirror, device), strict=True):
                    if moved.data_ptr() != self.params[name].data_ptr():
                        self.params[name].copy_(moved.view_as(self.params[name]))


def to_host_all(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`to_host` for tensors that may sit on different devices: one transfer per device."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        for i, host in zip(indices, to_host([tensors[i] for i in indices]), strict=True):
            out[i] = host
    return [t for t in out if t is not None]


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
    copied: tuple[str, ...] = ()  # of those, the ones copied whole from the trainer's cast: equal to it by that copy

    @property
    def density(self) -> float:
        return self.changed / max(1, self.elements)


class WeightSync:
    """Keeps an engine's weights equal to the trainer's, cast to the engine's dtype, bit for bit.

    Trainer and engine may sit on different devices (a CUDA trainer syncing into the vLLM
    engine's CPU copy): the cast happens on the trainer's device and moves, batched, to the
    engine's, where the diff runs.
    """

    def __init__(self, trainer_model: torch.nn.Module, engine_params: Mapping[str, torch.Tensor], *, limits: Limits = DEFAULT_LIMITS) -> None:
        trainer_params = dict(trainer_model.named_parameters())
        missing = sorted(set(engine_params) - set(trainer_params))
        if missing:
            raise ValueError(f"engine tensors {missing[:5]} have no trainer counterpart; are both the same architecture?")
        for name, tensor in engine_params.items():
            _check_dtype(name, tensor)
        self.trainer_params = trainer_params
        self.engine = EngineWeights(engine_params, limits=limits)
        self.limits = limits
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # where a CPU trainer's casts are written, sync after sync

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def engine_params(self) -> dict[str, torch.Tensor]:
        return self.engine.params

    def _targets(self, skip: Collection[str] = ()) -> Iterator[list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """(name, engine tensor, trainer cast on the engine's device) in groups of at most `_STAGE_BYTES`; every tensor
        but those in `skip`.

        Staged in groups so a large model never holds a full second copy on its device. On a CPU a group's casts are
        views of one staging buffer that the next group overwrites: use them before asking for the next.
        """
        group: list[tuple[str, torch.Tensor]] = []
        size = 0
        items = [(name, tensor) for name, tensor in self.engine.params.items() if name not in skip]
        for index, (name, engine_tensor) in enumerate(items):
            group.append((name, engine_tensor))
            size += engine_tensor.numel() * engine_tensor.element_size()
            last = index == len(items) - 1
            if not last and size < _STAGE_BYTES:
                continue
            yield self._cast(group)
            group, size = [], 0

    def _cast(self, group: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor, torch.Tensor] | None] = [None] * len(group)
        by_route: dict[tuple[torch.device, torch.device], list[int]] = {}
        for i, (name, engine_tensor) in enumerate(group):
            by_route.setdefault((self.trainer_params[name].device, engine_tensor.device), []).append(i)
        with torch.no_grad():
            for (trainer_device, engine_device), indices in by_route.items():
                pairs = [(self.trainer_params[group[i][0]], group[i][1].dtype) for i in indices]
                if trainer_device.type == engine_device.type == "cpu":
                    moved_casts = self._cast_into_staging(pairs)
                else:  # cast where the trainer is; move (batched) only when the engine sits elsewhere (vLLM's CPU copy)
                    casts = [source.detach().to(dtype).contiguous() for source, dtype in pairs]
                    moved_casts = casts if trainer_device == engine_device else to_device(casts, engine_device)
                for i, moved in zip(indices, moved_casts, strict=True):
                    out[i] = (group[i][0], group[i][1], moved)
        return [item for item in out if item is not None]

    def _cast_into_staging(self, tensors: list[tuple[torch.Tensor, torch.dtype]]) -> list[torch.Tensor]:
        """CPU tensors cast to their dtypes, written into views of a buffer kept between syncs (one per dtype).

        `copy_` rounds as `.to()` does (`.to()` is an empty tensor and a `copy_`). A fresh allocation each sync is, on
        a CPU, pages the kernel zeroes each time: the bf16 casts of SmolLM2-135M took 0.09 s that way, 0.02 s written
        into a kept buffer (1 thread, 2-core AMD EPYC). A GPU's caching allocator already reuses its blocks, and a
        buffer the sync held there would keep memory from the trainer's activations, so CUDA casts stay `.to()`.
        """
        needed: dict[torch.dtype, int] = {}
        for source, dtype in tensors:
            needed[dtype] = needed.get(dtype, 0) + source.numel()
        for dtype, count in needed.items():
            if dtype not in self._staging or self._staging[dtype].numel() < count:
                self._staging[dtype] = torch.empty(count, dtype=dtype)
        offsets = dict.fromkeys(needed, 0)
        casts = []
        for source, dtype in tensors:
            start = offsets[dtype]
            view = self._staging[dtype][start:start + source.numel()].view(source.shape)
            view.copy_(source.detach())
            offsets[dtype] = start + source.numel()
            casts.append(view)
        return casts

    def build_delta(self, version: int) -> WeightDelta:
        """The delta taking the engine from its current weights to the trainer's cast.

        The diff runs on the engine's device; the changed indices and values cross to the host
        in one transfer per device, where the result hash is taken over the mirror as patched.
        """
        found: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for group in self._targets():
                for name, engine_tensor, target in group:
                    indices, values = extract_delta(engine_tensor, target)
                    found.append((name, indices, values.view(_BITS[values.dtype][0])))
        flat = to_host_all([t for _, indices, values in found for t in (indices, values)])
        tensors = [
            self._tensor_delta(name, flat[2 * i], flat[2 * i + 1]) for i, (name, _, _) in enumerate(found) if flat[2 * i].numel()
        ]
        result = state_hash(_PatchedState(self.engine.state, tensors)) if tensors else self.engine.hash
        return WeightDelta(self.engine.version, version, self.engine.hash, result, tuple(tensors))

    def _tensor_delta(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> TensorDelta:
        """Codec form of one engine tensor's changes, from host tensors (int64 indices, values as same-width ints)."""
        engine_tensor = self.engine.params[name]
        return TensorDelta(
            name=name,
            shape=tuple(engine_tensor.shape),
            dtype=_NAMES[engine_tensor.dtype],
            indices=indices.numpy(),
            values=values.numpy().view(_BITS[engine_tensor.dtype][1]),
        )

    def encode(self, delta: WeightDelta) -> list[bytes]:
        """The wire chunks of a delta built by `build_delta` (against the engine's current weights)."""
        return encode_delta(delta, self.engine.state, limits=self.limits)

    def apply(self, chunks: Sequence[bytes]) -> WeightDelta:
        """Decode, validate and apply encoded chunks to the engine; raises ValueError if rejected."""
        verdict, delta = self.engine.apply_chunks(chunks)
        if not verdict.ok or delta is None:
            raise ValueError(f"weight delta rejected: {verdict}")
        return delta

    def sync(self, version: int, *, encode: bool = True, trainer_moved: bool = True) -> tuple[SyncStats, list[bytes]]:
        """Bring the engine to the trainer's weights as ``version``; returns stats and the wire chunks.

        ``encode=True`` (a leader) builds the wire chunks and applies them, exactly as a follower
        will; ``encode=False`` (nobody receives them) writes the changes directly and returns no chunks.
        ``trainer_moved=False``: the trainer has not changed a weight since the last sync (a step
        without an optimizer update), so the engine already holds its cast and only the version
        moves; no tensor is cast or compared (0.16-0.25 s saved a round for SmolLM2-135M on a 2-core AMD EPYC).
        """
        started = time.perf_counter()
        if not trainer_moved:
            chunks = []
            if encode:  # the empty delta a follower takes to the new version, applied here as there
                chunks = self.encode(WeightDelta(self.engine.version, version, self.engine.hash, self.engine.hash, ()))
                self.apply(chunks)
            else:
                self.engine.commit(version, rehash=False)
            changed, written, copied = 0, [], []
        elif encode:
            delta = self.build_delta(version)
            chunks = self.encode(delta)
            self.apply(chunks)
            changed, written, copied = delta.num_changed, [t.name for t in delta.tensors], []
        else:
            chunks = []
            changed, written, copied = self._write_local(version)
        stats = SyncStats(
            version=version,
            changed=changed,
            elements=sum(t.numel() for t in self.engine.params.values()),
            delta_bytes=sum(len(c) for c in chunks),
            dense_bytes=sum(t.numel() * t.element_size() for t in self.engine.params.values()),
            chunks=len(chunks),
            seconds=time.perf_counter() - started,
            tensors=tuple(dict.fromkeys(written)),
            copied=tuple(copied),
        )
        return stats, chunks

    def _write_local(self, version: int) -> tuple[int, list[str], list[str]]:
        """Write the trainer's cast into the engine, changed positions only or whole tensors; returns (changed, the
        names of the tensors written, of those the ones copied whole).

        A tensor is copied whole when its changed positions (8-byte index + value each) would
        take more memory than the tensor (the float32-after-Adam case, where every element moves),
        or when the engine's storage is its own host mirror (a CPU engine): there one copy of the
        cast costs less than finding the changed positions, and needs no host copy. For the
        embedded model's bfloat16 engine after a step that moved 9 % of it: 0.71 s -> 0.3 s, at 1
        thread on a 2-core AMD EPYC (bench/sync_modes.py).
        """
        changed, written, copied = 0, [], []
        with torch.no_grad():
            for group in self._targets():
                counts = to_host_all(mismatch_counts([(engine_tensor, target) for _, engine_tensor, target in group]))
                sparse_found: list[tuple[str, torch.Tensor, torch.Tensor]] = []
                dense_targets: list[tuple[str, torch.Tensor]] = []
                for (name, engine_tensor, target), count in zip(group, counts, strict=True):
                    n = int(count)  # host data
                    if n == 0:
                        continue
                    changed += n
                    written.append(name)
                    width = engine_tensor.element_size()
                    if n * (8 + width) >= engine_tensor.numel() * width or self.engine.mirrors_engine(name):
                        dense_targets.append((name, target))
                        copied.append(name)
                    else:
                        indices, values = extract_delta(engine_tensor, target)
                        write_delta(engine_tensor, indices, values)  # where the diff ran; the host copy is for the mirror
                        sparse_found.append((name, indices, values.view(_BITS[values.dtype][0])))
                host = to_host_all([t for _, indices, values in sparse_found for t in (indices, values)]
                                   + [target.reshape(-1).view(_BITS[target.dtype][0]) for _, target in dense_targets])
                sparse = [self._tensor_delta(name, host[2 * i], host[2 * i + 1]) for i, (name, _, _) in enumerate(sparse_found)]
                dense = {
                    name: (target, host[2 * len(sparse_found) + i].numpy().view(_BITS[target.dtype][1]))  # host data
                    for i, (name, target) in enumerate(dense_targets)
                }
                self.engine.write_local(sparse, dense)
        # A step without an optimizer update (no sample had an advantage) leaves every bit as it was.
        self.engine.commit(version, rehash=changed > 0)
        return changed, written, copied

    def reset(self, version: int) -> None:
        """Overwrite the engine with the trainer's cast and call it `version` (after a resume restored the trainer)."""
        with torch.no_grad():
            for group in self._targets():
                for _, engine_tensor, target in group:
                    engine_tensor.copy_(target)
        self.engine.reload(version=version)

    def mismatched_elements(self, skip: Collection[str] = ()) -> int:
        """Number of engine elements whose bits differ from the trainer's cast (0 after a sync); one read at the end.

        `skip`: tensors not to look at (a sync's `SyncStats.copied`, equal to the cast by the copy that wrote them).
        """
        counts = []
        with torch.no_grad():
            for group in self._targets(set(skip)):
                counts += mismatch_counts([(engine_tensor, target) for _, engine_tensor, target in group])
        if not counts:
            return 0
        return sum(int(c) for c in to_host_all([torch.stack([c for c in counts if c.device == d]).sum()
                                                  for d in dict.fromkeys(c.device for c in counts)]))
