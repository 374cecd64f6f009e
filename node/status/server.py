"""The node's status server: ``/status`` (JSON), ``/metrics`` (Prometheus) and ``/control`` on loopback.

- ``GET /status``: the `StatusBoard`'s snapshot as JSON (`protocol.status.encode_status`).
- ``GET /metrics``: Prometheus text exposition format 0.0.4, ``hivespec_`` metrics, written by
  prometheus_client from the same snapshot (`prometheus_text`).
- ``POST /control`` with ``{"paused": true|false}`` and the header ``X-Hivespec-Control: 1``:
  pause or resume training (between rounds). The custom header keeps web pages out: a browser
  cannot send it cross-origin without a CORS preflight, which this server never answers; and a
  Host other than a loopback name (DNS rebinding) is refused on every path.

`ThreadingHTTPServer` in a daemon thread: a slow client never touches the round loop. The URL
is written to ``<home>/status.json`` so `hivespec status` and `hivespec dash` find a local node.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hivespec.node.status.board import RunControl, StatusBoard
from hivespec.protocol.status import StatusSnapshot

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"  # in the node's home: where `hivespec status` finds a local node
CONTROL_HEADER = "X-Hivespec-Control"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_MAX_CONTROL_BYTES = 1024
# A client that sends half a request (or reads nothing) held its thread for good: one connection left open per poll
# by anything on the machine, and the node ran out of threads. Dashboards answer in 2 s.
CLIENT_TIMEOUT_S = 10.0
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # what prometheus_client's generate_latest writes


# ----- Prometheus -------------------------------------------------------------------------


def prometheus_text(snapshot: StatusSnapshot, log_counts: dict[str, int] | None = None) -> str:
    """The snapshot as Prometheus text exposition format 0.0.4 (``hivespec_`` metrics), written by prometheus_client.

    A fresh registry per call with one collector that reads the snapshot: nothing global, and
    every scrape shows the snapshot as it is now. Non-finite and missing values are left out.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot, log_counts or {}))
    return generate_latest(registry).decode()


