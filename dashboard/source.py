"""Where snapshots come from: a node's status server over local HTTP, or a function in-process.

A source's calls block (they are run in Textual thread workers, never on the event loop) and
fail only with `SourceError`, whose message says what to check. Standard library only, so
`hivespec status` stays fast and never imports torch.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Protocol

from hivespec.protocol.errors import UserError
from hivespec.protocol.status import MAX_STATUS_BYTES, StatusSnapshot, decode_status

CONTROL_HEADER = "X-Hivespec-Control"  # must match node/status/board.py (the dashboard may not import it)
DEFAULT_TIMEOUT_S = 2.0


class SourceError(UserError):
    """The node could not be read or controlled (a bad URL, no node answering); the message is meant for the user.

    A `UserError`, so `hivespec status` and `hivespec dash` end in its one line, exit 2.
    """


class SnapshotSource(Protocol):
    """What the dashboard polls. ``label`` names the node before its first snapshot arrives."""

    label: str

    def fetch(self) -> StatusSnapshot:
        """One snapshot; raises `SourceError`."""
        ...

    def set_paused(self, paused: bool) -> None:
        """Ask the node to pause (after its current round) or resume training; raises `SourceError`."""
        ...


class HttpSource:
    """A node's status server, e.g. ``http://127.0.0.1:4483``."""

    def __init__(self, url: str, *, label: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        url = url.rstrip("/").removesuffix("/status")  # `hivespec join` prints the status page's URL: the node's, plus /status
        if not url.startswith("http://"):
            raise SourceError(f"node URL must start with http:// (a local status server), got {url!r}")
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise SourceError(f"node URL {url!r} is malformed ({exc}); use http://HOST:PORT, e.g. http://127.0.0.1:4483") from None
        if not parts.hostname or port is None:
            raise SourceError(f"node URL {url!r} needs a host and a port: http://HOST:PORT, e.g. http://127.0.0.1:4483")
        if parts.path or parts.query:
            raise SourceError(f"node URL {url!r} has a path; pass the node's http://HOST:PORT alone, e.g. http://127.0.0.1:4483")
        self.url = url
        self.label = label or url.removeprefix("http://")
        self.timeout = timeout

    def fetch(self) -> StatusSnapshot:
        try:
            with urllib.request.urlopen(f"{self.url}/status", timeout=self.timeout) as response:
                data = response.read(MAX_STATUS_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise SourceError(f"{self.url}/status answered HTTP {exc.code}; is this a hivespec node?") from None
        except http.client.HTTPException as exc:  # another service on the port (ssh, say) answered, not in HTTP
            raise SourceError(_not_http(self.url, exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SourceError(f"no answer from {self.url} ({reason}); is the node running?") from None
        verdict, snapshot = decode_status(data)
        if snapshot is None:
            raise SourceError(f"{self.url}/status sent a bad snapshot: {verdict}")
        return snapshot

    def set_paused(self, paused: bool) -> None:
        request = urllib.request.Request(
            f"{self.url}/control",
            data=json.dumps({"paused": paused}).encode(),
            headers={CONTROL_HEADER: "1", "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read(1024)
        except urllib.error.HTTPError as exc:
            raise SourceError(f"{self.url}/control answered HTTP {exc.code}") from None
        except http.client.HTTPException as exc:
            raise SourceError(_not_http(self.url, exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise SourceError(f"could not reach {self.url} to {'pause' if paused else 'resume'} ({getattr(exc, 'reason', exc)})") from None


def _not_http(url: str, exc: http.client.HTTPException) -> str:
    what = f"{type(exc).__name__}: {str(exc).strip()[:80]!r}" if str(exc).strip() else type(exc).__name__
    return f"{url} did not answer in HTTP ({what}); is it the node's status URL (the 'status:' line of `hivespec join`)?"


class LocalSource:
    """A node in this process: ``snapshot_bytes`` returns its encoded snapshot (the same bytes /status serves)."""

    def __init__(self, label: str, snapshot_bytes: Callable[[], bytes], set_paused: Callable[[bool], None]) -> None:
        self.label = label
        self._snapshot_bytes = snapshot_bytes
        self._set_paused = set_paused

    def fetch(self) -> StatusSnapshot:
        try:
            data = self._snapshot_bytes()
        except Exception as exc:  # noqa: BLE001 - the node may be shutting down
            raise SourceError(f"{self.label}: {type(exc).__name__}: {exc}") from None
        verdict, snapshot = decode_status(data)
        if snapshot is None:
            raise SourceError(f"{self.label} produced a bad snapshot: {verdict}")
        return snapshot

    def set_paused(self, paused: bool) -> None:
        self._set_paused(paused)
