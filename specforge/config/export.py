"""``export``: the draft written as the engines read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specforge.config.base import ConfigError, Dtype


@dataclass
class ExportConfig:
    """``specforge export``: a training checkpoint -> the directory SGLang / vLLM load."""

    checkpoint: str | None = None
    """A checkpoint folder (``<output_dir>/checkpoints/step_N``); default: the newest one."""
    output: str | None = None
    """The export directory; defaults to ``<output_dir>/export``."""
    dtype: Dtype = "bfloat16"
    """Dtype of the exported float weights."""
    verify_engine: Literal["none", "vllm"] = "none"
    """``vllm``: after writing, serve the export with vLLM (a running server at ``bench.url``,
    or servers launched with ``bench.vllm_python``) on the first ``verify_questions`` questions
    of ``bench.questions`` at ``bench.num_steps`` tokens a round (under ``auto``: 5, or the
    depth a family that has no ``auto`` drafts), run the built-in runtime on the same turns, and
    gate vLLM's accept length against it (``bench.agreement_margin``) and check the export's
    contract (d2t, aux layers, norms, RoPE, vocabulary, dtype). The outcome goes to
    ``specforge-export.json`` as ``engine_check``, the reports to
    ``<output_dir>/engine_check/``; a failed gate (a gap past the margin, or a failed check)
    exits non-zero, the export kept."""
    verify_questions: int = 3
    """Questions (all their turns) the engine check asks."""

    def __post_init__(self):
        if self.verify_questions < 1:
            raise ConfigError(f"export.verify_questions must be >= 1, got {self.verify_questions}")
