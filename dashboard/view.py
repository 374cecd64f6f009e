"""What a snapshot means: formatting and the four health answers, as pure functions.

The dashboard's first panel answers a new user's questions without docs: how many peers are
connected, whether rollouts flow both ways, whether speculation pays, whether reward is rising.
Each answer is a `Health` (a level and a sentence) computed here from one `StatusSnapshot`, so
`hivespec status`, the Textual panels and the tests all agree. No Textual, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hivespec.protocol.status import PeerRow, StatusSnapshot, SupervisionStatus

Level = Literal["good", "warn", "bad", "unknown"]
DASH = "-"
MIN_ACTIVE_WINDOW_S = 120.0  # a peer is "connected" if its rollouts arrived this recently ...
ACTIVE_WINDOW_ROUNDS = 3.0  # ... or within this many of our round times, whichever is longer
TREND_ROUNDS = 20  # reward trend: least-squares fit over at most this many recent rounds
TREND_MIN_ROUNDS = 3
TREND_FLAT = 0.05  # a fitted change smaller than this over the window reads as flat
# ... and one within two standard errors of the slope as noise (5 rounds of 16 samples are noisy)
SPECULATION_PAYS = 1.05  # tokens per target forward above this: drafting saves target passes


@dataclass(frozen=True)
class Health:
    """One answer on the overview: ``level`` colours it, ``text`` says it in words."""

    label: str
    level: Level
    text: str


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A number with ``spec``, or '-' when the node does not report it."""
    return DASH if value is None else format(value, spec)


def fmt_int(value: int | None) -> str:
    return DASH if value is None else f"{value:,}"


def fmt_percent(value: float | None, digits: int = 0) -> str:
    return DASH if value is None else f"{100 * value:.{digits}f}%"


def fmt_bytes(value: float | None) -> str:
    """Bytes in B/KB/MB/GB (powers of 1000, like the demo table)."""
    if value is None:
        return DASH
    n = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}GB"


def fmt_duration(seconds: float | None) -> str:
    """Compact duration: 42s, 3m05s, 2h07m, 3d04h."""
    if seconds is None:
        return DASH
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_ago(seconds: float | None) -> str:
    return DASH if seconds is None else f"{fmt_duration(seconds)} ago"


def memory_text(supervision: SupervisionStatus) -> str | None:
    """The node's memory now and at most ("2.8 GB now, 5.3 GB at most"); None where the node does not say."""
    if supervision.resident_mb is None:
        return None
    peak = supervision.peak_resident_mb
    return f"{supervision.resident_mb / 1000:.1f} GB now" + (f", {peak / 1000:.1f} GB at most" if peak is not None else "")


def micro_batch_text(supervision: SupervisionStatus) -> str | None:
    """"micro batches of 3 samples, not 8, to fit the memory" where the node's last step took fewer than its config's;
    else None."""
    size, wanted = supervision.micro_batch_size, supervision.micro_batch_wanted
    if size is None or wanted is None or size >= wanted:
        return None
    return f"micro batches of {size} sample{'s' if size != 1 else ''}, not {wanted}, to fit the memory"


def short_id(peer_id: str) -> str:
    """The first 10 characters of a peer id ("hs" + 8 hex): enough to tell peers apart on screen."""
    return peer_id[:10]


def peer_label(peer: PeerRow, names: dict[str, str] | None = None) -> str:
    """A peer's display name: a local node's configured name if known, else its readable name, else its id."""
    if names and peer.peer_id in names:
        return names[peer.peer_id]
    return peer.name or short_id(peer.peer_id)


def active_window_s(snapshot: StatusSnapshot) -> float:
    """How recently a peer must have sent rollouts to count as connected."""
    last = snapshot.rounds[-1].seconds if snapshot.rounds else 0.0
    return max(MIN_ACTIVE_WINDOW_S, ACTIVE_WINDOW_ROUNDS * last)


def is_active(snapshot: StatusSnapshot, peer: PeerRow) -> bool:
    return peer.last_seen is not None and snapshot.time - peer.last_seen <= active_window_s(snapshot)


def active_peers(snapshot: StatusSnapshot) -> list[PeerRow]:
    return [p for p in snapshot.peers if is_active(snapshot, p)]


PEER_ROWS = 100  # peers listed at most (a public swarm has hundreds): the ones heard from most recently


def listed_peers(snapshot: StatusSnapshot, names: dict[str, str] | None = None) -> list[PeerRow]:
    """The peers a table lists: the `PEER_ROWS` heard from most recently, those that sent rollouts lately first, then
    by name (so rows only move when a peer comes, goes or stops sending)."""
    heard = sorted(snapshot.peers, key=lambda p: p.last_seen or 0.0, reverse=True)[:PEER_ROWS]
    return sorted(heard, key=lambda p: (not is_active(snapshot, p), peer_label(p, names)))


def unlisted_peers_line(snapshot: StatusSnapshot, listed: Sequence[PeerRow]) -> str:
    """What `listed_peers` left out, in a line; empty where it listed every peer."""
    hidden = len(snapshot.peers) - len(listed)
    return f"and {hidden} more peers, heard from less recently" if hidden else ""


