"""Admission of foreign rollout envelopes: every check runs before anything touches torch.

A peer's bytes pass, in order: envelope size, decode, signature and clock (protocol), announcing
peer == author, replay (author, seq), batch schema with the vocabulary bound (protocol), model
fingerprint, staleness (age in seconds by the signed timestamp, and policy-version distance: nodes
share no round numbers, so a batch's round is only its author's step count), then per rollout: the task is one we can regenerate from its prompt id
(a rollout whose spec is not, such as another reasoning-gym version or a dataset we do not hold,
is skipped and counted by reason, never trusted), the prompt tokens are exactly our chat prompt
for it, and the claimed reward equals the reward our own verifier computes. In a private swarm the author must be on the allowlist. The outcome
follows gossipsub v1.1: ``accept``; ``ignore`` (honest but useless: stale, duplicate, replayed)
with no penalty; ``reject`` (provably wrong) for the sender's score. `Admission.blame` names the
peer to score: the signer for content it signed, the holder that served it when the signature
does not verify or names another author. The replay log is pruned of envelopes past the clock
window (they are refused by timestamp first), so it stays bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Literal

import numpy as np

from hivespec.node.tasks.base import Task
from hivespec.node.tasks.source import TaskSource
from hivespec.node.training.store import RolloutStore, StoredRollout
from hivespec.protocol.envelope import Envelope, Kind, open_envelope
from hivespec.protocol.limits import DEFAULT_LIMITS, Limits
from hivespec.protocol.rollout import Rollout, decode_batch

if TYPE_CHECKING:
    from hivespec.node.config import TrainConfig
    from hivespec.protocol.private import PrivateSwarm

log = logging.getLogger(__name__)
_PRUNE_EVERY = 256  # admissions between prunes of the replay log
# Chat prompts' token ids kept by prompt id: a batch's completions share a prompt, and a prompt comes back
# within a few rounds or never (~4 KB each). Emptied only at 4096, the cache grew for hours like a leak.
_PROMPTS_CACHED = 256
# Rollouts skipped because their prompt spec is not regenerable here are counted per rollout in
# `IntakeCounters.reasons` as "spec:<reason>" (reasons: `TaskSource.resolve`).
SPEC_REASON_PREFIX = "spec:"

Outcome = Literal["accept", "ignore", "reject"]


class AdmissionReason(StrEnum):
    """Application-level reasons, on top of protocol's wire-level ``Reason`` values."""

    AUTHOR_MISMATCH = "author_mismatch"  # announced by one peer, signed by another
    REPLAY = "replay"  # (author, seq) seen before
    FINGERPRINT = "fingerprint_mismatch"  # another model or tokenizer
    STALE = "stale"  # signed more than staleness_seconds ago
    STALE_VERSION = "stale_version"  # policy more than staleness_versions from ours, either way
    UNKNOWN_TASK = "unknown_task"  # no rollout's prompt id is one we can regenerate (ignored, not trusted)
    PROMPT_MISMATCH = "prompt_mismatch"  # prompt tokens differ from our chat prompt for the task
    REWARD_MISMATCH = "reward_mismatch"  # claimed reward differs from our verifier's
    DUPLICATE = "duplicate"  # every rollout already stored
    NOT_ALLOWED = "not_on_allowlist"  # private swarm: the author is not a member


@dataclass(frozen=True)
class Admission:
    outcome: Outcome
    reason: str
    detail: str = ""
    author: str = ""
    rollouts: tuple[Rollout, ...] = ()
    policy_version: int = -1
    born: float = 0.0  # when the author signed the batch (its envelope's timestamp)
    signed_by: str = ""  # peer id whose signature verified ("" if it did not): who to score for a reject

    def blame(self, holder: str) -> str:
        """The peer to score for this verdict: the signer for what it signed, else the holder that served it."""
        if self.signed_by and self.reason != AdmissionReason.AUTHOR_MISMATCH:
            return self.signed_by
        return holder or self.author


@dataclass(frozen=True)
class AdmissionTally:
    """A round's admissions counted: bodies received, rollouts accepted, bodies rejected and ignored."""

    received: int = 0
    accepted: int = 0  # rollouts (a body may carry several)
    rejected: int = 0
    ignored: int = 0
    reward_mean: float | None = None  # claimed (and re-verified) reward of the accepted rollouts; None when none

    @classmethod
    def of(cls, admissions: Sequence[Admission]) -> AdmissionTally:
        accepted = [a for a in admissions if a.outcome == "accept"]
        rewards = [r.reward for a in accepted for r in a.rollouts]
        return cls(
            received=len(admissions),
            accepted=sum(len(a.rollouts) for a in accepted),
            rejected=sum(1 for a in admissions if a.outcome == "reject"),
            ignored=sum(1 for a in admissions if a.outcome == "ignore"),
            reward_mean=float(np.mean(rewards)) if rewards else None,
        )


