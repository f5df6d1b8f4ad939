"""The compiled engine's honest speedup, in one run: the target alone through HF's default
``generate``, the engine eager and the engine compiled, and an exported draft under the
speculative runtime against the compiled target alone, with the compilation's warm-up from a
cold and from a warm compile cache.

    python benchmarks/engine_speedup.py --draft outputs/quickstart/export \\
        --questions question.jsonl --output outputs/bench/engine_speedup

1. **warm-up**: a fresh process builds the compiled engine and decodes a short prompt (both
   graphs: one token, several), first with an empty ``TORCHINDUCTOR_CACHE_DIR`` (cold), then
   again with the cache that run left (warm);
2. **bench**: ``specforge bench`` on ``--questions`` (every turn; greedy, float32,
   ``--num-steps``), compiled engine, with that warm cache: HF ``generate``, the engine
   compiled, prompt lookup through the same engine (``--prompt-lookup-num-tokens``; 0 skips
   it) and the runtime, each output checked against HF's;
3. **eager**: the engine without compilation on the first turns of the first ``--eager-limit``
   questions, beside HF ``generate`` and the compiled engine on the same prompts.

Run it alone: a second CPU-heavy process slows PyTorch many times over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import parse_smoke

WARM_UP_PROMPT = "Write a haiku about the sea."


def warm_up_seconds(target: str, device: str, cache_dir: str) -> float:
    """Seconds a fresh process takes to build the compiled engine and decode a short prompt
    with compile cache ``cache_dir`` (a subprocess, so nothing is cached in memory; its errors
    go to this process's stderr)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run(
        [sys.executable, __file__, "--warm-up-only", "--target", target, "--device", device],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def _warm_up_here(target_name: str, device: str) -> None:
    """The warm-up subprocess: load the target, build the compiled engine, decode and verify
    once (both graphs), print the seconds from the engine's construction on."""
    import torch

    from specforge.config import load_config
    from specforge.data.chat import prompt_ids
    from specforge.engine.target import TargetEngine
    from specforge.models.adapter import text_config
    from specforge.models.target import default_aux_layer_ids, load_target

    cfg = load_config(None, [f"target.name_or_path={target_name}", f"target.device={device}"])
    model, tokenizer = load_target(cfg.target, dtype="float32")
    messages = [{"role": "user", "content": WARM_UP_PROMPT}]
    ids = torch.tensor([prompt_ids(tokenizer, messages)], device=device)
    start = time.perf_counter()
    aux = default_aux_layer_ids(text_config(model.config).num_hidden_layers)
    engine = TargetEngine(model, aux_layer_ids=aux, compile=True)
    engine.generate(ids, max_new_tokens=4)  # the one-token graph
    cache = engine.new_cache(ids.shape[1] + 8)
    engine.forward(ids, cache)
    engine.forward(ids[:, :6], cache)  # the several-token graph (a verification)
    print(json.dumps({"seconds": time.perf_counter() - start, **engine.stats.as_dict()}))


def eager_rows(
    target_name: str, device: str, questions: str, limit: int, max_new_tokens: int
) -> list:
    """tokens/s of HF ``generate``, the engine eager and the engine compiled on the first turns
    of the first ``limit`` questions, and whether each equals HF's outputs."""
    import torch

    from specforge.config import load_config
    from specforge.data.chat import end_of_turn_ids, pad_id_of, prompt_ids
    from specforge.data.questions import load_questions
    from specforge.engine.target import TargetEngine
    from specforge.models.adapter import text_config
    from specforge.models.target import default_aux_layer_ids, load_target
    from specforge.serving.bench import greedy_generate

    cfg = load_config(None, [f"target.name_or_path={target_name}", f"target.device={device}"])
    model, tokenizer = load_target(cfg.target, dtype="float32")
    eos = end_of_turn_ids(tokenizer, model.generation_config)
    pad = pad_id_of(tokenizer, model.generation_config)
    prompts = [
        torch.tensor(
            [prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}])], device=device
        )
        for q in load_questions(questions, limit=limit)
    ]
    aux = default_aux_layer_ids(text_config(model.config).num_hidden_layers)
    engines = {
        "engine eager": TargetEngine(model, aux_layer_ids=aux, compile=False),
        "engine compiled": TargetEngine(model, aux_layer_ids=aux, compile=True),
    }
    methods = {
        "HF generate": lambda ids: greedy_generate(
            model, ids, max_new_tokens, eos_token_ids=eos, pad_token_id=pad
        ),
        **{
            name: lambda ids, e=engine: e.generate(
                ids, max_new_tokens=max_new_tokens, eos_token_ids=eos
            )
            for name, engine in engines.items()
        },
    }
    rows, reference = [], None
    for name, generate in methods.items():
        generate(prompts[0][:, :16])  # warm-up (compilation)
        start = time.perf_counter()
        outputs = [generate(ids) for ids in prompts]
        seconds = time.perf_counter() - start
        reference = reference or outputs
        tokens = sum(len(o) for o in outputs)
        rows.append([name, round(tokens / seconds, 2), outputs == reference])
    return rows


