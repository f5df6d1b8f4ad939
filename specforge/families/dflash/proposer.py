"""The DFlash proposer: one block a round. The draft reads the target's states at the tokens
accepted since its last block as new context (kept as keys and values in its cache) and
predicts the ``block_size - 1`` tokens after the last accepted one in a single forward
(:class:`~specforge.families.dflash.model.DFlashDraftModel`); the runtime verifies them as a chain.

Sampling draws each slot from the draft's warped distribution there; the slots are predicted
in parallel, so a slot's distribution does not depend on the tokens drawn before it, and
rejection sampling stays exact (each token is accepted with ``min(1, p / q)`` for the ``q`` it
was drawn from).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specforge.families.dflash.model import DFlashCache, DFlashDraftModel
from specforge.serving.proposers.base import Proposer


@dataclass
class BlockState:
    """One sequence's draft: its cached context and what the next block reads."""

    cache: DFlashCache
    context: torch.Tensor
    """(1, T, n * Ht) the target's states at positions not yet in the cache."""
    anchor: int
    """The last accepted token (slot 0 of the next block)."""


class DFlashProposer(Proposer):
    """Drafts a block a round with a DFlash draft (see the module docstring).

    Args:
        draft_model: the draft, in any dtype: its logits are read in float32.
        drafting: the runtime's settings (:class:`~specforge.serving.drafting.Drafting`).
    """

    draft_model: DFlashDraftModel
    state: BlockState | None

    def start(self, tokens: torch.Tensor, aux: torch.Tensor, capacity: int) -> None:
        """A new sequence: the prompt's target states ``aux`` (1, T, F) as context; the last of
        ``tokens`` (1, T) (the target's first token) anchors the first block."""
        del capacity  # the cache grows in place
        cache = DFlashCache(self.draft_model.config.num_hidden_layers)
        self.state = BlockState(cache, aux, int(tokens[0, -1]))

    def accepted(self, tokens: list[int], aux: torch.Tensor) -> None:
        """A round's emitted ``tokens`` and the target's states at the positions before each
        (1, T, F): new context, and a new anchor."""
        state = self.state
        state.context = torch.cat([state.context, aux], 1)
        state.anchor = tokens[-1]

    @torch.no_grad()
    def chain(self, steps: int):
        """The first ``steps`` tokens of this round's block (target ids) and, when sampling,
        the distributions they were drawn from (K, V)."""
        state = self.state
        anchor = torch.tensor([state.anchor], device=state.context.device)
        logits = self.draft_model(state.context, anchor, cache=state.cache)[0, :steps].float()
        state.context = state.context[:, :0]  # cached now
        return self.draw(logits)
