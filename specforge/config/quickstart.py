"""``quickstart``: the embedded default's hour."""

from __future__ import annotations

from dataclasses import dataclass

from specforge.config.base import ConfigError


@dataclass
class QuickstartConfig:
    """``specforge quickstart``: its wall-clock budget."""

    minutes: float | None = None
    """Budget of the whole quickstart (prepare, train, export, bench). Prepare runs to the
    end (growing the corpus within ``data_share``); training then gets what is left after the
    bench's estimated time (its turns x ``bench.max_new_tokens`` at the bench target's measured
    per-token times through HF ``generate`` and through the engine, and the engine's measured
    compilation) and stops at ``train.max_steps`` or there, whichever comes first
    (``train.max_minutes``). A rerun counts the first run's prepare time, corpus size and
    estimate (``<output_dir>/quickstart.json``) and training's so far. ``null``: the recipe as
    it says (``synthesize.count``, ``train.max_steps``, ``train.max_minutes``)."""
    data_share: float | None = None
    """The share of ``minutes`` prepare may spend on data: after ``synthesize.count``, it asks
    for ``synthesize_step`` more prompts (written and answered by the target) while the last
    round's pace says the next one ends within the share. It sizes the corpus to the device:
    a fast CPU buys more distinct conversations, a slow one keeps the recipe's. ``null``:
    ``synthesize.count`` alone."""
    synthesize_step: int = 200
    """Prompts added per round when ``data_share`` grows the corpus."""

    def __post_init__(self) -> None:
        if self.minutes is not None and not self.minutes > 0:
            raise ConfigError(f"quickstart.minutes must be > 0 or null, got {self.minutes}")
        if self.data_share is not None and not 0 < self.data_share < 1:
            raise ConfigError(
                f"quickstart.data_share must be in (0, 1) or null, got {self.data_share}"
            )
        if self.synthesize_step < 1:
            raise ConfigError(
                f"quickstart.synthesize_step must be >= 1, got {self.synthesize_step}"
            )
