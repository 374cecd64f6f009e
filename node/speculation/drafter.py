"""Nonparametric drafter: suffix automata over recent rollouts, per prompt and global.

RL samples the same prompts again and again, and a policy's completions of one prompt repeat
long stretches of each other (DAS, SuffixDecoding). `SuffixDrafter` keeps, per prompt, a
sliding window of that prompt's recent rollouts, plus a global window over all recent
rollouts, and drafts the most frequent continuation of the longest suffix of the current
context (prompt + completion so far) that occurs in them, walking down while the empirical
probability of the whole draft stays above `min_prob`.

Each window is indexed by a suffix automaton (`SuffixIndex`): every substring of the indexed
sequences is one walk from the root, and all strings of a state share their set of end
positions, so a state's occurrence count gives exact continuation frequencies. Matching the
context is incremental (a `DraftSession` feeds only the tokens a row gained since its last
draft), and the most frequent continuation of every state is precomputed, so a proposal
costs O(new tokens + draft length) dict and list lookups. An index is immutable once built: a
window that changes marks it stale and it is rebuilt, once, at the next session that needs it
(a few ms per thousand tokens), so sessions already running keep a consistent snapshot.

Memory is bounded whatever peers send (a rollout may carry up to the wire's 8192 completion
tokens, which a peer can fill with junk of a valid reward): at most `max_prompts` prompt windows
(least recently used evicted) of at most `window` rollouts and `global_max_tokens` tokens each
(oldest rollouts dropped first), a global window of at most `global_max_tokens` tokens, and at
most `max_built` built per-prompt indexes holding at most `max_built_tokens` tokens together (an
index costs about 0.5 KB a token).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Draft", "DraftSession", "SuffixDrafter", "SuffixIndex"]

_SEPARATOR = -1  # between indexed sequences; never a token id, so no match ever crosses it


class SuffixIndex:
    """A suffix automaton over token sequences, with occurrence counts and best continuations.

    `best_token[s]` is the most frequent token following the strings of state s (-1 if none),
    `best_next[s]` the state reached by it and `best_prob[s]` its empirical probability:
    occurrences followed by that token / all occurrences (ends of sequences count as "no
    continuation", so a frequent stopping point lowers the probability of going on).
    """

    __slots__ = ("best_next", "best_prob", "best_token", "link", "maxlen", "next", "tokens")

    def __init__(self, sequences: Iterable[Sequence[int]]) -> None:
        link, maxlen, nxt, count = [-1], [0], [{}], [0]
        last = 0
        indexed = 0
        for sequence in sequences:
            for token in (*sequence, _SEPARATOR):
                indexed += 1
                cur = len(maxlen)
                maxlen.append(maxlen[last] + 1)
                link.append(0)
                nxt.append({})
                count.append(1)
                p = last
                while p != -1 and token not in nxt[p]:
                    nxt[p][token] = cur
                    p = link[p]
                if p != -1:
                    q = nxt[p][token]
                    if maxlen[p] + 1 == maxlen[q]:
                        link[cur] = q
                    else:
                        clone = len(maxlen)
                        maxlen.append(maxlen[p] + 1)
                        link.append(link[q])
                        nxt.append(dict(nxt[q]))
                        count.append(0)
                        while p != -1 and nxt[p].get(token) == q:
                            nxt[p][token] = clone
                            p = link[p]
                        link[q] = clone
                        link[cur] = clone
                last = cur
        # Occurrences of a state = end positions of its strings: push counts up the suffix links,
        # longest states first.
        for state in sorted(range(1, len(maxlen)), key=maxlen.__getitem__, reverse=True):
            count[link[state]] += count[state]
        best_token, best_next, best_prob = [-1] * len(maxlen), [0] * len(maxlen), [0.0] * len(maxlen)
        for state in range(1, len(maxlen)):
            top, top_count = -1, 0
            for token, child in nxt[state].items():
                if token != _SEPARATOR and count[child] > top_count:
                    top, top_count = token, count[child]
            if top >= 0:
                best_token[state] = top
                best_next[state] = nxt[state][top]
                best_prob[state] = top_count / count[state]
        self.link, self.maxlen, self.next = link, maxlen, nxt
        self.best_token, self.best_next, self.best_prob = best_token, best_next, best_prob
        self.tokens = indexed

    def advance(self, state: int, length: int, tokens: Iterable[int]) -> tuple[int, int]:
        """Extend a match (state, matched length) by tokens: the longest indexed suffix of the context after them."""
        nxt, link, maxlen = self.next, self.link, self.maxlen
        for token in tokens:
            while state and token not in nxt[state]:
                state = link[state]
                length = maxlen[state]
            child = nxt[state].get(token)
            if child is None:
                state, length = 0, 0
            else:
                state, length = child, length + 1
        return state, length

    def walk(self, state: int, limit: int, min_prob: float) -> tuple[list[int], list[float]]:
        """Follow the most frequent continuation from state while the draft's probability stays >= min_prob.

        Returns the draft and, per draft token, the empirical probability that the draft up to
        and including it continues the context (a product of continuation frequencies).
        """
        best_token, best_next, best_prob = self.best_token, self.best_next, self.best_prob
        draft: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while state and len(draft) < limit:
            token = best_token[state]
            prob *= best_prob[state]
            if token < 0 or prob < min_prob:
                break
            draft.append(token)
            probs.append(prob)
            state = best_next[state]
        return draft, probs


@dataclass(frozen=True)
class Draft:
    """Proposed tokens, the probability of each draft prefix, and the suffix length they matched."""

    tokens: list[int]
    probs: list[float]  # probs[j]: empirical probability that tokens[: j + 1] all continue the context
    match_length: int

    @property
    def expected(self) -> float:
        """Expected number of draft tokens the target accepts, by the index's own statistics."""
        return sum(self.probs)


class _Cursor:
    """A running match of one context against one index."""

    __slots__ = ("index", "length", "state")

    def __init__(self, index: SuffixIndex, context: Sequence[int]) -> None:
        self.index = index
        self.state, self.length = index.advance(0, 0, context)

    def feed(self, tokens: Sequence[int]) -> None:
        self.state, self.length = self.index.advance(self.state, self.length, tokens)

    def draft(self, budget: int, min_prob: float, spec_factor: float) -> Draft:
        limit = min(budget, math.ceil(spec_factor * self.length))
        tokens, probs = self.index.walk(self.state, limit, min_prob)
        return Draft(tokens, probs, self.length)


class DraftSession:
    """Drafting for one sequence being generated: matches its context incrementally.

    `propose(completion, budget)` takes the whole completion so far (the session remembers how
    much of it it has seen) and returns the better of the per-prompt and global drafts.
    """

    def __init__(self, drafter: SuffixDrafter, prompt_ids: Sequence[int], indexes: list[SuffixIndex]) -> None:
        self._drafter = drafter
        self._cursors = [_Cursor(index, prompt_ids) for index in indexes]
        self._seen = 0

    def propose(self, completion: Sequence[int], budget: int) -> Draft:
        """Up to `budget` draft tokens to follow prompt + completion; empty when nothing matches."""
        drafter = self._drafter
        if len(completion) > self._seen:
            new = completion[self._seen :]
            for cursor in self._cursors:
                cursor.feed(new)
            self._seen = len(completion)
        best = Draft([], [], 0)
        if budget <= 0:
            return best
        for cursor in self._cursors:
            draft = cursor.draft(budget, drafter.min_prob, drafter.spec_factor)
            if draft.expected > best.expected:
                best = draft
        return best


class _PromptWindow:
    __slots__ = ("index", "lengths", "prompt", "rollouts", "tokens")

    def __init__(self, prompt: tuple[int, ...]) -> None:
        self.prompt = prompt
        self.rollouts: deque[array] = deque()
        self.lengths: deque[int] = deque()
        self.tokens = 0  # in rollouts
        self.index: SuffixIndex | None = None

    def add(self, sequence: array, length: int, window: int, max_tokens: int) -> None:
        """Append a rollout, dropping the oldest while more than `window` or `max_tokens` (the newest always stays)."""
        self.rollouts.append(sequence)
        self.lengths.append(length)
        self.tokens += len(sequence)
        while len(self.rollouts) > 1 and (len(self.rollouts) > window or self.tokens > max_tokens):
            self.tokens -= len(self.rollouts.popleft())
            self.lengths.popleft()
        self.index = None


class SuffixDrafter:
    """Suffix-automaton drafter over recent rollouts: one window per prompt plus a global one.

    Feed it with `observe(prompt_ids, completion_ids)` (own and accepted foreign rollouts alike);
    draft with `session(prompt_ids).propose(completion, budget)`. Each indexed rollout is its
    prompt's last `prompt_tail` tokens followed by its completion, so a fresh completion finds a
    match from its first token; a prompt's own index also holds the whole prompt once, so
    completions that copy from the prompt get drafts before the prompt has any history.
    """

    def __init__(
        self,
        *,
        window: int = 16,
        global_max_tokens: int = 32768,
        max_prompts: int = 1024,
        max_built: int = 64,
        max_built_tokens: int = 262144,
        min_prob: float = 0.1,
        spec_factor: float = 2.0,
        prompt_tail: int = 8,
    ) -> None:
        for name, value in (("window", window), ("global_max_tokens", global_max_tokens), ("max_prompts", max_prompts), ("max_built", max_built), ("max_built_tokens", max_built_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        if spec_factor <= 0:
            raise ValueError(f"spec_factor must be > 0, got {spec_factor}")
        if prompt_tail < 0:
            raise ValueError(f"prompt_tail must be >= 0, got {prompt_tail}")
        self.window = window
        self.global_max_tokens = global_max_tokens
        self.max_prompts = max_prompts
        self.max_built = max_built
        self.max_built_tokens = max_built_tokens
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.prompt_tail = prompt_tail
        self._prompts: OrderedDict[tuple[int, ...], _PromptWindow] = OrderedDict()
        self._built: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prompts whose index is held (its tokens), LRU
        self._built_tokens = 0
        self._global: deque[array] = deque()
        self._global_tokens = 0
        self._global_index: SuffixIndex | None = None
        self.observed = 0

    def observe(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> None:
        """Add one finished rollout to its prompt's window and to the global window."""
        prompt = tuple(int(t) for t in prompt_ids)
        sequence = array("i", prompt[len(prompt) - self.prompt_tail :] if self.prompt_tail else ())
        sequence.extend(int(t) for t in completion_ids)
        entry = self._prompts.get(prompt)
        if entry is None:
            entry = self._prompts[prompt] = _PromptWindow(prompt)
            while len(self._prompts) > self.max_prompts:
                evicted, _ = self._prompts.popitem(last=False)
                self._unbuild(evicted)
        else:
            self._prompts.move_to_end(prompt)
            self._unbuild(prompt)
        entry.add(sequence, len(completion_ids), self.window, self.global_max_tokens)
        self._global.append(sequence)
        self._global_tokens += len(sequence)
        while self._global_tokens > self.global_max_tokens and len(self._global) > 1:
            self._global_tokens -= len(self._global.popleft())
        self._global_index = None
        self.observed += 1

    def session(self, prompt_ids: Sequence[int]) -> DraftSession:
        """A drafting session for one new sequence of this prompt (builds stale indexes first)."""
        prompt = tuple(int(t) for t in prompt_ids)
        indexes = [self._prompt_index(prompt), self._global_snapshot()]
        return DraftSession(self, prompt, indexes)

    def length_history(self, prompt_ids: Sequence[int]) -> list[int]:
        """Completion lengths of this prompt's rollouts in its window, oldest first."""
        entry = self._prompts.get(tuple(int(t) for t in prompt_ids))
        return list(entry.lengths) if entry is not None else []

    def all_lengths(self) -> list[int]:
        """Completion lengths of every windowed rollout (for length classes relative to the whole history)."""
        return [length for entry in self._prompts.values() for length in entry.lengths]

    def held_tokens(self) -> int:
        """Tokens held in the windows (per-prompt and global), the measure the memory bounds cap."""
        return self._global_tokens + sum(len(s) for e in self._prompts.values() for s in e.rollouts)

    def _prompt_index(self, prompt: tuple[int, ...]) -> SuffixIndex:
        entry = self._prompts.get(prompt)
        if entry is None:
            return SuffixIndex([prompt])
        index = entry.index
        if index is None:
            index = entry.index = SuffixIndex([prompt, *entry.rollouts])
            self._built[prompt] = index.tokens
            self._built_tokens += index.tokens
        self._built.move_to_end(prompt)
        while len(self._built) > 1 and (len(self._built) > self.max_built or self._built_tokens > self.max_built_tokens):
            self._unbuild(next(iter(self._built)))
        return index

    def _unbuild(self, prompt: tuple[int, ...]) -> None:
        """Drop this prompt's built index (rebuilt when a session needs it again)."""
        tokens = self._built.pop(prompt, None)
        if tokens is not None:
            self._built_tokens -= tokens
        entry = self._prompts.get(prompt)
        if entry is not None:
            entry.index = None

    def _global_snapshot(self) -> SuffixIndex:
        if self._global_index is None:
            self._global_index = SuffixIndex(self._global)
        return self._global_index
