"""Where bench/swarm_scale.py's workers run, and how many bytes the swarm put on the wire there.

`Network`: the host's loopback (no byte count: the host's own traffic shares it); `PrivateLoopback`: the loopback of a
namespace of our own, whose `lo` counters are exactly the swarm's bytes; `ShapedLan`: a namespace per worker on a
bridge, each link shaped by `tc tbf` (this kernel has no netem); `NatWan`: a public host and homes behind their own
masquerading routers (bench/net_topology.py). Each gives a worker's argv prefix and listen address.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

NS_PREFIX = "hsn"  # net_topology.PREFIX: namespaces named hsn<owner pid>-<role>, so its remove_stale() clears a killed run's

def _ip(*args: str, tool: str = "ip", check: bool = True) -> str:
    result = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{tool} {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _tx_bytes(ns: str, dev: str) -> int:
    return int(json.loads(_ip("-n", ns, "-j", "-s", "link", "show", dev))[0]["stats64"]["tx"]["bytes"])


def _tcp_counters(ns: str) -> dict[str, int]:
    """The namespace's kernel TCP counters (/proc/net/snmp): connections opened, segments sent."""
    text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], capture_output=True, text=True, check=True).stdout
    names, values = (line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:"))
    tcp = dict(zip(names, map(int, values)))
    return {"connects": tcp["ActiveOpens"], "segments": tcp["OutSegs"]}


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make network namespaces (one line), or None."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces need Linux, root and iproute2 (ip, tc)"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None if made.returncode == 0 else f"this kernel refuses network namespaces: {made.stderr.strip()}"


class Network:
    """Where worker i runs (argv prefix, listen address) and how many bytes the swarm put on the wire."""

    name = "loopback"

    def __init__(self) -> None:
        self._made: list[str] = []

    def _netns(self, role: str) -> str:
        ns = f"{NS_PREFIX}{os.getpid()}-{role}"
        _ip("netns", "del", ns, check=False)
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def prefix(self, worker: int) -> list[str]:
        return []

    def host(self, worker: int) -> str:
        return "127.0.0.1"

    def wire_bytes(self) -> int | None:
        return None

    def tcp_counters(self) -> dict[str, int] | None:
        return None

    def close(self) -> None:
        for ns in reversed(self._made):
            pids = _ip("netns", "pids", ns, check=False).split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)
        self._made.clear()


class PrivateLoopback(Network):
    """Every worker on the loopback of one namespace of our own: its lo counters are exactly the swarm's bytes."""

    name = "loopback"

    def __init__(self) -> None:
        super().__init__()
        self.ns = self._netns("lo")

    def prefix(self, worker: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def wire_bytes(self) -> int:
        return _tx_bytes(self.ns, "lo")

    def tcp_counters(self) -> dict[str, int]:
        return _tcp_counters(self.ns)


class ShapedLan(Network):
    """One host namespace per worker on a bridge; each host's link shaped by tbf (upload on its side, download on the bridge's)."""

    name = "shaped"

    def __init__(self, hosts: int, up_mbit: float, down_mbit: float) -> None:
        super().__init__()
        self.hosts: list[tuple[str, str]] = []
        try:
            self.bridge = self._netns("lan")
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for i in range(hosts):
                ns, addr, port = self._netns(f"h{i}"), f"10.77.{i // 200}.{i % 200 + 10}", f"p{i}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/16", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self._shape(ns, "eth0", up_mbit)
                self._shape(self.bridge, port, down_mbit)
                self.hosts.append((ns, addr))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float) -> None:
        # burst ~ 10 ms at the rate (at least a few full packets); the queue holds at most 200 ms.
        burst = max(16_000, int(mbit * 1e6 / 8 / 100))
        _ip("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(mbit * 1000)}kbit", "burst", str(burst),
            "latency", "200ms", tool="tc")

    def prefix(self, worker: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[worker][0]]

    def host(self, worker: int) -> str:
        return self.hosts[worker][1]

    def wire_bytes(self) -> int:
        return sum(_tx_bytes(ns, "eth0") + _tx_bytes(ns, "lo") for ns, _ in self.hosts)

    def drops(self) -> int:
        total = 0
        for ns, _ in self.hosts:
            for line in _ip("-n", ns, "-s", "qdisc", "show", "dev", "eth0", tool="tc").splitlines():
                if "dropped" in line:
                    total += int(line.split("dropped")[1].split(",")[0])
        return total


class NatWan(Network):
    """Worker 0 on a public host, every other worker in a home network behind its own masquerading router
    (bench/net_topology.py: no port forwarding, so homes reach each other only through the public node's relay
    circuits or through what it re-serves). Each home's upload shaped by tbf where `up_mbit` is set."""

    name = "nat"

    def __init__(self, homes: int, up_mbit: float | None) -> None:
        super().__init__()
        import net_topology

        self.topology = net_topology.Topology(homes=homes, uplink_mbit=up_mbit).build()
        self.hosts = [self.topology.public, *self.topology.home_hosts]
        self.public_addr = net_topology.PUBLIC_ADDR

    def prefix(self, worker: int) -> list[str]:
        return self.hosts[worker].command([])

    def host(self, worker: int) -> str:
        return self.public_addr if worker == 0 else "0.0.0.0"  # as bench/nat_swarm.py's homes listen

    def uploads(self) -> tuple[int, int]:
        """Bytes sent onto the WAN so far: (the public host's, all home routers' together)."""
        public = _tx_bytes(self.topology.public.ns, "wan0")
        return public, sum(_tx_bytes(router.ns, "wan0") for router in self.topology.routers)

    def wire_bytes(self) -> int:
        return sum(self.uploads())

    def close(self) -> None:
        self.topology.close()
