"""The status server with clients that hang up before their answer or stall half way."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
import urllib.request
from types import SimpleNamespace

from hivespec.node.status.board import RunControl
from hivespec.node.status.server import StatusServer


def test_a_client_that_hangs_up_before_its_answer_costs_a_debug_line_not_a_traceback_on_the_terminal(caplog, capfd):
    """A dashboard gives up on a node after 2 s; a snapshot that took longer (a slow disk under the journal) had
    printed socketserver's traceback on the node's terminal, between its round rows, for every poll."""
    hung_up = threading.Event()

    def snapshot_bytes() -> bytes:
        hung_up.wait(30)
        return b"{}" * 100_000

    board = SimpleNamespace(snapshot_bytes=snapshot_bytes, logs=SimpleNamespace(counts={}))
    server = StatusServer(board, RunControl(), port=0)
    caplog.set_level(logging.DEBUG, logger="hivespec.node.status.server")
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"GET /status HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset: the write fails
        hung_up.set()
        deadline = time.monotonic() + 30
        while not any("hung up" in record.getMessage() for record in caplog.records):
            assert time.monotonic() < deadline, capfd.readouterr().err
            time.sleep(0.01)
    finally:
        server.close()
    assert [r.levelno for r in caplog.records if "hung up" in r.getMessage()] == [logging.DEBUG]
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_that_sends_half_a_request_is_dropped_after_the_client_timeout():
    """Each stalled connection had held a server thread for as long as it stayed open."""
    server = StatusServer(SimpleNamespace(snapshot_bytes=lambda: b"{}", logs=SimpleNamespace(counts={})), RunControl(),
                          port=0, client_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as stalled:
            stalled.sendall(b"GET /status HTTP/1.0\r\n")  # and never the blank line that ends the request
            stalled.settimeout(30)
            assert stalled.recv(1024) == b""  # the server hung up
        with urllib.request.urlopen(f"{server.url}/status", timeout=30) as response:  # and serves the next client
            assert response.read() == b"{}"
    finally:
        server.close()
