"""SuffixDrafter / SuffixIndex: exact counts against brute force, drafting rules, windows and memory bounds."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hivespec.node.speculation.drafter import SuffixDrafter, SuffixIndex


def _occurrences(sequences, pattern):
    n = len(pattern)
    return sum(1 for s in sequences for i in range(len(s) - n + 1) if list(s[i : i + n]) == list(pattern))


def _longest_suffix_match(sequences, context):
    for n in range(len(context), 0, -1):
        if _occurrences(sequences, context[-n:]):
            return n
    return 0


@settings(max_examples=60, deadline=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=12), min_size=1, max_size=5),
    context=st.lists(st.integers(0, 4), min_size=0, max_size=10),
)
def test_match_and_continuation_probabilities_equal_brute_force(sequences, context):
    index = SuffixIndex(sequences)
    state, length = index.advance(0, 0, context)
    assert length == _longest_suffix_match(sequences, context)
    draft, probs = index.walk(state, limit=5, min_prob=0.0)
    matched = list(context[len(context) - length :]) if length else []
    prob = 1.0
    for token, p in zip(draft, probs, strict=True):
        # The drafted token is a most frequent continuation, with its empirical probability.
        base = _occurrences(sequences, matched)
        counts = {t: _occurrences(sequences, [*matched, t]) for t in range(5)}
        assert counts[token] == max(counts.values()) > 0
        prob *= counts[token] / base
        assert p == pytest.approx(prob)
        matched.append(token)
    if length == 0:
        assert draft == []


def test_proposes_the_majority_continuation_and_cuts_at_min_prob():
    drafter = SuffixDrafter(min_prob=0.3, prompt_tail=2)
    prompt = [100, 101, 102]
    for tail in ([7, 8, 9], [7, 8, 9], [7, 8, 5], [7, 4, 4]):
        drafter.observe(prompt, [1, 2, 3, *tail])
    session = drafter.session(prompt)
    draft = session.propose([1, 2, 3], budget=10)
    # After "1 2 3": 7 (4/4), then 8 (3/4), then 9 (2/4 of all: 0.5 >= 0.3), then the end.
    assert draft.tokens == [7, 8, 9]
    assert draft.probs == pytest.approx([1.0, 0.75, 0.5])
    assert session.propose([1, 2, 3, 7, 8], budget=10).tokens == [9]
    assert session.propose([1, 2, 3, 7, 8, 9], budget=1).tokens == []  # no continuation was ever seen
    strict = SuffixDrafter(min_prob=0.6, prompt_tail=2)
    for tail in ([7, 8, 9], [7, 8, 9], [7, 8, 5], [7, 4, 4]):
        strict.observe(prompt, [1, 2, 3, *tail])
    assert strict.session(prompt).propose([1, 2, 3], budget=10).tokens == [7, 8]


def test_budget_and_match_length_cap_the_draft():
    drafter = SuffixDrafter(spec_factor=1.0, prompt_tail=0)
    drafter.observe([1], list(range(10, 40)))
    session = drafter.session([1])
    assert session.propose([10, 11, 12, 13], budget=3).tokens == [14, 15, 16]
    assert session.propose([10, 11, 12, 13, 99, 20], budget=8).tokens == [21]  # matched 1 token, factor 1


def test_prompt_alone_gives_drafts_and_other_prompts_help_through_the_global_window():
    drafter = SuffixDrafter(prompt_tail=0)
    prompt = [5, 6, 7, 8, 9, 10]
    # A prompt never seen: its own tokens can be copied.
    assert drafter.session(prompt).propose([5, 6, 7], budget=3).tokens == [8, 9, 10]
    drafter.observe([42], [70, 71, 72, 73, 74])
    assert drafter.session(prompt).propose([1, 70, 71], budget=3).tokens == [72, 73, 74]


def test_window_eviction_and_memory_bounds():
    drafter = SuffixDrafter(window=2, max_prompts=3, global_max_tokens=100, prompt_tail=0, max_built=2)
    drafter.observe([1], [10, 11, 12])
    drafter.observe([1], [20, 21, 22])
    drafter.observe([1], [30, 31, 32])
    assert drafter.length_history([1]) == [3, 3]
    # The first rollout left the prompt's window; it is still in the global one.
    session = drafter.session([1])
    assert session.propose([30], budget=2).tokens == [31, 32]
    assert SuffixDrafter(window=2, global_max_tokens=3, prompt_tail=0).held_tokens() == 0
    rng = random.Random(0)
    for p in range(50):
        for _ in range(4):
            drafter.observe([p], [rng.randrange(1000) for _ in range(20)])
        drafter.session([p])
    assert len(drafter._prompts) == 3
    assert sum(1 for e in drafter._prompts.values() if e.index is not None) <= 2
    assert drafter.held_tokens() <= 100 + 3 * 2 * 20
    assert drafter.length_history([0]) == []



def test_a_peer_sending_the_longest_completions_cannot_bloat_the_prompt_windows():
    """A peer may send completions of the wire's 8192 tokens for our prompts, junk with an honest reward.

    Each prompt window had held 16 of them (131k tokens, a ~60 MB index built in seconds) and 64
    such indexes were kept: gigabytes. Now a window holds at most global_max_tokens tokens and the
    built indexes at most max_built_tokens together.
    """
    rng = random.Random(0)
    drafter = SuffixDrafter(window=16, global_max_tokens=1000, max_built_tokens=3000, prompt_tail=0)
    for p in range(6):
        for _ in range(16):
            drafter.observe([p], [rng.randrange(1000) for _ in range(400)])
        drafter.session([p])
        assert drafter.length_history([p]) == [400, 400]  # the newest that fit in 1000 tokens
    assert drafter.held_tokens() <= 1000 + 6 * 1000
    built = [e.index.tokens for e in drafter._prompts.values() if e.index is not None]
    assert 1 <= len(built) and sum(built) <= 3000
    # The newest rollout always stays, even alone over the bound, and drafts as before.
    drafter.observe([9], list(range(2000)))
    assert drafter.length_history([9]) == [2000]
    assert drafter.session([9]).propose([0, 1, 2], budget=3).tokens == [3, 4, 5]

def test_sessions_keep_their_snapshot_while_new_rollouts_arrive():
    drafter = SuffixDrafter(prompt_tail=0)
    drafter.observe([1], [2, 3, 4])
    session = drafter.session([1])
    drafter.observe([1], [2, 9, 9])
    drafter.observe([1], [2, 9, 9])
    assert session.propose([2], budget=2).tokens == [3, 4]
    assert drafter.session([1]).propose([2], budget=2).tokens == [9, 9]


def test_a_rollout_seen_with_a_few_tokens_changed_is_drafted_a_run_at_a_time():
    """Sixteen variants of one 200-token rollout (6 tokens changed in each): decoding the original, most drafts are
    taken whole, so it needs a fraction of a forward a token. What drafting costs is bench/drafter_replay.py's
    `draft_us_per_token` (target 50 us): a wall-time bound here would hold on one machine and not the next."""
    rng = random.Random(1)
    base = [rng.randrange(49152) for _ in range(200)]
    drafter = SuffixDrafter()
    prompt = list(range(40))
    for _ in range(16):
        variant = list(base)
        for _ in range(6):
            variant[rng.randrange(200)] = rng.randrange(49152)
        drafter.observe(prompt, variant)
    session = drafter.session(prompt)
    completion, proposed, accepted, forwards = [], 0, 0, 0
    while len(completion) < len(base):
        draft = session.propose(completion, budget=8)
        forwards += 1
        proposed += len(draft.tokens)
        agree = 0
        for token, truth in zip(draft.tokens, base[len(completion) :]):
            if token != truth:
                break
            agree += 1
        accepted += agree
        completion = base[: len(completion) + agree + 1]
    assert completion == base
    assert forwards < len(base) / 4 and accepted > 0.8 * proposed  # 27 forwards, 174 of 206 drafted tokens taken


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="window must be >= 1"):
        SuffixDrafter(window=0)
    with pytest.raises(ValueError, match="max_built_tokens must be >= 1"):
        SuffixDrafter(max_built_tokens=0)
    with pytest.raises(ValueError, match="min_prob"):
        SuffixDrafter(min_prob=1.5)
