"""Whether a fixed listening port is already taken on this machine, asked before p2pd starts.

p2pd (go-libp2p) listens with SO_REUSEPORT, so a second process asking for the same port gets it
too, without any error, and the kernel then hands each incoming connection to one of the two at
random. A `hivespec bootstrap` and a `hivespec join --config public` on one machine both took port
31337 that way: the node's dial to the bootstrap peer reached itself as often as not, failed its
peer-id check, and the node trained solo for its whole run with "no bootstrap peer answered". So a
node with a fixed `swarm.port` asks first (`Gossip._free_port_or_any`), as `hivespec doctor` does for its ports.
"""

from __future__ import annotations

import socket
import time


def port_in_use(host: str, port: int) -> str | None:
    """Why TCP `port` on `host` cannot be bound now (the OS's reason), or None where it is free.

    The probe binds with SO_REUSEADDR, as a listening server does, so connections of an earlier
    run still in TIME_WAIT do not count, and without SO_REUSEPORT, so another process's listener does.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def wait_for_port(host: str, port: int, seconds: float) -> str | None:
    """`port_in_use`, asked again for up to `seconds` while the port is taken: None once it is free, else the OS's
    reason. A node restarted right after a crash finds its old p2pd still listening for a moment (it exits as soon as
    it sees its node gone: 0.1 s after a SIGKILL, measured)."""
    deadline = time.monotonic() + seconds
    while (taken := port_in_use(host, port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return taken