def phase_text(snapshot: StatusSnapshot) -> tuple[Level, str]:
    """The node's state in a few words, e.g. ('good', 'training round 3/5')."""
    node = snapshot.node
    target = f"/{node.rounds_target}" if node.rounds_target else ""
    done = node.round + 1  # rounds are numbered from 0 on the wire, from 1 on screen
    current = done + 1
    if node.phase == "paused":
        return "warn", f"PAUSED after round {done}{target} (p resumes)"
    if node.phase == "pausing":
        return "warn", f"pausing after round {current}{target} finishes"
    if node.phase == "stopping":
        return "warn", "stopping at the round's next safe point"
    if node.phase == "done":
        return "good", f"done: {done} rounds"
    if node.phase == "failed":
        return "bad", f"STOPPED by an error after {done} rounds: no round runs any more (the log says why)"
    if node.phase == "starting":
        return "unknown", "starting"
    if node.solo:
        return "warn", f"training round {current}{target} SOLO: no DHT peers, retrying the bootstrap"
    return "good", f"training round {current}{target}"


def peers_health(snapshot: StatusSnapshot) -> Health:
    active = active_peers(snapshot)
    seen = len(snapshot.peers)
    dht = snapshot.gossip.known_peers
    window_s = active_window_s(snapshot)
    window = fmt_duration(window_s)
    if active:
        rejected = sum(p.rejected for p in active)
        tail = f"; {rejected} rejected batches" if rejected else ""
        level: Level = "good" if not rejected else "warn"
        return Health("peers", level, f"{len(active)} connected (rollouts in the last {window}), {dht} in the DHT{tail}")
    if seen:
        # A node fetches only what its pool has room for: a step can train on peers' rollouts fetched rounds ago.
        if any(r.foreign_used and snapshot.time - r.finished_at <= window_s for r in snapshot.rounds):
            return Health("peers", "good", f"0 fetched from in the last {window}: the pool held what the steps could train on "
                                           f"({seen} seen, {dht} in the DHT)")
        return Health("peers", "bad", f"0 connected: {seen} seen, none in the last {window}; {dht} in the DHT")
    if not snapshot.rounds:
        return Health("peers", "unknown", f"none yet (first round running); {dht} in the DHT")
    return Health("peers", "warn" if dht else "bad", f"none: no peer rollouts received yet; {dht} in the DHT")


def flow_health(snapshot: StatusSnapshot) -> Health:
    """Rollouts in (peers' batches we accepted) and out (our batches peers fetched)."""
    accepted = snapshot.intake.accepted_rollouts
    authors = sum(1 for p in snapshot.peers if p.accepted)
    served = snapshot.gossip.bodies_served
    inbound = f"in {accepted:,} from {authors} peer{'s' if authors != 1 else ''}"
    outbound = f"out {served:,} of our batches fetched"
    text = f"{inbound} | {outbound}"
    if accepted and served:
        return Health("rollouts", "good", f"both ways: {text}")
    if accepted or served:
        return Health("rollouts", "warn", f"one way only: {text}")
    if not snapshot.rounds:
        return Health("rollouts", "unknown", f"not yet: {text}")
    return Health("rollouts", "bad", f"none: {text}")


def speculation_health(snapshot: StatusSnapshot) -> Health:
    measured = [r for r in snapshot.rounds if r.tokens_per_target_forward is not None]
    if not measured:
        return Health("speculation", "unknown", "not reported (plain decoding: 1 token per target forward)")
    last = measured[-1]
    tpf = last.tokens_per_target_forward or 0.0
    accepted = f", {fmt_percent(last.draft_acceptance)} of drafts accepted" if last.draft_acceptance is not None else ""
    if tpf > SPECULATION_PAYS:
        return Health("speculation", "good", f"pays: {tpf:.2f} tokens/target forward (plain 1.00){accepted}")
    return Health("speculation", "warn", f"not paying: {tpf:.2f} tokens/target forward (plain 1.00){accepted}")


def reward_trend(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` per step (0.0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    return sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sxx


def slope_stderr(values: Sequence[float]) -> float:
    """Standard error of the least-squares slope (inf for fewer than three values)."""
    n = len(values)
    if n < 3:
        return float("inf")
    slope = reward_trend(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    residual = sum((v - (mean_y + slope * (i - mean_x))) ** 2 for i, v in enumerate(values))
    return (residual / (n - 2) / sxx) ** 0.5


def reward_health(snapshot: StatusSnapshot) -> Health:
    rewards = [r.reward_mean for r in snapshot.rounds[-TREND_ROUNDS:] if r.reward_mean is not None]
    if len(rewards) < TREND_MIN_ROUNDS:
        have = len(rewards)
        return Health("reward", "unknown", f"too early: {have} round{'s' if have != 1 else ''} (a trend needs {TREND_MIN_ROUNDS})")
    slope, stderr = reward_trend(rewards), slope_stderr(rewards)
    change = slope * (len(rewards) - 1)
    span = f"{rewards[0]:.2f} -> {rewards[-1]:.2f} over {len(rewards)} rounds ({slope:+.3f}/round)"
    # A trend must be larger than TREND_FLAT over the window and than twice its own noise.
    if change > TREND_FLAT and slope > 2 * stderr:
        return Health("reward", "good", f"rising: {span}")
    if change < -TREND_FLAT and slope < -2 * stderr:
        return Health("reward", "bad", f"falling: {span}")
    if abs(change) > TREND_FLAT:
        return Health("reward", "warn", f"no clear trend yet (noisy): {span}")
    return Health("reward", "warn", f"flat: {span}")


def health(snapshot: StatusSnapshot) -> list[Health]:
    """The four overview answers, in reading order."""
    return [peers_health(snapshot), flow_health(snapshot), speculation_health(snapshot), reward_health(snapshot)]
