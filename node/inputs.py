"""What a user typed, checked before anything heavy starts.

Right after the config resolves, `hivespec join`, `follow`, `bootstrap`, `doctor` and `demo`
check what can be checked without torch, a model or a socket: the home folder (`check_home`),
the trace file (`check_trace_file`), checkpoint.dir and other output folders (`check_folder`), the model source, engine and device
(`check_model_inputs`), the swarm's peers and files (`check_swarm_inputs`), a leader's peer id
(`check_leader`). A bad one ends in one `InputError` line (or the `UserError` of the part that
owns the check: `ModelSourceError`, `DeviceError`, `VllmUnavailable`), exit 2, instead of a
traceback minutes later, after the model has loaded. The parts check again where they use the
input, so nothing depends on these checks having run.

Only this module's own imports are light (the config); each check imports what it needs, so a
command pays for torch (model.device other than cpu, model.engine vllm) or hivemind (the swarm
checks) only when it gets that far.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from hivespec.node.config import HOME_ENV, InputError, ModelConfig, NodeConfig, SwarmConfig, node_home
from hivespec.protocol.identity import PEER_ID_PREFIX

if TYPE_CHECKING:
    from hivespec.protocol.private import PrivateSwarm

__all__ = [
    "MADDR_FORM", "InputError", "check_folder", "check_home", "check_leader", "check_model_inputs", "check_node_inputs",
    "check_swarm_inputs", "check_trace_file", "private_swarm",
]

MADDR_FORM = "/ip4/<address>/tcp/<port>/p2p/<peer id>, as `hivespec join` and `hivespec bootstrap` print it"
_PEER_ID = re.compile(rf"{PEER_ID_PREFIX}[0-9a-f]{{16}}")


def check_node_inputs(config: NodeConfig) -> None:
    """Everything `hivespec join` can check before its heavy imports: home, trace file, checkpoint.dir, model."""
    check_home(config)
    if config.speculation.trace_file:
        check_trace_file(config.speculation.trace_file)
    if config.checkpoint.dir:
        check_folder(Path(config.checkpoint.dir).expanduser(), "checkpoint.dir")
    check_model_inputs(config.model)


def check_home(config: NodeConfig) -> Path:
    """The node's home folder, created if missing; `InputError` when it is a file or cannot be created or written."""
    home = node_home(config)
    where = "--home (home)" if config.home else f"${HOME_ENV}" if os.environ.get(HOME_ENV) else "the home folder"
    check_folder(home, where, fix=f"point --home (or ${HOME_ENV}) at a folder you can write")
    return home


def check_folder(path: Path, where: str, *, fix: str = "pick a folder you can write") -> None:
    """Create ``path`` (and its parents) if missing; `InputError` naming ``where`` (a flag or key) when that cannot work."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{where} {str(path)!r} is a file, not a folder; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{where} {str(path)!r}: cannot create it ({exc.strerror}); {fix}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{where} {str(path)!r} is not writable; {fix}")


def check_trace_file(name: str) -> None:
    """`InputError` unless the rollout trace ``name`` can be appended to: its folder exists and is writable."""
    where = f"--trace (speculation.trace_file) {name[:200]!r}"
    path = Path(name).expanduser()
    if path.is_dir():
        raise InputError(f"{where} is a folder; give a file in it, e.g. {path / 'trace.jsonl'}")
    folder = path.parent
    if not folder.is_dir():
        raise InputError(f"{where}: the folder {str(folder)!r} does not exist; create it (mkdir -p {folder}) or pick another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{where} is not writable; pick a path you can write")


def check_model_inputs(model: ModelConfig) -> None:
    """The model source's form (a local folder must exist), vLLM where model.engine is vllm, and model.device."""
    from hivespec.node.model.source import check_model_source

    check_model_source(model.name)
    if model.engine == "vllm":
        from hivespec.node.model.vllm_engine import require_vllm

        require_vllm()  # VllmUnavailable: not installed, or no CUDA device
    if model.device != "cpu":  # every torch runs on the CPU; anything else costs the torch import to check
        from hivespec.node.model.device import check_device

        check_device(model.device)


def check_swarm_inputs(config: NodeConfig) -> None:
    """Raise `InputError` for a malformed bootstrap peer (flag, env or peers file) or an unreadable swarm file."""
    from hivespec.node.swarm.bootstrap import PEERS_ENV, read_peers_file

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
    private_swarm(swarm)


def private_swarm(swarm: SwarmConfig) -> PrivateSwarm | None:
    """The private swarm the `swarm` section names (None: a public swarm); `InputError` for a file that cannot be read or
    holds the wrong thing (`hivespec doctor`'s private swarm line reads it so too)."""
    from hivespec.node.swarm.private_files import load_private_swarm

    private = swarm.private
    try:
        return load_private_swarm(swarm.swarm, allowlist_file=private.allowlist_file, secret_file=private.secret_file)
    except OSError as exc:
        raise InputError(
            f"swarm.private: cannot read {exc.filename!r} ({exc.strerror}); fix swarm.private.allowlist_file / secret_file"
        ) from None
    except ValueError as exc:  # it names the key and the file
        raise InputError(str(exc)) from None


def check_leader(leader: str) -> None:
    """Raise `InputError` unless `leader` is a hivespec peer id ("hs" + 16 hex digits)."""
    if not _PEER_ID.fullmatch(leader):
        raise InputError(
            f"leader {leader[:80]!r} is not a hivespec peer id ({PEER_ID_PREFIX} + 16 hex digits); "
            "run `hivespec identity show` on the leader's machine and pass its peer_id"
        )


def _check_maddr(maddr: str, where: str) -> None:
    from hivespec.node.swarm.bootstrap import maddr_problem

    problem = maddr_problem(maddr)
    if problem is not None:
        why = "" if problem == "not of the form" else f" ({problem})"
        raise InputError(f"{where} {maddr[:120]!r} is not a peer's multiaddr{why}; use the form {MADDR_FORM}")
