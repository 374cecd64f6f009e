"""Verify-cost curve (calibration, cache, interpolation), length classes and the length-aware width choice."""

import json

import pytest
import torch

from hivespec.node.config import SpeculationConfig
from hivespec.node.model.engine import GenerationRequest, SamplingParams, SpeculationStats, TorchEngine
from hivespec.node.model.loader import load_model
from hivespec.node.speculation.curve import (
    VerifyCostCurve,
    calibrate_verify_cost,
    calibration_batches,
    load_or_calibrate,
    wider_pays,
)
from hivespec.node.speculation.drafter import Draft, SuffixDrafter
from hivespec.node.speculation.feed import DrafterFeed
from hivespec.node.speculation.policy import (
    CurveCalibration,
    LengthAwarePolicy,
    RowPlan,
    build_speculation,
    length_class,
    where_drafting_pays,
)
from hivespec.node.training.store import RolloutStore, StoredRollout
from hivespec.protocol.rollout import Rollout

torch.set_num_threads(1)


def _curve(b1=(1.0, 1.2, 1.3, 1.5, 1.6, 2.0), b8=(1.0, 1.7, 2.2, 2.7, 3.2, 5.0)):
    return VerifyCostCurve((1, 8), (1, 2, 3, 5, 9, 17), (b1, b8), (0.04, 0.2))


def test_ratio_interpolates_and_takes_the_next_larger_batch():
    curve = _curve()
    assert curve.ratio(1, 1) == 1.0
    assert curve.ratio(1, 9) == pytest.approx(1.6)
    assert curve.ratio(1, 7) == pytest.approx(1.55)
    assert curve.ratio(4, 9) == pytest.approx(3.2)  # batch 4 uses the batch-8 row
    assert curve.ratio(32, 17) == pytest.approx(5.0)



def test_widths_past_the_widest_measured_are_priced_linearly_from_it():
    """num_speculative_tokens may exceed the curve's widest width (17); a last segment that slopes down
    had been extended to a ratio of 1.0, so the policy verified 129 tokens a step as if it cost a plain one."""
    curve = VerifyCostCurve((1,), (1, 2, 3, 5, 9, 17), ((1.0, 1.8, 1.9, 1.4, 2.2, 2.1),), (0.05,))
    assert curve.ratio(1, 17) == pytest.approx(2.1)
    assert curve.ratio(1, 34) == pytest.approx(4.2) and curve.ratio(1, 129) > curve.ratio(1, 65) > curve.ratio(1, 33)
    policy = LengthAwarePolicy(curve, SuffixDrafter(), max_budget=128)
    draft = Draft(list(range(128)), [0.9 ** (j + 1) for j in range(128)], 10)
    assert 1 <= policy.width([draft], [RowPlan(128)]) <= 16


def test_a_slow_narrow_width_is_covered_by_a_cheaper_wider_one_and_the_curve_is_cached(tmp_path):
    calls = []

    def fake(batch, widths):
        calls.append(batch)
        seconds = {1: 1.0, 2: 9.0, 3: 1.3, 5: 1.4, 9: 1.6, 17: 2.0}  # width 2: a slow kernel (or a noise spike)
        return [seconds[w] * batch for w in widths]

    curve = calibrate_verify_cost(fake, batches=(1, 2), key="k", repeats=1)
    assert curve.ratios[0] == (1.0, 9.0, 1.3, 1.4, 1.6, 2.0)  # as measured
    assert curve.cover(1, 2) == (3, 1.3)  # one draft runs as a padded 3-token forward
    assert curve.cover(1, 3) == (3, 1.3) and curve.cover(1, 1) == (1, 1.0)
    assert curve.cover(1, 17) == (17, 2.0)
    cached = load_or_calibrate(tmp_path, "k", fake, batches=(1, 2), repeats=1)
    assert load_or_calibrate(tmp_path, "k", fake, batches=(1, 2)) == cached
    assert calls == [1, 2, 1, 2]  # the second load read the file
    assert load_or_calibrate(tmp_path, "k", fake, batches=(1,)) == cached  # a subset of what is cached
    assert calls == [1, 2, 1, 2]
    (tmp_path / "verify-cost-k.json").write_text(json.dumps({"format": 0}))
    load_or_calibrate(tmp_path, "k", fake, batches=(1,), repeats=1)
    assert calls[-1] == 1  # an old format is re-measured


