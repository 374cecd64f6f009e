"""DHT key names are stable strings and refuse swarm names that could escape their prefix."""

import pytest

from hivespec.protocol.keys import delta_key, peers_key, rollout_round_key


def test_key_names():
    assert rollout_round_key("demo", 12) == "hivespec/demo/rollouts/12"
    assert delta_key("demo", 3) == "hivespec/demo/delta/3"
    assert peers_key("my-swarm.v2") == "hivespec/my-swarm.v2/peers"


@pytest.mark.parametrize("swarm", ["", "a/b", "Demo", "-x", "x" * 65, "dé", 5])
def test_bad_swarm_names(swarm):
    with pytest.raises(ValueError, match="swarm name"):
        rollout_round_key(swarm, 0)


@pytest.mark.parametrize("value", [-1, True, 1.0, "3"])
def test_bad_counters(value):
    with pytest.raises(ValueError, match="non-negative"):
        rollout_round_key("demo", value)
    with pytest.raises(ValueError, match="non-negative"):
        delta_key("demo", value)
