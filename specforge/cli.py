"""The ``specforge`` command: one subcommand per pipeline stage.

Every subcommand takes ``--config FILE.yaml`` plus dotted overrides (``data.max_length=1024``);
its own flags are shorthands for the most used overrides and win over both.

    specforge prepare --target smollm2-135m --regenerate --limit 16 --output data.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from specforge.config import ConfigError, load_config

ONEDNN_PRIMITIVE_CACHE_CAPACITY = "16"
"""oneDNN (PyTorch's CPU matmul library) caches a compiled primitive per matmul shape, 1,024 by
default. Training's shapes change with every sequence length (and the loss's counted rows), so
on CPU the cache grew a run's memory by about 1 GB per 100 steps; 16 entries cost no speed here."""


def configure_process() -> None:
    """Process-wide settings, before the first matmul; an environment value set by the user
    wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE_CAPACITY)


def _prepare_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="read conversations, optionally self-distill them with the target, print statistics",
        description="Read conversations (files, HF datasets, or the built-in prompts when none "
        "are given), optionally regenerate the assistant turns with the target, write them as "
        "OpenAI-messages JSONL and print token statistics.",
    )
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--target", help="HF model id, local folder, or smollm2-135m")
    p.add_argument("--data", nargs="+", metavar="SOURCE", help=".json/.jsonl files or HF datasets")
    p.add_argument("--output", help="conversations JSONL to write")
    p.add_argument(
        "--regenerate", action="store_true", help="answer every user turn with the target"
    )
    p.add_argument("--limit", type=int, help="use only the first N conversations")
    p.add_argument("--max-new-tokens", type=int, help="answer length limit when regenerating")
    p.add_argument("--batch-size", type=int, help="conversations generated together")
    p.add_argument("--max-length", type=int, help="tokens per training sample")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", help="torch device for the target")
    p.add_argument("--draft-vocab-size", type=int)
    p.add_argument("--vocab-output", help="also write the draft vocabulary map (safetensors)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.set_defaults(run=_run_prepare)


PREPARE_FLAGS = {
    "target": "target.name_or_path",
    "output": "prepare.output",
    "limit": "data.limit",
    "max_new_tokens": "regenerate.max_new_tokens",
    "batch_size": "regenerate.batch_size",
    "max_length": "data.max_length",
    "dtype": "target.dtype",
    "device": "target.device",
    "draft_vocab_size": "vocab.draft_vocab_size",
    "vocab_output": "prepare.vocab_output",
}


def _flag_overrides(args: argparse.Namespace, table: dict[str, str]) -> list[str]:
    """Turn set flags into dotted overrides (JSON-quoted so strings stay strings)."""
    return [
        f"{key}={json.dumps(getattr(args, flag))}"
        for flag, key in table.items()
        if getattr(args, flag) is not None
    ]


def _run_prepare(args: argparse.Namespace) -> int:
    from specforge.prepare import prepare

    overrides = list(args.overrides) + _flag_overrides(args, PREPARE_FLAGS)
    if args.data:
        overrides.append(f"data.inputs={json.dumps(args.data)}")
    if args.regenerate:
        overrides.append("regenerate.enabled=true")
    cfg = load_config(args.config, overrides)
    result = prepare(cfg)
    print(f"\nwrote {result.output}")
    _print_stats(result.stats)
    return 0


def _print_stats(stats: dict) -> None:
    for section in ("regenerate", "tokens", "vocab", "timings_s"):
        if section not in stats:
            continue
        print(f"\n{section}")
        for key, value in stats[section].items():
            print(f"  {key:<28} {value}")


def _capture_parser(sub) -> None:
    p = sub.add_parser(
        "capture",
        help="capture the target's hidden states to sharded safetensors (offline training)",
        description="Run the frozen target over the conversations once and write sharded "
        "safetensors + manifest.json for `data.mode: offline` training. Rerun the same command "
        "after an interruption: complete shards are kept. Under torchrun each rank captures "
        "its own shards. With --verify DIR, re-check a capture's checksums and shapes instead.",
    )
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--target", help="HF model id, local folder, or smollm2-135m")
    p.add_argument("--data", nargs="+", metavar="SOURCE", help="conversations (.jsonl, HF, ...)")
    p.add_argument("--output", help="capture directory (default OUTPUT_DIR/hidden_states)")
    p.add_argument("--limit", type=int, help="use only the first N conversations")
    p.add_argument("--max-length", type=int, help="tokens per sample (longer are truncated)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="target dtype")
    p.add_argument("--store-dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", help="torch device for the target")
    p.add_argument("--shard-size-mb", type=float)
    p.add_argument("--verify", metavar="DIR", help="re-check the capture in DIR and exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.set_defaults(run=_run_capture)


CAPTURE_FLAGS = {
    "target": "target.name_or_path",
    "output": "capture.output",
    "limit": "data.limit",
    "max_length": "data.max_length",
    "dtype": "target.dtype",
    "store_dtype": "capture.dtype",
    "device": "target.device",
    "shard_size_mb": "capture.shard_size_mb",
}


def _run_capture(args: argparse.Namespace) -> int:
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
    from specforge.capture import capture

    overrides = list(args.overrides) + _flag_overrides(args, CAPTURE_FLAGS)
    if args.data:
        overrides.append(f"data.inputs={json.dumps(args.data)}")
    result = capture(load_config(args.config, overrides))
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


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train an EAGLE-3 draft with training-time test (online: the target runs in the step)",
        description="Train an EAGLE-3 draft. Under torchrun every rank runs this command; DDP "
        "uses gloo on CPU and nccl on CUDA.",
    )
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--output-dir")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.set_defaults(run=_run_train)


TRAIN_FLAGS = {"max_steps": "train.max_steps", "output_dir": "output_dir"}


def _run_train(args: argparse.Namespace) -> int:
    from specforge.trainer.train import train

    overrides = list(args.overrides) + _flag_overrides(args, TRAIN_FLAGS)
    if args.resume:
        overrides.append("train.resume=true")
    result = train(load_config(args.config, overrides))
    if result["checkpoint"] is not None:
        print(f"\ncheckpoint: {result['checkpoint']}")
        for split in ("train", "eval"):
            shown = {k: round(v, 4) for k, v in result[split].items() if not k.startswith("cond")}
            print(f"{split}: {shown}")
    return 0


def _export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a training checkpoint for SGLang / vLLM (checked against the contract)",
        description="Write CHECKPOINT as a LlamaForCausalLMEagle3 directory that SGLang loads "
        "with --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT (and vLLM).",
    )
    p.add_argument("checkpoint", help="a checkpoint folder, e.g. OUTPUT_DIR/checkpoints/step_1500")
    p.add_argument("output", help="the export directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    from specforge.serving.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.output, dtype=args.dtype)
    print(f"exported {args.checkpoint} -> {out}")
    for path in sorted(out.iterdir()):
        print(f"  {path.name:<28} {path.stat().st_size:>12,d} bytes")
    return 0


def _bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="accept length and speedup of an exported draft vs the target alone (MT-Bench)",
        description="Run the target alone, prompt-lookup decoding and the EAGLE-3 runtime on the "
        "same prompts (greedy, batch size 1) and write bench.json / bench.md / bench.png.",
    )
    p.add_argument("--target", required=True, help="HF model id, local folder, or smollm2-135m")
    p.add_argument("--draft", help="an export directory (specforge export); builtin engine")
    p.add_argument(
        "--engine",
        default="builtin",
        choices=["builtin", "sglang"],
        help="builtin: our runtime vs the target alone; sglang: a running server",
    )
    p.add_argument(
        "--url", help="SGLang server URL for --engine sglang, e.g. http://127.0.0.1:30000"
    )
    p.add_argument(
        "--questions",
        default="builtin-eval",
        help="FastChat question.jsonl, an HF dataset name "
        "(HuggingFaceH4/mt_bench_prompts), a conversations file, or builtin-eval",
    )
    p.add_argument("--num-steps", type=int, default=5)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--system-prompt", help="default: the chat template's own")
    p.add_argument("--limit", type=int, help="first N questions only")
    p.add_argument("--output", default="outputs/bench")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    from specforge.serving.bench import BenchSettings, run_bench

    if args.engine == "sglang":
        return _run_sglang_bench(args)
    if not args.draft:
        raise ValueError("--draft EXPORT_DIR is required with --engine builtin")
    settings = BenchSettings(
        target=args.target,
        draft=args.draft,
        questions=args.questions,
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        device=args.device,
        system_prompt=args.system_prompt,
        limit=args.limit,
        output=args.output,
    )
    result = run_bench(settings)
    print((Path(args.output) / "bench.md").read_text())
    print(f"wrote {args.output}/bench.json, bench.md, bench.png")
    return 0 if result["turns"] else 1


def _quickstart_parser(sub) -> None:
    p = sub.add_parser(
        "quickstart",
        help="prepare, train, export and bench the embedded default (SmolLM2-135M) on this CPU",
        description="The whole pipeline on the embedded default, offline: self-distill the "
        "built-in prompts, train the default recipe, export to OUTPUT/export, then measure the "
        "accept length and speedup (MT-Bench when reachable, else held-out built-in prompts).",
    )
    p.add_argument("--output", default="outputs/quickstart")
    p.add_argument("--questions", help="MT-Bench question.jsonl (or any question set)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-steps", type=int, default=5)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted recipe overrides")
    p.set_defaults(run=_run_quickstart)


def _run_quickstart(args: argparse.Namespace) -> int:
    from specforge.quickstart import quickstart

    result = quickstart(
        args.output,
        questions=args.questions,
        max_new_tokens=args.max_new_tokens,
        num_steps=args.num_steps,
        overrides=args.overrides,
    )
    print((Path(args.output) / "bench" / "bench.md").read_text())
    q = result["quickstart"]
    print(f"questions: {q['questions']}   export: {args.output}/export")
    print(
        f"accept length tau = {result['tau']:.2f}   speedup = {result['speedup']:.2f}x   "
        f"identical to the target: {result['all_match']}"
    )
    print(
        f"time: prepare+train {q['prepare_and_train_s']:.0f} s, export {q['export_s']:.0f} s, "
        f"bench {q['bench_s']:.0f} s"
    )
    return 0


def _run_sglang_bench(args: argparse.Namespace) -> int:
    from specforge.models.target import load_tokenizer
    from specforge.serving.sglang_client import run_sglang_bench

    if not args.url:
        raise ValueError("--engine sglang needs --url (the running server)")
    result = run_sglang_bench(
        args.url,
        load_tokenizer(args.target),
        args.questions,
        max_new_tokens=args.max_new_tokens,
        output=args.output,
        system_prompt=args.system_prompt,
        limit=args.limit,
    )
    print((Path(args.output) / "bench.md").read_text())
    return 0 if result["turns"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specforge", description="Train and evaluate EAGLE-3 draft models."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _prepare_parser(sub)
    _capture_parser(sub)
    _train_parser(sub)
    _export_parser(sub)
    _bench_parser(sub)
    _quickstart_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_process()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.run(args)
    except (ConfigError, ValueError, OSError) as err:  # OSError: missing files, full disk
        if args.verbose:
            raise
        print(f"specforge {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
