"""Prompt-lookup decoding through the engine: the target verifies, as the speculative runtime's
rounds do, the tokens that followed the last n-gram's earlier occurrence in the sequence (no
draft model). It is the free baseline a trained draft has to beat, so the bench runs it through
the same engine (compiled or eager) as the target alone and the runtime: a comparison against
HF's eager ``generate(prompt_lookup_num_tokens=...)`` would charge prompt lookup for the slower
forward, not for its proposals.

The proposals follow transformers' ``PromptLookupCandidateGenerator`` (:func:`ngram_candidates`):
the longest n-gram first (``max_ngram`` down to 1), the earliest occurrence whose continuation
is not empty, at most ``num_tokens`` tokens. Verification is greedy, so the output is the
target's own greedy output whatever is proposed. Greedy ``auto``, where lookup competes with
the draft, proposes after the longest matching context instead (:func:`longest_match`) and
learns its acceptance by that match's length.
"""

from __future__ import annotations

import torch

from specforge.engine.cache import crop_cache
from specforge.engine.target import TargetEngine

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


@torch.no_grad()
def prompt_lookup_generate(
    engine: TargetEngine,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    num_tokens: int,
    max_ngram: int = MAX_NGRAM,
    eos_token_ids=(),
) -> tuple[list[int], int]:
    """Greedy decoding of ``input_ids`` (1, T) with prompt-lookup proposals of up to
    ``num_tokens`` tokens verified by ``engine``: the new token ids (EOS included when
    generated; the target's greedy output) and the verification rounds after the prefill."""
    input_ids = input_ids.to(engine.device)
    cache = engine.new_cache(input_ids.shape[1] + max_new_tokens + num_tokens)
    logits, _ = engine.forward(input_ids, cache, logits_to_keep=1)
    output = [int(logits[-1].argmax())]
    prompt, rounds = input_ids[0].cpu(), 0
    while len(output) < max_new_tokens and output[-1] not in eos_token_ids:
        sequence = torch.cat([prompt, torch.tensor(output)])
        # proposals past the budget could never be emitted: the bonus token ends the turn
        room = max_new_tokens - len(output) - 1
        proposal = ngram_candidates(sequence, num_tokens=min(num_tokens, room), max_ngram=max_ngram)
        verify = torch.cat([sequence[-1:], proposal])[None].to(engine.device)
        start = cache.length
        logits, _ = engine.forward(verify, cache)
        predicted = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(proposal) and int(proposal[accepted]) == predicted[accepted]:
            accepted += 1
        crop_cache(cache, start + 1 + accepted)
        rounds += 1
        for token in predicted[: accepted + 1]:
            output.append(token)
            if token in eos_token_ids or len(output) >= max_new_tokens:
                break
    return output, rounds
