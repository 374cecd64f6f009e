"""The status server with clients that do not wait for their answer."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
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
