"""One snapshot as plain text, for `hivespec status` (no Textual: it must start fast)."""

from __future__ import annotations

from hivespec.protocol.status import StatusSnapshot

from .view import (
    DASH,
    fmt,
    fmt_ago,
    fmt_bytes,
    fmt_duration,
    fmt_percent,
    health,
    is_active,
    listed_peers,
    memory_text,
    micro_batch_text,
    peer_label,
    phase_text,
    short_id,
    unlisted_peers_line,
)


def render_text(snapshot: StatusSnapshot) -> str:
    """The overview a user reads in a terminal or pastes into a bug report."""
    node = snapshot.node
    target = f"/{node.rounds_target}" if node.rounds_target else ""
    title = (
        f"{node.name} ({short_id(node.peer_id)})  swarm {node.swarm}  rounds done {node.round + 1}{target}  "
        f"policy v{node.policy_version}  up {fmt_duration(node.uptime_s)}  {node.model} on {node.device or DASH}  "
        f"reach {node.reachability or DASH}"
    )
    lines = [
        title,
        f"state: {phase_text(snapshot)[1]}",
    ]
    if memory := memory_text(snapshot.supervision):
        shrunk = micro_batch_text(snapshot.supervision)
        lines.append(f"memory: {memory}" + (f"; {shrunk}" if shrunk else ""))
    if node.engine_dtype:
        lines.append(f"precision: engine {node.engine_dtype}, trainer {node.train_precision or DASH}")
        lines += [f"  {role} {reason}" for role, reason in (("engine", node.engine_dtype_reason),
                                                            ("trainer", node.train_precision_reason)) if reason]
    if node.attention:
        lines.append("attention:")
        lines += [f"  {choice}" for choice in node.attention]
    lines.append("")
    lines += [f"{answer.label:>11}  {answer.text}" for answer in health(snapshot)]
    lines.append("")
    if snapshot.peers:
        lines.append(f"  {'peer':<22} {'last seen':>11} {'batches':>8} {'accepted':>9} {'rej/ign':>8} {'score':>6}")
        listed = listed_peers(snapshot)
        for peer in listed:
            seen = snapshot.time - peer.last_seen if peer.last_seen is not None else None
            mark = "*" if is_active(snapshot, peer) else " "
            lines.append(
                f"{mark} {peer_label(peer)[:22]:<22} {fmt_ago(seen):>11} {peer.batches:>8} {peer.accepted:>9} "
                f"{f'{peer.rejected}/{peer.ignored}':>8} {fmt(peer.score):>6}"
            )
        if more := unlisted_peers_line(snapshot, listed):
            lines.append(f"  {more} (all of them: --json)")
        lines.append("  (* = sent rollouts recently)")
    else:
        lines.append("  no peer batches received yet")
    if snapshot.rounds:
        last = snapshot.rounds[-1]
        lines.append("")
        lines.append(
            f"last round {last.round}: reward {fmt(last.reward_mean)} (peers' {fmt(last.foreign_reward_mean)}), "
            f"loss {fmt(last.loss, '.4f')}, {fmt(last.tokens_per_second, '.1f')} tokens/s, "
            f"{fmt(last.rollouts_per_minute, '.1f')} rollouts/min, {last.seconds:.1f}s"
        )
        sync = snapshot.sync
        lines.append(
            f"sync: delta {fmt_bytes(sync.delta_bytes)} of {fmt_bytes(sync.dense_bytes)} dense, density "
            f"{fmt_percent(sync.density, 2)}, engine mismatch {DASH if sync.engine_mismatch is None else sync.engine_mismatch}, "
            f"versions behind {DASH if sync.versions_behind is None else sync.versions_behind}"
        )
        trainer = snapshot.trainer
        lines.append(f"trainer: {trainer.trained_samples} samples, foreign share {fmt_percent(trainer.foreign_share)}")
    problems = [line for line in snapshot.logs if line.level != "INFO"]
    if problems:
        latest = problems[-1]
        lines.append("")
        lines.append(f"{len(problems)} recent warnings/errors; latest: {latest.level} {latest.logger}: {latest.message}")
    return "\n".join(lines)
