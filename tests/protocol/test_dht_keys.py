"""DHT key names are stable strings and refuse swarm names that could escape their prefix."""

import pytest

from hivespec.protocol.keys import MAX_INDEX_LEVEL, check_swarm_name, delta_key, peers_key, rollout_index_key


def test_key_names():
    assert rollout_index_key("demo", 58_000_123, 2, 3) == "hivespec/demo/rollouts/58000123/2/3"
    assert rollout_index_key("demo", 0, 0, 0) == "hivespec/demo/rollouts/0/0/0"
    assert delta_key("demo", 3) == "hivespec/demo/delta/3"
    assert peers_key("my-swarm.v2") == "hivespec/my-swarm.v2/peers"


@pytest.mark.parametrize("swarm", ["", "a/b", "Demo", "-x", "x" * 65, "dé", 5])
def test_bad_swarm_names(swarm):
    with pytest.raises(ValueError, match="swarm name"):
        check_swarm_name(swarm)
    with pytest.raises(ValueError, match="swarm name"):
        rollout_index_key(swarm, 0, 0, 0)


@pytest.mark.parametrize("value", [-1, True, 1.0, "3"])
def test_bad_counters(value):
    with pytest.raises(ValueError, match="non-negative"):
        rollout_index_key("demo", value, 0, 0)
    with pytest.raises(ValueError, match="non-negative"):
        delta_key("demo", value)


@pytest.mark.parametrize(("level", "prefix"), [(0, 1), (1, 2), (3, 8), (MAX_INDEX_LEVEL + 1, 0)])
def test_an_index_prefix_must_fit_its_level(level, prefix):
    with pytest.raises(ValueError, match="outside"):
        rollout_index_key("demo", 1, level, prefix)
