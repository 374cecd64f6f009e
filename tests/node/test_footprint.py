"""How many demo nodes a machine holds (`nodes_to_run`) and the memory estimate it rests on (node/model/footprint.py).

The estimate is checked against real nodes' high-water marks where they run: tests/test_swarm.py
(three tiny nodes) and tests/test_first_run.py (three nodes of the embedded model).
"""

from dataclasses import replace

from hivespec.node.config import load_config
from hivespec.node.demo import DEFAULT_NODES, nodes_to_run
from hivespec.node.model.footprint import ModelShape, config_peak_bytes, fit_micro_batch, model_shape, node_peak_bytes, shape_of
from hivespec.node.model.loader import load_model
from hivespec.node.model.precision import cpu_facts

GIB = 1 << 30
SMOLLM2_135M = ModelShape(params=134_515_008, layers=30, hidden=576, intermediate=1536, heads=9)


def _per_node(at_eight: int):
    """A node's bound at each micro batch: `at_eight` at 8, 0.25 GiB less per sample fewer."""
    return lambda micro_batch_size: at_eight - (8 - micro_batch_size) * GIB // 4


def test_the_default_demo_starts_three_nodes_in_smaller_micro_batches_or_as_many_as_the_memory_holds():
    assert nodes_to_run(None, _per_node(5 * GIB), 8, 64 * GIB) == (DEFAULT_NODES, 8, "")
    nodes, micro, why = nodes_to_run(None, _per_node(5 * GIB), 8, 12 * GIB)  # 3 x 4 GiB at 4
    assert (nodes, micro) == (DEFAULT_NODES, 4)
    assert why.startswith("3 nodes in micro batches of 4 samples, not 8: a node needs up to ~5.0 GiB while it trains, "
                          "12.0 GiB is available, and ~4.0 GiB in micro batches of 4")
    nodes, micro, why = nodes_to_run(None, _per_node(5 * GIB), 8, 10 * GIB)  # 3 x 3.5 GiB at 2 do not fit: fewer
    assert (nodes, micro) == (2, 8) and why.startswith("starting 2 nodes, not 3: a node needs up to ~5.0 GiB while it "
                                                       "trains, 10.0 GiB") and "--nodes N" in why
    one = "starting 1 node, not 3: a node needs up to ~5.0 GiB while it trains, 6.0 GiB is available (--nodes N to choose)"
    assert nodes_to_run(None, _per_node(5 * GIB), 8, 6 * GIB) == (1, 8, one)
    nodes, micro, why = nodes_to_run(None, _per_node(5 * GIB), 8, 4 * GIB)  # one node still: it fits its micro batch
    assert (nodes, micro) == (1, 8) and why.endswith("; it trains in smaller micro batches to fit")


def test_a_chosen_node_count_is_kept_in_smaller_micro_batches_or_warned_about_where_it_may_not_fit():
    assert nodes_to_run(2, _per_node(5 * GIB), 8, 12 * GIB) == (2, 8, "")
    nodes, micro, why = nodes_to_run(4, _per_node(5 * GIB), 8, 13 * GIB)  # 4 x 3.25 GiB in micro batches of one
    assert (nodes, micro) == (4, 1) and why.startswith("4 nodes in micro batches of 1 sample, not 8")
    nodes, micro, why = nodes_to_run(5, _per_node(5 * GIB), 8, 13 * GIB)
    assert (nodes, micro) == (5, 8) and why.startswith("warning: 5 nodes may not fit") and "--nodes 2 fits" in why
    assert "close other programs" in nodes_to_run(1, _per_node(5 * GIB), 8, 1 * GIB)[2]


def test_a_step_s_activations_and_attention_follow_the_micro_batch_and_the_completion_length():
    def peak(**changes) -> int:
        settings = {"engine_dtype": "bfloat16", "autocast": True, "on_gpu": False, "micro_batch_size": 8,
                    "row_tokens": 96 + 48} | changes
        return node_peak_bytes(SMOLLM2_135M, **settings)

    assert peak(micro_batch_size=4) < peak() < peak(micro_batch_size=16)
    assert peak(row_tokens=96 + 16) < peak() < peak(row_tokens=96 + 256)
    assert peak() < peak(engine_dtype="float32")  # the engine's copy: 2 bytes a weight against 4
    assert peak(on_gpu=True) < peak() / 2  # weights, optimizer and activations in device memory
    assert peak() < peak(autocast=False)  # float32 activations
    # The embedded model at the demo's step: over the 5.3-5.6 GB three demo nodes held (bf16), not far over; in micro
    # batches of one over the 4.14 GB a node held so.
    assert 5.6e9 < peak() < 8e9 and 4.14e9 < peak(micro_batch_size=1) < 5.5e9



