"""Weights after each step: trainer -> engine, bit-exact, and leader -> followers over the swarm.

Both travel as the sparse delta of `hivespec.protocol.delta`; a follower applies the very
bytes the leader's own engine applied.

- `sync.py`: `WeightSync` (the trainer's step into the engine's dtype, through the encoded
  chunks, checked by hash; `SyncStats`) and `EngineWeights` (the engine's tensors as a codec
  state with version and hash).
- `publisher.py`: `PolicyPublisher` (a leader publishes each step's delta, periodic snapshots
  and its head), `cumulative_delta`.
- `follower.py`: `Follower` (mirrors a leader from the base checkpoint; gaps, reordering,
  snapshots), `FollowReport`, `follow` (the poll loop of `hivespec follow`).
"""
