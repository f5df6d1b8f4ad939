"""The ``specforge`` command: one subcommand per recipe (:mod:`specforge.recipes`).

Every subcommand takes ``--config FILE.yaml`` (or the name of a shipped recipe) plus dotted
overrides (``data.max_length=1024``). Its flags are generated from the config fields of the
sections it reads, with the field docstrings as help; a flag wins over the file and the
overrides. A :class:`specforge.errors.UserError` is reported in one line; anything else is a
bug and keeps its traceback.

    specforge prepare --target smollm2-135m --regenerate --limit 16 --output data.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import textwrap
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from specforge.config import DEFAULT_RECIPE, SpecForgeConfig, field_docs, load_config
from specforge.errors import Interrupted, UserError
from specforge.families import REGISTRY, sections
from specforge.recipes.quickstart import QUICKSTART_OVERRIDES
from specforge.upstream import help_table, translate


@dataclass(frozen=True)
class Stage:
    """A subcommand: its recipe runner, help text and the config keys it takes as flags."""

    run: Callable[[argparse.Namespace, SpecForgeConfig], int]
    help: str
    keys: tuple[str, ...]
    """Whole sections (``regenerate``) or single fields (``target.name_or_path``)."""
    positional: tuple[str, ...] = ()
    """Keys taken as optional positional arguments, in order."""
    default_config: str | None = None
    overrides: tuple[str, ...] = ()
    """Settings the stage applies over its config file, before the user's overrides."""


FLAG_NAMES = {
    "target.name_or_path": "target",
    "data.inputs": "data",
    "regenerate.enabled": "regenerate",
    "synthesize.count": "synthesize",
    "capture.dtype": "store-dtype",
    "output_dir": "output-dir",
    "draft.variant": "draft-variant",
    "draft.type": "draft-type",
    "synthesize.temperature": "synthesize-temperature",
    "synthesize.top_p": "synthesize-top-p",
    "synthesize.batch_size": "synthesize-batch-size",
    "synthesize.seed": "synthesize-seed",
}
"""Flags whose name is not the field's own (``--target`` for ``target.name_or_path``). Two
fields of one stage whose names meet must be told apart here: a clash is an error when the
parser is built, never settled by the order of the sections."""

QUICKSTART_FLAG_NAMES = {"output_dir": "output"}


def config_fields(key: str) -> list[tuple[str, Any, str]]:
    """``(dotted key, type, docstring)`` of every field of a section (``regenerate``), of one
    field (``target.name_or_path``), or of a top-level field (``output_dir``). A section's own
    sections (``train.on_policy``) have no flags: dotted overrides set them; a family's section
    (``draft.<name>``, :func:`specforge.families.sections`) has, as its options did before the
    sections."""
    root = typing.get_type_hints(SpecForgeConfig)
    section, _, name = key.rpartition(".")
    if not section and dataclasses.is_dataclass(root[key]):
        section, name = key, ""
    holder = root[section] if section else SpecForgeConfig
    return _fields_of(holder, f"{section}." if section else "", name)


def _fields_of(holder: type, prefix: str, name: str = "") -> list[tuple[str, Any, str]]:
    hints, docs = typing.get_type_hints(holder), field_docs(holder)
    found = []
    for f in dataclasses.fields(holder):
        if name and f.name != name:
            continue
        if hints[f.name] in sections().values():
            found += _fields_of(hints[f.name], f"{prefix}{f.name}.")
        elif not dataclasses.is_dataclass(hints[f.name]):
            found.append((prefix + f.name, hints[f.name], docs.get(f.name, "")))
    return found


def _integer_or_word(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def _argument_kwargs(field_type: Any) -> dict[str, Any]:
    """argparse settings for a config field's type (bool, int, float, str, Literal, list)."""
    origin = typing.get_origin(field_type)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(field_type) if a is not type(None)]
        if len(options) > 1:  # e.g. ``int | Literal["auto"]``: the config check decides
            return {"type": _integer_or_word}
        (field_type,) = options
        origin = typing.get_origin(field_type)
    if field_type is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(typing.get_args(field_type))}
    if origin is list:
        (item,) = typing.get_args(field_type)
        return {"nargs": "+", "type": item}
    return {"type": field_type}


FLAG_DEST = "config:"
"""Prefix of the argparse destinations that hold config values (``config:data.limit``)."""