def lookup_figures(result: dict) -> dict:
    """The prompt-lookup baseline's figures beside the runtime's (none when it was skipped)."""
    if result["speedup_prompt_lookup"] is None:
        return {}
    return {
        "prompt lookup through the engine: tokens/s, tau": (
            f"{result['tokens_per_s']['prompt_lookup']:.2f}, {result['tau_prompt_lookup']:.3f}"
        ),
        "prompt lookup's speedup over the compiled target alone": (
            f"{result['speedup_prompt_lookup']:.2f}x"
        ),
        "runtime's speedup / prompt lookup's": (
            f"{result['speedup'] / result['speedup_prompt_lookup']:.2f}"
        ),
        "prompt lookup's outputs identical": result["prompt_lookup_all_match"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft", help="an export directory (specforge export)")
    parser.add_argument("--questions", default="builtin-eval")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions only")
    parser.add_argument("--num-steps", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--eager-limit", type=int, default=10)
    parser.add_argument("--output", default="outputs/bench/engine_speedup")
    parser.add_argument("--warm-up-only", action="store_true", help=argparse.SUPPRESS)
    args = parse_smoke(parser, limit=1, max_new_tokens=8, eager_limit=1)
    if args.warm_up_only:
        _warm_up_here(args.target, args.device)
        return
    if not args.draft:
        parser.error("--draft is required")
    out = Path(args.output)
    cache_dir = tempfile.mkdtemp(prefix="specforge-inductor-")
    cold = warm_up_seconds(args.target, args.device, cache_dir)
    warm = warm_up_seconds(args.target, args.device, cache_dir)
    print(f"compile warm-up: cold cache {cold:.1f} s, warm cache {warm:.1f} s")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # the bench compiles from the warm cache

    from specforge.config import load_config
    from specforge.data.questions import resolve_question_set
    from specforge.recipes.bench import bench
    from specforge.results import write_result

    questions = resolve_question_set(args.questions)
    overrides = [
        f"target.name_or_path={args.target}",
        f"target.device={args.device}",
        f"bench.draft={args.draft}",
        f"bench.questions={questions}",
        f"bench.num_steps={args.num_steps}",
        f"bench.max_new_tokens={args.max_new_tokens}",
        f"bench.prompt_lookup_num_tokens={args.prompt_lookup_num_tokens}",
        f"bench.output={out / 'bench'}",
        "engine.compile=true",
    ]
    if args.limit:
        overrides.append(f"bench.limit={args.limit}")
    result = bench(load_config(None, overrides))
    speed = result["tokens_per_s"]
    eager = eager_rows(args.target, args.device, questions, args.eager_limit, args.max_new_tokens)
    figures = {
        "turns": result["turns"],
        "tau": round(result["tau"], 3),
        "HF generate tokens/s": round(speed["target_hf"], 2),
        "engine compiled, target alone tokens/s": round(speed["target"], 2),
        "runtime tokens/s": round(speed["eagle3"], 2),
        "speedup over the compiled target alone": f"{result['speedup']:.2f}x",
        "speedup over HF generate": f"{result['speedup_vs_hf_generate']:.2f}x",
        "outputs identical (runtime; engine's target alone)": (
            f"{result['all_match']}; {result['engine_all_match']}"
        ),
        **lookup_figures(result),
        "graphs compiled": result["engine"]["compilations"],
        "compile warm-up, cold / warm cache (s)": f"{cold:.1f} / {warm:.1f}",
        f"first turns of {args.eager_limit} questions, tokens/s": "; ".join(
            f"{name} {rate}" + ("" if same else " (outputs differ)") for name, rate, same in eager
        ),
    }
    write_result(
        out / "engine_speedup.json",
        {
            "settings": vars(args),
            "warm_up_seconds": {"cold": cold, "warm": warm},
            "bench": {k: v for k, v in result.items() if k != "turn_details"},
            "eager": eager,
            "title": f"The compiled engine: the target alone and the runtime ({args.device})",
            "summary": (
                f"{result['turns']} turns of {Path(questions).name}, greedy, float32, batch "
                f"size 1, num_steps {args.num_steps}: the runtime against the target alone "
                "through the same compiled engine, prompt lookup through that engine and HF "
                "generate beside both, and the compilation's warm-up from a cold and a warm "
                "cache."
            ),
            "figures": figures,
        },
    )
    print("\n| figure | value |\n|---|---|")
    for key, value in figures.items():
        print(f"| {key} | {value} |")
    print(f"\nwrote {out / 'engine_speedup.json'}")


if __name__ == "__main__":
    main()
