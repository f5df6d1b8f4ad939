"""Row buckets: a compiled CPU graph's float32 linear layers run, for each row count, the
kernel measured fastest for it on this CPU, over a weight packed once.

Why: a graph ``torch.compile`` builds calls PyTorch's default product, MKL's ``sgemm``, and
how fast that is depends on the CPU:

- On a 2-core AVX-512 Xeon without AVX512-BF16, from 4 rows on it switches to a kernel that
  repacks the weight on every call: SmolLM2's 576x576 projections over its 30 layers took
  3.3 ms at 1-3 rows and 11.9-12.4 ms at 4-8, so verifying 4-8 tokens cost 1.7-2.0 target
  tokens (``docs/results/verify_cost_row_buckets_cpu.json``). MKL's product over a weight packed
  once for a fixed row count (the ``torch.ops.mkl`` pair inductor emits for frozen float32
  graphs) read it once: 2.6-2.9 ms at 4-16 rows.
- On a 2-core Zen 5 EPYC (AVX512-BF16), MKL read SmolLM2's weights at about half oneDNN's
  bandwidth: its 210 linears took 23 ms a token inside the compiled graph, where oneDNN's
  product over weights reordered once (the eager engine's,
  :mod:`specforge.engine.cpu.packed_linear`) took ~10, and through the compiled engine 2-3
  tokens cost 1.4-1.6 times one
  (``docs/results/verify_cost_row_plan_cpu.json``). There MKL's row buckets were slower than
  the default.

How: :func:`bucket_linears` packs every linear layer of the engine's decoder both ways (MKL
for :data:`~specforge.engine.cpu.packed_linear.ROW_BUCKETS`, 8 and 16 rows; oneDNN), times one
pass over all of them with each kernel at 1, 2, 3, 4, 8, 16 and 32 rows (:data:`MEASURED_ROWS`;
a second or two for SmolLM2), and keeps a plan, the fastest kernel for each row count,
dropping the packings it does not use. Inside a compiled graph a float32 call runs
``specforge::bucket_linear`` (``csrc/bucket_linear.cpp``), which follows the plan: MKL's
bucket pads the rows with zeros to the first bucket that holds them, oneDNN takes any count.
The op is opaque to inductor, which cannot lower a packed product whose weight is an input
rather than a frozen constant, and keeps the row count dynamic, so the engine's graphs stay the
same two; the one-row graph calls it only where the plan's one-row kernel is not the default.
It is C++ (built with the decode attention kernel, :mod:`specforge.engine.cpu.decode_kernel`): a
Python kernel cost ~0.1 ms a call, 20 ms a forward of SmolLM2's 210 layers. Linear layers of
other classes (quantized ones, say) are left as they are.

Exactness: a row's result does not depend on the rows that share its call (tested; oneDNN's
one-row calls run as two rows where its one-row kernel rounds otherwise); kernels differ from
each other by float32 rounding, as the default's one-row and many-row kernels already do, so a
verification's logits agree with one-token decoding to rounding, as before. Where it does not
apply (no MKL, no AVX-512 build of the kernel module, another dtype, a trainable weight, or
packed copies beyond :data:`MAX_BUCKET_BYTES`) the layers keep the default.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from specforge.engine.cpu.decode_kernel import load_kernel_module
from specforge.engine.cpu.packed_linear import (
    DEFAULT,
    MKL_BUCKET,
    ONEDNN,
    PLAN_ROWS,
    ROW_BUCKETS,
    PackedLinear,
    bucketable,
    describe_plan,
)

logger = logging.getLogger(__name__)

MAX_BUCKET_BYTES = 6 << 30
"""Packed copies of a model's weights (one per MKL bucket, one reordered by oneDNN) may take at
most this much memory: a target of up to about 500M float32 weights."""

MEASURED_ROWS = (1, 2, 3, 4, 8, 16, 32)
"""The row counts :func:`measure_plan` times; a count between two takes the larger one's
choice, and more than 16 rows the choice at 32 (where MKL's buckets do not reach)."""

MARGIN = 0.97
"""Another kernel replaces the default only where it took less than this share of its time:
a tie keeps the default, which needs no op and no packed copy."""


def _bucket_linear_shape(x, weight, bias, *packings):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@functools.cache
def row_buckets_missing() -> str | None:
    """Why row buckets cannot run in this process, or ``None`` (the op is then loaded, its
    shapes known to ``torch.compile``)."""
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return "this PyTorch build has no MKL"
    module, missing = load_kernel_module()
    if module is None:
        return missing
    module.register_bucket_linear()
    torch.library.register_fake("specforge::bucket_linear", _bucket_linear_shape)
    return None


def _pass_seconds(linears: list[PackedLinear], rows: int, kernel: int | None) -> float:
    """Seconds of one call of every layer over ``rows`` rows: PyTorch's product called
    directly (``kernel=None``), or the op with a plan that names ``kernel`` for every count."""
    plan = [DEFAULT if kernel is None else kernel] * (PLAN_ROWS + 1)
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    start = time.perf_counter()
    for m in linears:
        x = inputs[m.in_features]
        F.linear(x, m.weight, m.bias) if kernel is None else m.run_plan(x, plan)
    return time.perf_counter() - start


def measure_plan(linears: list[PackedLinear], repeats: int = 3) -> tuple[int, ...]:
    """The fastest kernel for each row count over ``linears`` (packed by
    :meth:`~specforge.engine.cpu.packed_linear.PackedLinear.pack_row_buckets`) on this CPU: the
    best of ``repeats`` passes over all of them (weights read from memory, as a forward reads
    them) with each kernel at each of :data:`MEASURED_ROWS` rows. The op replaces PyTorch's
    direct call only where it beats it by :data:`MARGIN`, counting its own cost, over the one
    row the one-row graph runs and over the counts the other graph runs."""
    onednn = all(m._packed is not None for m in linears)
    mkl = all(m._buckets is not None for m in linears)
    best: dict[int, int] = {}
    seconds: dict[tuple[int, int | None], float] = {}
    with torch.no_grad():
        for rows in MEASURED_ROWS:
            kernels = [None, DEFAULT]
            kernels += [MKL_BUCKET] if mkl and rows <= ROW_BUCKETS[-1] else []
            kernels += [ONEDNN] if onednn else []
            for kernel in kernels:
                _pass_seconds(linears, rows, kernel)  # warm-up
                times = [_pass_seconds(linears, rows, kernel) for _ in range(repeats)]
                seconds[rows, kernel] = min(times)
            default = seconds[rows, DEFAULT]
            fastest = min(kernels[1:], key=lambda k: seconds[rows, k])
            best[rows] = fastest if seconds[rows, fastest] < MARGIN * default else DEFAULT
    # the op at all: the one-row graph, and the several-row graph, each against direct calls
    if seconds[1, best[1]] >= MARGIN * seconds[1, None]:
        best[1] = DEFAULT
    several = MEASURED_ROWS[1:]
    if sum(seconds[r, best[r]] for r in several) >= MARGIN * sum(seconds[r, None] for r in several):
        best.update(dict.fromkeys(several, DEFAULT))
    measured = [best[min(r for r in MEASURED_ROWS if r >= rows)] for rows in range(1, PLAN_ROWS)]
    return (DEFAULT, *measured, best[MEASURED_ROWS[-1]])


def bucket_linears(model: nn.Module, plan: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Give every ``nn.Linear`` of a frozen float32 CPU ``model`` row buckets
    (:meth:`~specforge.engine.cpu.packed_linear.PackedLinear.pack_row_buckets`; a plain
    ``nn.Linear`` is wrapped first, its eager calls left to the default) and a row plan:
    ``plan``, or the one :func:`measure_plan` finds. Returns the plan, or ``()`` where no
    layer takes one: the weights are not all frozen float32 on the CPU, their packed copies
    would take more than :data:`MAX_BUCKET_BYTES`, the op is missing (logged), or the default
    was the fastest at every row count.

    Raises:
        ValueError: a ``plan`` of the wrong length or with unknown kernels.
    """
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, PackedLinear)  # another subclass computes otherwise
    ]
    weights = [child.weight for _, _, child in linears]
    frozen = all(bucketable(w) for w in weights)
    copies = sum(w.numel() * w.element_size() for w in weights) * (len(ROW_BUCKETS) + 1)
    if not linears or not frozen or copies > MAX_BUCKET_BYTES:
        return ()
    missing = row_buckets_missing()
    if missing:
        logger.info("row buckets unused (compiled calls keep PyTorch's product): %s", missing)
        return ()
    kernels = (MKL_BUCKET, ONEDNN) if plan is None else tuple(set(plan[1:]) - {DEFAULT})
    packed = []
    for parent, name, child in linears:
        if type(child) is nn.Linear:
            child = PackedLinear.wrap(child, max_rows=0)
            setattr(parent, name, child)
        child.pack_row_buckets(kernels)
        packed.append(child)
    if plan is None:
        plan = measure_plan(packed)
        logger.info("row plan of %d linear layers: %s", len(packed), describe_plan(plan))
    used = plan if set(plan[1:]) != {DEFAULT} else None
    for child in packed:
        child.use_plan(used)
    return plan if used else ()
