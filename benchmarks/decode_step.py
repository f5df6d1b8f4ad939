"""What one decode step of self-distillation costs at each batch size: the continuous batcher
(``regenerate.backend: continuous``) on the embedded default, every row decoding to the end.

    python benchmarks/decode_step.py --device cuda --batch-sizes 1 64 256 1024 \\
        --output outputs/bench/decode_step.json

For each batch size B: B built-in prompts (repeated when B is larger than the split) are
answered twice with no end-of-turn ids, so every row runs its whole length: once for
``--warm-up`` tokens and once for ``--warm-up + --steps``. The difference over the extra decode
steps is the cost of a decode step at that batch (prefill and joining cancel out); its tokens/s
is B over that (each batch size runs once untimed first: a CPU library picks its kernels per
shape on first use). It says how large ``regenerate.batch_size`` should be on a device: where the
step's time stays flat as B grows, the step is bound by launches or host work, not the model's
arithmetic. ``--profile B`` prints PyTorch's profiler tables of one more whole run at that
batch (prefill included). Run it alone on a CPU: a second CPU-heavy process slows PyTorch many
times over.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
from common import parse_smoke, profiled

from specforge.config import TargetConfig
from specforge.data.chat import pad_id_of, prompt_ids
from specforge.data.prompts import builtin_conversations
from specforge.engine.generation import ContinuousBatcher, GenerationSettings, Request
from specforge.models.target import load_target
from specforge.results import write_result


def answer(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, int]:
    """Seconds and decode steps for every prompt answered with exactly ``new_tokens`` tokens."""
    settings = GenerationSettings(
        max_new_tokens=new_tokens, eos_ids=[], pad_id=pad_id, max_batch_size=len(prompts)
    )
    batcher = ContinuousBatcher(model, settings)
    requests = [Request(key=i, prompt=p) for i, p in enumerate(prompts)]
    sync(model)
    start = time.perf_counter()
    for _ in batcher.run(requests):
        pass
    sync(model)
    return time.perf_counter() - start, batcher.steps


def sync(model) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--warm-up", type=int, default=8, help="tokens of the shorter run")
    parser.add_argument("--steps", type=int, default=32, help="extra decode steps timed")
    parser.add_argument("--profile", type=int, default=0, help="a batch size to profile")
    parser.add_argument("--output", default="outputs/bench/decode_step.json")
    args = parse_smoke(parser, batch_sizes=[1, 2], warm_up=2, steps=2)
    if args.smoke and args.profile:  # profile a batch size the smoke run has
        args.profile = args.batch_sizes[-1]
    for name in ("warm_up", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")

    target = TargetConfig(name_or_path=args.target, device=args.device, dtype=args.dtype)
    model, tokenizer = load_target(target)
    pad = pad_id_of(tokenizer, model.generation_config)
    split = [
        prompt_ids(tokenizer, [{"role": "user", "content": c.messages[0]["content"]}])
        for c in builtin_conversations("train")
    ]
    answer(model, split[:2], args.warm_up, pad)  # lazy initialisation, kernels chosen
    rows = []
    for batch in args.batch_sizes:
        prompts = [split[i % len(split)] for i in range(batch)]
        answer(model, prompts, args.warm_up, pad)  # this batch's shapes: kernels chosen
        short, short_steps = answer(model, prompts, args.warm_up, pad)
        long, long_steps = answer(model, prompts, args.warm_up + args.steps, pad)
        step = (long - short) / (long_steps - short_steps)
        rows.append(
            {
                "batch": batch,
                "mean_prompt_tokens": round(sum(map(len, prompts)) / batch, 1),
                "step_ms": round(1000 * step, 2),
                "tokens_per_s": round(batch / step, 1),
            }
        )
        print(
            f"batch {batch:5d}: {1000 * step:8.2f} ms a decode step, {batch / step:9.1f} tokens/s",
            flush=True,
        )
        if batch == args.profile:
            with profiled(next(model.parameters()).device):
                answer(model, prompts, args.warm_up + args.steps, pad)
    cuda = next(model.parameters()).device.type == "cuda"
    device = torch.cuda.get_device_name() if cuda else platform.machine()
    report = {
        "device": f"{args.device} ({device}), {os.cpu_count()} cores, torch {torch.__version__}",
        "dtype": args.dtype,
        "warm_up_tokens": args.warm_up,
        "timed_steps": args.steps,
        "rows": rows,
    }
    write_result(args.output, report)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
