"""Prompt lookup's proposals: the tokens that followed an earlier occurrence of the sequence's
end. Prompt-lookup decoding is the free baseline a trained draft has to beat, so the bench runs
it through the speculative runtime's own loop (``SpeculativeDecoder.prompt_lookup``: no draft,
these proposals) on the same engine (compiled or eager) as the target alone: a comparison
against HF's eager ``generate(prompt_lookup_num_tokens=...)`` would charge prompt lookup for the
slower forward, not for its proposals.

The proposals follow transformers' ``PromptLookupCandidateGenerator`` (:func:`ngram_candidates`):
the longest n-gram first (``max_ngram`` down to 1), the earliest occurrence whose continuation
is not empty, at most ``num_tokens`` tokens. Verification is greedy, so the output is the
target's own greedy output whatever is proposed. Greedy ``auto``, where lookup competes with
the draft, proposes after the longest matching context instead (:func:`longest_match`) and
learns its acceptance by that match's length.
"""

from __future__ import annotations

import torch

MAX_NGRAM = 2
"""The longest n-gram matched (transformers' ``max_matching_ngram_size`` default)."""


def ngram_candidates(sequence: torch.Tensor, *, num_tokens: int, max_ngram: int = MAX_NGRAM):
    """The proposal after ``sequence`` (L,): the up to ``num_tokens`` tokens that followed the
    earliest earlier occurrence of its last ``n`` tokens, trying ``n = max_ngram .. 1``; an
    empty tensor when nothing matches (or ``num_tokens`` is 0)."""
    length = sequence.shape[0]
    if num_tokens < 1:
        return sequence[:0]
    for size in range(min(max_ngram, length - 1), 0, -1):
        windows = sequence.unfold(0, size, 1)  # (L - size + 1, size)
        matches = (windows == sequence[-size:]).all(-1).nonzero()[:, 0]
        for start in (matches + size).tolist():
            if start < length:  # the last n-gram matches itself, with nothing after it
                return sequence[start : start + num_tokens]
    return sequence[:0]


def longest_match(sequence: torch.Tensor, *, num_tokens: int, max_match: int = 8):
    """The proposal after ``sequence`` (L,) from the earlier occurrence of its last token whose
    preceding tokens match ``sequence``'s own for longest (at most ``max_match`` tokens; on a
    tie the earliest, as :func:`ngram_candidates` takes: in a repeating stretch it has the most
    tokens after it): the up to ``num_tokens`` tokens that followed it, and that match's length
    (an empty tensor and 0 when the last token occurs nowhere earlier, or ``num_tokens`` is 0).
    How far back a match reaches says how far its continuation can be trusted, so greedy
    ``auto`` learns its acceptance by that length."""
    length = sequence.shape[0]
    ends = (sequence[:-1] == sequence[-1]).nonzero()[:, 0]  # earlier copies of the last token
    if num_tokens < 1 or not len(ends):
        return sequence[:0], 0
    matched, alive = torch.ones_like(ends), torch.ones_like(ends, dtype=torch.bool)
    for back in range(1, min(max_match, length)):
        earlier = ends - back
        alive &= (earlier >= 0) & (sequence[earlier.clamp(min=0)] == sequence[length - 1 - back])
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    start = int(ends[matched == best][0]) + 1
    return sequence[start : start + num_tokens], best
