"""Prompt lookup as greedy ``auto``'s second proposer: the tokens that followed the earlier
occurrence of the last token whose context matches the conversation's for longest
(:func:`~specforge.engine.prompt_lookup.longest_match`), and what their acceptance has been,
by match length and by whether they start with the draft's own first choice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specforge.engine.prompt_lookup import longest_match
from specforge.serving.adaptive import AcceptanceEstimate


@dataclass
class PromptLookup:
    """Greedy ``auto``'s prompt-lookup proposals and what it learnt of them."""

    tokens: int
    """The most tokens proposed (and verified) in a round."""
    match_buckets: ClassVar[tuple[int, ...]] = (2, 3, 5)
    """The match lengths (:func:`~specforge.engine.prompt_lookup.longest_match`) from which a
    proposal is learnt apart: 1, 2, 3-4 and 5 or more tokens (a proposal after a longer match
    is accepted far more often)."""
    estimates: dict[tuple[bool, int], AcceptanceEstimate] = field(init=False)
    """Running acceptance per position of the proposals, by whether they start with the
    draft's first choice (one it agrees with is accepted far more often) and by their match
    length's bucket, learnt from every round's emitted tokens, verified or not."""
    proposal: torch.Tensor | None = None
    """This round's proposal (``None``: none)."""
    agrees: bool = False
    """Whether :attr:`proposal` starts with the draft's first choice (:meth:`compare`)."""
    bucket: int = 0
    """:attr:`proposal`'s match-length bucket: how many of :attr:`match_buckets` its match
    length reaches (0: a match of one token)."""

    def __post_init__(self) -> None:
        self.estimates = {
            (agrees, bucket): AcceptanceEstimate(self.tokens)
            for agrees in (False, True)
            for bucket in range(len(self.match_buckets) + 1)
        }

    def reset(self) -> None:
        """A new request: the estimates start again from their priors, no proposal."""
        self.__post_init__()
        self.proposal, self.agrees, self.bucket = None, False, 0

    @property
    def estimate(self) -> AcceptanceEstimate:
        """The estimate this round's proposal falls under."""
        return self.estimates[self.agrees, self.bucket]

    def propose(self, prompt: torch.Tensor, output: list[int], *, room: int) -> None:
        """This round's :attr:`proposal` after ``prompt`` (T,) and ``output``, at most ``room``
        tokens: ``None`` where there is no room (the draft sleeps, or the turn ends) or the
        last token occurs nowhere earlier."""
        self.proposal, self.agrees, self.bucket = None, False, 0
        if room:
            sequence = torch.cat([prompt.cpu(), torch.tensor(output)])
            proposal, matched = self.candidates(sequence)
            self.proposal = proposal[:room] if len(proposal) else None
            self.bucket = sum(matched >= length for length in self.match_buckets)

    def candidates(self, sequence: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The proposal after ``sequence`` (L,) and its match length
        (:func:`~specforge.engine.prompt_lookup.longest_match`)."""
        return longest_match(sequence, num_tokens=self.tokens)

    def compare(self, draft_first: int) -> None:
        """Note whether the proposal starts with ``draft_first``, the draft's first choice
        (target id) this round."""
        self.agrees = self.proposal is not None and int(self.proposal[0]) == draft_first

    def learn(self, emitted: list[int]) -> None:
        """The estimates after a round, from its emitted tokens (the target's own, whatever
        was verified): the proposal's positions up to its first difference from them, as far
        as the round reached."""
        if self.proposal is not None:
            reached = min(len(self.proposal), len(emitted))
            matched = 0
            while matched < reached and int(self.proposal[matched]) == emitted[matched]:
                matched += 1
            self.estimate.observe(reached, matched)
