"""Time every step of the prepare stage on the embedded default target and write JSON + a table.

    python benchmarks/prepare_stages.py --limit 16 --output outputs/bench/prepare_stages.json

Steps: converting the GGUF to an HF folder (in a fresh cache, first load), loading the cached
folder (every later load), self-distillation of the same prompts in the same run along these
paths: ``today`` (fixed batches, ``regenerate.backend: static``, ``--baseline-batch-size``, in
``--dtype``, with HF's own ``sdpa`` attention and PyTorch's default linear layers, as when the
issue was filed), ``static, ours`` (the same batches on the attention and the prepacked linear
layers ``load_target`` installs), ``continuous`` (continuous batching, ``--batch-size``,
same dtype), ``new`` (continuous batching in ``--new-dtype``; the same run as ``continuous``
when the dtypes agree) and, with ``--compare-row-spans``, ``new`` with the other decode
attention spans than ``regenerate.rows_per_span: auto`` gives (``one span`` over the whole batch
on a CPU, ``16-row spans`` on a GPU), with ``--compare-decode-kernel``, ``continuous, SDPA``
(decode steps' attention through PyTorch's SDPA instead of the CPU kernel,
``regenerate.decode_kernel: off``), with generated
tokens/s, their ratios to today's, how many answers are token-identical to today's, and how
often decode -> re-encode differs from the generated ids; with ``--synthesize N``, the target
writing N prompts with the top-p nucleus found among its top candidates and by ranking the
whole vocabulary (a top-k over all of it, which costs what the earlier full sort did; same
seeds); building (first use) or loading the CPU decode attention kernel, outside the
regeneration timings; tokenization with loss masks (conversations/s), and
the vocabulary map. ``--device cuda`` runs the target on a GPU. Run it alone: a second
CPU-heavy process slows PyTorch many times over.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from common import parse_smoke

from specforge.config import RegenerateConfig, SynthesizeConfig, TargetConfig
from specforge.data.chat import end_of_turn_ids, tokenize_conversations
from specforge.data.conversations import Conversation
from specforge.data.prompts import builtin_conversations
from specforge.data.sources import load_conversations
from specforge.data.vocab import build_vocab_map, count_token_frequencies
from specforge.distill.regenerate import regenerate_conversations
from specforge.distill.synthesize import synthesize_conversations
from specforge.engine import generation
from specforge.engine.cpu.decode_kernel import load_decode_kernel
from specforge.engine.generation import CPU_ROWS_PER_SPAN, default_rows_per_span
from specforge.io import read_jsonl
from specforge.models.target import embedded_target_dir, load_target
from specforge.results import write_result

TODAY, STATIC_OURS, SAME_DTYPE, NEW, ONE_SPAN, SDPA_DECODE = (
    "today",
    "static, ours",
    "continuous",
    "new",
    "one span",
    "continuous, SDPA",
)


class RegenerationPath(NamedTuple):
    backend: str
    batch_size: int
    dtype: str
    rows_per_span: int | str
    attention: str | None = None
    """``target.attn_implementation`` (None: what ``load_target`` installs)."""
    prepack: bool = True
    """``target.prepack_linear``."""
    decode_kernel: str = "auto"
    """``regenerate.decode_kernel``."""


def paths(args) -> dict[str, RegenerationPath]:
    """The regeneration paths compared, by name."""
    spans = RegenerateConfig.rows_per_span
    runs = {
        TODAY: RegenerationPath(
            "static", args.baseline_batch_size, args.dtype, spans, "sdpa", prepack=False
        ),
        STATIC_OURS: RegenerationPath("static", args.baseline_batch_size, args.dtype, spans),
        SAME_DTYPE: RegenerationPath("continuous", args.batch_size, args.dtype, spans),
    }
    if args.new_dtype != args.dtype:
        runs[NEW] = RegenerationPath("continuous", args.batch_size, args.new_dtype, spans)
    if args.compare_row_spans:  # the other choice than auto's on this device
        auto = default_rows_per_span(torch.device(args.device), args.batch_size)
        other = args.batch_size if auto < args.batch_size else CPU_ROWS_PER_SPAN
        name = ONE_SPAN if other >= args.batch_size else f"{other}-row spans"
        runs[name] = RegenerationPath("continuous", args.batch_size, args.new_dtype, other)
    if args.compare_decode_kernel:
        runs[SDPA_DECODE] = RegenerationPath(
            "continuous", args.batch_size, args.new_dtype, spans, decode_kernel="off"
        )
    return runs


def time_synthesis(model, tokenizer, count: int) -> dict:
    """The target writes ``count`` prompts (``synthesize`` defaults: temperature 1, top-p 0.95)
    twice from the same seeds: with the nucleus found among ``NUCLEUS_CANDIDATES`` top tokens,
    and with every row's whole vocabulary ranked (a top-k over all of it: 92 ms for 64 rows of
    49152 on a 2-core CPU, against 95 ms for the earlier full sort)."""
    reports, prompts = {}, {}
    top_candidates = generation.NUCLEUS_CANDIDATES
    for name, candidates in (("sorted", model.config.vocab_size), ("top", top_candidates)):
        generation.NUCLEUS_CANDIDATES = candidates
        try:
            with tempfile.TemporaryDirectory() as work:
                conversations, report = synthesize_conversations(
                    model, tokenizer, Path(work) / "x.jsonl", SynthesizeConfig(count=count)
                )
        finally:
            generation.NUCLEUS_CANDIDATES = top_candidates
        reports[name] = report.as_dict()
        prompts[name] = [c.messages[0]["content"] for c in conversations]
    rate = {n: r["generated_tokens"] / r["seconds"] for n, r in reports.items()}
    return {
        "reports": reports,
        "speedup": round(rate["top"] / rate["sorted"], 2),
        "identical": sum(a == b for a, b in zip(prompts["sorted"], prompts["top"], strict=True)),
        "top_candidates": top_candidates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=16, help="built-in prompts to self-distill")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--batch-size",
        type=lambda value: value if value == "auto" else int(value),
        default=64,
        help="continuous: rows in flight (auto: regenerate.batch_size's auto)",
    )
    parser.add_argument("--baseline-batch-size", type=int, default=16, help="static batches")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--new-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the new path's dtype (the CPU recipe's is dtype auto: bf16 on CPUs with bf16 "
        "instructions, else float32)",
    )
    parser.add_argument(
        "--compare-row-spans",
        action="store_true",
        help="also run the new path with the other decode attention spans than "
        "regenerate.rows_per_span's auto: over the whole batch (one span) on a CPU, "
        f"{CPU_ROWS_PER_SPAN}-row spans elsewhere",
    )
    parser.add_argument(
        "--compare-decode-kernel",
        action="store_true",
        help="also run the new path with decode attention through PyTorch's SDPA "
        "(regenerate.decode_kernel off)",
    )
    parser.add_argument(
        "--synthesize",
        type=int,
        default=0,
        metavar="N",
        help="also time the target writing N prompts (top-p sampling) with the nucleus found "
        "among the top candidates and by ranking the whole vocabulary (as the earlier sort did)",
    )
    parser.add_argument(
        "--conversations", help="prompts from this conversations file (default: the built-in ones)"
    )
    parser.add_argument(
        "--paths", nargs="+", help=f"the regeneration paths to run (default: all; {TODAY!r} first)"
    )
    parser.add_argument("--device", default="cpu", help="the target's device (cpu, cuda)")
    parser.add_argument("--output", default="outputs/bench/prepare_stages.json")
    args = parse_smoke(parser, limit=2, max_new_tokens=8)
    unknown = sorted(set(args.paths or []) - set(paths(args)))
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {list(paths(args))}")
    rows: list[tuple[str, float | None, str]] = []  # None: a ratio row

    with tempfile.TemporaryDirectory() as fresh_cache:
        os.environ["SPECFORGE_CACHE"] = fresh_cache
        start = time.perf_counter()
        folder = embedded_target_dir("smollm2-135m", args.dtype)
        convert_s = time.perf_counter() - start
        size_mb = sum(f.stat().st_size for f in folder.iterdir()) / 1e6
        rows.append(("convert GGUF -> HF folder (first use)", convert_s, f"{size_mb:.0f} MB"))
        start = time.perf_counter()
        model, tokenizer = load_target(
            TargetConfig(str(folder), dtype=args.dtype, device=args.device)
        )
        rows.append(("load cached target", time.perf_counter() - start, args.dtype))

        synthesis = time_synthesis(model, tokenizer, args.synthesize) if args.synthesize else {}
        for name, report in synthesis.get("reports", {}).items():
            rows.append(
                (
                    f"synthesize {args.synthesize} prompts, {name}",
                    report["seconds"],
                    f"{report['generated_tokens'] / report['seconds']:.0f} generated tok/s, "
                    f"{report['attempts']} attempts",
                )
            )
        if synthesis:
            rows.append(
                (
                    "synthesis: top candidates / sorted",
                    None,
                    f"{synthesis['speedup']:.2f}x tokens/s; {synthesis['identical']}/"
                    f"{args.synthesize} prompts identical",
                )
            )

        start = time.perf_counter()
        kernel, missing = load_decode_kernel()
        kernel_note = "ready" if kernel is not None else f"unavailable: {missing}"
        rows.append(
            ("decode attention kernel (build or load)", time.perf_counter() - start, kernel_note)
        )
        if args.conversations:
            conversations = load_conversations([args.conversations], limit=args.limit)
        else:
            conversations = builtin_conversations("train")[: args.limit]
        models = {(args.dtype, None, True): model}
        reports, answers = {}, {}
        runs = {name: run for name, run in paths(args).items() if name in (args.paths or [name])}
        for path, run in runs.items():
            backend, batch_size, dtype, rows_per_span, attention, prepack, kernel_mode = run
            if (dtype, attention, prepack) not in models:
                models[dtype, attention, prepack], _ = load_target(
                    TargetConfig(
                        str(folder),
                        dtype=dtype,
                        attn_implementation=attention,
                        prepack_linear=prepack,
                        device=args.device,
                    )
                )
            cfg = RegenerateConfig(
                enabled=True,
                backend=backend,
                max_new_tokens=args.max_new_tokens,
                batch_size=batch_size,
                rows_per_span=rows_per_span,
                decode_kernel=kernel_mode,
            )
            with tempfile.TemporaryDirectory() as work:
                output = Path(work) / "distilled.jsonl"
                report = regenerate_conversations(
                    models[dtype, attention, prepack], tokenizer, conversations, output, cfg
                )
                records = read_jsonl(output)
            reports[path], answers[path] = report, records
            rows.append(
                (
                    f"self-distill {len(conversations)} prompts, {path}",
                    report.seconds,
                    f"{report.generated_tokens / report.seconds:.0f} generated tok/s",
                )
            )
        compared = [path for path in runs if path != TODAY] if TODAY in runs else []
        new = next(path for path in (NEW, SAME_DTYPE, *runs) if path in runs)
        written = [Conversation.from_record(r) for r in answers[new]]
        rate = {path: r.generated_tokens / r.seconds for path, r in reports.items()}
        identical = {
            path: sum(
                a["meta"]["token_ids"] == b["meta"]["token_ids"]
                for a, b in zip(answers[TODAY], answers[path], strict=True)
            )
            for path in compared
        }
        for path in compared:
            report = reports[path]
            rows.append(
                (
                    f"{path} / {TODAY}",
                    None,
                    f"{rate[path] / rate[TODAY]:.2f}x tokens/s; {identical[path]}/"
                    f"{len(conversations)} conversations token-identical; re-encode differs in "
                    f"{report.reencode_mismatch_turns}/{report.turns} answers",
                )
            )

        start = time.perf_counter()
        samples, stats = tokenize_conversations(tokenizer, written, max_length=2048)
        tokenize_s = time.perf_counter() - start
        rows.append(
            ("tokenize + loss masks", tokenize_s, f"{len(written) / tokenize_s:.0f} conv/s")
        )
        start = time.perf_counter()
        counts = count_token_frequencies(
            ((s.input_ids, s.loss_mask) for s in samples), model.config.vocab_size
        )
        build_vocab_map(counts, 8192, always_include=end_of_turn_ids(tokenizer))
        rows.append(("vocab map (8192)", time.perf_counter() - start, ""))

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "decode_kernel": kernel_note,
        "regenerate": {path: r.as_dict() for path, r in reports.items()},
        "regenerate_speedup": {p: round(rate[p] / rate[TODAY], 2) for p in compared},
        "regenerate_identical_conversations": identical,
        "synthesize": synthesis,
        "tokens": stats.as_dict(),
        "cached_target_mb": round(size_mb, 1),
        "steps": [
            {"step": name, "seconds": None if s is None else round(s, 2), "note": note}
            for name, s, note in rows
        ],
    }
    write_result(args.output, result)
    print("\n| step | seconds | note |\n|---|---:|---|")
    for name, seconds, note in rows:
        print(f"| {name} | {'' if seconds is None else f'{seconds:.1f}'} | {note} |")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
