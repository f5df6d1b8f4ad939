"""The training launch flags of the tools users come from (SpecForge's ``scripts/train_eagle3.py``
and its ``_online`` / ``_offline`` variants, speculators' ``scripts/train.py``), mapped onto this
project's config, so that their launch commands run as they are: ``specforge train`` (and
``scripts/train_eagle3.py``) rewrite each upstream flag into the dotted overrides it means
(:func:`translate`), accept a flag that has no effect here with a note saying why, and refuse a
flag that has no equivalent in one line naming it and what to use instead. The table is
:data:`UPSTREAM_FLAGS`; ``specforge train --help`` and docs/switching.md list it.

What the mapping chooses where the tools differ:

- SpecForge's ``--train-data-path`` is a raw conversations file (ShareGPT / OpenAI messages);
  training here reads prepared conversations, so the file is prepared first (tokenized with the
  target's own chat template, nothing regenerated) into ``<output_dir>/conversations.jsonl``,
  once: a rerun (``--resume``) reuses it.
- ``--num-epochs`` / ``--epochs`` become ``train.epochs`` (passes over the data, which set
  ``train.max_steps`` when the data is read); ``--max-num-steps`` / ``--total-steps`` win over
  them, as in SpecForge.
- ``--draft-model-config`` / ``--draft-config``: the draft's geometry follows the target here;
  the file's ``draft_vocab_size`` is taken, a layer count other than one (EAGLE-3) is refused,
  and its other keys are read from the target instead (said in a note).
- ``--chat-template NAME``: the target tokenizer's own chat template is used (what the serving
  engines apply), whatever SpecForge template NAME names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specforge.errors import UserError
from specforge.families import option_modules
from specforge.io import read_json

SPECFORGE = "SpecForge scripts/train_eagle3.py"
SPECULATORS = "speculators scripts/train.py"
TOOLS = {"specforge": SPECFORGE, "speculators": SPECULATORS}
"""The names a family's ``options`` module gives the tools its upstream flags come from."""


@dataclass(frozen=True)
class UpstreamFlag:
    """One upstream flag and what it means here."""

    flag: str
    tool: str
    sets: tuple[str, ...] = ()
    """The dotted keys its value sets (each gets the value, JSON-quoted where a string)."""
    value: bool = True
    """It takes a value (``False``: a switch)."""
    fixed: tuple[str, ...] = ()
    """Overrides it sets whatever its value (a switch's, or beside ``sets``)."""
    note: str = ""
    """Accepted: what it means here (printed when given)."""
    refuse: str = ""
    """Refused: what to use instead."""
    convert: str = ""
    """A value that needs reading (a name of :data:`CONVERTERS`)."""


def _f(flag: str, tool: str, *sets: str, **kwargs) -> UpstreamFlag:
    return UpstreamFlag(flag, tool, tuple(sets), **kwargs)