@dataclass
class IntakeCounters:
    accepted_rollouts: int = 0
    outcomes: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)


class Intake:
    """Validates foreign envelopes and journals the rollouts that pass."""

    def __init__(
        self,
        *,
        fingerprint: str,
        vocab_size: int,
        tasks: TaskSource,
        tokenizer,
        store: RolloutStore,
        staleness_seconds: float,
        staleness_versions: int | None = None,
        allowlist: frozenset[bytes] | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.store = store
        self.staleness_seconds = staleness_seconds
        self.staleness_versions = staleness_versions
        self.allowlist = allowlist
        self.limits = limits
        self._admitted = 0
        self.counters = IntakeCounters()
        self._prompt_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # prompt id -> chat prompt ids, LRU

    @classmethod
    def from_config(
        cls,
        train: TrainConfig,
        *,
        fingerprint: str,
        vocab_size: int,
        tasks: TaskSource,
        tokenizer,
        store: RolloutStore,
        private: PrivateSwarm | None,
    ) -> Intake:
        """An intake with the `train` section's staleness window; a private swarm admits its allowlist's authors only."""
        return cls(
            fingerprint=fingerprint, vocab_size=vocab_size, tasks=tasks, tokenizer=tokenizer, store=store,
            staleness_seconds=train.staleness_seconds, staleness_versions=train.staleness_versions,
            allowlist=private.allowlist if private is not None else None,
        )

    def _version_stale(self, policy_version: int, current_version: int | None) -> bool:
        window = self.staleness_versions
        return window is not None and current_version is not None and policy_version >= 0 and abs(policy_version - current_version) > window

    def version_window(self, current_version: int | None):
        """Whether a batch from a policy version may still be used while ours is `current_version` (gossip's pre-filter)."""
        return lambda policy_version: not self._version_stale(policy_version, current_version)

    def still_fresh(self, born: float, policy_version: int, *, current_version: int | None, now: float | None = None) -> bool:
        """Whether an admitted rollout may still be trained on: younger than staleness_seconds, within the version window.

        The staleness policy has one owner, this class: `admit` ignores batches outside the
        windows, gossip fetches none it can tell are (`version_window`), and the runtime asks this
        before it trains on a rollout admitted steps ago. A `policy_version` below 0 (not known)
        passes the version window.
        """
        now = time.time() if now is None else now
        return now - born <= self.staleness_seconds and not self._version_stale(policy_version, current_version)

    def admit(self, announced_by: str, data: bytes, *, current_version: int | None = None) -> Admission:
        """Run every check on one envelope; never raises on bad input.

        With ``current_version`` (our policy version) and ``staleness_versions`` set, a batch whose
        policy is more than that many versions from ours (behind or ahead: a fast node runs far
        ahead of a slow one) is ignored.
        """
        try:
            admission = self._admit(announced_by, data, current_version)
        except Exception as exc:  # a bug here must not take the receive loop down
            log.exception("intake failed on an envelope from %s", announced_by)
            admission = Admission("reject", "internal_error", repr(exc), announced_by)
        self.counters.outcomes[admission.outcome] += 1
        self.counters.reasons[admission.reason] += 1
        self.counters.accepted_rollouts += len(admission.rollouts)
        if admission.outcome != "accept":
            log.debug("%s envelope from %s: %s %s", admission.outcome, announced_by, admission.reason, admission.detail)
        return admission

    def _admit(self, announced_by: str, data: bytes, current_version: int | None) -> Admission:
        verdict, envelope = open_envelope(data, limits=self.limits, expected_kind=Kind.ROLLOUTS)
        if not verdict.ok or envelope is None:
            return Admission("reject", verdict.reason.value, verdict.detail, announced_by)
        admission = self._admit_signed(envelope, announced_by, current_version)
        return dataclasses.replace(admission, signed_by=envelope.peer_id)

    def _admit_signed(self, envelope: Envelope, announced_by: str, current_version: int | None) -> Admission:
        author = envelope.peer_id
        if self.allowlist is not None and envelope.author not in self.allowlist:
            return Admission("reject", AdmissionReason.NOT_ALLOWED, "author is not on the private swarm's allowlist", author)
        if author != announced_by:
            return Admission("reject", AdmissionReason.AUTHOR_MISMATCH, f"signed by {author}", announced_by)
        verdict, batch = decode_batch(envelope.body, limits=self.limits, vocab_size=self.vocab_size)
        if not verdict.ok or batch is None:
            return Admission("reject", verdict.reason.value, verdict.detail, author)
        if batch.fingerprint != self.fingerprint:
            return Admission("ignore", AdmissionReason.FINGERPRINT, f"{batch.fingerprint} != ours {self.fingerprint}", author)
        age = time.time() - envelope.timestamp  # signed; a future timestamp was refused with the envelope
        if age > self.staleness_seconds:
            return Admission("ignore", AdmissionReason.STALE, f"signed {age:.0f} s ago (> {self.staleness_seconds:g} s)", author)
        if self._version_stale(batch.policy_version, current_version):
            return Admission("ignore", AdmissionReason.STALE_VERSION, f"version {batch.policy_version}, ours {current_version}", author)
        usable: list[Rollout] = []
        unregenerable: Counter = Counter()
        for rollout in batch.rollouts:
            task, why = self.tasks.resolve(rollout.prompt_id)
            if task is None:
                # A spec we cannot rebuild (another family, dataset, version or config) is not
                # evidence of a lie: skip the rollout, never trust its reward.
                unregenerable[why] += 1
                continue
            checked = self._verified(rollout, task)
            if not isinstance(checked, Rollout):
                reason, detail = checked
                return Admission("reject", reason, f"{rollout.prompt_id}#{rollout.sample_index}: {detail}", author)
            usable.append(checked)
        for why, count in unregenerable.items():
            self.counters.reasons[f"{SPEC_REASON_PREFIX}{why}"] += count
        if not usable:
            detail = ", ".join(f"{why} x{count}" for why, count in unregenerable.most_common())
            return Admission("ignore", AdmissionReason.UNKNOWN_TASK, detail, author)
        # Replay is checked last so a rejected forgery cannot burn an honest (author, seq).
        if not self.store.remember_envelope(author, envelope.seq, envelope.timestamp):
            return Admission("ignore", AdmissionReason.REPLAY, f"seq {envelope.seq}", author)
        now = time.time()
        self._admitted += 1
        if self._admitted % _PRUNE_EVERY == 0:
            # Older envelopes fail the clock check before the replay log is read: forget them.
            self.store.prune_envelopes(now - self.limits.max_clock_skew_s - 60.0)
        # A peer whose clock runs ahead signs up to the clock window (300 s) in the future: its batch is no younger than
        # now, else it would stay fresh (and be trained on) that much past staleness_seconds.
        born = min(envelope.timestamp, now)
        rows = [
            StoredRollout.from_rollout(
                r, author=author, round=batch.round, policy_version=batch.policy_version, own=False, received_at=now,
                born=born,
            )
            for r in usable
        ]
        # A rollout already journaled, or twice in this batch, is admitted once: copies would each be trained on.
        seen = set(self.store.existing([row.content_hash for row in rows]))
        fresh = []
        for r, row in zip(usable, rows):
            if row.content_hash not in seen:
                seen.add(row.content_hash)
                fresh.append(r)
        self.store.add_rollouts(rows)
        if not fresh:
            return Admission("ignore", AdmissionReason.DUPLICATE, "", author)
        return Admission("accept", "ok", "", author, tuple(fresh), batch.policy_version, born=born)

    def _verified(self, rollout: Rollout, task: Task) -> Rollout | tuple[str, str]:
        """`rollout` carrying the reward we computed, or (reason, detail) refusing it.

        A claim within rounding of our reward is honest; the claim itself is never kept: a group verified flat but
        claimed `[0, 0, 0, 1e-6]` would otherwise train as informative, crowd honest groups out of the pool and
        shrink every honest sample's share of the step's tokens.
        """
        expected = self._prompt_ids(task)
        if tuple(int(t) for t in rollout.prompt_ids) != expected:
            return AdmissionReason.PROMPT_MISMATCH, "prompt tokens differ from our chat prompt"
        text = self.tokenizer.decode(np.asarray(rollout.completion_ids).tolist(), skip_special_tokens=True)
        reward = float(self.tasks.reward(task, text))
        if not np.isclose(reward, rollout.reward, atol=1e-6):
            return AdmissionReason.REWARD_MISMATCH, f"claimed {rollout.reward}, verified {reward}"
        return rollout if reward == rollout.reward else dataclasses.replace(rollout, reward=reward)

    def _prompt_ids(self, task) -> tuple[int, ...]:
        cached = self._prompt_cache.get(task.prompt_id)
        if cached is None:
            cached = tuple(self.tasks.chat_prompt_ids(self.tokenizer, task))
            self._prompt_cache[task.prompt_id] = cached
            while len(self._prompt_cache) > _PROMPTS_CACHED:
                self._prompt_cache.popitem(last=False)
        else:
            self._prompt_cache.move_to_end(task.prompt_id)
        return cached
