"""The GPU checks of the runtime and data-engine issues in one bounded run on a CUDA machine:
each stage a subprocess with its own time limit, its log beside a summary JSON; the run exits
non-zero naming the stages that failed or timed out.

    python benchmarks/cuda_checks.py --draft outputs/quickstart/export \\
        --questions question.jsonl --data outputs/quickstart/conversations.jsonl \\
        --output outputs/cuda --quickstart-minutes 20

Stages, in order of what a short run on a GPU should get first:

0. ``engine``: ``benchmarks/engine_speedup.py`` on CUDA: the compiled engine's warm-up (cold
   and warm cache), the target alone through HF ``generate``, the engine eager and compiled (CUDA
   graphs), and the draft under ``auto`` against the compiled target alone (``--limit``
   questions);
1. ``adaptive``: ``benchmarks/adaptive_depth.py`` on CUDA, fixed chain depths 1-7 and ``auto``
   (the runtime issue's table; ``--limit`` questions); then ``round profile`` and ``round
   profile without cudnn``: a chain of 5 on the first question under PyTorch's profiler, with every
   attention kernel and without cuDNN's (on an H100 a bf16 draft step took 15 ms in a bench
   round against 1.5 ms expected);
2. ``decode step``: ``benchmarks/decode_step.py`` on CUDA, one decode step of continuous
   batching at 1-1024 rows, with the profiler's table at 256;
3. ``regeneration``: ``benchmarks/prepare_stages.py --device cuda``: self-distillation of
   ``--regenerate-prompts`` prompts of ``--prompts`` (GSM8K's train questions, say) with
   ``regenerate.batch_size: auto``, through the engine's row-slot cache and CUDA graphs;
4. ``train``: ``benchmarks/train_throughput.py`` of the long recipe on CUDA on ``--data``
   (prepared conversations): batch 1 (the recipe's) and a ``--batch-tokens`` budget, the TTT
   step eager and compiled; then ``real size``: ``benchmarks/real_size.py``, a
   Llama-3.1-8B-shaped target with random weights (training, capture and the runtime's round
   costs);
5. ``gpu recipe`` (with ``--quickstart-minutes``): ``specforge quickstart`` of
   ``configs/smollm2-135m-eagle3-gpu.yaml`` within that budget (its prompts written 4000 at a
   time and answered with ``regenerate.batch_size: auto``, training on 16k-token
   micro-batches): each stage's tokens/s (``conversations.stats.json``, ``metrics.jsonl``) and the
   resulting MT-Bench ``tau``.

A stage that fails or runs out of time is recorded and the next one runs. Stages without their
input (no ``--draft`` for 0 and 1, no ``--data`` for 4) are skipped; ``--only`` names the stages
to run when the GPU time at hand is too short for all of them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import parse_smoke

from specforge.processes import run_group
from specforge.results import write_result

GPU_RECIPE = "configs/smollm2-135m-eagle3-gpu.yaml"


def stages(args) -> list[tuple[str, list[str], float]]:
    """(name, command, seconds allowed) of every stage this run has the inputs for."""
    out, py = Path(args.output), sys.executable
    runs = []
    target = ["--target", args.target]
    if args.draft:
        runs.append(
            (
                "engine",
                [py, "benchmarks/engine_speedup.py", *target, "--draft", args.draft, "--device"]
                + [args.device, "--questions", args.questions, "--limit", str(args.limit)]
                + ["--eager-limit", str(args.eager_limit), "--output", str(out / "engine_speedup")],
                args.seconds[0],
            )
        )
        depths = [str(d) for d in range(1, 8)]
        runs.append(
            (
                "adaptive",
                [py, "benchmarks/adaptive_depth.py", *target, "--draft", args.draft]
                + ["--questions", args.questions, "--limit", str(args.limit)]
                + ["--settings", *depths, "auto", "--output", str(out / "adaptive_depth.json")]
                + [f"target.device={args.device}"],
                args.seconds[0],
            )
        )
        for name, kernels in (("", []), (" without cudnn", ["flash", "efficient", "math"])):
            runs.append(
                (
                    f"round profile{name}",
                    [py, "benchmarks/adaptive_depth.py", *target, "--draft", args.draft]
                    + ["--profile"]
                    + ["--questions", args.questions, "--limit", "1", "--settings", "5"]
                    + (["--sdpa-backends", *kernels] if kernels else [])
                    + ["--output", str(out / f"round_profile{len(kernels)}.json")]
                    + [f"target.device={args.device}"],
                    args.seconds[0],
                )
            )
    runs.append(
        (
            "decode step",
            [py, "benchmarks/decode_step.py", *target, "--device", args.device, "--profile", "256"]
            + ["--batch-sizes", "1", "64", "256", "1024"]
            + ["--output", str(out / "decode_step.json")],
            args.seconds[1],
        )
    )
    prompts = ["--conversations", args.prompts] if args.prompts else []
    runs.append(
        (
            "regeneration",
            [py, "benchmarks/prepare_stages.py", "--device", args.device, *prompts]
            + ["--limit", str(args.regenerate_prompts), "--batch-size", "auto"]
            + ["--paths", "continuous", "--output", str(out / "prepare_stages.json")],
            args.seconds[1],
        )
    )
    if args.data:
        runs.append(
            (
                "train",
                [py, "benchmarks/train_throughput.py", "--config", args.recipe]
                + ["--batch-tokens", str(args.batch_tokens), "--steps", "20", "--warmup", "5"]
                + ["--only", f"{args.batch_tokens} tokens, eager"]
                + [f"{args.batch_tokens} tokens, compiled"]
                + ["--output", str(out / "train_throughput.json")]
                + [f"target.device={args.device}", f"train.data_path={args.data}"],
                args.seconds[2],
            )
        )
        runs.append(
            (
                "real size",
                [py, "benchmarks/real_size.py", "--device", args.device, "--data", args.data]
                + ["--output", str(out / "real_size"), "--seconds", str(args.seconds[2])],
                4 * args.seconds[2],
            )
        )
    if args.quickstart_minutes:
        runs.append(
            (
                "gpu recipe",
                [py, "-m", "specforge.cli", "quickstart", "--config", GPU_RECIPE]
                + ["--output", str(out / "gpu"), "--questions", args.questions]
                + ["--minutes", str(args.quickstart_minutes), f"target.device={args.device}"]
                + [f"bench.limit={args.limit}"],
                # the budget, plus loading and the bench's own estimate's slack
                60 * args.quickstart_minutes * 1.2 + 60,
            )
        )
    if args.smoke:  # every script stage at its own smallest sizes
        runs = [
            (name, command[:2] + ["--smoke"] + command[2:], seconds)
            if command[1].startswith("benchmarks/")
            else (name, command, seconds)
            for name, command, seconds in runs
        ]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", help="an export directory (stage 1)")
    parser.add_argument("--questions", default="builtin-eval")
    parser.add_argument("--limit", type=int, default=5, help="questions for stages 1 and 5")
    parser.add_argument(
        "--eager-limit", type=int, default=2, help="first turns timed eagerly in stage 0"
    )
    parser.add_argument("--data", help="prepared conversations (stage 4)")
    parser.add_argument("--recipe", default="configs/smollm2-135m-eagle3-long.yaml")
    parser.add_argument(
        "--prompts", help="conversations whose prompts stage 3 answers (default: the built-in)"
    )
    parser.add_argument("--regenerate-prompts", type=int, default=4096)
    parser.add_argument(
        "--batch-tokens", type=int, default=16384, help="training's token budget (stage 4)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        nargs=3,
        default=[300, 300, 120],
        metavar=("ADAPTIVE", "REGENERATION", "TRAIN"),
        help="time allowed for stage 1, each of 2 and 3, and each run of 4",
    )
    parser.add_argument("--quickstart-minutes", type=float, default=0, help="0: no stage 5")
    parser.add_argument("--device", default="cuda", help="where the target runs")
    parser.add_argument(
        "--only", nargs="+", metavar="STAGE", help="run these stages alone (default: every one)"
    )
    parser.add_argument("--output", default="outputs/cuda")
    parser.add_argument(
        "--target", default="smollm2-135m", help="the target of the bench and decode stages"
    )
    args = parse_smoke(parser, limit=1, eager_limit=1, regenerate_prompts=4, batch_tokens=256)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    runs = stages(args)
    known = [name for name, _, _ in runs]
    unknown = sorted(set(args.only or []) - set(known))
    if unknown:
        parser.error(f"unknown stages {unknown}; this run has {known}")
    summary = []
    for name, command, seconds in runs:
        if args.only and name not in args.only:
            continue
        log = out / f"{name.replace(' ', '_')}.log"
        start = time.perf_counter()
        with log.open("w") as sink:
            rc = run_group(command, stdout=sink, stderr=subprocess.STDOUT, timeout=seconds)
            rc = "timed out" if rc is None else rc
        took = time.perf_counter() - start
        summary.append({"stage": name, "returncode": rc, "seconds": round(took, 1)})
        print(f"{name}: {rc} after {took:.0f} s (log: {log})", flush=True)
        write_result(out / "cuda_checks.json", {"stages": summary, "argv": sys.argv})
    print(json.dumps(summary, indent=1))
    failed = [row["stage"] for row in summary if row["returncode"] != 0]
    if failed:
        raise SystemExit(f"stages that failed: {failed} (their logs are in {out})")


if __name__ == "__main__":
    main()
