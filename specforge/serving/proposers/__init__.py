"""Proposers: what drafts the tokens a round verifies. Each holds one sequence's draft state
and answers the runtime's verbs: ``start`` (after the prompt), ``accepted`` (a round's emitted
tokens and the target's states at them), ``catch_up`` (before a round that drafts) and
``chain(steps)`` (the tokens to verify, with their draft distributions when sampling).

- :class:`~specforge.serving.proposers.eagle.EagleProposer`: an EAGLE-3 chain (or tree), step by
  step;
- :class:`~specforge.serving.proposers.dflash.DFlashProposer`: a DFlash block in one forward;
- :class:`~specforge.serving.proposers.lookup.PromptLookup`: prompt lookup, competing with the
  draft under greedy ``auto``.
"""

from __future__ import annotations

from specforge.errors import UserError
from specforge.models.dflash import DFlashDraftModel
from specforge.serving.proposers.dflash import DFlashProposer
from specforge.serving.proposers.eagle import EagleProposer, chain_draft_engine


def proposer_for(
    draft_model,
    *,
    num_steps: int,
    topk: int,
    auto: bool,
    engine=None,
    draft_engine=None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> EagleProposer | DFlashProposer:
    """The proposer of ``draft_model``'s family.

    Raises:
        UserError: drafting settings the family cannot run (a DFlash block is a chain of at
            most ``block_size - 1`` tokens, at a fixed depth).
    """
    if isinstance(draft_model, DFlashDraftModel):
        block = draft_model.config.block_size
        if auto or topk != 1 or num_steps > block - 1:
            depth = "auto" if auto else num_steps
            raise UserError(
                f"a DFlash draft proposes one block a round: num_steps 1..{block - 1} and "
                f"topk 1 (got num_steps {depth}, topk {topk})"
            )
        return DFlashProposer(draft_model, temperature=temperature, top_p=top_p)
    return EagleProposer(
        draft_model,
        depth=num_steps,
        engine=chain_draft_engine(draft_model, topk, engine, draft_engine),
        temperature=temperature,
        top_p=top_p,
    )
