"""Rollout traces: writer roundtrip and failure handling, the runtime hook, and the replay's acceptance math."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from hivespec.node.config import load_config
from hivespec.node.model.engine import (
    GenerationRequest,
    SamplingParams,
    SpeculationStats,
    TorchEngine,
)
from hivespec.node.model.loader import TINY_MODEL, load_model
from hivespec.node.speculation.drafter import SuffixDrafter
from hivespec.node.speculation.policy import UniformPolicy
from hivespec.node.speculation.trace import TraceRecord, TraceWriter, read_trace, replay


def _record(node="n", own=True, round=0, prompt=(1, 2, 3), completion=(4, 5, 6), key="p", author="a", index=0):
    return TraceRecord(
        node=node, own=own, author=author, round=round, prompt_key=key, prompt_ids=list(prompt),
        completion_ids=list(completion), sample_index=index, seed=2**64 - 1, policy_version=round, finish_reason="stop",
    )


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_writer_roundtrip_appends_and_flushes_per_call(tmp_path: Path, name: str) -> None:
    path = tmp_path / "sub" / name
    first = TraceWriter(path, meta={"model": "m", "max_new_tokens": 9})
    first.record([_record(round=0), _record(own=False, author="peer", round=0, completion=(7,))])
    assert not path.exists()  # nothing before the round's flush
    first.flush()
    first.record([_record(round=1, completion=(8, 9))])
    first.flush()
    # Flushed lines are readable while the writer is still open.
    assert [r.round for r in read_trace(path)[1]] == [0, 0, 1]
    first.close()
    second = TraceWriter(path, meta={"model": "m2"})  # a restart appends
    second.record([_record(round=2)])
    second.close()
    metas, records = read_trace(path)
    assert [m["model"] for m in metas] == ["m", "m2"]
    assert [(r.round, r.own, r.author, r.completion_ids) for r in records] == [
        (0, True, "a", [4, 5, 6]), (0, False, "peer", [7]), (1, True, "a", [8, 9]), (2, True, "a", [4, 5, 6]),
    ]
    assert records[0] == _record(round=0)
    assert first.written == 3 and second.written == 1


def test_truncated_last_line_is_skipped_and_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path)
    writer.record([_record(), _record(round=1)])
    writer.close()
    text = path.read_text()
    path.write_text(text[: len(text) - 10])  # killed mid-line
    assert [r.round for r in read_trace(path)[1]] == [0]
    path.write_text("not json\n" + text)
    with pytest.raises(ValueError, match=r"t.jsonl:1"):
        read_trace(path)


def test_a_full_disk_warns_once_and_stops_tracing(caplog: pytest.LogCaptureFixture) -> None:
    writer = TraceWriter("/dev/full")  # every write fails with ENOSPC
    writer.record([_record()])
    with caplog.at_level(logging.WARNING, logger="hivespec.node.speculation.trace"):
        writer.flush()
        writer.record([_record(round=1)])
        writer.flush()
        writer.close()
    assert writer.failed is not None and "No space" in writer.failed
    assert len([r for r in caplog.records if "tracing stops" in r.message]) == 1
    assert writer.written == 0


def test_replay_accepts_the_matching_draft_prefix_plus_one_bonus() -> None:
    prompt = [100, 101, 102]
    first = [1, 2, 3, 4, 5, 6]
    second = [1, 2, 3, 9, 5, 6]
    records = [
        _record(round=0, prompt=prompt, completion=first),
        _record(own=False, author="peer", round=0, prompt=prompt, completion=[7, 7, 7]),
        _record(round=1, prompt=prompt, completion=second),
    ]
    # Round 0 drafts from the prompt alone: nothing in the completion occurs in it, so each of
    # the 5 tokens after the prefill's first costs a step. Round 1, fed round 0's rollout:
    #   after [1]          draft 2 3 4 5 6 -> accept 2 3, bonus 9 (position 4)
    #   after [1 2 3 9]    "9" never seen -> no draft, bonus 5
    #   after [.. 9 5]     draft 6 (the suffix "5" continues with 6) -> accepted, and it is the last token
    drafter = SuffixDrafter(min_prob=0.0, spec_factor=16.0, prompt_tail=0)
    result = replay(records, drafter, budget=8, feeding="own")
    assert result.per_round == {0: [1, 6, 5], 1: [1, 6, 3]}
    assert result.rollouts == 2 and result.tokens == 12 and result.steps == 8
    assert result.accepted == 3  # 2, 3 and 6
    assert result.mean_accepted == pytest.approx((12 - 2) / 8)
    assert result.tokens_per_forward == pytest.approx(12 / 10)
    assert result.observed == 2  # the foreign rollout was left out
    # Fed the peer's rollout too, the drafter's counts change but this trace's steps do not.
    both = replay(records, SuffixDrafter(min_prob=0.0, spec_factor=16.0, prompt_tail=0), budget=8, feeding="own+foreign")
    assert both.observed == 3 and both.steps == 8
    # A budget of 1: after [1] draft 2 (accepted, bonus 3); after [1 2 3] draft 4 (rejected, bonus 9);
    # after [.. 9] nothing (bonus 5); after [.. 5] draft 6, the last token.
    capped = replay(records, SuffixDrafter(min_prob=0.0, spec_factor=16.0, prompt_tail=0), budget=1, feeding="own")
    assert capped.per_round[1] == [1, 6, 4] and capped.accepted == 2
    # The length limit caps drafts as the engine does: with max_new_tokens 6 the last step may not
    # draft (room 6 - 5 - 1 = 0), so the final 6 is a bonus, not an accepted draft.
    limited = replay(records, SuffixDrafter(min_prob=0.0, spec_factor=16.0, prompt_tail=0), budget=8, feeding="own", max_new_tokens=6)
    assert limited.per_round[1] == [1, 6, 3] and limited.accepted == 2


def test_sequential_feeding_lets_siblings_draft_for_each_other() -> None:
    prompt = [100, 101, 102]
    same = [5, 6, 7, 8, 9, 10, 11]
    records = [_record(round=0, prompt=prompt, completion=same, index=i) for i in range(2)]
    batched = replay(records, SuffixDrafter(prompt_tail=0), budget=8, feeding="own+foreign")
    sequential = replay(records, SuffixDrafter(prompt_tail=0), budget=8, feeding="sequential")
    assert batched.steps == 12  # one engine call: neither sibling sees the other
    # The second is drafted from the first: after [5] two drafts (spec_factor 2 x a 1-token match),
    # accepted with the bonus 8; then the remaining three, all accepted.
    assert sequential.steps == 6 + 2


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return load_model(TINY_MODEL, dtype=torch.float64)


def test_replay_predicts_the_engine_forwards_under_a_uniform_budget(tiny_model) -> None:
    """The replay is the engine's drafting and acceptance without the model: same forwards, row for row."""
    vocab = tiny_model.config.vocab_size
    generator = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(0, vocab, (n,), generator=generator).tolist()) for n in (5, 7, 7)]
    # Greedy on a random tiny model repeats itself: plenty of drafts, accepted and rejected.
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    drafter = SuffixDrafter()
    engine = TorchEngine(tiny_model, max_batch_size=2, drafter=drafter, policy=UniformPolicy(6))
    records, stats = [], []
    for round_index in range(3):
        requests = [GenerationRequest(p, seed=round_index, sample_index=i) for i, p in enumerate(prompts)]
        round_stats = SpeculationStats()
        samples = engine.generate(requests, params, stats=round_stats)
        for sample in samples:
            drafter.observe(sample.prompt_ids, sample.completion_ids)
        records += [_record(round=round_index, prompt=s.prompt_ids, completion=s.completion_ids) for s in samples]
        stats.append(round_stats)
    assert sum(s.accepted for s in stats) > 0
    result = replay(records, SuffixDrafter(), budget=6, feeding="own", max_new_tokens=40)
    for round_index, round_stats in enumerate(stats):
        rollouts, tokens, steps = result.per_round[round_index]
        assert tokens == round_stats.tokens
        assert steps + rollouts == round_stats.target_forwards, f"round {round_index}"


