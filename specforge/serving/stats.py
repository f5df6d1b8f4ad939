"""What a speculative generation counted: rounds, accepted tokens, depths and where its time
went (:class:`SpecStats`), and accept length ``tau`` = emitted tokens / verifications, the
bonus token counted (so ``tau >= 1``), as SGLang's "avg accept length" and the EAGLE papers
report it (docs/design.md, accept length)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields


@dataclass
class SpecStats:
    """Counters of one or many speculative generations."""

    num_steps: int
    verifications: int = 0
    emitted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    """Draft tokens accepted in each verification (0..num_steps), the bonus not counted."""
    depth_per_round: list[int] = field(default_factory=list)
    """Draft tokens verified in each round (``num_steps``, or what ``auto`` chose; 0 is a
    plain decoding step)."""
    seconds: float = 0.0
    """Wall time of the whole generation (prefill included)."""
    draft_seconds: float = 0.0
    """Of which proposing draft tokens (chains or trees)."""
    verify_seconds: float = 0.0
    """Of which the target's verification forwards (the tree mask and the logits included)."""
    extend_seconds: float = 0.0
    """Of which the draft's extension over each round's accepted tokens (with the target's
    features), which also yields the next round's first draft token."""
    prefill_seconds: float = 0.0
    """Of which the prefills: the target over the prompt and the draft over its features."""
    target_prefill_seconds: float = 0.0
    """Of the prefills, the target's forward over the prompt and its first token: what
    decoding with the target alone pays too."""
    dormant_rounds: int = 0
    """Plain rounds the draft slept through (``auto``: no extension, no decision)."""
    sibling_rounds: int = 0
    """Rounds that verified siblings of the first draft token (greedy ``auto``)."""
    sibling_hit_rounds: list[int] = field(default_factory=list)
    """The rounds (indices into :attr:`accepted_per_round`) in which a sibling, not the
    chain's first token, was the target's token: their accepted token counts in ``tau`` but
    not in the chain's :attr:`acceptance_per_position`."""
    lookup_rounds: list[int] = field(default_factory=list)
    """The rounds (indices into :attr:`accepted_per_round`) that verified prompt-lookup tokens,
    instead of the draft's or beside them in one tree (greedy ``auto`` with ``lookup_tokens``):
    their tokens count in ``tau`` but not in the draft's :attr:`acceptance_per_position`."""

    @property
    def tau(self) -> float:
        """Emitted tokens per target verification (the bonus token counted)."""
        return self.emitted / max(self.verifications, 1)

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_per_round).items()))

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft token k accepted | tokens < k accepted), k = 1..num_steps, for the chain
        (a sibling accepted in its place counts as the chain's first token rejected)."""
        rates = []
        # rounds recorded without a depth ran the fixed num_steps
        depths = self.depth_per_round or [self.num_steps] * len(self.accepted_per_round)
        chain, depths = list(self.accepted_per_round), list(depths)
        for index in self.sibling_hit_rounds:
            chain[index] = 0  # the chain's own first token was rejected
        for index in self.lookup_rounds:
            chain[index] = depths[index] = 0  # the draft proposed nothing there
        rounds = list(zip(chain, depths, strict=True))
        for k in range(1, self.num_steps + 1):
            reached = sum(a >= k - 1 and depth >= k for a, depth in rounds)
            accepted = sum(a >= k for a, _ in rounds)
            rates.append(accepted / reached if reached else 0.0)
        return rates

    @property
    def depth_histogram(self) -> dict[int, int]:
        """Rounds per verified depth (what ``num_steps: auto`` chose)."""
        return dict(sorted(Counter(self.depth_per_round).items()))

    def merge(self, other: SpecStats) -> None:
        """Add ``other``'s counters to these: counts and seconds summed, rounds appended (the
        round indices shifted past these rounds)."""
        offset = len(self.accepted_per_round)
        for name in (f.name for f in fields(self) if f.name != "num_steps"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if name.endswith("_per_round"):
                mine.extend(theirs)
            elif isinstance(mine, list):  # round indices
                mine.extend(offset + index for index in theirs)
            else:
                setattr(self, name, mine + theirs)
