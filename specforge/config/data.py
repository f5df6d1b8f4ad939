"""The data stage's sections: ``data``, ``regenerate``, ``synthesize``, ``vocab``, ``prepare``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from specforge.config.base import ConfigError


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
