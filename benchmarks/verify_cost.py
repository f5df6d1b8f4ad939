"""What one target verification costs against one decoded token, and what a draft step costs:
the two figures that decide whether speculative decoding pays on a machine.

    python benchmarks/verify_cost.py --target smollm2-135m --dtype float32

After a prefill of ``--context`` tokens, the target extends its KV cache by ``k`` tokens (the
runtime's verification call: aux capture plus ``lm_head`` on every new position) and the cache
is cropped back, for each ``k`` in ``--tokens``; a freshly initialized draft of the target's
geometry extends its own cache by one token. Each figure is the median of ``--repeats`` timed
calls after one warm-up call. Every figure is taken twice in the same run: with PyTorch's
default linear, then with the linears prepacked (``target.prepack_linear``, the default on CPU in
float32). Then the draft's extension over 3 accepted tokens right after a 3-token verification
(its weights cold, as in a round), for each form the bench may load the draft in: float32,
bfloat16 (both prepacked) and bfloat16 with int8 weights (``bench.draft_quantize``). With
``--engine``, the same verification costs through the engine the bench runs
(:class:`~specforge.engine.target.TargetEngine`, its cache written by slot), eager (its
linears prepacked), compiled with PyTorch's default linear and compiled with row buckets
(``specforge/engine/cpu/packed_linear.py``), timed in turn call by call. Prints a table and writes
JSON.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from common import median_ms, parse_smoke

from specforge.config import TargetConfig
from specforge.config.resolve import TORCH_DTYPES, torch_dtype
from specforge.engine.cache import crop_cache
from specforge.engine.cpu.int8_linear import int8_linear_available, quantize_linears
from specforge.engine.cpu.packed_linear import PackedLinear, default_linears, prepack_linears
from specforge.models.eagle3 import DraftKVCache, Eagle3Config, build_draft_model
from specforge.models.target import default_aux_layer_ids, load_target
from specforge.results import write_result
from specforge.serving.speculative import SpeculativeDecoder


@torch.no_grad()
def engine_timings(target, args) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """Median ms of the engine's forward over ``k`` new tokens after the prefill, for each
    ``k`` in ``--tokens``: eager, compiled with PyTorch's default linear, and compiled as the
    bench runs it (on a CPU in float32, row buckets with the row plan it measures, returned
    too). The engines are built and warmed first, then timed in turn call by call, so that a
    machine whose speed drifts slows all alike."""
    from specforge.engine.target import TargetEngine

    aux = default_aux_layer_ids(target.config.num_hidden_layers)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (1, args.context), generator=generator)
    calls, plan = {}, {}
    engines = (
        ("engine, eager", target, False, False),
        # its own copy of the target: the next engine gives the shared layers row buckets
        ("engine, compiled, default linears", copy.deepcopy(target), True, False),
        ("engine, compiled", target, True, True),
    )
    for name, model, compile, buckets in engines:
        engine = TargetEngine(model, aux_layer_ids=aux, compile=compile, row_buckets=buckets)
        cache = engine.new_cache(args.context + max(args.tokens))
        engine.forward(prompt, cache)
        plan = engine.stats.row_plan or plan

        def call(k: int, engine=engine, cache=cache) -> float:
            ids = torch.randint(0, target.config.vocab_size, (1, k), generator=generator)
            start = time.perf_counter()
            engine.forward(ids, cache)
            seconds = time.perf_counter() - start
            cache.crop(args.context)
            return seconds

        for k in args.tokens:  # compiles every shape
            call(k)
        calls[name] = call
    times: dict[str, dict[int, list[float]]] = {n: {k: [] for k in args.tokens} for n in calls}
    for _ in range(args.repeats):
        for k in args.tokens:
            for name, call in calls.items():
                times[name][k].append(call(k))
    medians = {
        name: {k: 1000 * statistics.median(ts) for k, ts in by_k.items()}
        for name, by_k in times.items()
    }
    return medians, plan


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", default="outputs/bench/verify_cost.json")
    parser.add_argument("--engine", action="store_true", help="the engine's forwards too")
    args = parse_smoke(parser, context=16, tokens=[1, 2], repeats=1)
    from transformers import DynamicCache

    target, _ = load_target(TargetConfig(args.target, dtype=args.dtype))
    config = target.config
    draft_vocab_size = min(8192, config.vocab_size)
    draft = build_draft_model(
        Eagle3Config.from_target(config, draft_vocab_size=draft_vocab_size),
        target_embedding=target.get_input_embeddings().weight.detach().float(),
        target_lm_head=target.get_output_embeddings().weight.detach().float(),
        d2t=torch.zeros(draft_vocab_size, dtype=torch.long),
        t2d=torch.arange(config.vocab_size) < draft_vocab_size,
    ).to(torch_dtype(args.dtype))
    runtime = SpeculativeDecoder(
        target, draft, aux_layer_ids=default_aux_layer_ids(config.num_hidden_layers)
    )
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, args.context), generator=generator)
    target_cache = DynamicCache()
    _, aux = runtime.verifier.forward(prompt, target_cache)

    def verify(k: int):
        ids = torch.randint(0, config.vocab_size, (1, k), generator=generator)

        def call():
            runtime.verifier.forward(ids, target_cache)
            crop_cache(target_cache, args.context)

        return call

    draft_cache = DraftKVCache()
    _, hidden = runtime.proposer.extend(prompt, aux, 0, draft_cache)

    def draft_step():
        position = torch.tensor([[args.context]])
        draft(prompt[:, -1:], hidden, position, cache=draft_cache)
        crop_cache(draft_cache, args.context)

    def timings() -> dict:
        target_ms = {k: median_ms(verify(k), args.repeats) for k in args.tokens}
        return {
            "target_forward_ms": target_ms,
            "relative_to_one_token": {
                k: v / target_ms[min(target_ms)] for k, v in target_ms.items()
            },
            "draft_step_ms": median_ms(draft_step, args.repeats),
        }

    def extension_after_verification_ms(form) -> float:
        """The draft's extension over 3 accepted tokens right after a 3-token verification
        (its weights evicted by the target's forward, as in a round of the runtime)."""
        cache, accepted = DraftKVCache(), prompt[:, -3:]
        form(prompt, form.fuse(aux), torch.arange(args.context)[None], cache=cache)
        positions = torch.arange(args.context - 3, args.context)[None]
        verify_three, times = verify(3), []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            verify_three()
            crop_cache(cache, args.context - 3)
            start = time.perf_counter()
            form(accepted, form.fuse(aux[:, -3:]), positions, cache=cache, logits_to_keep=1)
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times[1:])

    # the draft as the bench may load it (bench.draft_dtype, bench.draft_quantize): float32 and
    # bfloat16 prepacked, bfloat16 with int8 weights (engine/cpu/int8_linear.py)
    forms = {"float32": copy.deepcopy(draft).float(), "bfloat16": copy.deepcopy(draft).bfloat16()}
    if int8_linear_available():
        forms["bfloat16, int8 weights"] = copy.deepcopy(draft).bfloat16()
        quantize_linears(forms["bfloat16, int8 weights"])
    for form in forms.values():
        prepack_linears(form)  # no-op for the int8 form: it has no nn.Linear left
    extension_ms = {name: extension_after_verification_ms(form) for name, form in forms.items()}
    # PyTorch's default linear, then the same models with their linears prepacked (the
    # runtime's default on CPU in float32, as the bench loads them; see
    # specforge/engine/cpu/packed_linear.py)
    prepack_linears(draft)
    with default_linears(target), default_linears(draft):
        kernels = {"default": timings()}
    if any(isinstance(m, PackedLinear) for m in (*target.modules(), *draft.modules())):
        kernels["prepacked"] = timings()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "target": args.target,
        "dtype": args.dtype,
        "context": args.context,
        **kernels["prepacked" if "prepacked" in kernels else "default"],
        "linear_kernels": kernels,
        "draft_extension_after_verification_ms": extension_ms,
    }
    if args.engine:
        result["engine_forward_ms"], result["engine_row_plan"] = engine_timings(target, args)
    write_result(Path(args.output), result)
    print(f"\n{args.target} ({args.dtype}), context {args.context}")
    names = list(kernels)
    print("| new tokens | " + " | ".join(f"{n} ms | x one token" for n in names) + " |")
    print("|---" * (1 + 2 * len(names)) + "|")
    for k in args.tokens:
        cells = [
            f"{kernels[n]['target_forward_ms'][k]:.1f} | "
            f"{kernels[n]['relative_to_one_token'][k]:.2f}"
            for n in names
        ]
        print(f"| {k} | " + " | ".join(cells) + " |")
    for name, ms in result.get("engine_forward_ms", {}).items():
        cells = ", ".join(f"{k}: {v:.1f} ({v / ms[args.tokens[0]]:.2f}x)" for k, v in ms.items())
        print(f"{name}, ms by new tokens: {cells}")
    if "engine_row_plan" in result:
        print(f"engine, compiled: row plan {result['engine_row_plan'] or 'none'}")
    steps = ", ".join(f"{n} {kernels[n]['draft_step_ms']:.2f} ms" for n in names)
    print(f"\ndraft step: {steps}")
    extensions = ", ".join(f"{name} {ms:.2f} ms" for name, ms in extension_ms.items())
    print(f"draft extension over 3 tokens after a verification: {extensions}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