def test_nodes_record_own_and_accepted_foreign_rollouts(tmp_path: Path) -> None:
    from hivespec.node.build import build_node

    def node(name: str, peers: list[str]):
        config = load_config("tiny", overrides={
            "home": str(tmp_path / name), "name": name, "swarm.swarm": "test-trace", "swarm.expected_peers": "1",
            "swarm.round_timeout": "30", "swarm.bootstrap_timeout": "10", "status.enabled": "false",
            "checkpoint.every_rounds": "0", "checkpoint.at_exit": "false", "checkpoint.resume": "false",
            "speculation.trace_file": json.dumps(str(tmp_path / f"{name}.jsonl")), "swarm.initial_peers": json.dumps(peers),
        })
        return build_node(config)

    first = node("a", [])
    second = node("b", first.gossip.visible_maddrs)
    nodes = [first, second]
    try:
        reports = [None, None]

        def run(i: int) -> None:
            reports[i] = nodes[i].run_round(0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        # Flushed at the round, before close.
        for me, peer, report in ((first, second, reports[0]), (second, first, reports[1])):
            metas, records = read_trace(tmp_path / f"{me.name}.jsonl")
            assert metas[0]["node"] == me.name and metas[0]["max_new_tokens"] == 12
            own = [r for r in records if r.own]
            foreign = [r for r in records if not r.own]
            assert len(own) == report.rollouts.made == 8
            assert {r.author for r in own} == {me.identity.peer_id} and {r.node for r in records} == {me.name}
            assert len(foreign) == report.admissions.accepted > 0
            assert {r.author for r in foreign} == {peer.identity.peer_id}
            assert records.index(own[-1]) < records.index(foreign[0])  # the order the drafter was fed
            assert all(r.round == 0 and r.prompt_key for r in records)
            # Each rollout names its sampling key, and no two of a node's own share one.
            assert all(r.seed is not None for r in records)
            assert len({(r.seed, r.sample_index) for r in own}) == len(own)
    finally:
        for n in nodes:
            n.close()


def test_trace_flags_set_the_config_and_demo_gives_each_node_its_file(tmp_path: Path) -> None:
    from hivespec.node.cli import _config, build_parser
    from hivespec.node.config import ConfigError
    from hivespec.node.demo import node_trace_path

    args = build_parser().parse_args(["join", "--config", "tiny", "--trace", str(tmp_path / "t.jsonl")])
    assert _config(args).speculation.trace_file == str(tmp_path / "t.jsonl")
    assert build_parser().parse_args(["demo", "--trace", "x.jsonl"]).trace == "x.jsonl"
    assert node_trace_path("runs/t.jsonl", 2) == Path("runs/t.node-2.jsonl")
    assert node_trace_path("t.jsonl.gz", 0) == Path("t.node-0.jsonl.gz")
    with pytest.raises(ConfigError, match="speculation.trace_file"):
        load_config("tiny", overrides={"speculation.trace_file": '" "'})
