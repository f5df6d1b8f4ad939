"""The training stage's sections: ``draft`` (the family and its geometry), ``train`` and its
``on_policy`` phase."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from specforge.config.base import ConfigError
from specforge.families import sections


@dataclass
class DraftBase:
    """The draft's architecture (its geometry follows the target): what every family reads."""

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
    mask_token_id: int | None = None
    """A family whose draft reads a mask token in the positions it has not drafted yet: the
    target id whose embedding it is; ``null``: the tokenizer's mask token, else the largest id
    the training data never holds (recorded in the checkpoint and the export)."""

    def __post_init__(self) -> None:
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"draft.mask_token_id must be >= 0, got {self.mask_token_id}")

    @property
    def switches(self) -> dict[str, bool]:
        """The draft config's EAGLE 3.1 switches for this variant."""
        on = self.variant == "eagle3.1"
        return {"fc_norm": on, "norm_output": on}


DraftConfig = dataclasses.make_dataclass(
    "DraftConfig",
    [(name, options, field(default_factory=options)) for name, options in sections().items()],
    bases=(DraftBase,),
)
DraftConfig.__module__ = __name__
DraftConfig.__doc__ = """The draft's architecture (its geometry follows the target): the keys every
family reads, and one section per family that has options of its own (``draft.<name>``, defined
in the family's folder: :func:`specforge.families.sections`)."""


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
