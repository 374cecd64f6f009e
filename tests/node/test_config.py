import pytest

from hivespec.node.config import CONFIG_DIR, ConfigError, NodeConfig, describe, load_config, parse_override


def test_defaults_build_without_a_file():
    config = load_config(None, environ={})
    assert isinstance(config, NodeConfig)
    assert config.train.tis_clip == 2.0


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_shipped_preset_loads(preset):
    load_config(preset, environ={})


def test_precedence_file_then_env_then_cli():
    config = load_config(
        "tiny",
        environ={"HIVESPEC_TRAIN__LEARNING_RATE": "0.5", "HIVESPEC_ROLLOUT__TOP_P": "0.9"},
        overrides={"train.learning_rate": "1e-4"},
    )
    assert config.model.name == "tiny"  # from the file
    assert config.rollout.top_p == 0.9  # from env
    assert config.train.learning_rate == 1e-4  # CLI beats env; "1e-4" is a YAML string, still a number


def test_unknown_keys_are_errors_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['lr'\] in train; valid keys: .*learning_rate"):
        load_config(None, overrides={"train.lr": "1"}, environ={})
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(None, environ={"HIVESPEC_NOPE__X": "1"})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rollout.top_p", "1.5", "top_p must be in"),
        ("rollout.num_generations", "0", "num_generations must be >= 1"),
        ("train.tis_clip", "0.5", "tis_clip must be >= 1"),
        ("model.engine_dtype", "int8", "must be one of"),
        ("rounds", "three", "must be an integer"),
        ("model.autocast", "maybe", "true or false"),
        # inf is in most ranges, but a wait of inf overflows: bootstrap_timeout ended gossip's start in an OverflowError
        ("swarm.bootstrap_timeout", "inf", r"swarm.bootstrap_timeout must be a finite number >= 0, got inf"),
        ("train.tis_mask_high", ".inf", "tis_mask_high must be a finite number >= 1"),
        ("supervise.stall_after", "-.inf", "stall_after must be a finite number > 0"),
        # so does one past the platform's timers (~9.2e9 s): a follower's poll_interval ended in time.sleep's
        # OverflowError, start_timeout in gossip's, request_timeout at the first publish and again at shutdown
        ("sync.poll_interval", "1e10", r"sync.poll_interval must be > 0 and at most 1e\+09 \(a longer wait overflows the platform's timers\), got 1e\+10"),
        ("swarm.request_timeout", "10000000000", "request_timeout must be > 0 and at most 1e"),
        # gossip is heard from at each probe only: a healthy one was reported stalled (thread stacks) every 15 s
        ("supervise.stall_after", "10", r"stall_after \(10 s\) must be more than supervise.gossip_probe_every \(15 s\) \+ 10 s"),
    ],
)
def test_bad_values_say_what_is_wrong(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides={key: value}, environ={})


def test_a_nucleus_under_the_mask_s_lower_bound_is_refused():
    """An own token's importance weight is the mass of the nucleus the engine drew it from (the trainer's policy is
    the whole distribution): with top_p 0.4 under tis_mask_low 0.5 the node had masked every own sample and trained on
    none of them."""
    with pytest.raises(ConfigError, match=r"rollout.top_p 0.4 is under train.tis_mask_low 0.5.*set rollout.top_p >= 0.5"):
        load_config(None, overrides={"rollout.top_p": "0.4"}, environ={})
    for fine in ({"rollout.top_p": "0.5"}, {"rollout.top_p": "0.4", "train.tis_mask_low": "0.3"},
                 {"rollout.top_p": "0.4", "train.tis_mask": "none"}, {"rollout.top_p": "0.4", "rollout.temperature": "0"}):
        load_config(None, overrides=fine, environ={})


def test_list_of_task_mixes_and_peers():
    config = load_config(
        None,
        overrides={"tasks.mix": "[{family: count, difficulty: 2}]", "swarm.initial_peers": '["/ip4/127.0.0.1/tcp/1/p2p/Qm"]'},
        environ={},
    )
    assert config.tasks.mix[0].family == "count" and config.tasks.mix[0].difficulty == 2
    assert config.swarm.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/Qm"]


def test_parse_override_and_describe():
    assert parse_override("a.b=c=d") == ("a.b", "c=d")
    with pytest.raises(ConfigError):
        parse_override("novalue")
    keys = {row[0] for row in describe()}
    assert {"train.learning_rate", "rollout.num_generations", "swarm.initial_peers"} <= keys
    assert all(row[2] for row in describe()), "every key documents itself"


def test_missing_file_lists_presets():
    with pytest.raises(ConfigError, match="presets"):
        load_config("no-such-preset", environ={})


def test_a_text_key_takes_its_value_as_typed_where_yaml_would_read_another():
    # As YAML, 0420 is 272 (octal), 1.10 is 1.1, yes is true and ' #...' a comment: a private swarm named 0420 by
    # --set joined the swarm "272", and a hub tag 1.10 asked for 1.1.
    config = load_config(None, overrides={"swarm.swarm": "0420", "model.revision": "1.10", "name": "yes",
                                          "home": "/tmp/run #2", "swarm.peers_file": "'quoted: as YAML'"}, environ={})
    assert (config.swarm.swarm, config.model.revision, config.name, config.home) == ("0420", "1.10", "yes", "/tmp/run #2")
    assert config.swarm.peers_file == "quoted: as YAML"
    assert load_config(None, overrides={"model.revision": "null"}, environ={}).model.revision is None
    assert load_config(None, environ={"HIVESPEC_SWARM__SWARM": "007"}).swarm.swarm == "007"
    # Other keys read YAML as before.
    assert load_config(None, overrides={"rounds": "12", "swarm.initial_peers": "[]"}, environ={}).rounds == 12