NO_TARGET_SERVER = "the target runs in-process through transformers here"
UPSTREAM_FLAGS: tuple[UpstreamFlag, ...] = (
    # SpecForge: model
    _f("--target-model-path", SPECFORGE, "target.name_or_path"),
    _f("--draft-model-config", SPECFORGE, convert="draft_config"),
    _f("--embedding-key", SPECFORGE, note="the embedding is read from the target model itself"),
    _f("--lm-head-key", SPECFORGE, note="the lm_head is read from the target model itself"),
    _f("--target-model-backend", SPECFORGE, note=NO_TARGET_SERVER),
    _f(
        "--is-vlm",
        SPECFORGE,
        value=False,
        refuse="vision-language targets train on their text model here (a VLM checkpoint "
        "loads as its text config); drop the flag",
    ),
    # SpecForge: data
    _f("--train-data-path", SPECFORGE, convert="train_data"),
    _f(
        "--train-hidden-states-path",
        SPECFORGE,
        "capture.output",
        fixed=("data.mode=offline",),
        note="offline training reads a capture made by `specforge capture` (its own shard "
        "format), not SpecForge's hidden-state files",
    ),
    _f(
        "--eval-hidden-states-path",
        SPECFORGE,
        refuse="offline evaluation uses the held-out share of the capture (train.eval_fraction)",
    ),
    _f("--chat-template", SPECFORGE, note="the target tokenizer's own chat template is used"),
    _f(
        "--is-preformatted",
        SPECFORGE,
        value=False,
        refuse="give conversations (messages); the target's chat template is applied here",
    ),
    _f("--build-dataset-num-proc", SPECFORGE, note="tokenization runs in-process here"),
    _f("--dataloader-num-workers", SPECFORGE, "train.num_workers"),
    # SpecForge: training
    _f("--num-epochs", SPECFORGE, "train.epochs"),
    _f("--max-num-steps", SPECFORGE, "train.max_steps"),
    _f("--total-steps", SPECFORGE, "train.max_steps"),
    _f("--learning-rate", SPECFORGE, "train.lr"),
    _f("--max-length", SPECFORGE, "data.max_length"),
    _f("--warmup-ratio", SPECFORGE, "train.warmup_ratio"),
    _f("--ckpt-dir", SPECFORGE, "train.from_pretrained"),
    _f("--eval-interval", SPECFORGE, "train.eval_every"),
    _f("--save-interval", SPECFORGE, "train.save_every"),
    _f("--log-interval", SPECFORGE, "train.log_every"),
    _f("--draft-accumulation-steps", SPECFORGE, "train.grad_accumulation"),
    # SpecForge: parallelism and the rest
    _f("--tp-size", SPECFORGE, convert="one_or_fsdp"),
    _f("--sp-ulysses-size", SPECFORGE, convert="one"),
    _f("--sp-ring-size", SPECFORGE, convert="one"),
    _f("--attention-backend", SPECFORGE, note="the draft's attention is this project's own"),
    _f("--cache-key", SPECFORGE, note="prepared data is kept in the output directory"),
    _f("--cache-dir", SPECFORGE, note="prepared data is kept in the output directory"),
    _f("--verbose", SPECFORGE, value=False, note="use `specforge -v train` for debug logging"),
    _f("--dist-timeout", SPECFORGE, note="torch.distributed's default timeout is used"),
    _f("--model-download-dir", SPECFORGE, note="models load through the Hugging Face cache"),
    _f("--report-to", SPECFORGE, convert="tracker"),
    *(
        _f(
            flag,
            SPECFORGE,
            refuse="set WANDB_PROJECT / WANDB_NAME / WANDB_API_KEY in the environment "
            "(train.wandb logs offline)",
        )
        for flag in ("--wandb-project", "--wandb-name", "--wandb-key", "--wandb-dir")
    ),
    # speculators
    _f("--verifier-name-or-path", SPECULATORS, "target.name_or_path"),
    _f("--verifier", SPECULATORS, "target.name_or_path"),
    _f("--trust-remote-code", SPECULATORS, value=False, fixed=("target.trust_remote_code=true",)),
    _f("--speculator-type", SPECULATORS, "draft.type"),
    _f("--draft-config", SPECULATORS, convert="draft_config"),
    _f("--from-pretrained", SPECULATORS, "train.from_pretrained"),
    _f("--save-path", SPECULATORS, "output_dir"),
    _f("--epochs", SPECULATORS, "train.epochs"),
    _f("--total-seq-len", SPECULATORS, "train.batch_tokens"),
    _f("--log-freq", SPECULATORS, "train.log_every"),
    _f("--draft-vocab-size", SPECULATORS, "vocab.draft_vocab_size"),
    _f("--ttt-steps", SPECULATORS, "train.ttt_length"),
    _f("--num-depths", SPECULATORS, "train.ttt_length"),
    _f("--ttt-step-loss-decay", SPECULATORS, "train.step_weight"),
    *(
        _f(flag, TOOLS[tool], f"draft.{name}.{key}")
        for name, module in option_modules().items()
        for tool, flag, key in getattr(module, "UPSTREAM_FLAGS", ())
    ),
    _f(
        "--hidden-states-path",
        SPECULATORS,
        "capture.output",
        fixed=("data.mode=offline",),
        note="offline training reads a capture made by `specforge capture`",
    ),
    _f("--logger", SPECULATORS, convert="tracker"),
    _f("--run-name", SPECULATORS, note="the output directory names the run"),
    _f("--log-dir", SPECULATORS, note="metrics go to <output_dir>/metrics.jsonl"),
    _f(
        "--no-resume-from-checkpoint",
        SPECULATORS,
        value=False,
        note="a run resumes here only with --resume",
    ),
)
"""Every upstream flag this project knows, in the order docs/switching.md lists them. Flags
whose name and meaning are this project's own too (``--output-dir``, ``--batch-size``,
``--ttt-length``, ``--seed``, ``--resume``, ``--max-grad-norm``, ``--lr``, ``--block-size``,
``--mask-token-id``, ``--eval-data-path``, ``--num-workers``) need no entry."""

BY_FLAG = {entry.flag: entry for entry in UPSTREAM_FLAGS}

TRACKERS = {"wandb": "train.wandb=true", "tensorboard": "train.tensorboard=true", "none": ""}


@dataclass
class Translated:
    """An upstream command line rewritten for ``specforge train``."""

    argv: list[str]
    """The words left for the train stage's own parser, with the overrides appended."""
    notes: list[str] = field(default_factory=list)
    """What the accepted flags without an effect here mean (printed when the run starts)."""
    prepare_from: str | None = None
    """A raw conversations file to prepare before training (``--train-data-path``)."""


def _override(key: str, value: str) -> str:
    """``key=value``, the value JSON-quoted unless it reads as a number or a boolean."""
    try:
        float(value)
        return f"{key}={value}"
    except ValueError:
        pass
    if value in ("true", "false"):
        return f"{key}={value}"
    return f"{key}={json.dumps(value)}"


