"""N-gram proposals (prompt lookup): copy what followed the last n tokens the previous time
they occurred in the request's own tokens (prompt and output so far).

Summaries, edits, code changes and answers quoting their input repeat spans of the prompt;
for those the continuation of an earlier occurrence is often right, and proposing it costs
no model at all.

The search is over a numpy array of the request's tokens, which ``TokenHistory`` keeps per
request and extends by the tokens added since the step before: each n-gram length is a few
vectorised comparisons over the context instead of a Python loop over it (speculative steps
are synchronous, so this host work adds to every step; measured in benchmarks/RESULTS.md,
"N-gram proposals").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.request import Request


def propose_ngram(
    token_ids: Sequence[int] | np.ndarray, ngram_min: int, ngram_max: int, num_tokens: int
) -> list[int]:
    """The continuation of the most recent earlier match of the request's last n tokens.

    Lengths are tried longest first (``ngram_max`` down to ``ngram_min``); for one length
    the latest earlier occurrence wins::

        tokens   ... a b c X Y Z ... a b c | (end)      last 3 tokens: a b c
                       ^^^^^ match   proposal: X Y Z ... (up to num_tokens)

    Args:
        token_ids: the request's known tokens (prompt + output): a list, or the int64 array
            ``TokenHistory.tokens`` keeps.
        ngram_min, ngram_max: the n-gram lengths to try.
        num_tokens: the most tokens to propose.
    Returns:
        Up to ``num_tokens`` tokens; empty when no length matches.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = int(tokens.shape[0])
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        # The last n tokens start at ``tail``; candidate starts are 0 .. tail - 1 (the match
        # must end before the last token, so that something follows it).
        tail = total - n
        hit = tokens[:tail] == tokens[tail]
        for j in range(1, n):
            hit &= tokens[j : j + tail] == tokens[tail + j]
        found = np.flatnonzero(hit)
        if found.size:
            follow = int(found[-1]) + n
            return tokens[follow : follow + num_tokens].tolist()
    return []


@dataclass(slots=True)
class _History:
    request: Request
    tokens: np.ndarray  # int64, capacity >= length
    length: int


class TokenHistory:
    """Per request, its known tokens as an int64 array, extended by the tokens added since
    it was last asked (O(new tokens) a step, not O(context)).

    Invariant: a history's first ``length`` values are the request's first ``length``
    tokens. Tokens only grow while a request lives (speculative steps are synchronous, so
    no pending token is ever read); a request id reused by a new request starts afresh.
    Owned by the speculator, which forgets a request with its other state.
    """

    def __init__(self) -> None:
        self._histories: dict[str, _History] = {}

    def __len__(self) -> int:
        return len(self._histories)

    def tokens(self, request: Request) -> np.ndarray:
        """The request's tokens (prompt + output), a view valid until the next call."""
        total = request.num_tokens
        history = self._histories.get(request.request_id)
        if history is None or history.request is not request or history.length > total:
            history = _History(request, np.empty(max(16, 2 * total), dtype=np.int64), 0)
            self._histories[request.request_id] = history
        if history.length < total:
            if total > history.tokens.shape[0]:
                grown = np.empty(2 * total, dtype=np.int64)
                grown[: history.length] = history.tokens[: history.length]
                history.tokens = grown
            history.tokens[history.length : total] = request.token_ids(history.length, total)
            history.length = total
        return history.tokens[:total]

    def request_ids(self) -> set[str]:
        return set(self._histories)

    def forget(self, request_id: str) -> None:
        self._histories.pop(request_id, None)
