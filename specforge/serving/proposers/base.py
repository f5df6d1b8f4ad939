"""What every proposer shares: the proposer protocol's verbs (each doing nothing here: the
proposer of a runtime without a draft, the prompt-lookup baseline's, whose policy proposes
every round's tokens), the runtime's settings and the drawing of tokens from a
proposal's logits."""

from __future__ import annotations

import torch

from specforge.serving.drafting import Drafting


class Proposer:
    """A proposer with no draft (see the module docstring); families' proposers extend it.

    Args:
        draft_model: the draft (``None``: no draft).
        drafting: the runtime's settings; when sampling, tokens are drawn from the draft's
            warped distributions, returned beside them for verification.
    """

    draft_engine = None
    """What runs the draft's forwards (CUDA graphs), where a proposer has one."""

    def __init__(self, draft_model, drafting: Drafting):
        self.draft_model, self.drafting = draft_model, drafting
        self.generator: torch.Generator | None = None
        """Seeds sampling (set by the runtime per request)."""
        self.state = None
        """One sequence's draft state."""

    def draw(self, logits: torch.Tensor):
        """Tokens from ``logits`` (K, V) (float32 whatever the draft's dtype), one a row: the
        most likely, or drawn from the warped distributions, returned beside them (K, V)."""
        if not self.drafting.sampling:
            return logits.argmax(-1), None
        q = self.drafting.warp(logits.float())
        return torch.multinomial(q, 1, generator=self.generator)[:, 0], q

    def start(self, tokens: torch.Tensor, aux: torch.Tensor, capacity: int) -> None:
        """A new sequence: the prompt's target features ``aux`` (1, T, F) with each
        position's next token (1, T) (the prompt's from the second on, then the target's
        first), in room for ``capacity`` positions."""

    def accepted(self, tokens: list[int], aux: torch.Tensor) -> None:
        """A round's emitted ``tokens`` and the target's features at the positions before
        each (1, T, F)."""

    def catch_up(self) -> bool:
        """Before a round that drafts: take in what was accepted since the last; returns
        whether there was anything to (the time is the round's extension)."""
        return False
