"""Prompt lookup proposals: the tokens that followed the context's last n-gram where it occurred
before (Saxena's prompt lookup decoding; transformers' `prompt_lookup_num_tokens`).

Code and edits repeat their input (a function signature, a variable name, a quoted passage), so
the continuation of an earlier occurrence of the last few tokens is often the continuation now.
The proposals cost no forward at all; the engine verifies them like a drafter's block (lossless
either way) and its adaptive policy decides, from their acceptance and the measured cost of a
step, whether and how far they are worth verifying.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_NGRAM = 3  # longest suffix tried first: a longer match is a better predictor
MIN_NGRAM = 1


@dataclass
class Lookup:
    tokens: list[int]  # the proposals
    ngram: int  # length of the matched suffix (their reliability differs: the engine learns each)


def lookup_proposals(tokens: list[int], max_tokens: int, max_ngram: int = MAX_NGRAM,
                     min_ngram: int = MIN_NGRAM) -> Lookup | None:
    """Up to `max_tokens` tokens that followed the most recent earlier occurrence of the last n
    tokens of `tokens`, for n from `max_ngram` down to `min_ngram`; None when none occurs."""
    if max_tokens < 1:
        return None
    end = len(tokens)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix = tokens[end - n:]
        first = suffix[0]
        # the most recent start i < end - n whose n-gram equals the suffix and has a next token
        for i in range(end - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return Lookup(tokens[i + n : i + n + max_tokens], n)
    return None
