"""protocol.status: snapshots round-trip, and decoding treats the node's bytes as untrusted but tolerant."""

import json
from dataclasses import replace

import pytest
from fakes import make_snapshot

from hivespec.protocol.status import (
    MAX_LIST,
    MAX_STATUS_BYTES,
    STATUS_VERSION,
    NodeInfo,
    StatusSnapshot,
    decode_status,
    encode_status,
)
from hivespec.protocol.verdict import Reason


def _json(snapshot: StatusSnapshot) -> dict:
    return json.loads(encode_status(snapshot))


def test_a_full_snapshot_round_trips_exactly():
    snapshot = make_snapshot()
    verdict, decoded = decode_status(encode_status(snapshot))
    assert verdict.ok, verdict
    assert decoded == snapshot


def test_unknown_fields_from_a_newer_node_are_ignored_at_every_level():
    obj = _json(make_snapshot())
    obj["brand_new_section"] = {"x": 1}
    obj["node"]["future_field"] = "hello"
    obj["peers"][0]["latency_histogram"] = [1, 2, 3]
    obj["rounds"][0]["spec_tree_depth"] = 7
    verdict, decoded = decode_status(json.dumps(obj).encode())
    assert verdict.ok, verdict
    assert decoded == make_snapshot()


def test_an_older_node_that_reports_less_decodes_with_defaults():
    obj = {"version": STATUS_VERSION, "time": 5.0, "node": {"name": "n", "peer_id": "hs00", "swarm": "s"}}
    verdict, decoded = decode_status(json.dumps(obj).encode())
    assert verdict.ok, verdict
    assert decoded == StatusSnapshot(version=STATUS_VERSION, time=5.0, node=NodeInfo(name="n", peer_id="hs00", swarm="s"))
    assert decoded.rounds == [] and decoded.trainer.loss is None and decoded.sync.versions_behind is None


def test_non_finite_numbers_are_sent_as_null():
    snapshot = make_snapshot()
    last = replace(snapshot.rounds[-1], loss=float("nan"), tokens_per_second=float("inf"))
    verdict, decoded = decode_status(encode_status(replace(snapshot, rounds=[*snapshot.rounds[:-1], last])))
    assert verdict.ok, verdict
    assert decoded.rounds[-1].loss is None and decoded.rounds[-1].tokens_per_second is None


@pytest.mark.parametrize(
    ("mutate", "reason", "names"),
    [
        (lambda o: o.update(version=STATUS_VERSION + 1), Reason.BAD_VERSION, "upgrade hivespec here"),
        (lambda o: o.update(version=0), Reason.BAD_VERSION, "upgrade it"),
        (lambda o: o.pop("version"), Reason.BAD_KEYS, "snapshot.version"),
        (lambda o: o["node"].pop("peer_id"), Reason.BAD_KEYS, "snapshot.node.peer_id is missing"),
        (lambda o: o["node"].update(round="3"), Reason.BAD_TYPE, "snapshot.node.round"),
        (lambda o: o["node"].update(paused=1), Reason.BAD_TYPE, "snapshot.node.paused"),
        (lambda o: o["rounds"][2].update(reward_mean="high"), Reason.BAD_TYPE, "snapshot.rounds[2].reward_mean"),
        (lambda o: o["peers"].__setitem__(0, "hs01"), Reason.BAD_TYPE, "snapshot.peers[0]"),
        (lambda o: o["intake"].update(outcomes={"accept": 1.5}), Reason.BAD_TYPE, "snapshot.intake.outcomes.accept"),
        (lambda o: o["logs"][0].update(message="x" * 5000), Reason.TOO_LARGE, "snapshot.logs[0].message"),
        (lambda o: o.update(logs=[o["logs"][0]] * (MAX_LIST + 1)), Reason.TOO_LARGE, "snapshot.logs"),
        (lambda o: o.update(rounds={"0": {}}), Reason.BAD_TYPE, "snapshot.rounds must be a list"),
    ],
)
def test_bad_fields_are_rejected_with_their_path(mutate, reason, names):
    obj = _json(make_snapshot())
    mutate(obj)
    verdict, decoded = decode_status(json.dumps(obj).encode())
    assert decoded is None
    assert verdict.reason is reason
    assert names in verdict.detail


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", Reason.MALFORMED),
        (b"<html>not json</html>", Reason.MALFORMED),
        (b"\xff\xfe", Reason.MALFORMED),
        (b"[1, 2]", Reason.BAD_TYPE),
        (b'{"version": 1, "time": NaN}', Reason.NOT_FINITE),
        (b'{"version": 1, "time": Infinity}', Reason.NOT_FINITE),
        (b'{"version": 1, "time": ' + b"9" * 400 + b"}", Reason.NOT_FINITE),  # an int float() cannot hold: OverflowError
        (b"[" * 100_000 + b"]" * 100_000, Reason.TOO_DEEP),
        (b'{"a": ' * 20 + b"1" + b"}" * 20, Reason.TOO_DEEP),
        (b" " * (MAX_STATUS_BYTES + 1), Reason.TOO_LARGE),
    ],
)
def test_hostile_or_broken_bytes_never_raise(data, reason):
    verdict, decoded = decode_status(data)
    assert decoded is None
    assert verdict.reason is reason