def add_config_arguments(parser: argparse.ArgumentParser, stage: Stage, names: dict) -> None:
    """One flag per config field the stage reads (positionals for ``stage.positional``).

    Raises:
        ValueError: two fields would get the same flag (name one of them in ``names``).
    """
    used: dict[str, str] = {}
    for key in stage.keys:
        for dotted, field_type, doc in config_fields(key):
            kwargs = _argument_kwargs(field_type)
            doc = doc.replace("``", "").replace("%", "%%")
            kwargs.update(default=None, help=f"{doc} ({dotted})" if doc else dotted)
            if kwargs.get("action") is None and "choices" not in kwargs:
                kwargs["metavar"] = dotted.rpartition(".")[2].upper()
            if dotted in stage.positional:
                parser.add_argument(FLAG_DEST + dotted, nargs="?", **kwargs)
            else:
                name = names.get(dotted, dotted.rpartition(".")[2])
                if name in used:
                    raise ValueError(
                        f"--{name} would set both {used[name]} and {dotted}: give one of them "
                        "its own flag name in FLAG_NAMES"
                    )
                used[name] = dotted
                parser.add_argument(
                    "--" + name.replace("_", "-"), dest=FLAG_DEST + dotted, **kwargs
                )


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The flags that were given, as dotted overrides (JSON-quoted: strings stay strings)."""
    return [
        f"{dest.removeprefix(FLAG_DEST)}={json.dumps(value)}"
        for dest, value in vars(args).items()
        if dest.startswith(FLAG_DEST) and value is not None
    ]


# ---------------------------------------------------------------------------------------------
# The stages


def _run_prepare(args: argparse.Namespace, cfg: SpecForgeConfig) -> int:
    from specforge.recipes.prepare import prepare

    result = prepare(cfg)
    print(f"\nwrote {result.output}")
    for section in ("synthesize", "regenerate", "tokens", "vocab", "timings_s"):
        if section in result.stats:
            print(f"\n{section}")
            for key, value in result.stats[section].items():
                print(f"  {key:<28} {value}")
    return 0


def _run_capture(args: argparse.Namespace, cfg: SpecForgeConfig) -> int:
    if args.verify:
        from specforge.data.hidden_states import read_manifest, verify_capture

        problems = verify_capture(args.verify)
        manifest = read_manifest(args.verify)
        for problem in problems:
            print(f"  {problem}")
        print(
            f"{args.verify}: {len(manifest['shards'])} shards, {manifest['num_samples']} samples, "
            f"{manifest['num_tokens']} tokens: {'OK' if not problems else 'BROKEN'}"
        )
        return 0 if not problems else 1
    from specforge.recipes.capture import capture

    result = capture(cfg)
    if result.manifest is not None:
        manifest = json.loads(result.manifest.read_text())
        print(
            f"\nwrote {result.manifest}: {len(manifest['shards'])} shards "
            f"({result.shards_written} now, {result.shards_skipped} already complete), "
            f"{manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
            f"{manifest['bytes'] / 2**20:.1f} MiB, {manifest['bytes_per_token']} bytes/token"
        )
        rate = result.tokens_captured / max(result.seconds, 1e-9)
        print(
            f"captured {result.tokens_captured} tokens in {result.seconds:.1f} s ({rate:.0f} tok/s)"
        )
    return 0


def _run_train(args: argparse.Namespace, cfg: SpecForgeConfig) -> int:
    from specforge.recipes.train import train

    upstream = getattr(args, "upstream", None)
    if upstream is not None:
        for note in upstream.notes:
            logging.getLogger("specforge.upstream").info(note)
        if upstream.prepare_from:
            cfg = _prepared_upstream_data(cfg, upstream.prepare_from)
    result = train(cfg)
    if result.checkpoint is not None:
        print(f"\ncheckpoint: {result.checkpoint}")
        for split, metrics in (("train", result.train), ("eval", result.eval)):
            shown = {k: round(v, 4) for k, v in metrics.items() if not k.startswith("cond")}
            print(f"{split}: {shown}")
    return 0


def _prepared_upstream_data(cfg: SpecForgeConfig, path: str) -> SpecForgeConfig:
    """``cfg`` training on SpecForge's raw ``--train-data-path``, prepared (the target's chat
    template, nothing regenerated) into ``<output_dir>/conversations.jsonl`` unless a run
    already did; under torchrun rank 0 prepares while the others wait for the file (a failure
    on rank 0 ends them all)."""
    from specforge.recipes.prepare import prepare

    if cfg.train.data_path:
        raise UserError(
            f"--train-data-path {path} and train.data_path {cfg.train.data_path} both name "
            "the training data: give one"
        )
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, inputs=[path]),
        regenerate=dataclasses.replace(cfg.regenerate, enabled=False),
        synthesize=dataclasses.replace(cfg.synthesize, count=0),
    )
    prepared = cfg.conversations_path
    if not prepared.is_file():
        if int(os.environ.get("RANK", "0")) == 0:
            prepare(cfg)
        while not prepared.is_file():
            time.sleep(2)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, data_path=str(prepared)))


def _run_export(args: argparse.Namespace, cfg: SpecForgeConfig) -> int:
    from specforge.recipes.export import export

    out = export(cfg)
    print(f"exported -> {out}")
    for path in sorted(out.iterdir()):
        print(f"  {path.name:<28} {path.stat().st_size:>12,d} bytes")
    return 0


def _run_bench(args: argparse.Namespace, cfg: SpecForgeConfig) -> int:
    from specforge.recipes.bench import bench

    result = bench(cfg)
    print((cfg.bench_dir / "bench.md").read_text())
    print(f"wrote {cfg.bench_dir}/bench.json, bench.md")
    return 0 if result["turns"] else 1


def _run_quickstart(args: argparse.Namespace, cfg: SpecForgeConfig) -> int:
    from specforge.recipes.quickstart import quickstart

    result = quickstart(cfg)
    bench = result.bench
    print((cfg.bench_dir / "bench.md").read_text())
    print(f"questions: {bench['settings']['questions']}   export: {cfg.export_dir}")
    print(
        f"accept length tau = {bench['tau']:.2f}   speedup = {bench['speedup']:.2f}x over the "
        f"target alone ({bench['speedup_vs_hf_generate']:.2f}x over HF generate)   "
        f"identical to the target: {bench['all_match']}"
    )
    print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in result.seconds.items()))
    return 0


STAGES = {
    "prepare": Stage(
        _run_prepare,
        "read conversations (files, HF datasets, or the built-in prompts), optionally "
        "self-distill them with the target, write OpenAI-messages JSONL and token statistics",
        ("target", "data", "regenerate", "synthesize", "vocab", "prepare"),
    ),
    "capture": Stage(
        _run_capture,
        "run the target once over the conversations and write sharded safetensors + "
        "manifest.json for offline training (rerun after an interruption: complete shards are "
        "kept; under torchrun each rank captures its own shards)",
        ("target", "data", "capture"),
    ),
    "train": Stage(
        _run_train,
        "train a draft of the family --draft-type names (the registry's: "
        f"{', '.join(REGISTRY)}) with its objective (online: the target runs in the step; "
        "offline: data.mode=offline); under torchrun every rank runs this command",
        ("train", "draft", "output_dir"),
    ),
    "export": Stage(
        _run_export,
        "write a checkpoint as the directory SGLang and vLLM load (the layout of its draft's "
        "family), checked against the contract",
        (
            "export",
            "target.trust_remote_code",
            "output_dir",
            "bench.url",
            "bench.vllm_python",
            "bench.questions",
            "bench.agreement_margin",
        ),
        positional=("export.checkpoint", "export.output"),
    ),
    "bench": Stage(
        _run_bench,
        "accept length and speedup of an exported draft vs the target alone (and prompt "
        "lookup) on the same prompts, greedy, batch size 1",
        ("bench", "engine", "target.name_or_path", "target.device", "target.trust_remote_code"),
    ),
    "quickstart": Stage(
        _run_quickstart,
        "prepare, train, export and bench the embedded default (SmolLM2-135M) on the CPU",
        (
            "output_dir",
            "quickstart.minutes",
            "bench.questions",
            "bench.max_new_tokens",
            "bench.num_steps",
        ),
        default_config=DEFAULT_RECIPE,
        overrides=QUICKSTART_OVERRIDES,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specforge", description="Train and evaluate EAGLE-3 draft models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, stage in STAGES.items():
        description = stage.help[0].upper() + stage.help[1:] + "."
        # train lists the upstream flags it maps as a table (kept as written)
        upstream = name == "train"
        p = sub.add_parser(
            name,
            help=stage.help,
            description=textwrap.fill(description, 100) if upstream else description,
            epilog=help_table() if upstream else None,
            formatter_class=(
                argparse.RawDescriptionHelpFormatter if upstream else argparse.HelpFormatter
            ),
        )
        p.add_argument(
            "--config",
            default=stage.default_config,
            help="YAML recipe: a file or the name of a shipped recipe (see configs/)",
        )
        names = FLAG_NAMES | (QUICKSTART_FLAG_NAMES if name == "quickstart" else {})
        add_config_arguments(p, stage, names)
        if name == "capture":
            p.add_argument("--verify", metavar="DIR", help="re-check the capture in DIR and exit")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
        p.set_defaults(stage=stage)
    return parser


_SECTIONS = frozenset(f.name for f in dataclasses.fields(SpecForgeConfig))
"""The config's top-level names: the first part of a dotted override."""