def _draft_config(path: str) -> tuple[list[str], list[str]]:
    """The overrides a draft config file gives (its draft vocabulary), and a note on the rest.

    Raises:
        UserError: a file that cannot be read, or a draft of more than one layer.
    """
    if not Path(path).is_file():
        raise UserError(f"--draft-model-config {path}: no such file")
    values = read_json(Path(path))
    layers = values.get("num_hidden_layers", 1)
    if layers != 1:
        raise UserError(
            f"--draft-model-config {path}: num_hidden_layers {layers}; an EAGLE-3 draft here "
            "has one decoder layer (another family's own layer count: docs/families.md)"
        )
    overrides = []
    if "draft_vocab_size" in values:
        overrides.append(f"vocab.draft_vocab_size={int(values['draft_vocab_size'])}")
    rest = sorted(k for k in values if k not in ("draft_vocab_size", "num_hidden_layers"))
    note = f"{path}: the draft's geometry follows the target here ({', '.join(rest)} not read)"
    return overrides, [note] if rest else []


def _converted(entry: UpstreamFlag, value: str, out: Translated) -> list[str]:
    """The overrides of a flag whose value needs reading (``entry.convert``)."""
    if entry.convert == "draft_config":
        overrides, notes = _draft_config(value)
        out.notes += notes
        return overrides
    if entry.convert == "train_data":
        out.prepare_from = value
        return []
    if entry.convert == "tracker":
        chosen = [name.strip() for name in value.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in TRACKERS]
        if unknown:
            raise UserError(
                f"{entry.flag} {value}: {', '.join(unknown)} has no equivalent here "
                "(train.wandb, train.tensorboard)"
            )
        return [TRACKERS[name] for name in chosen if TRACKERS[name]]
    if entry.convert in ("one", "one_or_fsdp"):
        if value.strip() == "1":
            return []
        instead = (
            "shard the target with train.target_sharding=fsdp under torchrun"
            if entry.convert == "one_or_fsdp"
            else "run one sequence per rank"
        )
        raise UserError(f"{entry.flag} {value} has no equivalent here: {instead}")
    raise AssertionError(f"unknown converter {entry.convert!r}")


def translate(argv: list[str]) -> Translated:
    """Rewrite the upstream flags of a ``train`` command line (see the module docstring);
    every other word is left for the stage's own parser, in order.

    Raises:
        UserError: a refused flag (naming it and what to use instead), a flag without its
            value, or a value that cannot be read.
    """
    out, overrides, index = Translated([]), [], 0
    epochs_set = steps_set = False
    while index < len(argv):
        word = argv[index]
        flag, inline, value = word.partition("=") if word.startswith("--") else (word, "", "")
        entry = BY_FLAG.get(flag)
        index += 1
        if entry is None:
            out.argv.append(word)
            continue
        if entry.refuse:
            raise UserError(f"{flag} ({entry.tool}) has no equivalent here: {entry.refuse}")
        if entry.value and not inline:
            if index >= len(argv) or argv[index].startswith("--"):
                raise UserError(f"{flag} ({entry.tool}) needs a value")
            value, index = argv[index], index + 1
        if entry.note:
            out.notes.append(f"{flag} ({entry.tool}): {entry.note}")
        overrides += [_override(key, value) for key in entry.sets] + list(entry.fixed)
        if entry.convert:
            overrides += _converted(entry, value, out)
        epochs_set |= "train.epochs" in entry.sets
        steps_set |= "train.max_steps" in entry.sets
    if epochs_set and steps_set:  # SpecForge: a step count given wins over the epochs
        overrides = [o for o in overrides if not o.startswith("train.epochs=")]
    out.argv += overrides
    return out


def help_table() -> str:
    """The mapping as plain text (``specforge train --help``'s epilog)."""
    lines = ["upstream flags (SpecForge, speculators) this command accepts:"]
    for entry in UPSTREAM_FLAGS:
        lines.append(f"  {entry.flag:<28} {describe(entry)}")
    return "\n".join(lines)


def describe(entry: UpstreamFlag) -> str:
    """What an upstream flag does here, in a phrase."""
    if entry.refuse:
        return f"refused: {entry.refuse}"
    what = [*entry.sets, *entry.fixed]
    special = {
        "draft_config": "vocab.draft_vocab_size from the file; one layer (the rest follows "
        "the target)",
        "train_data": "prepared into <output_dir>/conversations.jsonl, then train.data_path",
        "tracker": "wandb -> train.wandb, tensorboard -> train.tensorboard, none",
        "one": "1 only",
        "one_or_fsdp": "1 only (train.target_sharding=fsdp shards the target)",
    }
    if entry.convert:
        what.append(special[entry.convert])
    if entry.note:
        what.append(entry.note if what else f"no effect: {entry.note}")
    return "; ".join(what)
