"""`HttpSource` against a loopback port that answers, but not in HTTP (a typo'd port: ssh, another service)."""

import asyncio
import contextlib
import socket
import threading

import pytest
from fakes import make_snapshot, screen_text

from hivespec.dashboard.app import DashboardApp
from hivespec.dashboard.source import HttpSource, SourceError
from hivespec.protocol.status import encode_status

SSH_BANNER = b"SSH-2.0-OpenSSH_9.6\r\n"


class Answering:
    """A loopback TCP port that answers every connection with ``reply`` (changeable) and hangs up."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # closed by close()
            while True:
                connection, _ = self._socket.accept()
                with connection:
                    connection.recv(4096)
                    connection.sendall(self.reply)

    def close(self) -> None:
        self._socket.close()


def _http_ok(body: bytes) -> bytes:
    return b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("reply", [SSH_BANNER, b"HTTP/1.0 200 OK\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n"],
                         ids=["ssh banner", "header line too long"])
def test_a_port_that_answers_but_not_in_http_is_a_source_error_that_says_so(reply):
    port = Answering(reply)
    try:
        source = HttpSource(port.url)
        with pytest.raises(SourceError, match=r"did not answer in HTTP .*is it the node's status URL"):
            source.fetch()
        with pytest.raises(SourceError, match="did not answer in HTTP"):
            source.set_paused(True)
    finally:
        port.close()


def test_a_node_whose_port_stops_answering_in_http_is_shown_lost_and_polled_until_it_answers_again():
    port = Answering(_http_ok(encode_status(make_snapshot())))

    async def scenario():
        app = DashboardApp([HttpSource(port.url)], poll_interval=0.2)
        async with app.run_test(size=(100, 30)) as pilot:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30

            async def until(condition) -> None:
                while not condition():
                    assert loop.time() < deadline, screen_text(app)
                    await pilot.pause(0.02)

            await until(lambda: app.feed.snapshot is not None)
            port.reply = SSH_BANNER
            await until(lambda: "LOST" in screen_text(app))
            assert "did not answer in HTTP" in screen_text(app)
            port.reply = _http_ok(encode_status(make_snapshot(name="node-back")))
            await until(lambda: app.feed.error is None and app.feed.snapshot.node.name == "node-back")

    try:
        asyncio.run(scenario())
    finally:
        port.close()
