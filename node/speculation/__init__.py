"""Lossless speculative rollouts: what to draft, when drafting pays, and traces to replay it.

The engine (`node/model/engine.py`) verifies drafts with keyed sampling, so speculation never
changes a completion; this package only decides how many tokens each row drafts.

- `drafter.py`: `SuffixDrafter` (suffix automata, `SuffixIndex`, over recent rollouts, per
  prompt and global), `Draft`, `DraftSession`.
- `curve.py`: `VerifyCostCurve` (what a K-token verify costs against a plain step, per batch
  size), `calibrate_verify_cost`, the per-machine cache (`load_cached_curve`,
  `load_or_calibrate`, `device_verify_cost`).
- `policy.py`: `LengthAwarePolicy` (per-row draft caps from length classes, the step width
  that pays), `UniformPolicy`, `RowPlan`, `SpeculationPolicy`; `CurveCalibration` (measures
  the curve while the node would sit idle); `build_speculation`.
- `feed.py`: `DrafterFeed`, the one path into the drafter (own rollouts, accepted foreign ones, the
  start-up rebuild from the journal), tracing included.
- `trace.py`: `TraceWriter` / `read_trace` (what a node fed its drafter, as JSON lines) and
  `replay` (feeds a trace through the drafter alone, for benchmarks).
"""
