"""What compiling the engine costs and saves on this CPU, per target: the eager engine's and the
compiled engine's greedy time per token, and the cold compilation of both graphs (decoding one
token, verifying several), into an empty inductor cache. ``engine.compile: auto`` prices a run
with these figures (``specforge.engine.target.COMPILED_SAVING`` and ``COMPILE_SECONDS``).

    python benchmarks/compile_cost.py --targets smollm2-135m tiny-llama

``tiny-llama`` is the test suite's 4-layer random Llama (hidden 64), built in-process. Run it
alone: a second CPU-heavy process slows PyTorch many times over.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from specforge.config import load_config
from specforge.engine.target import TargetEngine
from specforge.models.adapter import text_config
from specforge.models.target import default_aux_layer_ids, load_target
from specforge.results import write_result
from specforge.serving.speculative import SpeculativeDecoder

TINY = "tiny-llama"


def tiny_llama() -> torch.nn.Module:
    """The test suite's tiny Llama shape (4 layers, hidden 64, vocabulary 256), random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def load(name: str) -> torch.nn.Module:
    if name == TINY:
        return tiny_llama()
    cfg = load_config(None, [f"target.name_or_path={name}", "target.dtype=float32"])
    return load_target(cfg.target, dtype="float32")[0]


def per_token(engine: TargetEngine, ids: torch.Tensor, tokens: int) -> float:
    """Seconds per greedy token through ``engine`` after ``ids`` (after one untimed run)."""
    engine.generate(ids, max_new_tokens=8)
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=tokens)
    return (time.perf_counter() - start) / tokens


def measure(name: str, tokens: int) -> dict:
    model = load(name)
    layers = text_config(model.config).num_hidden_layers
    aux = default_aux_layer_ids(layers)
    ids = torch.arange(3, 35)[None] % text_config(model.config).vocab_size
    eager = per_token(TargetEngine(model, aux_layer_ids=aux, compile=False), ids, tokens)
    compiled = TargetEngine(model, aux_layer_ids=aux, compile=True)
    # both graphs: verifying several tokens (prompt lookup's rounds) and decoding one
    SpeculativeDecoder.prompt_lookup(compiled, 4).generate(ids, max_new_tokens=16)
    compiled.generate(ids, max_new_tokens=4)
    compile_seconds = compiled.stats.compile_seconds
    fast = per_token(compiled, ids, tokens)
    return {
        "target": name,
        "layers": layers,
        "eager_ms_per_token": round(1000 * eager, 2),
        "compiled_ms_per_token": round(1000 * fast, 2),
        "saving": round(1 - fast / eager, 3),
        "graphs": compiled.stats.compilations,
        "cold_compile_s": round(compile_seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["smollm2-135m", TINY])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens timed")
    parser.add_argument("--output", default="outputs/bench/compile_cost.json")
    args = parser.parse_args()
    rows = []
    for name in args.targets:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold compilation
            torch._dynamo.reset()
            rows.append(measure(name, args.tokens))
    figures = {
        f"{r['target']} ({r['layers']} layers)": (
            f"eager {r['eager_ms_per_token']} ms/token, compiled {r['compiled_ms_per_token']} "
            f"(saves {r['saving']:.0%}); cold compilation of {r['graphs']} graphs "
            f"{r['cold_compile_s']} s"
        )
        for r in rows
    }
    write_result(
        Path(args.output),
        {"settings": vars(args), "rows": rows},
        title="What compiling the engine costs and saves (cpu)",
        summary=(
            "Greedy decoding through the eager and the compiled engine, float32, batch size 1, "
            "and the cold compilation of its two graphs into an empty inductor cache: the "
            "figures engine.compile auto prices a run with."
        ),
        figures=figures,
    )
    print("\n| target | layers | eager ms/token | compiled | saving | cold compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['target']} | {r['layers']} | {r['eager_ms_per_token']} | "
            f"{r['compiled_ms_per_token']} | {r['saving']:.0%} | {r['cold_compile_s']} |"
        )


if __name__ == "__main__":
    main()
