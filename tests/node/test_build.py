"""build.py: a bootstrap peer, a leader's gossip and `hivespec follow` join a private swarm the same way (real hivemind on 127.0.0.1)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from hivespec.node.build import build_node, claim_home, make_gossip, open_bootstrap_peer, open_follower
from hivespec.node.config import InputError, NodeConfig
from hivespec.node.identity_file import load_or_create_identity
from hivespec.node.model.loader import TINY_MODEL, load_model
from hivespec.node.swarm.bootstrap import IdentityInUse
from hivespec.node.swarm.private_files import check_member
from hivespec.node.weights.follower import follow
from hivespec.node.weights.publisher import PolicyPublisher
from hivespec.node.weights.sync import WeightSync
from hivespec.protocol.identity import Identity
from hivespec.protocol.private import PrivateSwarm

SWARM = "test-build-private"
pytestmark = pytest.mark.timeout(300)


def _config(home: Path, *, initial_peers=(), allowlist: Path | None = None, secret: Path | None = None) -> NodeConfig:
    config = NodeConfig()
    config.home = str(home)
    config.model.name = TINY_MODEL
    config.model.engine_dtype = "bfloat16"  # the leader's engine dtype; 'auto' would time this machine first
    config.model.threads = 1
    config.swarm.swarm = SWARM
    config.swarm.initial_peers = list(initial_peers)
    config.swarm.bootstrap_timeout = 10.0
    config.swarm.private.allowlist_file = str(allowlist) if allowlist else None
    config.swarm.private.secret_file = str(secret) if secret else None
    config.sync.fetch_timeout = 3.0
    return config


def _member(home: Path):
    """The identity a process with this home will run as (made now so it can go on the allowlist)."""
    home.mkdir(parents=True)
    return load_or_create_identity(home / "identity.key")


def test_follow_in_a_private_swarm_through_a_bootstrap_peer(tmp_path: Path) -> None:
    homes = {name: tmp_path / name for name in ("bootstrap", "leader", "follower", "outsider")}
    members = {name: _member(homes[name]) for name in ("bootstrap", "leader", "follower")}
    allowlist, secret = tmp_path / "allowlist.txt", tmp_path / "secret.txt"
    allowlist.write_text("".join(f"{m.public_key.hex()}  # {name}\n" for name, m in members.items()))
    secret.write_text("22" * 32)
    secret.chmod(0o600)
    private = {"allowlist": allowlist, "secret": secret}

    with open_bootstrap_peer(_config(homes["bootstrap"], **private)) as bootstrap:
        assert bootstrap.private is not None and bootstrap.identity.public_key == members["bootstrap"].public_key
        entry = bootstrap.gossip.visible_maddrs

        # The leader's side: its gossip from the same factory a node's build uses.
        leader_config = _config(homes["leader"], initial_peers=entry, **private)
        _, leader_lock, leader = claim_home(leader_config)
        factory = make_gossip(leader_config.swarm, leader, homes["leader"])
        assert factory.private is not None and factory.bootstrap == [("config", m) for m in entry]
        leader_gossip = factory()
        try:
            trainer = load_model(TINY_MODEL, dtype=torch.float32)
            engine = {n: p.detach() for n, p in copy.deepcopy(trainer).to(torch.bfloat16).named_parameters()}
            sync = WeightSync(trainer, engine)
            publisher = PolicyPublisher(leader_gossip, leader, sync.engine, snapshot_every=2)
            optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
            ids = torch.randint(0, trainer.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
            for version in (1, 2, 3):
                optimizer.zero_grad()
                trainer(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                _, chunks = sync.sync(version)
                publisher.publish_step(version, chunks)

            # `hivespec follow`, as the CLI builds it: the private swarm, its bootstrap peer, its home.
            follower_config = _config(homes["follower"], initial_peers=entry, **private)
            with open_follower(follower_config, leader.peer_id) as follower:
                assert follower.gossip.private is not None
                assert follower.gossip.p2p_identity_path == str(homes["follower"] / "p2p.key")
                with pytest.raises(IdentityInUse):  # the follower holds its home, as a node does
                    claim_home(follower_config)
                reports = []
                follow(follower, poll_interval=0.5, until_version=3, on_report=lambda r, _: reports.append(r) or _give_up(reports))
                assert follower.engine.version == 3 and follower.engine.hash == sync.engine.hash
                assert not any(r.rejected for r in reports)

            # Without the swarm's secret (what `follow` did before: a public gossip) nothing of the leader is visible.
            with open_follower(_config(homes["outsider"], initial_peers=entry), leader.peer_id) as outsider:
                report = outsider.poll()
                assert report.leader_version is None and outsider.engine.version == 0
        finally:
            leader_gossip.shutdown()
            leader_lock.close()


def _give_up(reports: list) -> None:
    if len(reports) > 20:
        raise AssertionError(f"the follower did not reach the leader's version in 20 polls: {reports[-1]}")


def test_who_runs_is_checked_against_the_allowlist_before_anything_starts(tmp_path: Path, caplog) -> None:
    """An outsider with the lab's files (or a member the allowlist forgot) had trained with every batch refused by every
    member and nothing said; a follower of a leader not on its allowlist, or a bootstrap peer listing only itself,
    refused every record the same way. Each is now one line at start, before the model loads or gossip starts."""
    homes = {name: tmp_path / name for name in ("member", "outsider", "follower", "bootstrap")}
    people = {name: _member(home) for name, home in homes.items()}
    allowlist, secret = tmp_path / "allowlist.txt", tmp_path / "secret.txt"
    allowlist.write_text(f"{people['member'].public_key.hex()}  # the lab's only training node\n")
    secret.write_text("33" * 32)
    secret.chmod(0o600)
    private = {"allowlist": allowlist, "secret": secret}

    outsider = _config(homes["outsider"], **private)
    with pytest.raises(InputError, match=f"public_key {people['outsider'].public_key.hex()} is not on swarm.private.allowlist_file"):
        build_node(outsider)
    claim_home(outsider)[1].close()  # the refused node let go of its home
    leader_unknown = f"the leader {people['outsider'].peer_id} is not on swarm.private.allowlist_file"
    with pytest.raises(InputError, match=leader_unknown), open_follower(_config(homes["follower"], **private), people["outsider"].peer_id):
        pass
    alone = tmp_path / "bootstrap-only.txt"
    alone.write_text(people["bootstrap"].public_key.hex() + "\n")
    only_itself = "lists only this bootstrap peer's own public_key"
    with pytest.raises(InputError, match=only_itself), open_bootstrap_peer(_config(homes["bootstrap"], allowlist=alone, secret=secret)):
        pass

    # Who may: a member (a leader alone on it, too); a follower of a member and a bootstrap peer, neither listed.
    swarm = PrivateSwarm.create(SWARM, b"\x33" * 32, {people["member"].public_key})
    config = _config(homes["member"], **private).swarm
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hivespec.node.swarm.private_files"):
        check_member(swarm, people["member"], config, trains=True)  # a leader alone: said, not refused
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and said[0].startswith(
            f"swarm.private.allowlist_file {str(allowlist)!r} lists only this node's own public_key: it refuses every peer's batches")
        caplog.clear()
        both = PrivateSwarm.create(SWARM, b"\x33" * 32, {people["member"].public_key, people["outsider"].public_key})
        check_member(both, people["member"], config, trains=True)
        assert not caplog.records
    check_member(swarm, people["follower"], config, leader=people["member"].peer_id)
    check_member(swarm, people["bootstrap"], config)
    check_member(None, Identity.generate(), config, trains=True)  # a public swarm
