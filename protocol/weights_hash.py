"""The weights hash: what binds a delta to its base and its result, and what a round event calls `policy_hash`.

    sha256("hivespec/weights/v2\0"
           || for each tensor, in name order:
                u32le(len(header)) || header        header = name \0 dtype \0 comma-joined shape \0
                || sha256(piece) for each PIECE_BYTES piece of its bit patterns (one empty piece for an empty tensor))

Hashing each piece on its own lets the pieces go to every core (hashlib lets go of the GIL): the
whole stream through one sha256 (v1) took 0.24 s of a GPU node's 0.37-0.46-s sync after each
step for SmolLM2-135M's bfloat16 weights (269 MB) on its 16-core Xeon host, and 0.14 of 0.35 s
on a 2-core AMD EPYC. A node hashes its engine weights after every sync that moved one: a leader
and its followers must agree on this function, so the domain string names its version, and the
deltas bound by v2 hashes are delta format 4 (`delta.DELTA_FORMAT_VERSION`): a node of the v1 days
refuses them by their format.

Pure host code over `State` (the codec's view of a model); at most `WINDOW_BYTES` of bit patterns
wait for a core at once, so a state materialised tensor by tensor (`sync._PatchedState`) stays one
tensor plus the window in memory.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .delta import State, TensorBits

DOMAIN = b"hivespec/weights/v2\0"
PIECE_BYTES = 4 << 20  # a piece of a tensor's bits, hashed on its own
WINDOW_BYTES = 256 << 20  # bits handed to the workers and not yet hashed
_INLINE_BYTES = 64 << 10  # smaller pieces (norms, biases) are hashed where they are read: a thread hand-off costs more


def hash_workers() -> int:
    """Threads for the pieces: the cores this process may run on, at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _digest(piece: memoryview) -> bytes:
    return hashlib.sha256(piece).digest()


def state_hash(state: State, *, workers: int | None = None) -> bytes:
    """The v2 weights hash of `state` (see the module docstring), its pieces over `workers` threads (default `hash_workers()`)."""
    workers = hash_workers() if workers is None else workers
    hasher = hashlib.sha256(DOMAIN)
    if workers <= 1:
        for name in sorted(state):
            for part in _parts(name, state[name]):
                hasher.update(part if isinstance(part, bytes) else _digest(part))
        return hasher.digest()
    queue: deque[tuple[bytes | Future[bytes], int]] = deque()  # in hash order: headers, digests, digests to come
    waiting = 0  # bytes of the pieces in the queue

    def feed(limit: int) -> None:
        nonlocal waiting
        while queue and waiting > limit:
            part, size = queue.popleft()
            hasher.update(part if isinstance(part, bytes) else part.result())
            waiting -= size

    with ThreadPoolExecutor(workers, thread_name_prefix="weights-hash") as pool:
        for name in sorted(state):
            for part in _parts(name, state[name]):
                if isinstance(part, bytes):
                    queue.append((part, 0))
                elif len(part) < _INLINE_BYTES:
                    queue.append((_digest(part), 0))
                else:
                    queue.append((pool.submit(_digest, part), len(part)))
                    waiting += len(part)
                    feed(WINDOW_BYTES)
        feed(-1)
    return hasher.digest()


def _parts(name: str, tensor: TensorBits) -> list[bytes | memoryview]:
    """A tensor's header (bytes) and its pieces of bit patterns (memoryviews), in hash order."""
    header = f"{name}\0{tensor.dtype}\0{','.join(map(str, tensor.bits.shape))}\0".encode()
    data = memoryview(np.ascontiguousarray(tensor.bits).reshape(-1).view(np.uint8))
    pieces = [data[start:start + PIECE_BYTES] for start in range(0, len(data), PIECE_BYTES)] or [data]
    return [len(header).to_bytes(4, "little") + header, *pieces]