class _SnapshotCollector(Collector):
    """One status snapshot as metric families (the names and labels `/metrics` has always served)."""

    def __init__(self, snapshot: StatusSnapshot, log_counts: dict[str, int]) -> None:
        self.snapshot = snapshot
        self.log_counts = log_counts

    def collect(self) -> Iterator[Metric]:
        families: list[Metric] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float | None]]) -> None:
            rows = [(labels, float(value)) for labels, value in samples if value is not None and math.isfinite(value)]
            if not rows:
                return
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(f"hivespec_{name}", help_text, labels=list(rows[0][0]))
            for labels, value in rows:
                family.add_metric([labels[key] for key in rows[0][0]], value)
            families.append(family)

        snapshot = self.snapshot
        node = snapshot.node
        last = snapshot.rounds[-1] if snapshot.rounds else None
        metric("info", "gauge", "Node identity; the value is always 1.", [(
            {"name": node.name, "peer_id": node.peer_id, "swarm": node.swarm, "model": node.model, "role": node.role}, 1,
        )])
        metric("uptime_seconds", "gauge", "Seconds since the node started.", [({}, node.uptime_s)])
        metric("round", "gauge", "Last finished round (-1 before the first).", [({}, node.round)])
        metric("policy_version", "gauge", "Version of the node's policy weights.", [({}, node.policy_version)])
        metric("paused", "gauge", "1 while training is paused.", [({}, 1 if node.paused else 0)])
        metric("peers_seen", "gauge", "Peers whose rollout batches reached this node.", [({}, len(snapshot.peers))])
        gossip = snapshot.gossip
        metric("known_peers", "gauge", "Peers in the DHT routing table.", [({}, gossip.known_peers)])
        metric("gossip_bytes_total", "counter", "Rollout body bytes fetched from (in) and served to (out) peers.",
               [({"direction": "in"}, gossip.bytes_in), ({"direction": "out"}, gossip.bytes_out)])
        metric("gossip_bodies_total", "counter", "Rollout bodies fetched from and served to peers.",
               [({"direction": "in"}, gossip.bodies_fetched), ({"direction": "out"}, gossip.bodies_served)])
        metric("intake_batches_total", "counter", "Foreign rollout batches by admission outcome.",
               [({"outcome": k}, v) for k, v in sorted(snapshot.intake.outcomes.items())])
        metric("intake_reasons_total", "counter", "Foreign rollout batches by admission reason.",
               [({"reason": k}, v) for k, v in sorted(snapshot.intake.reasons.items())])
        metric("accepted_rollouts_total", "counter", "Foreign rollouts accepted.", [({}, snapshot.intake.accepted_rollouts)])
        metric("store_rollouts", "gauge", "Rollouts in the journal.",
               [({"origin": "own"}, snapshot.store.own), ({"origin": "foreign"}, snapshot.store.foreign)])
        metric("peer_batches_total", "counter", "Rollout batches received per peer.",
               [({"peer": p.peer_id, "name": p.name}, p.batches) for p in snapshot.peers])
        metric("peer_accepted_rollouts_total", "counter", "Rollouts accepted per peer.",
               [({"peer": p.peer_id, "name": p.name}, p.accepted) for p in snapshot.peers])
        metric("peer_rejected_batches_total", "counter", "Rollout batches rejected per peer.",
               [({"peer": p.peer_id, "name": p.name}, p.rejected) for p in snapshot.peers])
        if last is not None:
            metric("reward_mean", "gauge", "Mean reward of own rollouts in the last round.", [({}, last.reward_mean)])
            metric("foreign_reward_mean", "gauge", "Mean reward of foreign rollouts accepted in the last round.",
                   [({}, last.foreign_reward_mean)])
            metric("loss", "gauge", "Training loss of the last step.", [({}, last.loss)])
            metric("round_seconds", "gauge", "Wall time of the last round.", [({}, last.seconds)])
            metric("tokens_per_second", "gauge", "Generated tokens per second of rollout time, last round.",
                   [({}, last.tokens_per_second)])
            metric("tokens_per_target_forward", "gauge", "Speculative decoding: tokens per target-model forward, last round.",
                   [({}, last.tokens_per_target_forward)])
            metric("delta_bytes", "gauge", "Bytes of the last sparse weight delta.", [({}, last.delta_bytes)])
            metric("delta_density", "gauge", "Share of weights that changed in the last delta.", [({}, last.delta_density)])
        trainer = snapshot.trainer
        metric("foreign_share", "gauge", "Share of the last step's samples that came from peers.", [({}, trainer.foreign_share)])
        for attr in ("kept_fraction", "truncated_fraction", "masked_fraction", "ess_fraction", "mean_weight", "max_weight"):
            metric(f"tis_{attr}", "gauge", f"Importance weights of the last step by sample source: {attr.replace('_', ' ')}.",
                   [({"source": source.source}, getattr(source, attr)) for source in trainer.sources])
        metric("versions_behind", "gauge", "Follower: policy versions behind the swarm.", [({}, snapshot.sync.versions_behind)])
        metric("engine_mismatch_elements", "gauge", "Engine weights that differ from the trainer's cast (0 = bit-exact).",
               [({}, snapshot.sync.engine_mismatch)])
        if self.log_counts:
            metric("log_records_total", "counter", "WARNING-or-worse log records.",
                   [({"level": level}, count) for level, count in sorted(self.log_counts.items())])
        yield from families


# ----- the HTTP server ----------------------------------------------------------------------


