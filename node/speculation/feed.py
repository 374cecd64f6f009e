"""What the drafter learns from: the one path every rollout takes into it, and into the trace.

A node feeds its suffix drafter three kinds of rollouts, all through `DrafterFeed`: its own
right after a round generated them, peers' rollouts as intake accepts them (shared prompts:
their completions predict ours), and at start-up the most recent journaled ones (`replay`, the
rebuild after a restart). The first two are also written to the rollout trace
(``speculation.trace_file``) in the order fed, which is what `bench/drafter_replay.py` replays;
the start-up rebuild is not traced again (those rollouts were traced when first fed).

Owns nothing else: it never decides how many tokens to draft (policy.py) or touches
the engine. With no drafter and no trace every call is a no-op, so callers never branch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hivespec.node.speculation.trace import TraceRecord
from hivespec.protocol.rollout import Rollout, decode_rollout

if TYPE_CHECKING:
    from hivespec.node.speculation.drafter import SuffixDrafter
    from hivespec.node.speculation.trace import TraceWriter
    from hivespec.node.training.store import RolloutStore

log = logging.getLogger(__name__)


class DrafterFeed:
    """Feeds rollouts to a drafter (None: speculation off) and records them in a trace (None: not tracing)."""

    def __init__(self, drafter: SuffixDrafter | None = None, trace: TraceWriter | None = None, *, node: str = "") -> None:
        self.drafter = drafter
        self.trace = trace
        self.node = node  # the recording node's name, in each trace line

    @property
    def observed(self) -> int:
        """Rollouts the drafter has observed since it was made (the start-up rebuild included); 0 without one."""
        return self.drafter.observed if self.drafter is not None else 0

    def feed(self, rollouts: Sequence[Rollout], *, own: bool, author: str, round_index: int, policy_version: int) -> None:
        """The drafter observes `rollouts` in order, and the trace records them.

        `own`: the node generated them in round `round_index` (else: accepted from `author`
        while collecting that round); `policy_version` is the policy that sampled them.
        """
        if self.drafter is not None:
            for rollout in rollouts:
                self.drafter.observe(rollout.prompt_ids.tolist(), rollout.completion_ids.tolist())
        if self.trace is not None:
            self.trace.record(
                TraceRecord(
                    node=self.node, own=own, author=author, round=round_index, prompt_key=r.prompt_id,
                    prompt_ids=r.prompt_ids.tolist(), completion_ids=r.completion_ids.tolist(), sample_index=r.sample_index,
                    seed=r.seed, policy_version=policy_version, finish_reason=r.finish_reason,
                )
                for r in rollouts
            )

    def replay(self, store: RolloutStore, limit: int, *, up_to_rowid: int | None = None) -> int:
        """Feed the drafter the `limit` most recent journaled rollouts (own and accepted foreign), oldest first.

        `up_to_rowid` stops at that journal row (a resume: the drafter then holds what it held at
        the checkpoint). Not traced. Returns how many were fed; rows whose payload no longer
        decodes are skipped (logged at debug).
        """
        if self.drafter is None:
            return 0
        replayed = 0
        for row in reversed(store.recent(limit, up_to_rowid=up_to_rowid)):
            verdict, rollout = decode_rollout(row.payload)
            if rollout is None:
                log.debug("drafter rebuild: skipping a stored rollout that does not decode (%s)", verdict.reason)
                continue
            self.drafter.observe(rollout.prompt_ids.tolist(), rollout.completion_ids.tolist())
            replayed += 1
        return replayed

    def flush(self) -> None:
        """Write the trace lines of the round so far (once per round)."""
        if self.trace is not None:
            self.trace.flush()

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
