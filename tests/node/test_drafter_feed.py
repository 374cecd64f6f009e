"""DrafterFeed: own and accepted rollouts reach the drafter and the trace in the order fed; the start-up rebuild replays the journal."""

import numpy as np

from hivespec.node.speculation.drafter import SuffixDrafter
from hivespec.node.speculation.feed import DrafterFeed
from hivespec.node.speculation.trace import TraceWriter, read_trace
from hivespec.node.training.store import RolloutStore, StoredRollout
from hivespec.protocol.rollout import Rollout


def _rollout(prompt: list[int], completion: list[int], index: int = 0) -> Rollout:
    return Rollout("p-" + "-".join(map(str, prompt)), index, 42, np.asarray(prompt, np.uint32), np.asarray(completion, np.uint32),
                   np.zeros(len(completion), np.float32), 1.0, "stop")


def test_own_then_foreign_rollouts_feed_the_drafter_and_the_trace_in_order(tmp_path):
    drafter = SuffixDrafter()
    feed = DrafterFeed(drafter, TraceWriter(tmp_path / "t.jsonl", meta={"node": "n"}), node="n")
    own = [_rollout([1, 2, 3], [7, 8, 9, 10], 0), _rollout([1, 2, 3], [7, 8, 9, 11], 1)]
    foreign = [_rollout([1, 2, 3], [7, 8, 9, 10], 5)]
    feed.feed(own, own=True, author="me", round_index=4, policy_version=2)
    feed.feed(foreign, own=False, author="peer", round_index=4, policy_version=1)
    feed.flush()
    feed.close()
    assert feed.observed == drafter.observed == 3
    assert drafter.length_history([1, 2, 3]) == [4, 4, 4]
    assert drafter.session([1, 2, 3]).propose([7, 8], 2).tokens[:1] == [9]  # what it saw predicts the continuation
    _, records = read_trace(tmp_path / "t.jsonl")
    assert [(r.own, r.author, r.sample_index, r.policy_version, r.round) for r in records] == [
        (True, "me", 0, 2, 4), (True, "me", 1, 2, 4), (False, "peer", 5, 1, 4)
    ]
    assert records[0].prompt_ids == [1, 2, 3] and records[1].completion_ids == [7, 8, 9, 11] and records[0].seed == 42
    assert all(isinstance(t, int) for t in records[0].completion_ids)


def test_without_a_drafter_or_trace_feeding_is_a_no_op(tmp_path):
    feed = DrafterFeed()
    feed.feed([_rollout([1], [2])], own=True, author="me", round_index=0, policy_version=0)
    feed.flush()
    assert feed.observed == 0
    store = RolloutStore(tmp_path / "r.sqlite")
    assert feed.replay(store, 10) == 0
    store.close()


def test_the_rebuild_replays_the_newest_journaled_rollouts_oldest_first_up_to_a_mark(tmp_path):
    store = RolloutStore(tmp_path / "r.sqlite")
    for index in range(5):
        rollout = _rollout([1, 2], [3] * (index + 1), index)
        store.add_rollouts([StoredRollout.from_rollout(rollout, author="me", round=index, policy_version=index, own=True,
                                                       received_at=float(index))])
        if index == 2:
            mark = store.journal_high_water()
    drafter = SuffixDrafter()
    assert DrafterFeed(drafter).replay(store, 2, up_to_rowid=mark) == 2
    assert drafter.length_history([1, 2]) == [2, 3]  # rows 1 and 2 (the two newest up to the mark), oldest first
    everything = SuffixDrafter()
    assert DrafterFeed(everything).replay(store, 100) == 5
    store.close()
