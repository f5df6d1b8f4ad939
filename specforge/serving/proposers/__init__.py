"""Proposers: what drafts the tokens a round verifies, each answering the runtime's verbs
(:class:`~specforge.serving.proposers.base.Proposer`) and ``chain(steps)``:

- :class:`~specforge.serving.proposers.eagle.EagleProposer`: an EAGLE-3 chain (or tree), step by
  step: the runtime's own drafter, which other families extend;
- :class:`~specforge.serving.proposers.lookup.PromptLookup`: prompt lookup, competing with the
  draft under greedy ``auto``;
- a draft family's own proposer, built by its factory
  (:attr:`specforge.families.base.DraftFamily.proposer`) and handed to the runtime.
"""
