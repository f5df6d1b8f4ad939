"""Typed configuration: dataclasses, YAML loading and dotted command-line overrides.

One config tree serves every stage. A YAML file holds the sections below; the command line adds
``section.field=value`` overrides (``data.max_length=1024``). Unknown keys and values of the wrong
type are errors that name the offending key, so a typo never silently falls back to a default.

Example::

    cfg = load_config("configs/smollm2-135m-eagle3.yaml", ["regenerate.max_new_tokens=64"])
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from specforge.errors import UserError

Dtype = Literal["bfloat16", "float16", "float32"]
DtypeOrAuto = Literal["bfloat16", "float16", "float32", "auto"]
"""A dtype name, or ``auto`` (:func:`resolve_auto_dtype`)."""

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""Config dtype names -> torch dtypes (the one table every stage uses)."""


def bfloat16_is_fast(device: str) -> bool:
    """Whether bfloat16 matmuls outrun float32 ones on ``device``: a CUDA GPU with bfloat16
    support, or a CPU with bfloat16 dot-product instructions: AMX tiles (Intel Sapphire Rapids
    and later) or AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake). Without either, a CPU emulates
    bfloat16 and runs it slower than float32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False


def int8_linear_available() -> bool:
    """Whether this PyTorch has the weight-only int8 kernel that ``bench.draft_quantize: int8``
    multiplies with (:mod:`specforge.engine.cpu.int8_linear`)."""
    return hasattr(torch, "_weight_int8pack_mm")


def resolve_auto_dtype(name: str, device: str) -> str:
    """``name``, or for ``auto`` the faster of ``bfloat16`` / ``float32`` on ``device``
    (:func:`bfloat16_is_fast`)."""
    if name != "auto":
        return name
    return "bfloat16" if bfloat16_is_fast(device) else "float32"


def resolve_draft_quantize(name: str, draft_dtype: str, device: str) -> str:
    """``bench.draft_quantize`` made concrete: ``auto`` is ``int8`` for a bfloat16 draft on a
    CPU that runs bfloat16 fast, where this PyTorch has the kernel, else ``none``.

    Raises:
        ConfigError: ``int8`` with another draft dtype or device.
    """
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        fits = on_cpu and draft_dtype == "bfloat16" and bfloat16_is_fast(device)
        return "int8" if fits and int8_linear_available() else "none"
    if name == "int8" and not (on_cpu and draft_dtype == "bfloat16"):
        raise ConfigError(
            f"bench.draft_quantize int8 needs bench.draft_dtype bfloat16 on a CPU; got "
            f"{draft_dtype!r} on {device!r}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name.

    Raises:
        UserError: an unknown name.
    """
    if name not in TORCH_DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


class ConfigError(UserError):
    """A config file or override names an unknown key or holds a value of the wrong type."""


SUPPORTED_DEVICES = ("cpu", "cuda")
"""The device types every stage runs on."""


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
        try:
            kind = torch.device(self.device).type
        except RuntimeError:
            kind = None
        if kind not in SUPPORTED_DEVICES:
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


