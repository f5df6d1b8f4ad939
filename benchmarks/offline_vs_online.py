"""Offline vs online EAGLE-3 training on the embedded default: capture throughput, bytes per
token on disk, training tokens/s, peak memory, and accuracies after the same number of steps.

    python benchmarks/offline_vs_online.py --data ../shared/data/gsm8k/train.jsonl

1. the first ``--limit`` conversations of ``--data`` (GSM8K's question/answer records, or any
   conversations file) are written once as OpenAI-messages JSONL, so both modes see the same
   samples and ids;
2. ``capture``: ``specforge capture`` stores them (bf16);
3. ``offline``: ``--steps`` training steps from the capture (no target model in memory);
4. ``online``: the same steps with the target running inside each step.

Each stage runs in its own process, so each peak RSS is that stage's alone. Training tokens/s
are real (unpadded) input tokens per second, averaged over the logged windows after the first
(which holds start-up). ``acc_0 avg 151-200`` is the mean train ``acc_0`` of the windows that
cover steps 151-200 (with 200 steps and ``log_every`` 10). Bytes per token: the manifest's
measured figure, the formula ``5 + 3*H*b + f*H*b`` (``b`` bytes per element, ``f`` the share of
positions whose next token is under the loss mask), and the projection of both to H = 4096
(Llama-3.1-8B) against the layout that stores aux (3H) and last hidden (H) for every token
(``8*H`` bytes per token in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import torch

from specforge.config import load_config
from specforge.data.sources import load_conversations
from specforge.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from specforge.results import write_result

STAGES = ("capture", "offline", "online")


def stage_config(args: argparse.Namespace, stage: str):
    out = Path(args.output)
    overrides = [
        f"target.name_or_path={args.target}",
        "target.dtype=bfloat16",
        f"data.inputs=[{out / 'conversations.jsonl'}]",
        f"data.max_length={args.max_length}",
        f"capture.output={out / 'capture'}",
        "capture.dtype=bfloat16",
        f"train.data_path={out / 'conversations.jsonl'}",
        f"output_dir={out / stage}",
        "vocab.draft_vocab_size=8192",
        "train.ttt_length=7",
        "train.batch_size=1",
        "train.dtype=bfloat16",
        f"train.max_steps={args.steps}",
        f"train.lr={args.lr}",
        "train.warmup_steps=20",
        "train.log_every=10",
        f"train.eval_every={args.steps}",
        f"train.save_every={args.steps}",
        "train.eval_fraction=0.05",
        f"data.mode={'online' if stage == 'online' else 'offline'}",
    ]
    return load_config(None, overrides)


def run_stage(args: argparse.Namespace) -> None:
    """One stage in this process; writes ``<output>/<stage>.json``."""
    cfg = stage_config(args, args.stage)
    result: dict = {"stage": args.stage}
    if args.stage == "capture":
        from specforge.recipes.capture import capture

        done = capture(cfg)
        manifest = json.loads(done.manifest.read_text())
        result.update(
            seconds=round(done.seconds, 1),
            tokens=done.tokens_captured,
            tokens_per_s=round(done.tokens_captured / done.seconds, 1),
            manifest={k: v for k, v in manifest.items() if k != "shards"},
            shards=len(manifest["shards"]),
        )
    else:
        from specforge.recipes.train import train

        train(cfg)
        records = read_jsonl(Path(cfg.output_dir) / "metrics.jsonl")
        windows = [r for r in records if r["split"] == "train"]
        late = [r for r in windows if 150 < r["step"] <= 200]
        result.update(
            tokens_per_s=round(sum(w["tokens_per_s"] for w in windows[1:]) / len(windows[1:]), 1),
            train_acc_0_avg_151_200=round(sum(r["acc_0"] for r in late) / len(late), 4)
            if late
            else None,
            final_train=windows[-1],
            final_eval=[r for r in records if r["split"] == "eval"][-1],
        )
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    write_json_atomic(Path(args.output) / f"{args.stage}.json", result)


def bytes_per_token(hidden: int, itemsize: int, last_fraction: float) -> float:
    return 5 + 3 * hidden * itemsize + last_fraction * hidden * itemsize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="GSM8K train.jsonl or a conversations file")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--limit", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--output", default="outputs/bench/offline_vs_online")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        run_stage(args)
        return

    out = Path(args.output)
    conversations = load_conversations([args.data], limit=args.limit)
    write_jsonl_atomic(out / "conversations.jsonl", (c.to_json() for c in conversations))
    results = {}
    for stage in STAGES:
        cmd = [sys.executable, __file__, "--stage", stage, *sys.argv[1:]]
        subprocess.run(cmd, check=True)
        results[stage] = json.loads((out / f"{stage}.json").read_text())

    manifest = results["capture"]["manifest"]
    hidden = manifest["target"]["hidden_size"]
    fraction = manifest["num_last_positions"] / manifest["num_tokens"]
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "settings": {
            "target": args.target,
            "data": args.data,
            "conversations": len(conversations),
            "max_length": args.max_length,
            "batch_size": 1,
            "ttt_length": 7,
            "draft_vocab_size": 8192,
            "dtype": "bfloat16",
            "steps": args.steps,
            "lr": args.lr,
        },
        "capture_tokens_per_s": results["capture"]["tokens_per_s"],
        "capture_tokens": manifest["num_tokens"],
        "capture_bytes": manifest["bytes"],
        "bytes_per_token": manifest["bytes_per_token"],
        "bytes_per_token_formula": round(bytes_per_token(hidden, 2, fraction), 1),
        "last_hidden_fraction": round(fraction, 4),
        "full_layout_bytes_per_token": 8 * hidden,
        "llama8b_bytes_per_token": round(bytes_per_token(4096, 2, fraction), 1),
        "llama8b_full_layout_bytes_per_token": 8 * 4096,
        "offline_tokens_per_s": results["offline"]["tokens_per_s"],
        "online_tokens_per_s": results["online"]["tokens_per_s"],
        "peak_rss_mb": {stage: results[stage]["peak_rss_mb"] for stage in STAGES},
        "offline_train_acc_0_avg_151_200": results["offline"]["train_acc_0_avg_151_200"],
        "online_train_acc_0_avg_151_200": results["online"]["train_acc_0_avg_151_200"],
        "eval": {
            stage: {
                k: results[stage]["final_eval"][k]
                for k in ("step", "loss", "acc_0", "acc_1", "tau_pred")
            }
            for stage in ("offline", "online")
        },
        "stages": results,
    }
    write_result(out / "summary.json", summary)
    print("\n| metric | value |\n|---|---|")
    for key, value in summary.items():
        if key not in ("stages", "settings"):
            print(f"| {key} | {value} |")
    print(f"\nwrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
