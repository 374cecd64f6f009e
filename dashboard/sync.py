"""Panel 4, sync and data: weight deltas, versions behind, intake outcomes, journal and gossip counters."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline, Static

from hivespec.protocol.status import StatusSnapshot

from .view import DASH, fmt_ago, fmt_bytes, fmt_int, fmt_percent, memory_text, micro_batch_text


class SyncPanel(Vertical):
    """Delta bytes (and a sparkline per round), density, engine match, versions behind; then data flow counters."""

    DEFAULT_CSS = """
    SyncPanel #sync-facts { height: auto; }
    SyncPanel > Horizontal { height: 2; margin: 1 0; }
    SyncPanel .name { width: 18; text-style: bold; }
    SyncPanel Sparkline { width: 1fr; height: 2; }
    SyncPanel #data-facts { height: auto; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="sync-facts")
        with Horizontal():
            yield Label("delta bytes/round", classes="name")
            yield Sparkline([], id="spark-delta")
        yield Static(id="data-facts")

    def show(self, snapshot: StatusSnapshot) -> None:
        sync = snapshot.sync
        facts = Text(no_wrap=True, overflow="ellipsis")
        facts.append("weight delta  ", style="bold")
        if sync.delta_bytes:
            share = f" ({fmt_percent(sync.delta_bytes / sync.dense_bytes, 1)} of dense)" if sync.dense_bytes else ""
            facts.append(f"{fmt_bytes(sync.delta_bytes)} vs {fmt_bytes(sync.dense_bytes)} dense{share}")
        else:  # a node without followers writes its engine directly: nothing is coded
            facts.append(f"written directly (no followers), {fmt_bytes(sync.dense_bytes)} dense")
        facts.append(f" | density {fmt_percent(sync.density, 2)}")
        if sync.codec:
            facts.append(f" | codec {sync.codec}")
        facts.append("\nengine match  ", style="bold")
        if sync.engine_mismatch is None:
            facts.append(DASH)
        elif sync.engine_mismatch == 0:
            facts.append("bit-exact (0 elements differ from the trainer's cast)", style="green")
        else:
            facts.append(f"{sync.engine_mismatch:,} elements differ from the trainer's cast", style="bold red")
        node = snapshot.node
        if node.engine_dtype:
            facts.append("\nprecision     ", style="bold")
            facts.append(f"engine {node.engine_dtype}, trainer {node.train_precision or DASH}")
            for role, reason in (("engine", node.engine_dtype_reason), ("trainer", node.train_precision_reason)):
                if reason:
                    facts.append(f"\n              {role} {reason}", style="dim")
        if node.attention:
            facts.append("\nattention     ", style="bold")
            for index, choice in enumerate(node.attention):
                facts.append(("\n              " if index else "") + choice, style="dim" if index else "")
        facts.append("\nbehind swarm  ", style="bold")
        behind = sync.versions_behind
        facts.append(
            f"{DASH} (trainer: no lag)" if behind is None else f"{behind} policy version{'s' if behind != 1 else ''}",
            style="yellow" if behind else "",
        )
        self.query_one("#sync-facts", Static).update(facts)
        self.query_one("#spark-delta", Sparkline).data = [float(r.delta_bytes) for r in snapshot.rounds]

        intake, store, gossip = snapshot.intake, snapshot.store, snapshot.gossip
        data = Text(no_wrap=True, overflow="ellipsis")
        outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(intake.outcomes.items())) or DASH
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(intake.reasons.items()) if k != "ok") or "none"
        data.append("intake        ", style="bold")
        data.append(f"batches: {outcomes} | {intake.accepted_rollouts:,} rollouts accepted")
        data.append("\nnot accepted  ", style="bold")
        data.append(reasons, style="yellow" if reasons != "none" else "")
        data.append("\njournal       ", style="bold")
        data.append(f"{fmt_int(store.own)} own + {fmt_int(store.foreign)} foreign = {fmt_int(store.total)} rollouts")
        data.append("\ngossip        ", style="bold")
        data.append(
            f"in {fmt_bytes(gossip.bytes_in)} ({gossip.bodies_fetched} bodies) | out {fmt_bytes(gossip.bytes_out)} "
            f"({gossip.bodies_served} bodies) | published {gossip.published} | DHT peers {gossip.known_peers}"
        )
        node, supervision = snapshot.node, snapshot.supervision
        data.append("\ncheckpoint    ", style="bold")
        if node.checkpoint is None:
            data.append("none written yet")
        else:
            age = f", {fmt_ago(snapshot.time - node.checkpoint_at)}" if node.checkpoint_at is not None else ""
            data.append(f"{node.checkpoint} after round {fmt_int(node.checkpoint_round)}{age}")
        data.append("\nself-healing  ", style="bold")
        data.append(
            f"{fmt_int(supervision.oom_retries)} OOM retries | {fmt_int(supervision.gossip_restarts)} gossip restarts | "
            f"{fmt_int(supervision.watchdog_stalls)} stalls"
        )
        problems = gossip.bad_records + gossip.fetch_failures
        if problems:
            data.append(f"\n              {gossip.bad_records} bad records, {gossip.fetch_failures} failed fetches", style="yellow")
        older, newer = gossip.counters.get("peers_older_protocol", 0), gossip.counters.get("peers_newer_protocol", 0)
        if older or newer:  # peers of another hivespec version: their records are refused, nothing is shared with them
            data.append(f"\n              other hivespec versions: {older} older, {newer} newer peers (no sharing)", style="yellow")
        if memory := memory_text(supervision):  # last: a small screen keeps the warnings above
            data.append("\nmemory        ", style="bold")
            data.append(f"{memory} (its largest training step)" if supervision.peak_resident_mb is not None else memory)
            if shrunk := micro_batch_text(supervision):
                data.append(f"\n              {shrunk}", style="yellow")
        self.query_one("#data-facts", Static).update(data)