@dataclass
class DataConfig:
    """Where conversations come from and how they are tokenized."""

    mode: Literal["online", "offline"] = "online"
    """``online``: the target runs inside each training step. ``offline``: training reads the
    hidden states ``specforge capture`` wrote to ``capture.output`` (no target weights but the
    embedding, ``lm_head`` and final norm)."""
    inputs: list[str] = field(default_factory=list)
    """Conversation sources: ``.json``/``.jsonl`` files, folders written by
    ``datasets.save_to_disk``, or HF dataset names. Empty means the built-in prompt set."""
    split: str = "train"
    """Split to read from HF datasets (ignored for local files)."""
    format: Literal["auto", "sharegpt", "openai", "ultrachat", "qa", "questions"] = "auto"
    """Record layout; ``auto`` detects it per record. ``questions``: a benchmark's questions,
    MT-Bench's ``{"question_id", "turns": [user texts]}`` (for ``--regenerate`` to answer)."""
    builtin_split: Literal["train", "eval", "all"] = "train"
    """Which part of the built-in prompt set to use when ``inputs`` is empty. ``eval`` is held
    out from training for the accept-length benchmark."""
    limit: int | None = None
    """Use only the first ``limit`` conversations (after reading, before regenerating)."""
    max_length: int = 2048
    """Tokens per training sample; longer samples are truncated and counted."""
    chat_template: str | None = None
    """A Jinja chat template (a file path or the template text) for tokenizers without one,
    or to override the tokenizer's own."""
    system_prompt: str | None = None
    """A system message prepended to conversations that have none. ``None`` keeps the
    template's default behaviour."""

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ConfigError(f"data.max_length must be >= 2, got {self.max_length}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"data.limit must be >= 1 or null, got {self.limit}")


@dataclass
class RegenerateConfig:
    """Self-distillation: the target answers every user turn itself."""

    enabled: bool = False
    """Replace the assistant turns of the input with the target's own answers."""
    backend: Literal["continuous", "static", "server"] = "continuous"
    """``continuous``: rows leave the batch when their answer ends and waiting prompts join
    (fast); ``static``: ``model.generate`` on fixed batches, turn by turn (the baseline);
    ``server``: an OpenAI-compatible server at ``server_url`` (SGLang, vLLM) answers."""
    server_url: str | None = None
    """``http://HOST:PORT/v1`` of a running OpenAI-compatible server; setting it selects the
    ``server`` backend (and turns regeneration on)."""
    server_model: str | None = None
    """The model name the server expects; default ``target.name_or_path``."""
    concurrency: int = 8
    """Server backend: conversations in flight."""
    retries: int = 4
    """Server backend: retries of a request that failed for a passing reason (refused
    connection, HTTP 429 / 5xx, a cut or non-JSON body), with exponential backoff."""
    retry_backoff_s: float = 1.0
    """Server backend: the first retry waits this long, each next one twice as long."""
    request_timeout_s: float = 600.0
    """Server backend: seconds one request may take before it counts as failed (and is
    retried); long answers from a loaded server need more."""
    max_new_tokens: int = 256
    """Longest answer generated per user turn."""
    batch_size: int | Literal["auto"] = "auto"
    """Answers generated together: rows in flight (``continuous``) or conversations per fixed
    batch (``static``). ``auto``: as many as half the device's free memory holds with every
    row at its longest (``max_prompt_length`` + ``max_new_tokens`` cached tokens, plus the
    cache's spare columns), at most 256 on a CPU and 1,024 on a GPU
    (:func:`~specforge.engine.generation.auto_batch_size`)."""
    rows_per_span: int | Literal["auto"] = "auto"
    """``continuous``: decode attention runs over spans of this many neighbouring rows, each
    reading only the cached columns its longest row fills (rows are left-padded, and a new
    prompt sits beside answers hundreds of tokens long); ``batch_size`` or more: one span, every
    row reads the longest row's columns. Outputs agree to float rounding either way. ``auto``:
    16 on a CPU, where attention reads memory; one span on a GPU, where every span costs its
    own kernel launches (256 rows: 16 attention calls a layer instead of one)."""
    decode_kernel: Literal["auto", "on", "off"] = "auto"
    """``continuous`` on CPU: decode steps' attention through specforge's AVX-512 kernel
    (:mod:`specforge.engine.cpu.decode_kernel`, built on first use with the system's C++ compiler
    and kept under ``TORCH_EXTENSIONS_DIR``): ``auto`` where it builds and applies, else
    PyTorch's SDPA with a warning naming why; ``on``: an error instead of that fallback;
    ``off``: SDPA. Outputs agree with SDPA's to float rounding."""
    temperature: float = 0.0
    """0 means greedy decoding; > 0 samples at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold when sampling."""
    seed: int = 0
    """Seed for sampling: each answer draws from ``(seed, conversation id, turn)``."""
    num_samples: int = 1
    """Answers per conversation (needs ``temperature`` > 0); each is its own record, id
    ``<id>#s<k>``."""
    max_prompt_length: int = 1536
    """A conversation whose prompt grows past this many tokens stops at that turn."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"regenerate.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size != "auto" and self.batch_size < 1:
            raise ConfigError(f"regenerate.batch_size must be >= 1, got {self.batch_size}")
        if self.rows_per_span != "auto" and self.rows_per_span < 1:
            raise ConfigError(f"regenerate.rows_per_span must be >= 1, got {self.rows_per_span}")
        if self.request_timeout_s <= 0:
            raise ConfigError(
                f"regenerate.request_timeout_s must be > 0, got {self.request_timeout_s}"
            )
        if self.concurrency < 1 or self.retries < 0 or self.retry_backoff_s < 0:
            raise ConfigError(
                "regenerate.concurrency must be >= 1, retries and retry_backoff_s >= 0, got "
                f"{self.concurrency}, {self.retries}, {self.retry_backoff_s}"
            )
        if self.server_url is not None:
            if not self.server_url.startswith(("http://", "https://")):
                raise ConfigError(
                    f"regenerate.server_url must be http(s)://..., got {self.server_url!r}"
                )
            self.backend, self.enabled = "server", True
        if self.backend == "server" and not self.server_url:
            raise ConfigError("regenerate.backend server needs regenerate.server_url")
        if self.temperature < 0:
            raise ConfigError(f"regenerate.temperature must be >= 0, got {self.temperature}")
        if self.num_samples < 1 or (self.num_samples > 1 and self.temperature <= 0):
            raise ConfigError(
                f"regenerate.num_samples must be >= 1, and > 1 only with temperature > 0 (greedy "
                f"answers would be identical), got {self.num_samples} at temperature "
                f"{self.temperature}"
            )
        if self.max_prompt_length < 1:
            raise ConfigError(
                f"regenerate.max_prompt_length must be >= 1, got {self.max_prompt_length}"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"regenerate.top_p must be in (0, 1], got {self.top_p}")


MAX_SYNTHESIZE = 10_000_000
"""The most prompts one ``specforge prepare --synthesize`` run may ask for."""


@dataclass
class SynthesizeConfig:
    """Prompts the target writes itself (``specforge prepare --synthesize N``; "Magpie")."""

    count: int = 0
    """Conversations to synthesize (0: none). They are added to ``data.inputs`` (the built-in
    prompts are then used only when listed as the ``builtin`` source)."""
    temperature: float = 1.0
    """Sampling temperature of the prompts."""
    top_p: float = 0.95
    """Nucleus threshold of the prompts."""
    max_prompt_tokens: int = 160
    """A prompt that has not ended its turn after this many tokens is dropped."""
    min_words: int = 4
    """Shorter prompts are dropped."""
    max_similarity: float = 0.6
    """Word-trigram Jaccard similarity at which a prompt counts as a near duplicate."""
    batch_size: int = 64
    """Prompts sampled together (continuous batching)."""
    max_attempts_factor: int = 4
    """Give up after ``max_attempts_factor * count`` attempts (a warning says how many)."""
    seed: int = 0
    """Attempt ``a`` samples with a generator seeded from ``(seed, a)``."""
    topics: list[str] = field(default_factory=list)
    """Steer the prompts across these subjects (names, not example questions): attempt ``a``
    writes its prompt under a system message naming ``topics[a % len(topics)]``; the answer is
    then written without it. Empty: unsteered."""
    follow_ups: float = 0.0
    """Share of the synthesized conversations that get a second user turn the target writes
    after its own first answer (the template up to the next user message, sampled and
    filtered as the first prompts are) and then answers: multi-turn data like MT-Bench's
    second turns (:mod:`specforge.distill.follow_ups`). 0: single-turn prompts."""

    def __post_init__(self) -> None:
        if not 0 <= self.follow_ups <= 1:
            raise ConfigError(f"synthesize.follow_ups must be in [0, 1], got {self.follow_ups}")
        for topic in self.topics:
            if not isinstance(topic, str) or not topic.strip():
                raise ConfigError(f"synthesize.topics must be non-empty strings, got {topic!r}")
        if not 0 <= self.count <= MAX_SYNTHESIZE:
            raise ConfigError(
                f"synthesize.count must be in 0..{MAX_SYNTHESIZE:,}, got {self.count}"
            )
        for name in ("max_prompt_tokens", "min_words", "batch_size", "max_attempts_factor"):
            if getattr(self, name) < 1:
                raise ConfigError(f"synthesize.{name} must be >= 1, got {getattr(self, name)}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"synthesize.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"synthesize.top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.max_similarity <= 1:
            raise ConfigError(
                f"synthesize.max_similarity must be in (0, 1], got {self.max_similarity}"
            )


@dataclass
class VocabConfig:
    """The draft vocabulary: the most frequent target tokens (docs/design.md §3.4)."""

    draft_vocab_size: int = 32000
    """Rows of the draft's ``lm_head``; capped at the target's vocabulary size."""

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 1:
            raise ConfigError(f"vocab.draft_vocab_size must be >= 1, got {self.draft_vocab_size}")


@dataclass
class PrepareConfig:
    """Where ``specforge prepare`` writes its results."""

    output: str | None = None
    """Conversations JSONL written by prepare; defaults to ``<output_dir>/conversations.jsonl``."""
    vocab_output: str | None = None
    """If set, also write the draft vocabulary map (``d2t``/``t2d`` safetensors) here."""


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


@dataclass
class DraftConfig:
    """The draft's architecture (its geometry follows the target)."""

    type: str = "eagle3"
    """The draft family: a name of the family registry (:data:`specforge.families.REGISTRY`;
    docs/families.md lists them with what each reads). ``eagle3``: EAGLE-3 and 3.1, one layer
    over three target layers, chains drafted step by step, trained with training-time test.
    Options that only another family reads are refused when a stage starts."""
    variant: Literal["eagle3", "eagle3.1"] = "eagle3"
    """``eagle3``: SGLang's ``LlamaForCausalLMEagle3``. ``eagle3.1``: the same layer with
    ``fc_norm`` (an RMSNorm on each aux state before ``fc``) and ``norm_output`` (the next
    draft step reads the post-norm hidden state), written to the export's ``config.json`` as
    the engines read them; an engine that predates EAGLE 3.1 ignores both keys, so serve such a
    draft with one that reads them."""
    block_size: int = 8
    """``dflash``: tokens per block, the anchor included (a round proposes ``block_size - 1``)."""
    dflash_layers: int = 1
    """``dflash``: the draft's decoder layers."""
    target_layers: int = 5
    """``dflash``: how many target layers the draft reads, spread from layer 1 to ``L - 3`` as
    SGLang spreads them (fewer on a shallow target)."""
    mask_token_id: int | None = None
    """``dflash``: the target id whose embedding fills a block's slots after the anchor;
    ``null``: the tokenizer's mask token, else the largest id the training data never holds
    (recorded in the checkpoint and the export)."""
    anchors: int = 64
    """``dflash``: blocks per training sequence, at random anchors before assistant tokens."""
    block_decay: float | None = 4.0
    """``dflash``: slot ``k`` of a block weighs ``exp(-(k - 1) / block_decay)`` in the loss
    (later slots are reached less often); ``null``: every slot alike."""
    block_labels: Literal["hard", "soft"] = "hard"
    """``dflash``: what slot ``k`` learns. ``hard``: the target's greedy token there (what
    greedy verification accepts; on regenerated data, mostly the data's token); ``soft``: the
    target's whole distribution there (cross-entropy to it, KL up to a constant: the
    full-vocabulary softmax at every scored position, a step's memory grows by 4 bytes x
    vocabulary per token). At equal time on the quickstart's corpus: docs/training.md."""

    def __post_init__(self) -> None:
        for name in ("dflash_layers", "target_layers", "anchors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"draft.{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ConfigError(f"draft.block_size must be >= 2, got {self.block_size}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"draft.mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.block_decay is not None and not self.block_decay > 0:
            raise ConfigError(f"draft.block_decay must be > 0 or null, got {self.block_decay}")

    @property
    def switches(self) -> dict[str, bool]:
        """The draft config's EAGLE 3.1 switches for this variant."""
        on = self.variant == "eagle3.1"
        return {"fc_norm": on, "norm_output": on}


@dataclass
class OnPolicyConfig:
    """The on-policy phase after supervised TTT (``draft.type: eagle3``;
    :mod:`specforge.trainer.ttt`, docs/training.md): every step replays the current draft's
    greedy chain rounds over the target's own answers and trains only the states those rounds
    reach, the anchors where rounds start (after a rejection) and each step through the first
    rejected one, on the target's distribution there."""

    steps: int = 0
    """Optimizer steps of the phase, after the supervised ones end (at ``train.max_steps`` or
    ``train.max_minutes``); ``0``: no phase."""
    max_minutes: float | None = None
    """Wall-clock budget of the phase (as ``train.max_minutes``, counted on its own);
    ``null``: steps alone."""
    depth: int = 5
    """Draft tokens per replayed round: the chain depth the draft will be served at."""
    lr: float | None = None
    """The phase's learning rate, constant; ``null``: where the supervised schedule ended,
    ``train.lr * train.min_lr_ratio``."""
    replay: bool = True
    """``false``: the phase trains every position and step as the supervised steps do, at its
    learning rate: the control of an A/B of the phase (``benchmarks/on_policy_ab.py``)."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"train.on_policy.steps must be >= 0, got {self.steps}")
        if self.depth < 1:
            raise ConfigError(f"train.on_policy.depth must be >= 1, got {self.depth}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(
                f"train.on_policy.max_minutes must be > 0 or null, got {self.max_minutes}"
            )
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"train.on_policy.lr must be > 0 or null, got {self.lr}")
        if self.steps == 0:
            for spec in dataclasses.fields(self):
                value = getattr(self, spec.name)
                if spec.name != "steps" and value != spec.default:
                    raise ConfigError(
                        f"train.on_policy.{spec.name}={value!r} does nothing while "
                        "train.on_policy.steps is 0 (no on-policy phase): set steps, or remove it"
                    )


@dataclass
class TrainConfig:
    """EAGLE-3 training with training-time test (docs/design.md §3.3)."""

    data_path: str | None = None
    """Conversations JSONL to train on; defaults to what prepare writes
    (``<output_dir>/conversations.jsonl``). A missing file is an error that says to run
    ``specforge prepare``."""
    ttt_length: int = 7
    """Unrolled draft steps per position."""
    step_weight: float = 0.8
    """Step ``k`` of the unroll is weighted ``step_weight ** k``."""
    loss: Literal["kl", "lk"] = "kl"
    """Per-step objective: ``kl`` is the soft cross-entropy to the target's distribution on the
    draft vocabulary (EAGLE's); ``lk`` is ``-log sum_v min(p_v, q_v)``, minus the log of the
    probability that a token drawn from the draft is accepted (an "LK" loss that optimises
    acceptance directly)."""
    target_temperature: float = 1.0
    """The temperature of the target distribution the loss reads, relative to the target's
    own: ``softmax(log p / T)`` on the draft vocabulary. ``1``: the target's distribution
    (EAGLE's); below 1 sharper, toward its greedy token, above 1 flatter; ``0``: the greedy
    token alone (hard cross-entropy). Greedy serving accepts the draft's argmax alone;
    sampling is lossless whatever the draft learnt, but accepts most where it learnt ``p``.
    Measured on the quickstart's corpus, 0.5 and 0 trained no better draft than 1
    (docs/training.md)."""
    from_pretrained: str | None = None
    """Start from a draft on disk instead of a new one: an export directory (``specforge
    export``'s, of ``draft.type``'s family), fine-tuned on this run's data. Its geometry, its
    weights and its vocabulary map are kept (``train.rebuild_vocab`` makes a new map from the
    data); it is checked against the target first (hidden size, vocabulary, RoPE, the aux
    layers it reads: ``target.aux_layer_ids`` must name them when they are not the default),
    so a draft of another target is refused before training. ``train.init_from_target`` (a
    new draft's initialisation, which the recipes set) does not apply, and says so."""
    rebuild_vocab: bool = False
    """With ``from_pretrained``: a new vocabulary map from this run's data
    (``vocab.draft_vocab_size`` ids); ``lm_head`` keeps the draft's rows for the ids both maps
    hold and takes the target's for the others."""
    init_from_target: bool = False
    """Start the draft's decoder layer from the target's last layer where shapes allow
    (attention on the hidden half of its input, MLP, norms) and ``fc`` as the identity on the
    top aux layer; else a seeded random initialisation. Embedding, ``norm`` and ``lm_head``
    always come from the target."""
    freeze_lm_head: bool = False
    """Keep the draft's ``lm_head`` (the target's rows for the draft vocabulary) as it starts:
    the draft learns a state the target's own head reads. A step skips the weight gradient and
    the optimizer update of the draft's largest matrix (on SmolLM2 8,192 x 576, 4.7M weights,
    beside 4.1M in the decoder layer); the exported head is the target's rows. Measured on the
    quickstart's corpus, no better draft at equal steps (docs/training.md)."""
    max_steps: int = 1000
    """Optimizer steps (the schedule spans them); the data repeats in seeded epochs."""
    max_minutes: float | None = None
    """Wall-clock budget of training (its evaluations and checkpoints included, resumed runs
    counted from where they left off), as PyTorch Lightning's ``max_time``: the first step that
    ends past it is the last (evaluated and saved as at ``max_steps``). The schedule's progress
    is the larger of the step and the time fraction, so the decay ends within the budget.
    ``null``: steps alone. The quickstart sets it to keep its hour on slower CPUs."""
    batch_size: int = 1
    """Conversations per micro-batch on each rank (padded to the longest)."""
    max_tokens_per_batch: int | None = None
    """Token budget of a micro-batch (``batch_size x padded length``); longer batches are split."""
    batch_tokens: int | None = None
    """Micro-batches by token budget instead of by count: conversations of similar length,
    as many as fit ``batch_tokens`` padded tokens (rows x the longest; a longer conversation
    goes alone), so every step trains on about the same number of tokens, and one micro-batch
    fills a GPU. Needs ``batch_size`` 1 and no ``max_tokens_per_batch``. ``null``: by count."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step on each rank."""
    lr: float = 1e-4
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 50
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps`` (or at
    ``max_minutes``, whichever comes first)."""
    warmup_ratio: float | None = None
    """The warmup as a share of the run's steps (SpecForge's ``--warmup-ratio``), set when the
    steps are known; ``null``: ``warmup_steps``."""
    epochs: float | None = None
    """Passes over the training data (SpecForge's ``--num-epochs``): ``max_steps`` becomes
    this many times the optimizer steps of one pass, once the data is read; ``null``:
    ``max_steps``."""
    min_lr_ratio: float = 0.1
    """The learning rate at ``max_steps``, as a fraction of ``lr``."""
    max_grad_norm: float = 0.5
    """Gradients are clipped to this global norm."""
    dtype: Literal["float32", "bfloat16", "auto"] = "bfloat16"
    """Autocast dtype of the draft's forward (weights and optimizer stay float32). ``auto``:
    as ``target.dtype``'s ``auto``, on the target's device (resolved when training starts)."""
    compile: Literal["auto", "true", "false"] = "auto"
    """``true``: the draft's TTT step (its decoder layer, one graph per unrolled step, rows and
    lengths dynamic) runs through ``torch.compile``, compiled in the first steps; ``auto``:
    ``false`` on every device, as measured (benchmarks/train_throughput.py): on a CPU the step
    is bound by its matrix products and compiling it gains nothing; on one H200 the eager step
    trains the long recipe at 60k tokens/s on 16k-token micro-batches, while compiling it had
    not finished after three minutes, a share of a 20-minute recipe it would have to win back."""
    seed: int = 0
    """Seed of the draft's initialisation and of the data order."""
    eval_fraction: float = 0.05
    """Share of the conversations held out for evaluation (hash-based, stable; the answers
    ``regenerate.num_samples`` sampled for one prompt are held out together)."""
    eval_every: int = 100
    """Optimizer steps between evaluations on the held-out conversations."""
    eval_data_path: str | None = None
    """Conversations JSONL evaluated beside the held-out split at every evaluation and logged
    as split ``eval_data`` (never trained on): e.g. the target's own answers to a benchmark's
    questions (``specforge prepare`` on them), to watch accept length where it is served.
    Online training only."""
    log_every: int = 10
    """Optimizer steps between ``metrics.jsonl`` records."""
    save_every: int = 200
    """Optimizer steps between checkpoints (one is always written at the end)."""
    resume: bool = False
    """Continue from the newest checkpoint in ``<output_dir>/checkpoints``."""
    num_workers: int = 1
    """Offline mode: DataLoader workers that read shards ahead of the step (0: in-process)."""
    state_cache_gb: float = 0.0
    """Online mode: keep the target's states of each conversation (aux layers, and the final
    hidden state and the target's argmax where the loss reads them) in host memory, up to this
    many GiB, so that later passes over it (and repeated evaluations) skip the target's forward,
    about two thirds of a CPU step, and its full-vocabulary logits
    (:mod:`specforge.trainer.state_cache`). About ``(3 + f) x hidden x 2`` bytes a token in 16
    bits (``f``: the share of tokens under the loss), 4.4 KB for SmolLM2.
    ``0``: the target runs every step. Offline mode reads every state from its shards and
    ignores it, with a warning."""
    target_sharding: Literal["replicate", "fsdp"] = "replicate"
    """Online mode under torchrun: every rank holds the whole frozen target (``replicate``), or
    its decoder layers are sharded across ranks with FSDP2 ``fully_shard`` (``fsdp``, for
    targets that do not fit one device; embedding, norm and ``lm_head`` stay whole)."""
    zero_optimizer: bool = False
    """Shard the draft's AdamW state across ranks (ZeRO stage 1, PyTorch's
    ``ZeroRedundancyOptimizer``); the draft itself stays replicated under DDP."""
    max_nonfinite_steps: int = 0
    """Steps with a non-finite loss or gradient norm that are skipped (no optimizer step)
    before the run stops with an error naming the step and its samples."""
    tensorboard: bool = False
    """Also log to TensorBoard (``<output_dir>/tensorboard``; the ``tensorboard`` extra)."""
    wandb: bool = False
    """Log to Weights & Biases in offline mode (sync later with ``wandb sync``)."""
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    """The on-policy phase after the supervised steps (:class:`OnPolicyConfig`)."""

    def __post_init__(self) -> None:
        for name in (
            "ttt_length",
            "max_steps",
            "batch_size",
            "grad_accumulation",
            "log_every",
            "eval_every",
            "save_every",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_workers", "warmup_steps", "max_nonfinite_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if not self.state_cache_gb >= 0:
            raise ConfigError(f"train.state_cache_gb must be >= 0, got {self.state_cache_gb}")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"train.epochs must be > 0 or null, got {self.epochs}")
        if self.warmup_ratio is not None and not 0 <= self.warmup_ratio < 1:
            raise ConfigError(
                f"train.warmup_ratio must be in [0, 1) or null, got {self.warmup_ratio}"
            )
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"train.max_minutes must be > 0 or null, got {self.max_minutes}")
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < 1:
            raise ConfigError(
                f"train.max_tokens_per_batch must be >= 1 or null (no limit), got "
                f"{self.max_tokens_per_batch}"
            )
        if self.batch_tokens is not None:
            if self.batch_tokens < 1:
                raise ConfigError(
                    f"train.batch_tokens must be >= 1 or null, got {self.batch_tokens}"
                )
            if self.batch_size != 1 or self.max_tokens_per_batch is not None:
                raise ConfigError(
                    f"train.batch_tokens ({self.batch_tokens}) sizes micro-batches by tokens: "
                    f"leave train.batch_size at 1 (got {self.batch_size}) and "
                    f"train.max_tokens_per_batch null (got {self.max_tokens_per_batch})"
                )
        if self.max_grad_norm <= 0:
            raise ConfigError(f"train.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if not 0 < self.step_weight <= 1:
            raise ConfigError(f"train.step_weight must be in (0, 1], got {self.step_weight}")
        if not self.target_temperature >= 0:  # NaN too
            raise ConfigError(
                f"train.target_temperature must be >= 0, got {self.target_temperature}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ConfigError(f"train.weight_decay must be >= 0, got {self.weight_decay}")
        if self.rebuild_vocab and not self.from_pretrained:
            raise ConfigError("train.rebuild_vocab does nothing without train.from_pretrained")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"train.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")


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


AUTO_MAX_DEPTH = 7
"""The deepest chain ``bench.num_steps: auto`` drafts (SGLang's adaptive tiers stop at 7 too);
also the most first-position siblings ``bench.auto_siblings`` may ask for."""

AUTO_MAX_LOOKUP = 16
"""The most prompt-lookup tokens ``bench.auto_lookup`` may verify in a round (deeper than the
draft's chains: lookup's proposals cost no draft step)."""


ENGINE_OPTIONS = {
    "url": ("sglang", "vllm"),
    "baseline_url": ("sglang", "vllm"),
    "vllm_python": ("vllm",),
    "vllm_args": ("vllm",),
    "agree_with": ("vllm",),
}
"""The ``bench`` options only an engine reads, and the engines that read them."""


@dataclass
class BenchConfig:
    """``specforge bench``: accept length and speedup of an exported draft vs the target."""

    draft: str | None = None
    """An export directory (``specforge export``); defaults to ``<output_dir>/export``."""
    engine: Literal["builtin", "sglang", "vllm"] = "builtin"
    """``builtin``: our runtime vs the target alone; ``sglang``: a running SGLang server;
    ``vllm``: vLLM serving the draft, against vLLM without it (a running server at ``url``,
    or servers launched with ``vllm_python``)."""
    url: str | None = None
    """A running server's URL for ``engine: sglang`` or ``vllm``, e.g.
    ``http://127.0.0.1:30000``."""
    baseline_url: str | None = None
    """``engine: sglang``, or ``vllm`` with ``url``: a running server (of the same engine) of the
    same target without speculation, the speedup's baseline (none: accept length only)."""
    vllm_python: str | None = None
    """``engine: vllm`` without ``url``: the Python interpreter of an environment where vLLM is
    installed (e.g. ``~/vllm-venv/bin/python``); the bench launches vLLM's server with it twice,
    with the draft and without, on loopback, and stops each when its half ends."""
    vllm_args: list[str] = field(default_factory=list)
    """Extra flags for the launched vLLM servers (after ``--dtype float32 --max-model-len 4096
    --enforce-eager --seed 0``). On the command line ``--vllm-args`` takes every word after it,
    dashes and all, up to the next specforge flag: ``--vllm-args --no-enforce-eager``."""
    vllm_start_timeout_s: float = 900.0
    """How long a launched vLLM server may take to answer ``/health``."""
    agree_with: str | None = None
    """``engine: vllm``: a built-in bench's ``bench.json`` of the same export on the same
    questions and depth; the report sets the two accept lengths side by side, and when the
    engine's falls more than ``agreement_margin`` below ours, names the export checks run
    (:mod:`specforge.serving.agreement`)."""
    agreement_margin: float = 0.10
    """How far (a share) the engine's accept length may fall below the built-in runtime's."""
    questions: str = "builtin-eval"
    """FastChat ``question.jsonl``, a conversations file, ``builtin-eval`` (the held-out built-in
    prompts), ``auto`` (MT-Bench from the HF hub when reachable, else ``builtin-eval``), a set by
    name (``mt_bench``, ``gsm8k``, ``humaneval``, ``math500``), an HF dataset with a train split,
    or a comma-separated suite of these (one table per set)."""
    num_steps: int | Literal["auto"] = 5
    """Draft depth: tokens per chain, or levels of a tree; ``auto`` (chains) picks the depth
    before each round from this device's measured costs and the running acceptance per
    position (0 = plain decoding when no depth pays)."""
    topk: int = 1
    """Branches per draft step; 1 drafts a chain, more a tree."""
    num_draft_tokens: int | None = None
    """Tree size including the root (tree drafting only)."""
    auto_siblings: int = 3
    """``num_steps: auto``, greedy: at most this many further candidates for the first draft
    position, verified beside the chain (a small tree) in rounds where the costs say they pay;
    0 keeps ``auto`` to chains. Ignored where the target's attention cannot verify a tree."""
    auto_lookup: int = 10
    """``num_steps: auto``: prompt lookup competes with the draft. Each round, the up to this
    many tokens that followed the earlier occurrence of the last token whose context matches
    the conversation's for longest are verified instead of the draft's tokens, or beside them,
    when their measured acceptance (learnt every round from the target's tokens, by match
    length) promises more tokens per second; 0: the draft's always. It may exceed the draft's
    depth (up to 16; the default, 10, is the prompt-lookup baseline's). A fixed depth does not
    use it. The outputs stay the target's either way."""
    max_new_tokens: int = 256
    """Longest answer per turn."""
    dtype: Dtype = "float32"
    """Dtype of the target (and of its baseline); token-identical outputs need ``float32``."""
    draft_dtype: DtypeOrAuto = "auto"
    """Dtype the built-in runtime runs the draft in. It changes only which tokens the draft
    proposes: the target verifies each one, so every output stays the target's. ``auto``:
    ``bfloat16``, the dtype drafts are exported in, where it is fast on the target's device
    (CUDA, or a CPU with AMX or AVX512-BF16), else ``float32``."""
    draft_quantize: Literal["auto", "int8", "none"] = "auto"
    """How the built-in runtime stores the draft's linear weights. ``int8``: int8 with one
    scale per output row, computed in bfloat16 (:mod:`specforge.engine.cpu.int8_linear`; needs
    ``draft_dtype`` bfloat16 on a CPU): half the bytes a draft step reads. Like ``draft_dtype`` it
    changes only the proposals, never the outputs. ``auto``: ``int8`` where the draft runs in
    bfloat16 on a CPU that runs bfloat16 fast (as ``draft_dtype``'s ``auto`` decides) and this
    PyTorch has the kernel, else ``none`` (CUDA keeps bfloat16 weights)."""
    system_prompt: str | None = None
    """A system message for every question; default: the chat template's own."""
    limit: int | None = None
    """Benchmark only the first ``limit`` questions (of each set of a suite)."""
    prompt_lookup_num_tokens: int = 10
    """Tokens proposed per step by the prompt-lookup baseline (n-gram drafting, verified through
    the same engine as the target alone); 0 skips that baseline (a third of the benchmark's
    time)."""
    target_compile: bool = False
    """The target alone (the baseline ``speedup`` is measured against, and the reference
    outputs) decodes with a static KV cache and ``torch.compile`` (compiled in the warm-up).
    Off by default: transformers' static cache grows to each longer prompt and recompiles, so
    over multi-turn prompts it can be slower than the default (``benchmarks/baseline_decoding.py``
    compares the two)."""
    output: str | None = None
    """Where ``bench.json``, ``bench.md`` and ``bench.png`` go; defaults to
    ``<output_dir>/bench``."""

    def __post_init__(self) -> None:
        if self.num_steps == "auto" and self.topk != 1:
            raise ConfigError(f"bench.num_steps auto drafts chains: needs topk 1, got {self.topk}")
        for name in ("num_steps", "topk", "max_new_tokens"):
            if getattr(self, name) != "auto" and getattr(self, name) < 1:
                raise ConfigError(f"bench.{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_num_tokens < 0:
            raise ConfigError(
                f"bench.prompt_lookup_num_tokens must be >= 0, got {self.prompt_lookup_num_tokens}"
            )
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"bench.limit must be >= 1 or null, got {self.limit}")
        if self.engine == "vllm" and self.num_steps == "auto":
            raise ConfigError("bench.engine vllm serves a fixed depth: set bench.num_steps")
        if not 0 <= self.auto_lookup <= AUTO_MAX_LOOKUP:
            raise ConfigError(
                f"bench.auto_lookup must be in 0..{AUTO_MAX_LOOKUP}, got {self.auto_lookup}"
            )
        if not 0 <= self.auto_siblings <= AUTO_MAX_DEPTH:
            raise ConfigError(
                f"bench.auto_siblings must be in 0..{AUTO_MAX_DEPTH}, got {self.auto_siblings}"
            )
        if not 0 <= self.agreement_margin < 1:
            raise ConfigError(
                f"bench.agreement_margin must be in [0, 1), got {self.agreement_margin}"
            )
        if not self.vllm_start_timeout_s > 0:
            raise ConfigError(
                f"bench.vllm_start_timeout_s must be > 0, got {self.vllm_start_timeout_s}"
            )

    def check_engine_options(self) -> None:
        """Refuse an option the chosen ``engine`` does not read (a ``url`` with the built-in
        runtime, ``vllm_args`` with SGLang): the bench would run without it. Checked when a
        bench starts, not at load: ``export.verify_engine`` reads them under ``engine:
        builtin``.

        Raises:
            ConfigError: naming the option and the engines that read it.
        """
        for name, engines in ENGINE_OPTIONS.items():
            value = getattr(self, name)
            if value and self.engine not in engines:
                raise ConfigError(
                    f"bench.{name}={value!r} does nothing with bench.engine {self.engine} (read "
                    f"by engine {' or '.join(engines)}): remove it, or set bench.engine"
                )


@dataclass
class EngineConfig:
    """``engine``: how ``specforge bench`` runs the target's forwards, for the target alone and
    for the speculative runtime's verification (:mod:`specforge.engine`)."""

    compile: Literal["auto", "true", "false"] = "auto"
    """``true``: on a CPU, through ``torch.compile`` at a bounded set of shapes, compiled in the
    warm-up and cached on disk by PyTorch (``TORCHINDUCTOR_CACHE_DIR``); on a GPU, CUDA graphs
    of the eager forwards (the target's, and a chain's draft steps), each shape captured once
    and replayed; ``false``: the engine eager (its preallocated cache, no compilation);
    ``auto``: compiled where it pays and can run: on a GPU, and on a CPU with a C++ compiler
    when the run decodes enough tokens to repay the compilation (priced from the eager
    engine's measured time per token), never where the layer loop reads a tensor on the host
    (dynamic RoPE); else the eager engine. ``bench.json`` records the path that ran and why.
    Either way the speedup is against the target alone run by the same engine. A target whose
    decoder is not the engine's plain layer loop (or has windowed attention) decodes through
    transformers instead, with a warning (with ``true``: an error)."""


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


def resolve_auto(cfg: SpecForgeConfig) -> SpecForgeConfig:
    """``cfg`` with its hardware-dependent ``auto`` values made concrete for the running machine:
    ``target.dtype``, ``train.dtype`` and ``train.compile`` (the draft trains on the target's
    device), ``bench.draft_dtype`` and ``bench.draft_quantize``; ``engine.compile`` depends on
    the target and the run too, and is resolved when the engine is built
    (:func:`specforge.engine.target.build_engine`). A loaded config keeps ``auto``, so it means
    the same on every machine; each stage resolves it when it starts and records the result in
    its outputs. Concrete values are kept as they are.

    Raises:
        ConfigError: ``bench.draft_quantize: int8`` with a draft dtype or device it cannot run.
    """
    device = cfg.target.device
    draft_dtype = resolve_auto_dtype(cfg.bench.draft_dtype, device)
    return dataclasses.replace(
        cfg,
        target=dataclasses.replace(cfg.target, dtype=resolve_auto_dtype(cfg.target.dtype, device)),
        train=dataclasses.replace(
            cfg.train,
            dtype=resolve_auto_dtype(cfg.train.dtype, device),
            compile=resolve_train_compile(cfg.train.compile, device),
        ),
        bench=dataclasses.replace(
            cfg.bench,
            draft_dtype=draft_dtype,
            draft_quantize=resolve_draft_quantize(cfg.bench.draft_quantize, draft_dtype, device),
        ),
    )


def resolve_train_compile(value: str, device: str) -> str:
    """``train.compile``'s ``auto`` for ``device``: ``false`` (see :class:`TrainConfig`)."""
    del device  # measured the same way on a CPU and a GPU so far
    return "false" if value == "auto" else value


# ---------------------------------------------------------------------------------------------
# Loading


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (by default the last one
    wins silently, so a config could hold two values for one setting)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}): keep one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None):
    """Build a :class:`SpecForgeConfig` from a YAML file plus dotted overrides.

    Args:
        path: YAML file, or ``None`` for the defaults.
        overrides: ``key.sub=value`` strings; values are parsed as YAML scalars/lists.

    Returns:
        The validated config.

    Raises:
        ConfigError: unknown key, wrong type, bad value, or an unreadable file.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = recipe_path(path)
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path}: not UTF-8 text ({err.reason} at byte {err.start})"
            ) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping, got {type(loaded).__name__}"
            )
        raw = loaded or {}
    for item in overrides or []:
        apply_override(raw, item)
    return from_dict(SpecForgeConfig, raw)


SHIPPED_RECIPES = "specforge.configs"
"""The package that holds the shipped recipes (``configs/`` in a checkout links to it)."""
DEFAULT_RECIPE = "smollm2-135m-eagle3"
"""The embedded default recipe, which ``specforge quickstart`` runs."""


def recipe_path(path: str | Path) -> Path:
    """A config file: an existing path, else the name of a shipped recipe (``smollm2-135m-eagle3``
    or ``smollm2-135m-eagle3.yaml``), read from the installed package.

    Raises:
        ConfigError: neither exists.
    """
    path = Path(path)
    if path.is_file():
        return path
    name = path.name if path.suffix == ".yaml" else f"{path.name}.yaml"
    shipped = Path(str(resources.files(SHIPPED_RECIPES).joinpath(name)))
    if len(path.parts) == 1 and shipped.is_file():
        return shipped
    raise ConfigError(f"config file not found: {path}")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict (creating sections as needed)."""
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override must look like section.key=value, got {item!r}")
    try:
        value = yaml.load(text, Loader=UniqueKeyLoader) if text.strip() else None
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({reason})") from None
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def from_dict(cls: type, raw: Any, prefix: str = ""):
    """Build dataclass ``cls`` from a dict, checking keys and types recursively."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}"
            f" (known keys of {where}: {', '.join(sorted(names))})"
        )
    kwargs = {name: _check(hints[name], value, f"{prefix}{name}") for name, value in raw.items()}
    return cls(**kwargs)


YAML_BOOLEAN_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}
"""The words YAML reads as booleans: a choice field that offers one of them (``decode_kernel:
on``) takes the boolean back as that word."""


def _check(tp: Any, value: Any, key: str) -> Any:
    """Return ``value`` converted to type ``tp`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} must not be null")
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(arg, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads on/off, yes/no as booleans
            spellings = YAML_BOOLEAN_WORDS[value]
            value = next((word for word in spellings if word in choices), value)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_check(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        # PyYAML reads "3e-4" as a string (YAML 1.1); accept numeric strings for float fields.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # a bug in this module


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (for saving next to checkpoints and outputs)."""
    return dataclasses.asdict(cfg)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (for ``--help``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:] + [None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
