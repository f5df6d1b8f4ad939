"""Online training throughput of a recipe: tokens/s and peak memory, written as JSON + a table.

    python benchmarks/train_throughput.py --config configs/smollm2-135m-eagle3.yaml --steps 40

Runs ``--steps`` optimizer steps of the recipe (target forward + TTT unroll + backward + AdamW)
in a scratch output folder, discards the first ``--warmup`` steps, and reports the training
tokens (real, unpadded input tokens) per second over the rest, with the process's peak RSS
(target + draft + activations) and, on CUDA, the peak allocated GPU memory. The recipe's
prepared conversations are used; run ``specforge prepare --config ...`` first.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import tempfile
from pathlib import Path

import torch

from specforge.config import load_config, resolve_auto
from specforge.io import read_jsonl
from specforge.recipes.train import train
from specforge.results import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-135m-eagle3.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--output", default="outputs/bench/train_throughput.json")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    base = load_config(args.config, args.overrides)
    data = base.train.data_path or str(base.conversations_path)
    if not Path(data).exists():
        raise SystemExit(f"{data} is missing: run `specforge prepare --config {args.config}`")
    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(
            args.config,
            [
                *args.overrides,
                f"output_dir={scratch}",
                f"train.data_path={data}",
                f"train.max_steps={args.steps}",
                "train.max_minutes=null",  # the steps above, not the recipe's time cap
                f"train.log_every={args.warmup}",
                "train.eval_fraction=0",
                f"train.save_every={args.steps}",
            ],
        )
        if torch.cuda.is_available() and cfg.target.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        train(cfg)
        records = read_jsonl(Path(scratch) / "metrics.jsonl")
        windows = [r for r in records if r["split"] == "train"][1:]
    tokens_per_s = sum(w["tokens_per_s"] for w in windows) / len(windows)
    result = {
        "config": args.config,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "device": cfg.target.device,
        "target_dtype": resolve_auto(cfg).target.dtype,
        "train_dtype": resolve_auto(cfg).train.dtype,
        "ttt_length": cfg.train.ttt_length,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "max_length": cfg.data.max_length,
        "batch_size": cfg.train.batch_size,
        "measured_steps": args.steps - args.warmup,
        "tokens_per_s": round(tokens_per_s, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if torch.cuda.is_available() and cfg.target.device.startswith("cuda"):
        result["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    write_result(args.output, result)
    print("\n| metric | value |\n|---|---|")
    for key, value in result.items():
        print(f"| {key} | {value} |")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
