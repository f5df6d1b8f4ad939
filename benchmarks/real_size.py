"""Real-size costs on a Llama-3.1-8B-shaped target with random weights (nothing downloaded):
online training tokens/s and peak memory, capture tokens/s and bytes a token, and the
speculative runtime's round costs at batch 1, so users can size their runs.

    python benchmarks/real_size.py --device cuda --data conversations.jsonl \\
        --output outputs/real_size

1. ``target``: ``LlamaForCausalLM`` with Llama-3.1-8B's geometry (4096 hidden, 32 layers, 32
   query and 8 key-value heads, 14336 MLP, a 128256-token vocabulary, bf16), randomly
   initialised and saved once under ``--output`` with ``--tokenizer``'s tokenizer (SmolLM2's
   by default: its ids are a subset of the vocabulary; its chat template renders the data), so
   every stage loads it as a user's model;
2. ``train``: ``benchmarks/train_throughput.py`` with ``configs/llama3.1-8b-eagle3.yaml`` on
   it, micro-batches of ``--batch-tokens``, the TTT step eager (``train.compile: auto`` on a
   GPU: compiling SmolLM2's step had not finished after three minutes on an H200);
3. ``capture``: the capture recipe's forward and serialization over ``--capture-limit``
   conversations, timed without loading the model: tokens/s and bytes a token on disk;
4. ``runtime``: a draft trained two steps (its weights do not matter: every figure is a cost),
   exported, and ``specforge bench --num-steps auto`` on one built-in question in bf16: the
   calibration's target time a token and verification, draft and extension times a round.

Random weights make the accept length meaningless; nothing here reports one. SGLang reports
158 tokens/s for Llama-3.1-8B-Instruct alone on one H100 at batch 1 (MT-Bench) and 373 with
its EAGLE-3 draft; ``sglang`` in the JSON says so beside ours. ``--scale tiny`` runs every stage
on a few-layer model of the same kind (a check of the script on a CPU, not a figure).
Each stage is a subprocess with its own log and time limit; a failed stage is recorded and
the next one runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import parse_smoke

from specforge.config import TargetConfig, load_config
from specforge.io import write_json_atomic
from specforge.processes import run_group
from specforge.results import write_result

LLAMA_31_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
}
RECIPE = "configs/llama3.1-8b-eagle3.yaml"
SGLANG = {
    "source": "docs.sglang.io, speculative decoding: Llama-3.1-8B-Instruct, MT-Bench, 1x H100",
    "target alone tokens/s": 158.34,
    "EAGLE-3 tokens/s": 373.25,
}


def build_target(args) -> Path:
    """The random-weight target folder (written once)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specforge.models.target import load_tokenizer

    folder = Path(args.output) / "target"
    if (folder / "config.json").exists():
        return folder
    shape = LLAMA_31_8B if args.scale == "8b" else TINY
    tokenizer = load_tokenizer(TargetConfig(name_or_path=args.tokenizer))
    config = LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = folder.with_name("target.partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)
    return folder


def overrides(args, folder: Path) -> list[str]:
    """What every stage adds to the recipe."""
    return [
        f"target.name_or_path={folder}",
        f"target.device={args.device}",
        f"train.data_path={args.data}",
        f"data.max_length={args.max_length}",
    ]


def capture_stage(args) -> dict:
    """Stage 3 in this process: the capture forward's tokens/s and bytes a token."""
    from specforge.data.chat import pad_id_of, set_chat_template, tokenize_conversations
    from specforge.data.sources import load_conversations
    from specforge.models.target import load_target, resolve_aux_layer_ids
    from specforge.recipes.capture import capture_shard

    cfg = load_config(RECIPE, overrides(args, Path(args.output) / "target"))
    model, tokenizer = load_target(cfg.target)
    set_chat_template(tokenizer, cfg.data.chat_template)
    conversations = load_conversations([args.data], limit=args.capture_limit)
    samples, _ = tokenize_conversations(
        tokenizer, conversations, max_length=args.max_length, system_prompt=cfg.data.system_prompt
    )
    aux = resolve_aux_layer_ids(None, model.config.num_hidden_layers)
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    payload = capture_shard(
        model,
        sorted(samples, key=lambda s: -len(s.input_ids)),
        aux_layer_ids=aux,
        dtype=torch.bfloat16,
        batch_tokens=cfg.capture.batch_tokens,
        max_batch_size=cfg.capture.max_batch_size,
        pad_id=pad_id_of(tokenizer, model.generation_config),
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(s.input_ids) for s in samples)
    result = {
        "conversations": len(samples),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "bytes_per_token": round(len(payload) / tokens, 1),
    }
    if on_cuda:
        result["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return result


def stages(args, folder: Path) -> list[tuple[str, list[list[str]], float]]:
    """(name, commands run in order, seconds allowed) of stages 2-4."""
    out, py, extra = Path(args.output), sys.executable, overrides(args, folder)
    budget = str(args.batch_tokens)
    train = [py, "benchmarks/train_throughput.py", "--config", RECIPE, "--batch-tokens", budget]
    train += ["--only", f"{budget} tokens, eager"]
    train += ["--steps", "20", "--warmup", "5", "--output", str(out / "train.json"), *extra]
    runtime_cfg = [*extra, f"output_dir={out / 'draft'}", "train.max_steps=2"]
    runtime_cfg += ["train.eval_fraction=0", "train.save_every=2", "bench.dtype=bfloat16"]
    cli = [py, "-m", "specforge.cli"]
    return [
        ("train", [train], args.seconds),
        ("capture", [[py, __file__, *sys.argv[1:], "--stage", "capture"]], args.seconds),
        (
            "runtime",
            [
                [*cli, "train", "--config", RECIPE, *runtime_cfg],
                [*cli, "export", "--config", RECIPE, *runtime_cfg],
                [*cli, "bench", "--config", RECIPE, "--num-steps", "auto"]
                + ["--questions", "builtin-eval", *runtime_cfg, "bench.limit=1"],
            ],
            args.seconds,
        ),
    ]


def run(name: str, commands: list[list[str]], seconds: float, out: Path) -> dict:
    """Run a stage's commands in order (logged), within ``seconds`` in all."""
    log, start, code = out / f"{name}.log", time.perf_counter(), 0
    with log.open("w") as sink:
        for command in commands:
            left = seconds - (time.perf_counter() - start)
            code = run_group(command, stdout=sink, stderr=subprocess.STDOUT, timeout=max(left, 1))
            code = "timed out" if code is None else code
            if code != 0:
                break
    took = round(time.perf_counter() - start, 1)
    print(f"{name}: {code} after {took:.0f} s (log: {log})", flush=True)
    return {"returncode": code, "seconds": took}


def figures(out: Path, capture: dict | None) -> dict:
    """The stages' figures from their outputs (what finished)."""
    found: dict = {}
    train = out / "train.json"
    if train.exists():
        found["train"] = json.loads(train.read_text())["variants"]
    if capture:
        found["capture"] = capture
    bench = out / "draft" / "bench" / "bench.json"
    if bench.exists():
        found["runtime"] = json.loads(bench.read_text()).get("calibration")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--data", required=True, help="prepared conversations (OpenAI messages)")
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument("--scale", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--capture-limit", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=600, help="time allowed a stage")
    parser.add_argument("--output", default="outputs/real_size")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    args = parse_smoke(parser, scale="tiny", batch_tokens=256, max_length=128, capture_limit=4)
    out = Path(args.output)
    if args.stage == "capture":
        write_json_atomic(out / "capture.json", capture_stage(args))
        return
    out.mkdir(parents=True, exist_ok=True)
    folder = build_target(args)
    summary = {}
    for name, commands, seconds in stages(args, folder):
        summary[name] = run(name, commands, seconds, out)
    capture_file = out / "capture.json"
    capture = json.loads(capture_file.read_text()) if capture_file.exists() else None
    write_result(
        out / "real_size.json",
        {
            "scale": args.scale,
            "device": args.device,
            "batch_tokens": args.batch_tokens,
            "stages": summary,
            **figures(out, capture),
            "sglang": SGLANG,
        },
    )
    print(json.dumps(summary, indent=1))
    print(f"wrote {out / 'real_size.json'}")


if __name__ == "__main__":
    main()
