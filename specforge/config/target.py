"""``target``: the frozen model the draft learns from."""

from __future__ import annotations

from dataclasses import dataclass

from specforge.config.base import SUPPORTED_DEVICES, ConfigError, DtypeOrAuto


@dataclass
class TargetConfig:
    """The frozen target model whose hidden states the draft learns from."""

    name_or_path: str = "smollm2-135m"
    """An HF model id, a local HF folder, or an embedded default name (``smollm2-135m``)."""
    dtype: DtypeOrAuto = "bfloat16"
    """Weights and compute dtype of the target. Exact-equality checks want ``float32``.
    ``auto``: ``bfloat16`` where it is the faster one (a CUDA GPU, a CPU with AMX or
    AVX512-BF16), else ``float32``; resolved on the machine a stage runs on, when it starts,
    and recorded in its outputs."""
    device: str = "cpu"
    """Torch device for the target (``cpu``, ``cuda``, ``cuda:1``)."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint folder. Off unless you trust the source."""
    aux_layer_ids: list[int] | None = None
    """Decoder layers whose output residual stream feeds the draft. ``None`` means the
    default ``[1, L//2 - 1, L - 4]``, the layers SGLang and vLLM capture by default."""
    attn_implementation: str | None = None
    """The target's attention (``sdpa``, ``eager``, ``flex_attention``, ``flash_attention_2``,
    ...); ``None`` lets transformers choose (``sdpa`` where the model supports it, else
    ``eager``) and runs its ``sdpa`` grouped-query (no KV-head copies, bit-identical; every
    stage alike). Tree drafting needs one whose masks come from a mask function (not flash)."""
    prepack_linear: bool = True
    """On CPU in ``float32``, run the calls of up to 32 rows (decoding, verification, draft
    steps) of the linear layers with at least 2^18 weights on weights oneDNN reordered once
    (results agree to rounding, see ``specforge/engine/cpu/packed_linear.py``); in ``bfloat16``,
    where the CPU runs it natively, calls of up to 2048 rows. Smaller layers, larger calls and
    other devices or dtypes keep PyTorch's default. ``false`` keeps it everywhere."""

    def __post_init__(self) -> None:
        kind, _, index = self.device.partition(":")
        if kind not in SUPPORTED_DEVICES or (index and not index.isdigit()):
            raise ConfigError(
                f"target.device must be a CPU or CUDA device (cpu, cuda, cuda:1), got "
                f"{self.device!r}"
            )
        if not self.name_or_path:
            raise ConfigError("target.name_or_path must not be empty")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ConfigError(
                f"target.aux_layer_ids must list 3 layer ids, got {self.aux_layer_ids!r}"
            )
