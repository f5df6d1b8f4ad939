"""Models: the frozen target (loading, aux hidden-state capture) and the EAGLE-3 draft."""