def test_auto_precision_is_sized_as_the_cpu_will_likely_pick_it():
    """Before a node has measured its machine: bf16 autocast and engine on a CPU with native bf16, float32 elsewhere."""
    demo = load_config("demo")
    assert (demo.model.autocast, demo.model.engine_dtype) == ("auto", "auto")
    bf16 = bool(cpu_facts()["native_bf16_flags"])
    dtype = "bfloat16" if bf16 else "float32"
    settled = replace(demo, model=replace(demo.model, autocast=bf16, engine_dtype=dtype))
    assert config_peak_bytes(demo, SMOLLM2_135M) == config_peak_bytes(settled, SMOLLM2_135M)


def test_a_loaded_model_and_its_config_alone_give_one_shape():
    """A node sizes itself from its loaded model (build.py), the demo and the doctor from the config: they agree."""
    tiny = load_model("tiny")
    assert shape_of(tiny.config.to_dict(), sum(p.numel() for p in tiny.parameters())) == model_shape("tiny")


def test_a_gpt2_style_config_gives_its_shape_under_its_own_names():
    """GPT-2 (GPT-J, StarCoder) writes n_embd, n_layer, n_head, n_inner: a node of such a model sized itself by
    `config.to_dict()` and ended its start in KeyError 'hidden_size'."""
    from transformers import GPT2Config

    gpt2 = GPT2Config(vocab_size=100, n_embd=64, n_layer=3, n_head=4).to_dict()
    assert shape_of(gpt2, 1000) == ModelShape(params=1000, layers=3, hidden=64, intermediate=256, heads=4)
    assert shape_of({**gpt2, "n_inner": 96}, 1000).intermediate == 96


def test_a_node_short_of_memory_trains_in_smaller_micro_batches_and_says_so():
    config = load_config("demo")  # as a node has it once its precision is known
    config = replace(config, model=replace(config.model, autocast=True, engine_dtype="bfloat16"))
    shape = SMOLLM2_135M
    need = config_peak_bytes(config, shape)
    assert fit_micro_batch(config, shape, available=need, resident=0) == (8, "", True)
    assert fit_micro_batch(config, shape, available=need // 2, resident=need - need // 2) == (8, "", True)  # it holds half already
    size, why, fits = fit_micro_batch(config, shape, available=need * 9 // 10, resident=0)
    assert fits
    assert 1 < size < 8 and why.startswith(f"training in micro batches of {size} samples, not 8")
    smaller = replace(config, train=replace(config.train, micro_batch_size=size))
    assert config_peak_bytes(smaller, shape) <= need * 9 // 10 < config_peak_bytes(
        replace(config, train=replace(config.train, micro_batch_size=size + 1)), shape)  # the largest that fits
    # A step of long rows (a user's own tasks' prompts) fits in fewer samples at once than the config's rows would.
    long_rows = fit_micro_batch(config, shape, available=need * 9 // 10, resident=0, row_tokens=600)
    assert long_rows.fits and long_rows.size < size and long_rows.why.startswith(f"training in micro batches of {long_rows.size} ")
    gpu = replace(config, model=replace(config.model, device="cuda"))  # its host memory does not follow the micro batch
    assert fit_micro_batch(gpu, shape, available=GIB // 2, resident=0)[::2] == (8, False)
    size, why, fits = fit_micro_batch(config, shape, available=GIB, resident=0)
    assert size == 1 and not fits and "even in micro batches of one sample" in why and "the kernel may stop it mid-round" in why


def test_the_demo_sizes_its_nodes_by_the_precision_their_trainer_measures_here(tmp_path):
    """A CPU's bf16 flag does not say which precision it trains faster in: the demo sizes by the trainer's measurement,
    read here from a cache seeded under the key a node of 3 on this machine looks up."""
    import json

    from hivespec.node.demo import _at_measured_precision
    from hivespec.node.model.loader import load_model_config
    from hivespec.node.model.precision import ModelShape as Shapes
    from hivespec.node.model.precision import measurement_key, train_rows

    config = load_config("tiny", overrides={"model.autocast": "auto", "model.threads": "1"}, environ={})
    cache = tmp_path / "precision.json"
    rows = train_rows(config.train.micro_batch_size, config.rollout.max_completion_length)
    key = measurement_key("trainer", Shapes.of(load_model_config("tiny")), rows, 1, cpu_facts())
    shape = model_shape("tiny")
    for seconds, autocast, label in (((1.0, 2.0), False, "float32"), ((2.0, 1.0), True, "bfloat16 autocast")):
        cache.write_text(json.dumps({key: {"float32": seconds[0], "bfloat16": seconds[1]}}))
        sized, trains = _at_measured_precision(config, local_nodes=3, cache=cache)
        assert (sized.model.autocast, trains) == (autocast, f" (in {label} here)")
        explicit = replace(config, model=replace(config.model, autocast=autocast))
        assert config_peak_bytes(sized, shape) == config_peak_bytes(explicit, shape)
    set_by_user = replace(config, model=replace(config.model, autocast=True))
    assert _at_measured_precision(set_by_user, local_nodes=3, cache=cache) == (set_by_user, "")
