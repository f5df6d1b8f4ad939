"""The proof's sections: ``bench`` (the built-in runtime and the engines) and ``engine`` (the
target's forward)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specforge.config.base import ConfigError, Dtype, DtypeOrAuto

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
