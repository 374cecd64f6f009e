"""A private swarm's files, read before anything starts (no hivemind here, so `hivespec doctor --offline` reads them too):
`load_private_swarm` (the allowlist and the secret the config names, or ``$HIVESPEC_SWARM_SECRET``) and `check_member`
(whether the allowlist leaves this process anything to do: a training node not on it reaches nobody)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from hivespec.node.config import InputError, SwarmConfig
from hivespec.protocol.identity import Identity, peer_id_of
from hivespec.protocol.private import PrivateSwarm, parse_allowlist, parse_secret

log = logging.getLogger(__name__)

SECRET_ENV = "HIVESPEC_SWARM_SECRET"


def load_private_swarm(
    swarm: str, *, allowlist_file: str | None, secret_file: str | None, environ: Mapping[str, str] | None = None
) -> PrivateSwarm | None:
    """The private swarm described by the config (None for a public swarm); raises ValueError with the fix."""
    env = os.environ if environ is None else environ
    if allowlist_file is None:
        if secret_file or env.get(SECRET_ENV):
            raise ValueError("a swarm secret is set but swarm.private.allowlist_file is not: a private swarm needs both")
        return None
    if secret_file:
        path = Path(secret_file).expanduser()
        where = f"swarm.private.secret_file {str(path)!r}"
        secret_text = _read_swarm_file(path, where)
        mode = path.stat().st_mode & 0o777
        if os.name == "posix" and mode & 0o007:
            raise ValueError(
                f"{where} has mode {mode:04o}: every user of this machine can read the swarm secret; run "
                f"`chmod 600 {path}` (640 to share it with a group), and make a new secret for every member if others "
                "could have read it"
            )
    elif env.get(SECRET_ENV):
        secret_text, where = env[SECRET_ENV], f"${SECRET_ENV}"
    else:
        raise ValueError(f"swarm.private.allowlist_file is set but no secret: set swarm.private.secret_file or ${SECRET_ENV}")
    try:
        secret = parse_secret(secret_text)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    path = Path(allowlist_file).expanduser()
    where = f"swarm.private.allowlist_file {str(path)!r}"
    text = _read_swarm_file(path, where)
    try:
        return PrivateSwarm.create(swarm, secret, parse_allowlist(text))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _read_swarm_file(path: Path, where: str) -> str:
    """The text of a private swarm's file; ValueError naming it where it is not text (a raw 32-byte secret from
    `openssl rand 32` had ended in UnicodeDecodeError's words, naming neither the file nor the form expected)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not text: it must hold hex digits (the secret: 64, as "
                         "`python -c 'import secrets; print(secrets.token_hex(32))'` prints; the allowlist: one "
                         "public key a line, as `hivespec identity show` prints)") from None



def check_member(private: PrivateSwarm | None, identity: Identity, swarm: SwarmConfig, *, trains: bool = False,
                 leader: str | None = None) -> None:
    """`InputError` where the private swarm's allowlist leaves this process nothing to do (None: a public swarm).

    A training node (`trains`) not on it: every member, its own DHT storage too, refuses its records, so its batches
    reach nobody; on it alone, a warning (it shares nothing, which a leader with followers may mean). A follower of a
    `leader` not on it: it refuses the leader's records. A bootstrap peer on it alone: it refuses every member's
    records. A follower or bootstrap peer publishes nothing, so it need not be on it.
    """
    if private is None:
        return
    allowlist = f"swarm.private.allowlist_file {swarm.private.allowlist_file!r}"
    if trains and not private.allows(identity.public_key):
        raise InputError(
            f"this node's public_key {identity.public_key.hex()} is not on {allowlist}: every member would refuse its "
            "batches; add that line to the allowlist of every member (or run `hivespec follow` to mirror a policy "
            "without training)"
        )
    if trains and private.allowlist == {identity.public_key}:
        log.warning("%s lists only this node's own public_key: it refuses every peer's batches and trains on its own "
                    "(enough for a leader that followers mirror); list the members' public_keys to share with them", allowlist)
    if leader is not None and all(peer_id_of(key) != leader for key in private.allowlist):
        raise InputError(
            f"the leader {leader} is not on {allowlist}: this follower would refuse its records; add the leader's "
            "public_key (`hivespec identity show` on the leader's machine)"
        )
    if not trains and leader is None and private.allowlist == {identity.public_key}:
        raise InputError(
            f"{allowlist} lists only this bootstrap peer's own public_key, so it would refuse every member's records; "
            "list the members' public_keys (`hivespec identity show` on each member's machine), one a line"
        )