def test_calibration_repeats_keep_each_widths_fastest_time_and_cover_new_batches(tmp_path):
    timings = iter([
        [1.0, 1.1, 1.2, 1.3, 1.5, 2.0],  # quiet
        [1.0, 2.3, 2.4, 2.5, 2.6, 3.0],  # the wider forwards timed while another job ran
    ])
    calls = []

    def busy(batch, widths):
        calls.append(batch)
        return next(timings) if batch == 1 else [batch * w for w in (1.0, 1.2, 1.4, 1.6, 2.0, 3.0)]

    curve = calibrate_verify_cost(busy, batches=(1,), key="k", repeats=2)
    assert curve.ratios[0] == (1.0, 1.1, 1.2, 1.3, 1.5, 2.0)
    timings = iter([[1.0, 1.1, 1.2, 1.3, 1.5, 2.0]] * 2)
    load_or_calibrate(tmp_path, "k", busy, batches=(1,), repeats=1)
    # A cache measured for batch 1 only is re-measured for the union when batch 2 is wanted.
    wider = load_or_calibrate(tmp_path, "k", busy, batches=(2,), repeats=1)
    assert wider.batches == (1, 2) and calls[-2:] == [1, 2]
    assert wider.ratio(2, 17) == pytest.approx(3.0)


def test_length_classes_from_history():
    population = list(range(10, 100, 10))
    assert length_class([], population) == "medium"
    assert length_class([95], population) == "long"
    assert length_class([10, 20], population) == "short"
    assert length_class([50], population) == "medium"


def test_width_follows_the_cost_curve_and_the_length_class():
    drafter = SuffixDrafter()
    for p, length in [(1, 10), (2, 20), (3, 200), (3, 220)]:
        drafter.observe([p], [7] * length)
    policy = LengthAwarePolicy(_curve(), drafter, max_budget=16)
    assert policy.plan([3]).length_class == "long" and policy.plan([3]).cap == 16
    assert policy.plan([1]).cap == 4
    sure = Draft([5] * 8, [1.0] * 8, 8)
    unsure = Draft([5] * 8, [0.5**i for i in range(1, 9)], 3)
    plan = policy.plan([3])
    # Batch 1, confident draft: all 8 tokens pay (9 tokens for 1.6x a plain step).
    assert policy.width([sure], [plan]) == 8
    # A weak draft: only the first tokens are worth their cost.
    assert 0 < policy.width([unsure], [plan]) < 8
    # Batch 8 with weak drafts: compute-bound, plain steps.
    assert policy.width([unsure] * 8, [plan] * 8) == 0
    assert policy.wants_drafts(1)
    flat = LengthAwarePolicy(_curve(b8=(1.0, 2.5, 3.5, 6.0, 10.0, 18.0)), drafter)
    assert not flat.wants_drafts(8)


