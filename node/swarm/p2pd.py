"""p2pd as a node runs it: in a session of its own, its unix sockets in a directory of ours, relays set at once.

hivemind's `P2P.create` starts p2pd in our process group and talks to it over two unix sockets,
``/tmp/hivemind-p2pd-<id>.sock`` and ``/tmp/hivemind-p2pclient-<id>.sock``, which it removes
when it stops p2pd itself. Three things differ here:

- **p2pd's session** (`_SessionP2P`): a terminal's Ctrl-C reaches the node alone, which stops
  p2pd when it shuts down (a p2pd whose node was killed exits once its client is gone).
- **The sockets** live in ``<tmp>/hivespec-<uid>/``, named after the process that owns them:
  ``<pid>-p2pd-<id>.sock``. A node killed by SIGKILL or the OOM killer removes nothing, and a
  p2pd that died first kept its socket in hivemind's hands too; such files piled up in /tmp
  (619 of them on one machine after two days of test suites and benches). Now a
  node removes its p2pd's socket whatever ended it, and `start_p2pd` sweeps the sockets of
  processes that are gone. Where that directory cannot be ours (another user made it, or the
  path would pass the 107 bytes a unix socket's name may have) hivemind's /tmp names are used.
- **Static relays** (`_RelayedP2P`): behind NAT the bootstrap peers are relays at once
  (``-relayDiscovery=0``), instead of after discovery; see `node/swarm/nat.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from hivespec.node.identity_file import private_temp_file

log = logging.getLogger(__name__)

# The longest socket name we make below our directory: "<pid>-p2pclient-<11 characters>.sock".
_NAME_ROOM = len("4194304-p2pclient-") + 11 + len(".sock") + 1
_UNIX_PATH_MAX = 107  # sun_path's 108 bytes, its terminating NUL left out


async def start_p2pd(
    *,
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str] | None,
    use_relay: bool,
    nat_port_map: bool,
    relays: Sequence[str],
    identity_path: str | None,
    startup_timeout: float,
) -> P2P:
    """p2pd via hivemind's P2P.create; with `relays` it reserves slots on them at once (node/swarm/nat.py's doc)."""
    if identity_path is not None:
        ensure_p2p_key(Path(identity_path))
    directory = socket_dir()
    if directory is not None:
        sweep_stale_sockets(directory)
    kwargs: dict[str, Any] = {
        "host_maddrs": list(host_maddrs),
        "announce_maddrs": list(announce_maddrs) if announce_maddrs else None,
        "nat_port_map": nat_port_map,
        "use_relay": use_relay or bool(relays),
        "startup_timeout": startup_timeout,
        "identity_path": identity_path,
    }
    if not relays:
        return await _SessionP2P.create(**kwargs)
    return await _RelayedP2P.create(use_auto_relay=True, trusted_relays=list(relays), force_reachability="private", **kwargs)


def ensure_p2p_key(path: Path) -> None:
    """A libp2p key at `path` that p2pd can read: kept where one is there, else a new RSA key written whole.

    Made here rather than by `P2P.generate_identity`, which announces it on stderr in the middle of our
    one-line messages, writes the file in place with the umask's mode and chmods it after, and does not
    fsync: a node killed (or a laptop losing power) just after its first start left an empty or torn
    key, and p2pd then refused every later start ("proto: cannot parse invalid wire-format data"), which
    the node reported as a port or peers problem. A file that holds no key is replaced, with a warning:
    it never gave p2pd a peer id (the node's own identity, identity.key, is another file).
    """
    if path.is_file():
        problem = _p2p_key_problem(path.read_bytes())
        if problem is None:
            return
        log.warning("%s holds no libp2p key (%s; a write cut short?): writing a new one, so this node gets a new libp2p address", path, problem)
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()
    with private_temp_file(path, key, mode=0o400) as tmp:  # p2pd only reads it; never readable by others
        os.replace(tmp, path)


def _p2p_key_problem(data: bytes) -> str | None:
    """Why `data` is no libp2p private key p2pd would read (an RSA one must hold a whole DER key); None where it is one."""
    from cryptography.hazmat.primitives.serialization import load_der_private_key
    from google.protobuf.message import DecodeError

    if not data:
        return "empty"
    key = crypto_pb2.PrivateKey()
    try:
        key.ParseFromString(data)
    except DecodeError as exc:
        return f"not a key record: {exc}"
    if key.key_type == crypto_pb2.KeyType.RSA:
        try:
            load_der_private_key(key.data, password=None)
        except ValueError:
            return "a cut RSA key"
    return None


def socket_dir() -> Path | None:
    """``<tmp>/hivespec-<uid>``, made private on first use; None where it is not ours or too long a path."""
    path = Path(tempfile.gettempdir()) / f"hivespec-{os.getuid()}"
    if len(str(path)) + _NAME_ROOM > _UNIX_PATH_MAX:
        return None
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():  # a link, a file, or another user's
        return None
    return path


def sweep_stale_sockets(directory: Path) -> list[Path]:
    """Remove the sockets in `directory` whose process (the number their name starts with) is gone; the removed ones."""
    removed = []
    for path in directory.glob("*-p2p*.sock"):
        owner = path.name.split("-", 1)[0]
        if owner.isdigit() and not _running(int(owner)):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process holds that number now
        return True
    return True


class _OwnSocketPrefix:
    """`P2P._UNIX_SOCKET_PREFIX`, read by `P2P.create` as it names the two sockets: our directory and pid."""

    def __get__(self, instance: object, owner: type) -> str:
        directory = socket_dir()
        return P2P._UNIX_SOCKET_PREFIX if directory is None else f"/unix{directory}/{os.getpid()}-"


# Run by the interpreter that runs us, which then becomes p2pd (same pid: hivemind's handle on its child still holds).
_OWN_SESSION = "import os, sys; os.setsid(); os.execv(sys.argv[1], sys.argv[1:])"


class _SessionP2P(P2P):
    """P2P whose p2pd runs in a session of its own, still our child, with its sockets in `socket_dir`.

    hivemind starts p2pd in our process group, so a terminal's Ctrl-C (SIGINT to the whole foreground
    group) stopped p2pd at once while the node went on to its round's next safe point: whatever it
    still did over gossip until then failed, p2pd printed an error on the way out, and the node's
    shutdown then waited 10 s on the dead daemon. Now the signal reaches the node alone.
    """

    _UNIX_SOCKET_PREFIX = _OwnSocketPrefix()  # type: ignore[assignment]

    @staticmethod
    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:  # static as in P2P: testable without a daemon
        command = P2P._make_process_args(*args, **kwargs)
        return [sys.executable, "-I", "-S", "-c", _OWN_SESSION, *command] if hasattr(os, "setsid") and sys.executable else command

    def _terminate(self) -> None:
        super()._terminate()
        # hivemind removes p2pd's socket only when it stops a running p2pd; one that died first (killed, crashed) left it.
        daemon = getattr(self, "_daemon_listen_maddr", None)
        if self._child is not None and daemon is not None:  # our own p2pd, not a replica's handle on another's
            with contextlib.suppress(OSError):
                os.remove(daemon["unix"])


class _RelayedP2P(_SessionP2P):
    """P2P whose p2pd takes its trusted relays as static relays instead of waiting for discovery."""

    @staticmethod
    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        kwargs["relayDiscovery"] = False
        return _SessionP2P._make_process_args(*args, **kwargs)
