"""``capture``: the target's hidden states written to disk for offline training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specforge.config.base import ConfigError


@dataclass
class CaptureConfig:
    """Offline hidden-state capture (``specforge capture``): shards of safetensors + a manifest."""

    output: str | None = None
    """Capture directory; defaults to ``<output_dir>/hidden_states``. Offline training reads it."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the stored hidden states."""
    shard_size_mb: float = 256.0
    """Target size of one shard file in MiB (a shard holds whole samples, so sizes vary)."""
    batch_tokens: int = 8192
    """Padded tokens per target forward (samples are sorted by length, so padding is small)."""
    max_batch_size: int = 32
    """Samples per target forward at most."""

    def __post_init__(self) -> None:
        if self.shard_size_mb <= 0:
            raise ConfigError(f"capture.shard_size_mb must be > 0, got {self.shard_size_mb}")
        for name in ("batch_tokens", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"capture.{name} must be >= 1, got {getattr(self, name)}")
