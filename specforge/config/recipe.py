"""The whole recipe: every stage's section under one tree."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specforge.config.base import ConfigError
from specforge.config.bench import BenchConfig, EngineConfig
from specforge.config.capture import CaptureConfig
from specforge.config.data import (
    DataConfig,
    PrepareConfig,
    RegenerateConfig,
    SynthesizeConfig,
    VocabConfig,
)
from specforge.config.export import ExportConfig
from specforge.config.quickstart import QuickstartConfig
from specforge.config.target import TargetConfig
from specforge.config.train import DraftConfig, TrainConfig


@dataclass
class SpecForgeConfig:
    """The whole recipe: one section per stage."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    synthesize: SynthesizeConfig = field(default_factory=SynthesizeConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    quickstart: QuickstartConfig = field(default_factory=QuickstartConfig)
    output_dir: str = "outputs/specforge"
    """Directory for everything the recipe writes."""

    def __post_init__(self) -> None:
        if self.bench.draft_quantize == "int8" and self.bench.draft_dtype != "auto":
            from specforge.config.resolve import resolve_draft_quantize  # probes the hardware

            resolve_draft_quantize("int8", self.bench.draft_dtype, self.target.device)
        self._check_decode_kernel()
        if self.quickstart.data_share and self.regenerate.backend == "server":
            raise ConfigError(
                "quickstart.data_share grows the corpus with prompts the target writes "
                "in-process; regenerate.backend server cannot write them (set data_share null)"
            )
        if self.train.eval_data_path and self.data.mode == "offline":
            raise ConfigError(
                f"train.eval_data_path ({self.train.eval_data_path}) needs the target in the "
                "training step: data.mode offline's shards hold only the training "
                "conversations' states"
            )

    def _check_decode_kernel(self) -> None:
        """``regenerate.decode_kernel: on`` where the kernel would never run is an error, not a
        setting that silently does nothing."""
        if self.regenerate.decode_kernel != "on":
            return
        if self.target.attn_implementation is not None:
            raise ConfigError(
                "regenerate.decode_kernel on runs inside specforge's own attention, which "
                "target.attn_implementation null selects; got target.attn_implementation "
                f"{self.target.attn_implementation!r}"
            )
        if self.regenerate.backend != "continuous":
            raise ConfigError(
                "regenerate.decode_kernel on runs in the continuous backend only; got "
                f"regenerate.backend {self.regenerate.backend!r}"
            )

    @property
    def conversations_path(self) -> Path:
        """The conversations file prepare writes and later stages read."""
        if self.prepare.output:
            return Path(self.prepare.output)
        return Path(self.output_dir) / "conversations.jsonl"

    @property
    def training_data_path(self) -> Path:
        """The conversations training (and capture) read: ``train.data_path`` or prepare's."""
        return Path(self.train.data_path) if self.train.data_path else self.conversations_path

    @property
    def export_dir(self) -> Path:
        """Where ``specforge export`` writes (and ``bench`` reads) the exported draft."""
        return Path(self.export.output) if self.export.output else Path(self.output_dir) / "export"

    @property
    def bench_draft(self) -> Path:
        """The export directory ``specforge bench`` measures."""
        return Path(self.bench.draft) if self.bench.draft else self.export_dir

    @property
    def bench_dir(self) -> Path:
        """Where ``specforge bench`` writes its report."""
        return Path(self.bench.output) if self.bench.output else Path(self.output_dir) / "bench"

    @property
    def capture_dir(self) -> Path:
        """Where ``specforge capture`` writes and offline training reads hidden states."""
        if self.capture.output:
            return Path(self.capture.output)
        return Path(self.output_dir) / "hidden_states"
