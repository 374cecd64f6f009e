"""Real networks on one machine: Linux network namespaces joined by veth pairs, NAT routers, a tbf uplink.

`Topology` builds, as root, one "internet" segment and the hosts on it:

    public (203.0.113.10) ---+
                             |  wan: a bridge, 203.0.113.0/24
    nat1 (203.0.113.1) ------+------ nat2 (203.0.113.2)
      | masquerade 10.1.0.0/24         | masquerade 10.2.0.0/24
    home1 (10.1.0.2)                 home2 (10.2.0.2)

Each home network sits behind its own NAT router namespace (nftables masquerade set through
pyroute2's netlink API, so no `nft`/`iptables` binary is needed; no port forwarding). The public
side has no route to 10.0.0.0/8, so nothing can dial a home host: only replies to connections
the home host opened come back, as behind a real home router. `uplink_mbit` puts a tbf qdisc on
a router's WAN egress (the home's upload). 203.0.113.0/24 is TEST-NET-3 and 10.0.0.0/8 private:
every address lives inside namespaces made here, and no namespace has a route off the machine.

Cleanup: namespaces are named ``hsn<owner pid>-<role>``; `close()` (also at interpreter exit and
on SIGTERM) kills the processes started in them and deletes them, and every new `Topology`
first removes namespaces whose owner process is gone (a run that was SIGKILLed).
`unavailable()` says in one line why this machine cannot build it (not root, no `ip`, no netns,
no nftables NAT, pyroute2 missing), or None.

Imported by bench/nat_swarm.py and tests/net/ from the bench folder (never put the repository
root on sys.path); run as ``python net_topology.py masquerade SUBNET`` inside a router namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

PREFIX = "hsn"
WAN_NET = "203.0.113"  # TEST-NET-3 (RFC 5737): documentation only, never routed
PUBLIC_ADDR = f"{WAN_NET}.10"
MAX_HOMES = 200  # home i's LAN is 10.i.0.0/24


def router_addr(home: int) -> str:
    """Home `home`'s router on the WAN: 203.0.113.<home>, skipping the public host's .10."""
    return f"{WAN_NET}.{home if home < 10 else home + 1}"
_HERE = Path(__file__).resolve()


def _ip(*args: str, check: bool = True, tool: str = "ip") -> subprocess.CompletedProcess:
    result = subprocess.run([tool, *args], check=False, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{tool} {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _owner(ns: str) -> int | None:
    head = ns[len(PREFIX):].split("-", 1)[0]
    return int(head) if ns.startswith(PREFIX) and head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_namespaces() -> list[str]:
    """Every namespace with our prefix (any owner)."""
    if shutil.which("ip") is None:
        return []
    listing = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip() and _owner(line.split()[0]) is not None]


def delete_namespace(ns: str) -> None:
    """Kill the processes inside `ns` (SIGKILL; they are ours) and delete it."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces left by runs whose owner process is gone; returns their names."""
    stale = [ns for ns in our_namespaces() if not _alive(_owner(ns) or 0)]
    for ns in stale:
        delete_namespace(ns)
    return stale


def _masquerade(subnet: str) -> None:
    """In the current namespace: `table ip hsnat { chain post { type nat hook postrouting; ip saddr SUBNET masquerade } }`."""
    from pyroute2.nftables.expressions import ipv4addr, masq
    from pyroute2.nftables.main import NFTables

    nft = NFTables(nfgen_family=2)  # NFPROTO_IPV4
    try:
        nft.table("add", name="hsnat")
        nft.chain("add", table="hsnat", name="post", hook="postrouting", type="nat", priority=100)
        nft.rule("add", table="hsnat", chain="post", expressions=(ipv4addr(src=subnet), masq()))
    finally:
        nft.close()