class StatusServer:
    """``/status``, ``/metrics`` and ``/control`` on a loopback address, from a daemon thread."""

    def __init__(
        self, board: StatusBoard, control: RunControl, *, host: str = "127.0.0.1", port: int = 0,
        client_timeout: float = CLIENT_TIMEOUT_S,
    ) -> None:
        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"the status server binds loopback only (127.0.0.1, ::1 or localhost), got {host!r}")
        self.board = board
        self.control = control
        handler = _handler_for(board, control, client_timeout)
        try:
            self._server = _Server((host, port), handler)
        except OSError as exc:
            if port == 0:
                raise
            log.warning("status port %d on %s is taken (%s); serving status on a free port instead", port, host, exc)
            self._server = _Server((host, 0), handler)
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="hivespec-status", daemon=True)
        self._thread.start()
        log.info("status server on %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to stderr, the node's terminal: one for every dashboard that gave up waiting.
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("status client %s hung up: %s", client_address, error)
        else:
            log.error("status request from %s failed", client_address, exc_info=error)


def _handler_for(board: StatusBoard, control: RunControl, client_timeout: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "hivespec-status"
        timeout = client_timeout  # each socket read and write; a client that stalls is dropped, its thread freed

        def do_GET(self) -> None:
            if not self._local_host():
                return
            path = self.path.split("?", 1)[0]
            if path == "/status":
                self._send(HTTPStatus.OK, board.snapshot_bytes(), "application/json")
            elif path == "/metrics":
                text = prometheus_text(board.snapshot(), dict(board.logs.counts))
                self._send(HTTPStatus.OK, text.encode(), METRICS_CONTENT_TYPE)
            elif path == "/":
                self._send(HTTPStatus.OK, b"hivespec node: GET /status (JSON), GET /metrics (Prometheus), POST /control\n",
                           "text/plain; charset=utf-8")
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found; try /status or /metrics\n", "text/plain; charset=utf-8")

        def do_POST(self) -> None:
            if not self._local_host():
                return
            if self.path.split("?", 1)[0] != "/control":
                self._send(HTTPStatus.NOT_FOUND, b"not found; POST /control\n", "text/plain; charset=utf-8")
                return
            if self.headers.get(CONTROL_HEADER) != "1":
                self._send(HTTPStatus.FORBIDDEN, f"missing header {CONTROL_HEADER}: 1\n".encode(), "text/plain; charset=utf-8")
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 < length <= _MAX_CONTROL_BYTES:
                self._send(HTTPStatus.BAD_REQUEST, b"body: {\"paused\": true|false}, at most 1 KiB\n", "text/plain; charset=utf-8")
                return
            try:
                request = json.loads(self.rfile.read(length))
            except ValueError:
                request = None
            if not isinstance(request, dict) or not isinstance(request.get("paused"), bool):
                self._send(HTTPStatus.BAD_REQUEST, b"body: {\"paused\": true|false}\n", "text/plain; charset=utf-8")
                return
            control.set_paused(request["paused"])
            self._send(HTTPStatus.OK, json.dumps({"paused": control.paused}).encode(), "application/json")

        def _local_host(self) -> bool:
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 still sends its own Host.
            host = (self.headers.get("Host") or "").strip()
            name = host[1:].split("]", 1)[0] if host.startswith("[") else host.rsplit(":", 1)[0] if host.count(":") == 1 else host
            if name in LOOPBACK_HOSTS:
                return True
            self._send(HTTPStatus.FORBIDDEN, b"Host must be 127.0.0.1, localhost or [::1]\n", "text/plain; charset=utf-8")
            return False

        def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("status %s - " + format, self.address_string(), *args)

    return Handler


# ----- where a local node's status server is ------------------------------------------------


def write_status_file(home: Path, url: str, *, name: str, peer_id: str) -> Path:
    """Record the status URL in the node's home, so `hivespec status` finds it without flags."""
    path = home / STATUS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "name": name, "peer_id": peer_id, "written_at": time.time()}))
    tmp.replace(path)
    return path


def remove_status_file(home: Path, url: str) -> None:
    """Remove the status file if it still names our server (another node may have replaced it)."""
    path = home / STATUS_FILE
    try:
        if json.loads(path.read_text()).get("url") == url:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def read_status_url(home: Path) -> str | None:
    """The status URL a node in ``home`` recorded, or None."""
    try:
        url = json.loads((home / STATUS_FILE).read_text()).get("url")
    except (OSError, ValueError, AttributeError):
        return None
    return url if isinstance(url, str) and url.startswith("http://") else None
