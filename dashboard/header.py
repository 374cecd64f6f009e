"""The two header lines: who the node is, and whether it is training, paused or lost."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from hivespec.protocol.status import StatusSnapshot

from .view import DASH, active_peers, fmt_duration, phase_text, short_id

LEVEL_STYLE = {"good": "bold green", "warn": "bold yellow", "bad": "bold red", "unknown": "dim"}
# How peers reach this node, as peers measured it (node/swarm/nat.py): behind NAT it is relayed or unreachable.
REACH_STYLE = {"reachable": "green", "relayed": "yellow", "unreachable": "bold red"}


class StatusHeader(Static):
    """Line 1: name, short peer id, swarm, reachability, policy version, round, uptime, device.
    Line 2: state (training / paused / lost), connected peers, warnings, and the node switcher."""

    DEFAULT_CSS = "StatusHeader { dock: top; height: 2; background: $panel; padding: 0 1; }"

    def show(
        self,
        snapshot: StatusSnapshot | None,
        *,
        label: str,
        lost: str | None,
        nodes: list[tuple[str, bool]] | None = None,
    ) -> None:
        """Redraw. ``lost`` is why the node does not answer (None while it does); ``nodes`` are
        the local nodes to switch between as (name, is_current), shown only when more than one."""
        text = Text(no_wrap=True, overflow="ellipsis")
        if snapshot is None:
            text.append("hivespec ", style="bold")
            text.append(label, style="bold cyan")
            text.append("\n")
        else:
            node = snapshot.node
            target = f"/{node.rounds_target}" if node.rounds_target else ""
            text.append(node.name, style="bold cyan")
            text.append(f" {short_id(node.peer_id)}", style="dim")
            parts = [
                f"rounds done {node.round + 1}{target}",
                f"policy v{node.policy_version}",
                f"up {fmt_duration(node.uptime_s)}",
                f"swarm {node.swarm}",
            ]
            if node.role != "trainer":
                parts.insert(0, node.role)
            text.append(" | " + " | ".join(parts) + " | reach ")
            text.append(node.reachability or DASH, style=REACH_STYLE.get(node.reachability or "", ""))
            text.append(f" | {node.device or DASH}")
            text.append("\n")
        if lost is not None:
            text.append("LOST ", style="bold white on red")
            text.append(f" {lost}; retrying", style="red")
        elif snapshot is None:
            text.append(f"connecting to {label} ...", style="dim")
        else:
            level, phase = phase_text(snapshot)
            text.append(phase, style=LEVEL_STYLE[level])
            active = len(active_peers(snapshot))
            text.append(f" | {active} peer{'s' if active != 1 else ''} connected")
            warnings = sum(1 for line in snapshot.logs if line.level == "WARNING")
            errors = sum(1 for line in snapshot.logs if line.level in ("ERROR", "CRITICAL"))
            if errors:
                text.append(f" | {errors} error{'s' if errors != 1 else ''}", style="bold red")
            if warnings:
                text.append(f" | {warnings} warning{'s' if warnings != 1 else ''}", style="yellow")
            if errors or warnings:
                text.append(" (l)", style="dim")
        if nodes and len(nodes) > 1:
            text.append(" | ")
            for name, current in nodes:
                text.append(f"[{name}]" if current else f" {name} ", style="reverse" if current else "dim")
            text.append(" n: next", style="dim")
        self.update(text)
