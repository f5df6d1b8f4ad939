"""Online training throughput of a recipe, micro-batches by count or by token budget, the TTT
step eager or compiled: tokens/s and peak memory, written as JSON + a table.

    python benchmarks/train_throughput.py --config configs/smollm2-135m-eagle3.yaml \\
        --steps 40 --batch-tokens 2048 --output docs/results/train_throughput_cpu.json

Each variant runs ``--steps`` optimizer steps of the recipe (target forward + TTT unroll +
backward + AdamW) in a scratch output folder, in its own process (so its peak memory is its
own): ``batch 1`` (one conversation a step, the CPU recipes') and ``--batch-tokens`` (a token
budget, :func:`specforge.data.batching.token_budget_batches`), each with ``train.compile``
``false`` and ``true``; and ``batch 1, kept states (second pass)``: two passes over
``--steps / 2`` conversations with ``train.state_cache_gb``, measured on the second, whose
batches skip the target (its first pass, through the target, beside it). The first
``--warmup`` steps (start-up, compilation) are discarded; the rest give the training tokens
(real, unpadded input tokens) per second, the tokens a step, the process's peak RSS and, on
CUDA, the peak allocated GPU memory. The recipe's prepared conversations are used; run
``specforge prepare --config ...`` first.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import parse_smoke

from specforge.config import load_config
from specforge.config.resolve import resolve_auto
from specforge.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from specforge.recipes.train import train
from specforge.results import write_result

KEPT = "batch 1, kept states (second pass)"
"""The variant that trains two passes over ``--steps / 2`` conversations with
``train.state_cache_gb`` and is measured on its second pass."""


def variants(batch_tokens: int) -> dict[str, list[str]]:
    """Name -> the overrides of each measured variant."""
    batching = {
        "batch 1": ["train.batch_size=1"],
        f"{batch_tokens} tokens": [f"train.batch_tokens={batch_tokens}"],
    }
    table = {
        f"{name}, {mode}": [*overrides, f"train.compile={flag}"]
        for name, overrides in batching.items()
        for mode, flag in (("eager", "false"), ("compiled", "true"))
    }
    table[KEPT] = ["train.batch_size=1", "train.compile=false", "train.state_cache_gb=16"]
    return table


def spread(records: list, count: int) -> list:
    """``count`` records spread over ``records`` (every k-th)."""
    return records[:: max(1, len(records) // count)][:count]


def rate(windows: list[dict], after: int) -> tuple[float, float, int]:
    """Tokens/s and tokens a step over the logged windows that start at step ``after`` or
    later (windows cover the steps since the one before), and the steps they cover."""
    covered = [
        (w, w["step"] - b["step"])
        for b, w in zip(windows[:-1], windows[1:], strict=True)
        if b["step"] >= after
    ]
    steps = sum(n for _, n in covered)
    seconds = sum(w["seconds_per_step"] * n for w, n in covered)
    tokens = sum(w["tokens_per_step"] * n for w, n in covered)
    return tokens / seconds, tokens / steps, steps


def measure(args, name: str, overrides: list[str]) -> dict:
    """One variant in this process: its figures."""
    base = load_config(args.config, args.overrides)
    data = base.train.data_path or str(base.conversations_path)
    half = args.steps // 2
    with tempfile.TemporaryDirectory() as scratch:
        if name == KEPT:  # two passes over half the steps' conversations
            data = Path(scratch) / "pass.jsonl"
            write_jsonl_atomic(
                data, spread(read_jsonl(base.train.data_path or base.conversations_path), half)
            )
        cfg = load_config(
            args.config,
            [
                *args.overrides,
                *overrides,
                f"output_dir={scratch}",
                f"train.data_path={data}",
                f"train.max_steps={args.steps}",
                "train.max_minutes=null",  # the steps above, not the recipe's time cap
                f"train.log_every={args.warmup}",
                "train.eval_fraction=0",
                f"train.save_every={args.steps}",
            ],
        )
        on_cuda = torch.cuda.is_available() and cfg.target.device.startswith("cuda")
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        train(cfg)
        records = read_jsonl(Path(scratch) / "metrics.jsonl")
    windows = [r for r in records if r["split"] == "train"]
    # after the first window (start-up and compilation); the kept variant on its second pass
    tokens_per_s, tokens_per_step, steps = rate(windows, half if name == KEPT else args.warmup)
    resolved = resolve_auto(cfg)
    result = {
        "tokens_per_s": round(tokens_per_s, 1),
        "tokens_per_step": round(tokens_per_step, 1),
        "measured_steps": steps,
        "first_window_s": round(args.warmup * windows[0]["seconds_per_step"], 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "train_dtype": resolved.train.dtype,
        "target_dtype": resolved.target.dtype,
    }
    if name == KEPT:  # the first pass, through the target, for comparison
        result["first_pass_tokens_per_s"] = round(
            rate(windows[: half // args.warmup], args.warmup)[0], 1
        )
    if on_cuda:
        result["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return result


def write_rows(args, base, rows: dict) -> dict:
    """Write the variants run so far (after each one, so a run cut short keeps what it
    measured); returns the measured ones (none: nothing is written)."""
    measured = {name: row for name, row in rows.items() if "returncode" not in row}
    if not measured:
        return measured
    first = next(iter(measured))
    figures = {f"{name} tokens/s": row["tokens_per_s"] for name, row in measured.items()}
    figures.update(
        {f"{name} tokens a step": row["tokens_per_step"] for name, row in measured.items()}
    )
    figures.update(
        {f"{name} failed": row["returncode"] for name, row in rows.items() if name not in measured}
    )
    write_result(
        args.output,
        {
            "config": args.config,
            "overrides": args.overrides,
            "device": base.target.device,
            "ttt_length": base.train.ttt_length,
            "steps": args.steps,
            "warmup": args.warmup,
            "variants": rows,
            "title": f"Training throughput ({base.target.device})",
            "summary": (
                f"`{args.config}` online (target forward + TTT unroll + backward + AdamW), "
                f"{rows[first]['train_dtype']}, after {args.warmup} steps of warm-up: one "
                f"conversation a step against a token budget of {args.batch_tokens}, the TTT "
                "step eager and compiled (train.compile), and a second pass whose target "
                "states were kept from the first (train.state_cache_gb)."
            ),
            "figures": figures,
        },
    )
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-135m-eagle3.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--output", default="outputs/bench/train_throughput.json")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parse_smoke(parser, steps=4, warmup=1, batch_tokens=256)
    if args.steps < 4 * args.warmup or args.steps % (2 * args.warmup):
        parser.error(
            f"--steps ({args.steps}) must be a multiple of twice --warmup ({args.warmup}), "
            "at least four times it (two passes of two windows or more)"
        )
    table = variants(args.batch_tokens)
    unknown = [name for name in args.only or [] if name not in table]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(table)}")
    if args.variant:  # a child process: one variant, its figures to --output
        write_json_atomic(Path(args.output), measure(args, args.variant, table[args.variant]))
        return
    base = load_config(args.config, args.overrides)
    data = base.train.data_path or str(base.conversations_path)
    if not Path(data).exists():
        raise SystemExit(f"{data} is missing: run `specforge prepare --config {args.config}`")
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.only or table:
            child = Path(scratch) / "variant.json"
            command = [sys.executable, __file__, "--variant", name, "--output", str(child)]
            command += ["--config", args.config, "--steps", str(args.steps)]
            command += ["--warmup", str(args.warmup), "--batch-tokens", str(args.batch_tokens)]
            code = subprocess.run([*command, *args.overrides]).returncode
            # a variant that fails (its log above) is recorded; the others still run
            rows[name] = json.loads(child.read_text()) if code == 0 else {"returncode": code}
            write_rows(args, base, rows)
    measured = write_rows(args, base, rows)
    if not measured:
        raise SystemExit(f"every variant failed: {rows}")
    print("\n| variant | tokens/s | tokens a step | first window s | peak RSS MB |")
    print("|---|---:|---:|---:|---:|")
    for name, row in measured.items():
        print(
            f"| {name} | {row['tokens_per_s']} | {row['tokens_per_step']} | "
            f"{row['first_window_s']} | {row['peak_rss_mb']} |"
        )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
