"""Self-distillation: prompts the target writes (:mod:`.synthesize`), its answers to every
user turn (:mod:`.regenerate`) and second turns it writes over its own answers
(:mod:`.follow_ups`), generated through :mod:`specforge.engine`."""
