"""The fastest plain decoding the stack offers for the target, on this device: HF ``generate``
with its dynamic cache (what ``specforge bench`` times as the target alone), the same with
PyTorch's default linear instead of the prepacked one (``dynamic-unpacked``; see
``target.prepack_linear``), with a static cache, with a static cache plus ``torch.compile``, and
a hand-written greedy loop (``loop``: one forward per token on a growing in-place cache, the
last position's logits only, none of ``generate``'s machinery), and the engine the speculative
runtime verifies with (``engine``: a cache written by slot, the layers in one loop;
``engine+compile``: the same through ``torch.compile``, what ``specforge bench`` times as the
target alone); tokens/s and whether each output equals the dynamic cache's. JSON + a table.

    python benchmarks/baseline_decoding.py --questions question.jsonl --limit 5

Greedy, batch size 1, the bench's dtype and attention (grouped-query sdpa). Every method is
warmed up on a short prompt first (compilation happens there, and is reported apart). Run it
alone: a second CPU-heavy process slows PyTorch many times over.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from common import parse_smoke

from specforge.config import load_config
from specforge.data.chat import end_of_turn_ids, pad_id_of, prompt_ids
from specforge.data.questions import load_questions, resolve_question_set
from specforge.engine.cpu.packed_linear import default_linears
from specforge.engine.target import TargetEngine
from specforge.models.adapter import text_config
from specforge.models.kv_cache import cache_kwargs, growing_cache
from specforge.models.target import default_aux_layer_ids, load_target
from specforge.results import write_result
from specforge.serving.bench import compiled_generate_kwargs, greedy_generate


@torch.no_grad()
def plain_loop(model, ids: torch.Tensor, max_new_tokens: int, eos: list[int]) -> list[int]:
    """Greedy decoding by hand: the forward the speculative runtime verifies with, one token
    at a time."""
    cache, out = growing_cache(), []
    logits = model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
    while True:
        out.append(int(logits[0, -1].argmax()))
        if out[-1] in eos or len(out) >= max_new_tokens:
            return out
        step = torch.tensor([[out[-1]]], device=ids.device)
        logits = model(step, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits


def method_kwargs(name: str) -> dict:
    """``generate`` keyword arguments of each decoding method."""
    if name in ("dynamic", "dynamic-unpacked"):
        return {}
    if name == "static":
        return {"cache_implementation": "static", "disable_compile": True}
    return compiled_generate_kwargs()  # what specforge bench's target alone runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--questions", default="builtin-eval")
    parser.add_argument("--limit", type=int, default=5, help="first turns of the first N")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["dynamic", "static+compile", "loop", "engine", "engine+compile"],
    )
    parser.add_argument("--output", default="outputs/bench/baseline_decoding.json")
    args = parse_smoke(parser, limit=1, max_new_tokens=8)
    cfg = load_config(None, [f"target.name_or_path={args.target}", f"target.dtype={args.dtype}"])
    model, tokenizer = load_target(cfg.target, dtype=args.dtype)
    eos = end_of_turn_ids(tokenizer, model.generation_config)
    pad = pad_id_of(tokenizer, model.generation_config)
    source = resolve_question_set(args.questions)
    prompts = [
        torch.tensor([prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}])])
        for q in load_questions(source, limit=args.limit)
    ]

    aux = default_aux_layer_ids(text_config(model.config).num_hidden_layers)
    engines = {
        name: TargetEngine(model, aux_layer_ids=aux, compile=name == "engine+compile")
        for name in ("engine", "engine+compile")
        if name in args.methods
    }

    def generate(ids, name):
        if name == "loop":
            return plain_loop(model, ids, args.max_new_tokens, eos)
        if name in engines:
            return engines[name].generate(
                ids, max_new_tokens=args.max_new_tokens, eos_token_ids=eos
            )
        unpacked = default_linears(model) if name == "dynamic-unpacked" else nullcontext()
        with unpacked:
            return greedy_generate(
                model,
                ids,
                args.max_new_tokens,
                eos_token_ids=eos,
                pad_token_id=pad,
                **method_kwargs(name),
            )

    rows, reference = [], None
    for name in args.methods:
        start = time.perf_counter()
        generate(prompts[0][:, :16], name)  # warm-up (and compilation)
        generate(prompts[0][:, :16], name)
        warm_up = time.perf_counter() - start
        outputs, seconds = [], 0.0
        for ids in prompts:
            start = time.perf_counter()
            outputs.append(generate(ids, name))
            seconds += time.perf_counter() - start
        reference = reference or outputs
        tokens = sum(len(o) for o in outputs)
        rows.append(
            {
                "method": name,
                "tokens": tokens,
                "tokens_per_s": round(tokens / seconds, 2),
                "warm_up_s": round(warm_up, 1),
                "identical_to_dynamic": outputs == reference,
                **({"engine": engines[name].stats.as_dict()} if name in engines else {}),
            }
        )
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_dynamic"] = round(row["tokens_per_s"] / base, 3)
    write_result(Path(args.output), {"settings": vars(args) | {"questions": source}, "rows": rows})
    print("\n| method | tokens/s | vs dynamic | warm-up s | identical |\n|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['vs_dynamic']:.2f}x | "
            f"{r['warm_up_s']:.1f} | {r['identical_to_dynamic']} |"
        )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
