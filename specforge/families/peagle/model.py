"""The P-EAGLE draft: an EAGLE-3 draft that proposes a whole chain in one forward (parallel
drafting). Past the chain's first token each position reads no drafted token: its input is a
**mask token** (``mask_token_id``'s embedding, the target's) and a learned **mask hidden state**
(``mask_hidden``, one vector in the width of the three fused target layers, through the same
``fc``) instead of the previous step's token and state.

So serving drafts ``K`` tokens in one forward: after the context (the accepted tokens, each
with its target feature), positions ``n .. n + K - 2`` hold the mask inputs; the context's last
logits give the first token and each mask position the next (vLLM's ``parallel_drafting``: the
same export with ``mask_hidden`` and ``mask_token_id``). Training is EAGLE-3's training-time
test with those inputs at every step ``k > 0`` (:meth:`PEagleDraftModel.unrolled_inputs`): step
``k`` at position ``t`` attends to the context up to ``t`` and to the mask positions of its own
chain before it, at RoPE position ``t + k``, exactly the attention of the serving forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specforge.models.eagle3 import AUX_STATES, Eagle3Config, Eagle3DraftModel


@dataclass
class PEagleConfig(Eagle3Config):
    """EAGLE-3's geometry plus the mask inputs and the depth trained."""

    mask_token_id: int = 0
    """The target id whose embedding fills the chain's positions after the first."""
    parallel_draft_tokens: int = 7
    """The deepest chain trained (``train.ttt_length``): the most tokens a round drafts."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be in 0..{self.vocab_size - 1}, got {self.mask_token_id}"
            )
        if self.parallel_draft_tokens < 1:
            raise ValueError(
                f"parallel_draft_tokens must be >= 1, got {self.parallel_draft_tokens}"
            )


class PEagleDraftModel(Eagle3DraftModel):
    """EAGLE-3's layers plus ``mask_hidden`` (1, 3 * Ht): see the module docstring."""

    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig):
        super().__init__(config)
        # (1, 3 * Ht): a fused-feature row for every masked position
        self.mask_hidden = nn.Parameter(torch.randn(1, AUX_STATES * config.target_hidden_size))

    def mask_inputs(self, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask token ids (B, T) and the fused mask hidden state (B, T, H) for ``shape``
        (B, T) masked positions."""
        # (1, 3 * Ht) -> (1, 1, H) -> (B, T, H)
        hidden = self.fuse(self.mask_hidden[None]).expand(*shape, -1)
        ids = torch.full(shape, self.config.mask_token_id, device=self.mask_hidden.device)
        return ids, hidden

    def unrolled_inputs(
        self, input_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``k > 0`` reads the mask inputs, not the shifted tokens or the last state."""
        return self.mask_inputs(tuple(input_ids.shape))
