"""The DFlash family's config section, ``draft.dflash``: what only a block draft reads. The
config composes it from the registry (:func:`specforge.families.sections`), so its keys exist
only here, and another family's recipe that sets one is refused at load. Importing this module
imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specforge.config.base import ConfigError


@dataclass
class Options:
    """``draft.type: dflash``: the block draft's geometry and training objective."""

    block_size: int = 8
    """Tokens per block, the anchor included (a round proposes ``block_size - 1``)."""
    draft_layers: int = 1
    """The draft's decoder layers."""
    target_layers: int = 5
    """How many target layers the draft reads, spread from layer 1 to ``L - 3`` as SGLang
    spreads them (fewer on a shallow target)."""
    anchors: int = 64
    """Blocks per training sequence, at random anchors before assistant tokens."""
    block_decay: float | None = 4.0
    """Slot ``k`` of a block weighs ``exp(-(k - 1) / block_decay)`` in the loss (later slots
    are reached less often); ``null``: every slot alike."""
    block_labels: Literal["hard", "soft"] = "hard"
    """What slot ``k`` learns. ``hard``: the target's greedy token there (what greedy
    verification accepts; on regenerated data, mostly the data's token); ``soft``: the target's
    whole distribution there (cross-entropy to it, KL up to a constant: the full-vocabulary
    softmax at every scored position, a step's memory grows by 4 bytes x vocabulary per
    token). At equal time on the quickstart's corpus: docs/training.md."""

    def __post_init__(self) -> None:
        for name in ("draft_layers", "target_layers", "anchors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"draft.dflash.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"draft.dflash.block_size must be >= 2, got {self.block_size}")
        if self.block_decay is not None and not self.block_decay > 0:
            raise ConfigError(
                f"draft.dflash.block_decay must be > 0 or null, got {self.block_decay}"
            )


UPSTREAM_FLAGS = (
    ("speculators", "--max-anchors", "anchors"),
    ("speculators", "--dflash-decay-gamma", "block_decay"),
)
"""The upstream training flags of a block draft: ``(tool, flag, this section's key)``."""
