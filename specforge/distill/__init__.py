"""Self-distillation: prompts the target writes (:mod:`.synthesize`) and its answers to every
user turn (:mod:`.regenerate`), generated through :mod:`specforge.engine`."""