def unavailable() -> str | None:
    """One line saying why namespaces with NAT cannot be built here, or None when they can (probes for real)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root to include the NAT tests"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    try:
        import pyroute2  # noqa: F401 - the NAT rules go through its netlink API
    except ImportError:
        return "pyroute2 is not installed (pip install -e '.[dev]')"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"this kernel or sandbox refuses network namespaces: {made.stderr.strip()}"
        result = subprocess.run(["ip", "netns", "exec", probe, sys.executable, str(_HERE), "masquerade", "10.9.0.0/24"],
                                check=False, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["?"])[-1]
            return f"nftables NAT is refused here (no CONFIG_NFT_MASQ?): {tail}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _exit_on_sigterm() -> None:
    # SIGTERM's default action skips atexit; turn it into SystemExit so close() still runs.
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


@dataclass
class Host:
    """One namespace with one address; `popen`/`run` start commands inside it."""

    ns: str
    addr: str

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        check = kwargs.pop("check", True)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(argv), check=check, **kwargs)


@dataclass
class Topology:
    """A public host and `homes` home hosts, each behind its own masquerading router; see the module doc.

    Use as a context manager (or call `build()` and `close()`). `uplink_mbit` (None = unlimited)
    caps each home's upload with tbf on its router's WAN side.
    """

    homes: int = 2
    uplink_mbit: float | None = None
    tag: str = ""
    public: Host = field(init=False)
    home_hosts: list[Host] = field(init=False, default_factory=list)
    routers: list[Host] = field(init=False, default_factory=list)
    _made: list[str] = field(init=False, default_factory=list)
    _closed: bool = field(init=False, default=False)

    def _name(self, role: str) -> str:
        return f"{PREFIX}{os.getpid()}-{self.tag}{role}"

    def _netns(self, role: str) -> str:
        ns = self._name(role)
        if ns in our_namespaces():
            delete_namespace(ns)
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def build(self) -> Self:
        """Create the namespaces, links, addresses, routes, NAT rules and tbf; raises on any failure (after cleanup)."""
        if not 1 <= self.homes <= MAX_HOMES:
            raise ValueError(f"homes must be in 1..{MAX_HOMES}, got {self.homes}")
        remove_stale()
        atexit.register(self.close)
        _exit_on_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        wan = self._netns("wan")
        _ip("-n", wan, "link", "add", "br0", "type", "bridge")
        _ip("-n", wan, "link", "set", "br0", "up")

        def uplink(ns: str, addr: str, port: str) -> None:
            _ip("link", "add", "wan0", "netns", ns, "type", "veth", "peer", "name", port, "netns", wan)
            _ip("-n", wan, "link", "set", port, "master", "br0")
            _ip("-n", wan, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "wan0")
            _ip("-n", ns, "link", "set", "wan0", "up")

        public = self._netns("pub")
        uplink(public, PUBLIC_ADDR, "p-pub")
        self.public = Host(public, PUBLIC_ADDR)
        for i in range(1, self.homes + 1):
            router, home = self._netns(f"nat{i}"), self._netns(f"home{i}")
            uplink(router, router_addr(i), f"p-nat{i}")
            lan, gateway, addr = f"10.{i}.0.0/24", f"10.{i}.0.1", f"10.{i}.0.2"
            _ip("link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", home)
            _ip("-n", router, "addr", "add", f"{gateway}/24", "dev", "lan0")
            _ip("-n", router, "link", "set", "lan0", "up")
            _ip("-n", home, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", home, "link", "set", "eth0", "up")
            _ip("-n", home, "route", "add", "default", "via", gateway)
            router_host = Host(router, router_addr(i))
            router_host.run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
            router_host.run([sys.executable, str(_HERE), "masquerade", lan])
            self.set_uplink(router_host, self.uplink_mbit)
            self.routers.append(router_host)
            self.home_hosts.append(Host(home, addr))

    @staticmethod
    def set_uplink(router: Host, mbit: float | None) -> None:
        """Cap the home's upload at `mbit` Mbit/s (tbf on the router's WAN egress), or lift the cap (None)."""
        _ip("-n", router.ns, "qdisc", "del", "dev", "wan0", "root", check=False, tool="tc")
        if mbit is None:
            return
        # burst ~ rate x 10 ms, at least a few full-size packets; latency bounds the queue at 200 ms.
        burst = max(16_000, int(mbit * 1e6 / 8 / 100))
        _ip("-n", router.ns, "qdisc", "add", "dev", "wan0", "root", "tbf", "rate", f"{int(mbit * 1000)}kbit",
            "burst", str(burst), "latency", "200ms", tool="tc")

    def wan_bytes_sent(self, host: Host) -> int:
        """Bytes `host` sent towards the internet (its WAN veth's tx counter): a router's is its home's upload."""
        out = host.run(["cat", "/sys/class/net/wan0/statistics/tx_bytes"]).stdout
        return int(out.strip())

    def close(self) -> None:
        """Kill every process started in our namespaces and delete them (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._made):
            delete_namespace(ns)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> Self:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_port(host: Host, port: int, timeout: float) -> None:
    """Block until something listens on `host.addr:port` as seen from `host`'s namespace."""
    deadline = time.monotonic() + timeout
    probe = f"import socket; socket.create_connection(({host.addr!r}, {port}), timeout=1).close()"
    while time.monotonic() < deadline:
        if host.run([sys.executable, "-c", probe], check=False).returncode == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host.addr}:{port} in {host.ns} after {timeout:g} s")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "masquerade":
        _masquerade(sys.argv[2])
    else:
        sys.exit("usage: python net_topology.py masquerade SUBNET  (inside a router namespace)")
