"""Proposers: what drafts the tokens a round verifies (an EAGLE-3 chain or tree, prompt
lookup, a DFlash block)."""
