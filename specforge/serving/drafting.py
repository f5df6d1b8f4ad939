"""A runtime's drafting and decoding settings in one record, checked together when made: the
runtime, its policy and its proposer read the same :class:`Drafting`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specforge.config import AUTO_MAX_DEPTH
from specforge.engine.generation import warp_probs
from specforge.errors import UserError

AUTO_MAX_SIBLINGS = 3
"""Greedy ``auto``'s default for the most further candidates of the first draft position
verified beside the chain (a fan of up to 4 there), within the verification widths
calibrated."""


@dataclass(frozen=True)
class Drafting:
    """How a runtime drafts and decodes.

    Raises:
        UserError: a setting out of range, or settings that do not go together, naming them.
    """

    num_steps: int | str = 5
    """Draft depth (tokens per chain, levels of a tree), or ``"auto"``: each round the depth in
    ``0 .. AUTO_MAX_DEPTH`` with the most expected tokens per second, decided token by token
    from the draft's calibrated confidence when greedy, from the position estimates when
    sampling (:mod:`specforge.serving.adaptive`; chains only)."""
    topk: int = 1
    """Branches per draft step; 1 drafts a chain."""
    num_draft_tokens: int | None = None
    """Tree size including the root (tree drafting only)."""
    temperature: float = 0.0
    """0 verifies greedily; > 0 samples (lossless rejection sampling)."""
    top_p: float = 1.0
    """Nucleus filtering of the distributions when sampling."""
    max_siblings: int = AUTO_MAX_SIBLINGS
    """Greedy ``auto``: at most this many further candidates for the first draft position
    verified beside the chain where the costs say they pay (0: chains only; none on a target
    whose attention cannot verify a tree)."""
    lookup_tokens: int = 0
    """Greedy ``auto``: prompt lookup's up to this many tokens (may pass ``num_steps``;
    :func:`~specforge.engine.prompt_lookup.longest_match`) are verified instead of the draft's,
    or beside them in one tree, in a round where their acceptance promises more tokens per
    second (0: the draft's always)."""

    def __post_init__(self) -> None:
        if self.auto and self.topk != 1:
            raise UserError(f"num_steps auto drafts chains only (topk 1), got topk={self.topk}")
        if not isinstance(self.depth, int):
            raise UserError(f"num_steps must be an integer or 'auto', got {self.num_steps!r}")
        if self.depth < 1 or self.topk < 1:
            raise UserError(f"num_steps and topk must be >= 1, got {self.depth}, {self.topk}")
        if not 0 <= self.max_siblings <= AUTO_MAX_DEPTH:
            raise UserError(f"max_siblings must be in 0..{AUTO_MAX_DEPTH}, got {self.max_siblings}")
        largest = 1 + self.topk + (self.depth - 1) * self.topk**2  # a tree's levels hold
        if self.topk > 1 and not (self.num_draft_tokens and 2 <= self.num_draft_tokens <= largest):
            raise UserError(
                f"tree drafting needs 2 <= num_draft_tokens <= {largest} for topk={self.topk}, "
                f"num_steps={self.depth}; got {self.num_draft_tokens}"
            )
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise UserError(
                f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}"
            )
        # prompt lookup competes with greedy auto's draft only
        if self.lookup_tokens < 0 or (self.lookup_tokens and (not self.auto or self.sampling)):
            raise UserError(
                f"lookup_tokens needs num_steps auto and greedy decoding, got {self.lookup_tokens}"
            )

    @property
    def auto(self) -> bool:
        return self.num_steps == "auto"

    @property
    def depth(self) -> int:
        """The deepest chain (or tree) a round drafts (``auto``: :data:`AUTO_MAX_DEPTH`)."""
        return AUTO_MAX_DEPTH if self.auto else self.num_steps

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The distributions sampling draws from (``temperature``, ``top_p``) over ``logits``."""
        return warp_probs(logits, self.temperature, self.top_p)
