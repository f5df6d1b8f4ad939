"""The P-EAGLE proposer: EAGLE-3's draft state (the context extended lazily over the accepted
tokens), and a chain drafted in one forward over mask positions (:mod:`.model`) instead of one
draft step per token."""

from __future__ import annotations

import torch

from specforge.engine.cache import crop_cache
from specforge.families.peagle.model import PEagleDraftModel
from specforge.serving.proposers.eagle import EagleProposer


class PEagleProposer(EagleProposer):
    """Drafts with a :class:`PEagleDraftModel`: the first token from the context's last
    logits, the rest from one forward over ``steps - 1`` mask positions after it, whose cache
    entries are dropped again (the next extension writes the accepted tokens there)."""

    draft_model: PEagleDraftModel

    @torch.no_grad()
    def chain(self, steps: int):
        """Propose ``steps`` target ids from the state after the last accepted token. Returns
        the tokens (K,) and, when sampling, their draft distributions (K, V)."""
        state = self.state
        logits = state.logits[None]
        if steps > 1:
            # 1. the mask positions length .. length + K - 2 after the context, one forward
            ids, hidden = self.draft_model.mask_inputs((1, steps - 1))
            positions = torch.arange(state.length, state.length + steps - 1, device=ids.device)
            more, _ = self.draft_model(ids, hidden, positions[None], cache=state.cache)
            crop_cache(state.cache, state.length)
            # (K, Vd), float32 whatever the draft's dtype
            logits = torch.cat([logits, more[0].float()])
        return self.tokens(logits)  # 2. each position's token (and distribution) on its own