def is_override(word: str) -> bool:
    """Whether a command-line word is a dotted override: ``section.field=value`` for a section
    of the config, or ``output_dir=value``. Such a word is never a flag's value, so a list flag
    (``--data a.jsonl``) cannot swallow the override after it."""
    key, sep, _ = word.partition("=")
    section = key.partition(".")[0]
    if not sep or not key.replace(".", "").replace("_", "").isalnum():
        return False
    return key == "output_dir" or ("." in key and section in _SECTIONS)


PASSTHROUGH_FLAGS = {"--vllm-args": "bench.vllm_args"}
"""List flags whose words are another program's flags: each takes every word after it, leading
dashes and all, up to the next flag of the stage's own or a dotted override
(``--vllm-args --no-enforce-eager --max-num-seqs 1 --limit 3``: the first three are vLLM's)."""


def _take_passthrough(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list, dict]:
    """``argv`` without the :data:`PASSTHROUGH_FLAGS` and their words, and ``{dotted key:
    words}`` for each given (``--vllm-args=--flag`` takes that one word and the ones after)."""
    command = next((word for word in argv if word in STAGES), None)
    if command is None:
        return argv, {}
    stages = parser._subparsers._group_actions[0].choices  # argparse keeps subparsers here
    own = set(stages[command]._option_string_actions) - set(PASSTHROUGH_FLAGS)
    kept: list[str] = []
    taken: dict[str, list[str]] = {}
    words = iter(argv)
    for word in words:
        flag, sep, first = word.partition("=")
        if flag not in PASSTHROUGH_FLAGS:
            kept.append(word)
            continue
        values = taken.setdefault(PASSTHROUGH_FLAGS[flag], [])
        values += [first] if sep else []
        for word in words:
            if word.partition("=")[0] in own or is_override(word):
                kept.append(word)
                break
            values.append(word)
    return kept, taken


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a ``specforge`` command line, the dotted overrides (:func:`is_override`) taken out
    first wherever they stand; for ``train``, SpecForge's and speculators' launch flags
    rewritten first (:func:`specforge.upstream.translate`).

    Raises:
        UserError: a word no parser knows, or an upstream flag refused (:func:`main` prints
            it in one line naming the stage).
    """
    command = next((i for i, word in enumerate(argv) if word in STAGES), None)
    upstream = None
    if command is not None and argv[command] == "train":
        upstream = translate(argv[command + 1 :])
        argv = [*argv[: command + 1], *upstream.argv]
    parser = build_parser()
    argv, passed = _take_passthrough(argv, parser)
    overrides = [word for word in argv if is_override(word)]
    args, unknown = parser.parse_known_args([word for word in argv if not is_override(word)])
    for dotted, words in passed.items():
        if not words:
            raise UserError(f"{dotted} needs at least one word after its flag")
        setattr(args, FLAG_DEST + dotted, words)
    if unknown:
        raise UserError(
            f"unrecognized arguments: {' '.join(unknown)} (specforge {args.command} --help "
            "lists its flags)"
        )
    args.overrides = [*overrides, *args.overrides]
    args.upstream = upstream
    return args


def flag_table() -> dict[str, dict[str, str]]:
    """Every subcommand's config flags, ``{stage: {flag: dotted key}}`` (a positional argument
    as ``<dotted key>``): what the documentation lists and a snapshot test pins."""
    parser = build_parser()
    stages = parser._subparsers._group_actions[0].choices  # argparse keeps subparsers here
    return {
        stage: {
            (action.option_strings or [f"<{action.dest.removeprefix(FLAG_DEST)}>"])[0]: (
                action.dest.removeprefix(FLAG_DEST)
            )
            for action in sub._actions
            if action.dest.startswith(FLAG_DEST)
        }
        for stage, sub in stages.items()
    }


def stage_config(args: argparse.Namespace) -> SpecForgeConfig:
    """The config a subcommand runs with: the file, the stage's own settings, the overrides,
    then the flags."""
    return load_config(args.config, [*args.stage.overrides, *args.overrides, *flag_overrides(args)])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except UserError as err:  # a flag no parser knows, or an upstream flag refused
        command = next((word for word in argv if word in STAGES), "")
        print(f"specforge {command}: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.stage.run(args, stage_config(args))
    except UserError as err:
        if args.verbose:
            raise
        print(f"specforge {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:
        print(f"specforge {args.command}: {err}", file=sys.stderr)
        return 128 + err.signum
    except KeyboardInterrupt:
        if args.verbose:
            raise
        print(f"specforge {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
