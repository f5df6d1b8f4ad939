"""Proposers: what drafts the tokens a round verifies. Each holds one sequence's draft state
and answers the runtime's verbs: ``start`` (after the prompt), ``accepted`` (a round's emitted
tokens and the target's states at them), ``catch_up`` (before a round that drafts) and
``chain(steps)`` (the tokens to verify, with their draft distributions when sampling).

- :class:`~specforge.serving.proposers.eagle.EagleProposer`: an EAGLE-3 chain (or tree), step by
  step: the runtime's own drafter (:func:`eagle_proposer`), which other families extend;
- :class:`~specforge.serving.proposers.lookup.PromptLookup`: prompt lookup, competing with the
  draft under greedy ``auto``;
- a draft family's own proposer, built by its factory
  (:attr:`specforge.families.base.DraftFamily.proposer`) and handed to the runtime.
"""

from __future__ import annotations

from specforge.engine.draft import chain_draft_engine
from specforge.serving.proposers.eagle import EagleProposer


def eagle_proposer(
    draft_model,
    *,
    num_steps: int,
    topk: int,
    auto: bool,
    engine=None,
    draft_engine=None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> EagleProposer:
    """An EAGLE-3 chain (or tree) drafted step by step, its chain's forwards through CUDA graphs
    where the target's engine replays them (:func:`~specforge.engine.draft.chain_draft_engine`)."""
    return EagleProposer(
        draft_model,
        depth=num_steps,
        engine=chain_draft_engine(draft_model, topk, engine, draft_engine),
        temperature=temperature,
        top_p=top_p,
    )
