"""N-gram proposals (prompt lookup): copy what followed the last n tokens the previous time
they occurred in the request's own tokens (prompt and output so far).

Summaries, edits, code changes and answers quoting their input repeat spans of the prompt;
for those the continuation of an earlier occurrence is often right, and proposing it costs
no model at all.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(
    token_ids: Sequence[int], ngram_min: int, ngram_max: int, num_tokens: int
) -> list[int]:
    """The continuation of the most recent earlier match of the request's last n tokens.

    Lengths are tried longest first (``ngram_max`` down to ``ngram_min``); for one length
    the latest earlier occurrence wins::

        tokens   ... a b c X Y Z ... a b c | (end)      last 3 tokens: a b c
                       ^^^^^ match   proposal: X Y Z ... (up to num_tokens)

    Args:
        token_ids: the request's known tokens (prompt + output).
        ngram_min, ngram_max: the n-gram lengths to try.
        num_tokens: the most tokens to propose.
    Returns:
        Up to ``num_tokens`` tokens; empty when no length matches.
    """
    tokens = list(token_ids)
    total = len(tokens)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        tail = tokens[total - n :]
        first = tail[0]
        # The match must end before the last token, so that something follows it.
        for start in range(total - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == tail:
                follow = start + n
                return tokens[follow : follow + num_tokens]
    return []
