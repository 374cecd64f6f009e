"""What the trainer learns from, the step itself, and the state that survives a crash.

- `intake.py`: `Intake` (every check on a peer's rollout batch before it is journaled: signature,
  allowlist, fingerprint, round and policy-version windows, task regeneration, token and
  reward checks; the one owner of the staleness policy: `still_fresh`), `Admission`,
  `AdmissionReason`.
- `store.py`: `RolloutStore` (the SQLite journal of own and accepted rollouts), `StoredRollout`.
- `trainer.py`: `Trainer` (GRPO with filtered truncated importance weights; `from_config`
  reads the `train` section), `ImportanceSettings`, `TrainSample`, `StepStats`.
- `foreign_pool.py`: `ForeignPool` (admitted foreign rollouts until a step takes them), `PendingRollout`.
- `node_state.py`: `NodeState` (what a checkpoint holds of a node: save and restore).
- `checkpoint.py`: `CheckpointManager` (crash-safe checkpoints: weights, optimizer, RNGs,
  manifest last), `Checkpoint`, `StateProvider`, `CheckpointError`, `CorruptCheckpoint`.
"""