def test_drafter_rebuilds_from_the_store_and_engine_gets_speculation(tmp_path):
    import numpy as np

    with RolloutStore(tmp_path / "rollouts.sqlite") as store:
        rows = []
        for i in range(3):
            rollout = Rollout(
                "p", i, 1, np.array([1, 2, 3], dtype=np.uint32), np.array([4, 5, 6 + i], dtype=np.uint32),
                np.zeros(3, dtype=np.float32), 0.0, "stop",
            )
            rows.append(StoredRollout.from_rollout(rollout, author="me", round=0, policy_version=0, own=True, received_at=float(i)))
        store.add_rollouts(rows)
        drafter = SuffixDrafter()
        assert DrafterFeed(drafter).replay(store, 2) == 2
        assert drafter.length_history([1, 2, 3]) == [3, 3]
        # A resume: back to what was journaled by the checkpoint (here the first two rows).
        checkpoint_rowid = store.journal_high_water() - 1
        drafter = SuffixDrafter()
        assert DrafterFeed(drafter).replay(store, 10, up_to_rowid=checkpoint_rowid) == 2
        assert drafter.session([1, 2, 3]).propose([4, 5], 4).tokens in ([6], [7])  # never the later row's 8
        model = load_model("tiny", dtype=torch.float32)
        engine = TorchEngine(model, max_batch_size=2)
        build = {"model_config": model.config, "dtype": "float32", "device": "cpu", "max_batch_size": 2, "cache_folder": tmp_path / "cache"}
        drafter, policy, calibration = build_speculation(SpeculationConfig(rebuild_rollouts=10), engine, store, **build)
    assert drafter.observed == 3
    # No cached curve: the policy starts inactive and the engine decodes plainly until it is measured.
    assert calibration is not None and not policy.active and not policy.wants_drafts(1)
    engine.set_speculation(drafter, policy)
    assert engine.drafter is drafter
    requests = [GenerationRequest((1, 2, 3), seed=5, sample_index=i) for i in range(2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    stats = SpeculationStats()
    plain = engine.generate(requests, params, stats=stats)
    assert stats.speculative_steps == 0 and stats.proposed == 0
    progress: list[str] = []
    curve = calibration.run(on_progress=progress.append)
    assert progress == ["timing batch 1 (1/2)", "timing batch 2 (2/2)"]
    assert policy.active and policy.curve is curve and curve.batches == (1, 2)
    assert list((tmp_path / "cache").glob("verify-cost-*.json"))
    speculative = engine.generate(requests, params)
    # Lossless: the same completions; log-probs equal up to the rounding of other forward widths.
    assert [s.completion_ids for s in speculative] == [s.completion_ids for s in plain]
    for a, b in zip(speculative, plain, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    # The next start finds the curve cached: active at once, nothing left to measure.
    again = build_speculation(SpeculationConfig(rebuild_rollouts=0), engine, None, **build)
    assert again[2] is None and again[1].active and again[1].curve == curve


def test_a_busy_moment_behind_a_larger_batchs_plain_step_does_not_make_its_drafts_look_cheap():
    # A demo node's timings (ms) on a 2-core EPYC while its two peers trained: batch 16's plain step
    # came out 2.7x too slow, so every width there looked cheap (9 tokens for 3.0x) next to batch 4's 11.6x.
    measured = {
        1: [31.6, 34.6, 36.3, 62.1, 67.7, 50.1],
        4: [33.3, 85.7, 128.6, 214.3, 385.7, 728.5],
        16: [125.4, 156.8, 142.5, 218.6, 381.7, 769.0],
    }
    curve = calibrate_verify_cost(lambda batch, widths: [measured[batch][j] / 1000 for j in range(len(widths))],
                                  batches=(1, 4, 16), key="k")
    assert curve.ratios[0] == pytest.approx((1.0, 1.0949, 1.1487, 1.9652, 2.1424, 1.5854), abs=1e-4)  # batch 1 as measured
    for smaller, larger in ((0, 1), (1, 2)):
        assert all(b >= a for a, b in zip(curve.ratios[smaller], curve.ratios[larger], strict=True))
    assert curve.ratios[2] == curve.ratios[1] and curve.ratio(16, 9) == pytest.approx(385.7 / 33.3, abs=1e-3)
    policy = LengthAwarePolicy(curve, SuffixDrafter())
    assert policy.wants_drafts(1) and not policy.wants_drafts(16)
    assert where_drafting_pays(policy) == "drafting pays at batch sizes [1]"


def test_calibration_skips_widths_past_the_compute_bound_and_prices_them_linearly():
    timed_widths = []

    def compute_bound(batch, widths, wider_pays=wider_pays):
        seconds = []
        for width in widths:
            seconds.append(float(width))  # every token costs a full plain step: nothing pays
            timed_widths.append(width)
            if not wider_pays(width, seconds[-1] / seconds[0]):
                break
        return seconds + [float("inf")] * (len(widths) - len(seconds))

    curve = calibrate_verify_cost(compute_bound, batches=(16,), key="k")
    assert timed_widths == [1, 2]  # 2 tokens for 2x: at 80% acceptance a 2-token step emits 1.8
    assert curve.ratios[0] == (1.0, 2.0, 3.0, 5.0, 9.0, 17.0)
    assert not LengthAwarePolicy(curve, SuffixDrafter()).wants_drafts(16)
    assert calibration_batches(16) == [1, 4, 16] and calibration_batches(2) == [1, 2] and calibration_batches(1) == [1]


def test_observed_rejections_turn_speculation_down_and_probes_keep_measuring():
    drafter = SuffixDrafter()
    policy = LengthAwarePolicy(_curve(b1=(1.0, 2.2, 2.2, 2.2, 2.2, 3.9)), drafter, probe_every=4)
    sure = Draft([5] * 8, [1.0] * 8, 8)
    plan = policy.plan([1])
    assert policy.width([sure], [plan]) > 0  # the prior trusts a confident drafter
    for _ in range(200):
        policy.observe(drafted=8, accepted=0, rejections=1)  # the target keeps rejecting the first token
    assert policy.alpha < 0.05
    # A checkpoint keeps the adaptive state: a resumed policy picks the same widths.
    resumed = LengthAwarePolicy(policy.curve, drafter, probe_every=4)
    resumed.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert resumed.alpha == policy.alpha
    widths = [policy.width([sure], [plan]) for _ in range(8)]
    assert widths == [resumed.width([sure], [plan]) for _ in range(8)]
    assert widths.count(0) == 6 and widths.count(2) == 2  # off, but one step in 4 probes with 2 tokens


def test_a_short_draft_runs_as_the_cheaper_padded_forward_and_stays_lossless():
    # Width 2 and 3 on the slow small-GEMM path, 5 cheap (as measured in fp32 on a 2-core CPU).
    curve = VerifyCostCurve((1,), (1, 2, 3, 5, 9, 17), ((1.0, 1.9, 2.1, 1.3, 1.5, 1.8),), (0.05,))
    drafter = SuffixDrafter()
    policy = LengthAwarePolicy(curve, drafter, max_budget=16)
    plan = policy.plan([1])
    one = Draft([5], [1.0], 4)
    # One sure draft token: a 2-token forward (1.9x for 2 tokens) would not pay; a padded
    # 5-token forward (1.3x for the same 2 tokens) does.
    assert policy.width([one], [plan]) == 4
    assert policy.wants_drafts(1)

    model = load_model("tiny", dtype=torch.float64)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(0, vocab, (6,), generator=generator).tolist()) for _ in range(2)]
    from hivespec.node.model.engine import GenerationRequest, SamplingParams, SpeculationStats

    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    requests = [GenerationRequest(p, seed=1, sample_index=i) for i, p in enumerate(prompts)]
    plain = TorchEngine(model, max_batch_size=1).generate(requests, params)
    for sample in plain:
        drafter.observe(sample.prompt_ids, sample.completion_ids)
    stats = SpeculationStats()
    padded = TorchEngine(model, max_batch_size=1, drafter=drafter, policy=policy).generate(requests, params, stats=stats)
    assert padded == plain
    assert stats.accepted > 0 and stats.tokens_per_forward > 1.0


def test_a_calibration_takes_the_curve_a_sibling_node_cached_meanwhile(tmp_path):
    calls = []

    def timer(batch, widths):
        calls.append(batch)
        return [float(batch) * (1 + 0.1 * w) for w in widths]

    first = CurveCalibration(LengthAwarePolicy(None, SuffixDrafter()), timer, tmp_path, "k", [1, 4])
    second = CurveCalibration(LengthAwarePolicy(None, SuffixDrafter()), timer, tmp_path, "k", [1, 4])
    measured = first.run()
    assert calls == [1, 4]
    assert second.run() == measured and calls == [1, 4]  # read from the cache, not timed again
    assert second.policy.active and second.policy.curve == measured
    assert first.measured and not second.measured  # what the node then tells its user: measured, or found ready


def test_where_drafting_pays_names_the_batch_sizes_or_says_it_pays_nowhere():
    drafter = SuffixDrafter()
    assert where_drafting_pays(LengthAwarePolicy(None, drafter)) == "drafting pays at no batch size here: decoding plainly"
    steep = LengthAwarePolicy(_curve(b8=(1.0, 2.5, 3.5, 6.0, 10.0, 18.0)), drafter)
    assert steep.curve.batches == (1, 8) and steep.wants_drafts(1) and not steep.wants_drafts(8)
    assert where_drafting_pays(steep) == "drafting pays at batch sizes [1]"


def test_calibration_does_not_count_time_the_core_spends_on_other_work():
    # A demo node times its curve while its peers train on the same cores: a step the scheduler
    # pauses is slow by the wall, not in work. A paused plain step (slept through here, as a
    # preempted one waits) made every wider step look cheap by the wall; the thread's CPU time,
    # which a one-thread CPU node times by (`work_clock`), does not count the pause.
    import time

    from hivespec.node.model.device import work_clock

    model = load_model("tiny", dtype=torch.float32)
    forward = model.forward

    def paused_when_plain(*args, input_ids=None, **kwargs):
        if input_ids.shape[1] == 1:
            time.sleep(0.3)
        return forward(*args, input_ids=input_ids, **kwargs)

    model.forward = paused_when_plain
    engine = TorchEngine(model, max_batch_size=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a demo node on a 2-core machine has
    try:
        assert work_clock("cpu") is time.thread_time
        by_work = engine.time_forwards(2, [1, 3], rounds=1)
        by_wall = engine.time_forwards(2, [1, 3], rounds=1, clock=time.perf_counter)
    finally:
        torch.set_num_threads(threads)
    assert by_wall[0] >= 0.3 > by_work[0]  # the pause counts by the wall only
    assert by_wall[1] < by_wall[0]  # where, timed by the wall, 3 tokens a row cost less than 1


def test_several_threads_and_gpus_are_timed_by_the_wall():
    import time

    from hivespec.node.model.device import work_clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert work_clock("cpu") is time.perf_counter  # the other threads' work is not this thread's CPU time
        torch.set_num_threads(1)
        assert work_clock("cpu") is time.thread_time
        assert work_clock("cuda:0") is time.perf_counter  # the GPU works elsewhere; the step synchronizes
    finally:
        torch.set_num_threads(threads)


def test_nodes_on_one_machine_measure_the_curve_one_at_a_time(tmp_path):
    # A demo's three nodes reach their first wait together: the second waits for the first's
    # measurement and takes its curve instead of timing beside it.
    import threading

    calls, measuring, waited = [], threading.Event(), threading.Event()

    def slow_timer(batch, widths):
        calls.append(batch)
        measuring.set()
        assert waited.wait(30)  # the second node is waiting for the lock by now
        return [float(batch) * (1 + 0.1 * w) for w in widths]

    first = CurveCalibration(LengthAwarePolicy(None, SuffixDrafter()), slow_timer, tmp_path, "k", [1, 4])
    second = CurveCalibration(LengthAwarePolicy(None, SuffixDrafter()), slow_timer, tmp_path, "k", [1, 4])
    measured = []
    thread = threading.Thread(target=lambda: measured.append(first.run()))
    thread.start()
    assert measuring.wait(30)
    told = []
    curve = second.run(on_progress=lambda text: (told.append(text), waited.set()))
    thread.join(30)
    assert told[0] == "waiting for another node on this machine to finish measuring it"
    assert calls == [1, 4] and first.measured and not second.measured
    assert curve == measured[0] and second.policy.curve == curve
