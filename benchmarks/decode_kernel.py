"""The CPU decode attention kernel against PyTorch's SDPA at one layer's shapes: continuous
batching's decode step, one query position per row over a growing cache.

    python benchmarks/decode_kernel.py --rows 256 --keys 2048 --output outputs/decode_kernel.json

Shapes: SmolLM2-135M (9 query heads over 3 key heads, head size 64) and Llama-3-8B (32 over 8,
head size 128; a group of 4), bf16, each row's cache ``--keys`` columns wide with a share of it
left padding (rows hold answers of different lengths). Each is timed as the median of
``--repeats`` calls after a warm-up, for the kernel and for SDPA over the same views (HF's
grouped-query call), and the two outputs are compared. Needs an x86-64 CPU with AVX-512; run it
alone on the machine.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import median_ms

from specforge.engine.cpu.decode_kernel import kernel_decode_attention, load_decode_kernel
from specforge.results import write_result

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128)}
"""Model -> (query heads, key heads, head size)."""


def inputs(rows: int, heads: int, kv_heads: int, size: int, keys: int, padding: float):
    """A bf16 decode query, key/value views of wider buffers, and a left-padding mask whose
    padded share grows from 0 to ``padding`` across the rows."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(rows, heads, 1, size, generator=generator).to(torch.bfloat16)
    buffers = torch.randn(2, rows, kv_heads, keys + 64, size, generator=generator)
    key, value = buffers.to(torch.bfloat16)[:, :, :, :keys].unbind(0)
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    for row in range(rows):
        mask[row, ..., : int(keys * padding * row / max(rows - 1, 1))] = False
    return query, key, value, mask


def time_shape(query, key, value, mask, repeats: int) -> tuple[float, float, float]:
    """Milliseconds of the kernel and of SDPA over the same views, and the kernel's largest
    difference from SDPA in float32."""
    ours = median_ms(
        lambda: kernel_decode_attention(query, key, value, mask, None, mode="on"), repeats
    )
    out = kernel_decode_attention(query, key, value, mask, None, mode="on")
    sdpa = median_ms(
        lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True),
        repeats,
    )
    reference = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    return ours, sdpa, float((out.float() - reference).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--keys", type=int, default=2048)
    parser.add_argument("--padding", type=float, default=0.5, help="the most-padded row's share")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default="outputs/bench/decode_kernel.json")
    args = parser.parse_args()
    if min(args.rows, args.keys, args.repeats) < 1 or not 0 <= args.padding < 1:
        parser.error("--rows, --keys and --repeats must be >= 1, --padding in [0, 1)")
    kernel, why = load_decode_kernel()
    if kernel is None:
        parser.error(f"the decode kernel is unavailable here: {why}")
    rows = []
    for model, (heads, kv_heads, size) in SHAPES.items():
        query, key, value, mask = inputs(args.rows, heads, kv_heads, size, args.keys, args.padding)
        ours, sdpa, error = time_shape(query, key, value, mask, args.repeats)
        rows.append(
            {
                "model": model,
                "heads": heads,
                "kv_heads": kv_heads,
                "head_size": size,
                "kernel_ms": round(ours, 3),
                "sdpa_ms": round(sdpa, 3),
                "speedup": round(sdpa / ours, 2),
                "max_abs_error": error,
            }
        )
    print(f"\n{args.rows} rows x {args.keys} keys, bf16, {torch.get_num_threads()} threads")
    print("| shape | kernel ms | SDPA ms | speedup | max abs error |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} ({r['heads']}/{r['kv_heads']} heads, D {r['head_size']}) | "
            f"{r['kernel_ms']} | {r['sdpa_ms']} | {r['speedup']}x | {r['max_abs_error']:.2g} |"
        )
    write_result(args.output, {"settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
