"""What a user typed about the swarm, checked before anything heavy starts.

`hivespec join`, `follow`, `bootstrap`, `doctor` and `demo` call `check_swarm_inputs` right
after the config resolves: a malformed multiaddr, an unreadable peers or private-swarm file,
or a leader that is not a peer id then ends in one `InputError` line (the CLI prints it and
exits 2) instead of a traceback minutes later, after the model has loaded.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hivespec.node.config import InputError, NodeConfig
from hivespec.node.swarm.bootstrap import PEERS_ENV, is_bootstrap_maddr, load_private_swarm, read_peers_file
from hivespec.protocol.identity import PEER_ID_PREFIX

__all__ = ["MADDR_FORM", "InputError", "check_leader", "check_swarm_inputs"]

MADDR_FORM = "/ip4/<address>/tcp/<port>/p2p/<peer id>, as `hivespec join` and `hivespec bootstrap` print it"
_PEER_ID = re.compile(rf"{PEER_ID_PREFIX}[0-9a-f]{{16}}")


def check_swarm_inputs(config: NodeConfig) -> None:
    """Raise `InputError` for a malformed bootstrap peer (flag, env or peers file) or an unreadable swarm file."""
    swarm = config.swarm
    for maddr in swarm.initial_peers:
        _check_maddr(maddr, "--initial-peer (swarm.initial_peers)")
    for maddr in re.split(r"[\s,]+", os.environ.get(PEERS_ENV, "")):
        if maddr:
            _check_maddr(maddr, f"${PEERS_ENV}")
    if swarm.peers_file:
        path = Path(swarm.peers_file).expanduser()
        try:
            read_peers_file(path)
        except OSError as exc:
            raise InputError(f"swarm.peers_file {str(path)!r}: cannot read it ({exc.strerror}); fix the path or drop the setting") from None
        except ValueError as exc:
            raise InputError(f"swarm.peers_file: {exc}; each line must be {MADDR_FORM}") from None
    private = swarm.private
    try:
        load_private_swarm(swarm.swarm, allowlist_file=private.allowlist_file, secret_file=private.secret_file)
    except OSError as exc:
        raise InputError(
            f"swarm.private: cannot read {exc.filename!r} ({exc.strerror}); fix swarm.private.allowlist_file / secret_file"
        ) from None
    except ValueError as exc:
        raise InputError(f"swarm.private: {exc}") from None


def check_leader(leader: str) -> None:
    """Raise `InputError` unless `leader` is a hivespec peer id ("hs" + 16 hex digits)."""
    if not _PEER_ID.fullmatch(leader):
        raise InputError(
            f"leader {leader[:80]!r} is not a hivespec peer id ({PEER_ID_PREFIX} + 16 hex digits); "
            "run `hivespec identity show` on the leader's machine and pass its peer_id"
        )


def _check_maddr(maddr: str, where: str) -> None:
    if not is_bootstrap_maddr(maddr):
        raise InputError(f"{where} {maddr[:120]!r} is not a peer's multiaddr; use the form {MADDR_FORM}")
    port = int(maddr.split("/")[4])
    if not 1 <= port <= 65535:
        raise InputError(f"{where} {maddr[:120]!r} has port {port}; a TCP port is 1..65535")
