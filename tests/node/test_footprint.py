"""How many demo nodes a machine holds (`nodes_to_run`) and the memory estimate it rests on (node/model/footprint.py).

The estimate is checked against real nodes' high-water marks where they run: tests/test_swarm.py
(three tiny nodes) and tests/test_first_run.py (three nodes of the embedded model).
"""

import pytest

from hivespec.node.config import load_config
from hivespec.node.demo import DEFAULT_NODES, nodes_to_run
from hivespec.node.model.footprint import ModelShape, config_peak_bytes, memory_warning, model_shape, node_peak_bytes, shape_of
from hivespec.node.model.loader import load_model
from hivespec.protocol.errors import UserError

GIB = 1 << 30
SMOLLM2_135M = ModelShape(params=134_515_008, layers=30, hidden=576, intermediate=1536, heads=9)


def test_the_default_demo_starts_as_many_nodes_as_the_memory_holds():
    assert nodes_to_run(None, 5 * GIB, 64 * GIB) == (DEFAULT_NODES, "")
    nodes, why = nodes_to_run(None, 5 * GIB, 12 * GIB)
    assert nodes == 2 and why.startswith("starting 2 nodes, not 3: a node needs up to ~5.0 GiB while it trains, 12.0 GiB")
    assert "--nodes N" in why
    assert nodes_to_run(None, 5 * GIB, 6 * GIB)[0] == 1
    with pytest.raises(UserError, match="not enough memory for one node: a node needs up to ~5.0 GiB.*micro_batch_size"):
        nodes_to_run(None, 5 * GIB, 4 * GIB)


def test_a_chosen_node_count_is_kept_and_warned_about_where_it_may_not_fit():
    assert nodes_to_run(2, 5 * GIB, 12 * GIB) == (2, "")
    nodes, why = nodes_to_run(4, 5 * GIB, 12 * GIB)
    assert nodes == 4 and why.startswith("warning: 4 nodes may not fit") and "--nodes 2 fits" in why
    assert "close other programs" in nodes_to_run(1, 5 * GIB, 1 * GIB)[1]


def test_a_step_s_activations_and_attention_follow_the_micro_batch_and_the_completion_length():
    def peak(**changes) -> int:
        settings = {"engine_dtype": "bfloat16", "autocast": True, "on_gpu": False, "micro_batch_size": 8,
                    "max_completion_length": 48} | changes
        return node_peak_bytes(SMOLLM2_135M, **settings)

    assert peak(micro_batch_size=4) < peak() < peak(micro_batch_size=16)
    assert peak(max_completion_length=16) < peak() < peak(max_completion_length=256)
    assert peak() < peak(engine_dtype="float32")  # the engine's copy: 2 bytes a weight against 4
    assert peak(on_gpu=True) < peak() / 2  # weights, optimizer and activations in device memory
    assert peak() < peak(autocast=False) == peak(autocast="auto")  # float32 activations: "auto" may turn out so
    # The embedded model at the demo's step: over the 5.3-5.5 GB three demo nodes held (bf16), not far over.
    assert 5.5e9 < peak() < 6.5e9
    assert peak() < config_peak_bytes(load_config("demo"), SMOLLM2_135M) < 7.5e9


def test_a_node_is_warned_at_start_where_its_training_step_will_not_fit_the_memory_available():
    tiny = load_model("tiny")
    config = load_config("tiny")
    shape = shape_of(tiny.config.to_dict(), sum(p.numel() for p in tiny.parameters()))
    assert shape == model_shape("tiny")  # the loaded model and its config alone agree
    peak = config_peak_bytes(config, shape)
    assert memory_warning(config, shape, available=peak, resident=0) is None
    assert memory_warning(config, shape, available=peak // 2, resident=peak // 2) is None  # it holds half already
    warning = memory_warning(config, shape, available=peak // 4, resident=peak // 2)
    assert warning is not None and "the kernel may stop it mid-round" in warning and "train.micro_batch_size" in warning
