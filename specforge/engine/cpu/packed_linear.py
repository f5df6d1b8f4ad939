"""Linear layers that decode faster on CPU: oneDNN's matmul on weights reordered once.

On CPU, PyTorch's default ``linear`` in float32 calls MKL, which repacks the weight on every
call: with a few rows (one decoded token, a verification of 2-8, a draft step) that repacking
reads and writes every weight again, so the layer costs up to ~1.8x a single row's. oneDNN can
reorder a weight once into its blocked layout and reuse it (``torch.ops.mkldnn``, the same pair
of ops inductor emits for frozen CPU graphs). Measured on a 2-core AVX2 CPU with SmolLM2's
float32 target after a 300-token prefill: one token 54 -> 48 ms, 2 tokens 89 -> 51, 3 117 -> 55,
8 86 -> 63. From about 64 rows on, MKL is as fast or faster there (prefills, training, batched
regeneration), so those keep PyTorch's default. On a CPU with AVX-512 the packed path stays
faster at every size timed (a 2-core Zen 4 EPYC: SmolLM2's 576-to-1536 linear 10-49% faster at
48-2048 rows, its prefill of 60 tokens 166 -> 123 ms, of 150 315 -> 242), so float32 calls of
up to :data:`MAX_PACKED_ROWS_AVX512` rows take it there (:func:`max_packed_rows`).

A row's result does not depend on how many rows share the call (a property the tests check),
which the default does not have (MKL's one-row path rounds differently from its matrix path).
oneDNN too runs some one-row calls with another kernel (on that Zen 4, every layer with 1152 or
more inputs: SmolLM2's ``down_proj``, in float32 and bfloat16), whose sums round differently;
such a layer, found by comparing one probe row alone and beside another when it is packed,
computes a one-row call as two rows (~1 us more) so that a token decoded alone gets the bits
it gets inside a verification. The results agree with the default to float32 rounding.

bfloat16 takes the same path where oneDNN runs it natively (AVX512-BF16 or AMX, as
``torch.ops.mkldnn._is_mkldnn_bf16_supported`` reports): on a 2-core Zen 4 EPYC (AVX512-BF16, no
AMX), SmolLM2's linear layers over 1 row took 16.2 instead of 22.9 ms, over 16 rows 21.0
instead of 32.5, and the draft's (read from memory, not cache) 1.26 instead of 1.67 ms, with
results bit-identical to the default's there; from 64 rows on the gain is under 15% (3% at
2048 rows), which batched regeneration and prefills take too (:data:`MAX_PACKED_ROWS_BF16`).

Why private ops: PyTorch's public route to them is ``torch.compile`` with frozen weights, which
compiles once per input shape, while decoding, verification and draft steps change their row
count every round. The ops are private, so ``tests/models/test_private_ops.py`` pins their
signatures and results: a PyTorch that changes them fails there first, and
:func:`packed_linear_available` keeps the default where they are missing.

:func:`prepack_linears` swaps a model's ``nn.Linear`` modules for :class:`PackedLinear`, which
shares their parameters (tied weights stay tied, ``state_dict`` is unchanged) and falls back to
``F.linear`` wherever the packed path does not apply: gradients, another device or dtype, more
rows than ``max_rows``, a weight changed since it was packed (it is packed again on next use),
or a graph being compiled.

**Row buckets, inside compiled graphs.** A graph ``torch.compile`` built calls PyTorch's
default product, which on some CPUs repacks the weight on every call of 4 or more rows and on
others reads it at half oneDNN's memory bandwidth. A layer given row buckets
(:meth:`PackedLinear.pack_row_buckets`, which
:func:`specforge.engine.cpu.row_buckets.bucket_linears` calls) holds its weight packed by MKL for
:data:`ROW_BUCKETS` rows and reordered by oneDNN, and a compiled graph's float32 call runs the
op ``specforge::bucket_linear`` with a plan: for each row count, the kernel measured fastest on
this CPU (:mod:`specforge.engine.cpu.row_buckets` says why and what it measured).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

MAX_PACKED_ROWS = 32
"""float32 calls with more rows than this use PyTorch's default on CPUs without AVX-512 (MKL
is as fast from ~64 rows on there)."""

MAX_PACKED_ROWS_AVX512 = 2048
"""float32 calls with more rows than this use PyTorch's default on CPUs with AVX-512."""

MAX_PACKED_ROWS_BF16 = 2048
"""bfloat16 calls with more rows than this use PyTorch's default. PyTorch's bfloat16 linear
calls oneDNN too, reordering the weight each time, so the packed path was as fast or faster
at every size timed (1-2048 rows)."""

MIN_PACKED_WEIGHT = 1 << 18
"""Smaller weights keep PyTorch's default: oneDNN's call costs ~50-100 us more on its own, which
only a weight read from memory (not cache) pays back. SmolLM2's 192x576 key/value projections
stay default; its 576x576 and larger layers are packed."""


ROW_BUCKETS = (8, 16)
"""The row counts MKL's packings are made for: a call planned for MKL is padded to the first
that holds it."""

DEFAULT, MKL_BUCKET, ONEDNN = 0, 1, 2
"""The kernels of a row plan (``csrc/bucket_linear.cpp``): PyTorch's default product, MKL's
product over the weight packed for a row bucket, oneDNN's over the weight reordered once."""

KERNEL_NAMES = {DEFAULT: "default", MKL_BUCKET: "mkl_bucket", ONEDNN: "onednn"}

PLAN_ROWS = 17
"""A row plan names the kernel for calls of 1 to ``PLAN_ROWS - 1`` rows (``plan[rows]``) and,
at ``plan[PLAN_ROWS]``, for every larger call; ``plan[0]`` is unused."""


def describe_plan(plan: tuple[int, ...]) -> dict[str, str]:
    """A row plan as ``bench.json`` reports it: row ranges to kernel names, e.g.
    ``{"1": "onednn", "2-3": "default", "4-16": "mkl_bucket", "17+": "onednn"}``."""
    spans: list[list[int]] = []
    for rows in range(1, len(plan)):
        if spans and plan[spans[-1][0]] == plan[rows]:
            spans[-1][1] = rows
        else:
            spans.append([rows, rows])
    last = len(plan) - 1

    def name(first: int, end: int) -> str:
        if end == last:
            return f"{first}+"
        return str(first) if first == end else f"{first}-{end}"

    return {name(first, end): KERNEL_NAMES[plan[first]] for first, end in spans}


def bucketable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` may get row buckets: frozen (packed once, it must not change),
    float32 (MKL's packed product) and on the CPU."""
    return (
        not weight.requires_grad and weight.dtype == torch.float32 and weight.device.type == "cpu"
    )


def packed_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN's reordered-weight linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@cache
def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes :class:`PackedLinear` packs on this CPU: float32, and bfloat16 where oneDNN
    runs it natively (AVX512-BF16 or AMX)."""
    if not packed_linear_available():
        return ()
    native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
    return (torch.float32, torch.bfloat16) if native else (torch.float32,)


def max_packed_rows(dtype: torch.dtype) -> int:
    """The most rows :func:`prepack_linears` packs a call of in ``dtype`` on this CPU."""
    if dtype == torch.bfloat16:
        return MAX_PACKED_ROWS_BF16
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return MAX_PACKED_ROWS_AVX512 if avx512 else MAX_PACKED_ROWS


def _linear_packed(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    # (..., in_features) -> (..., out_features)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _one_row_rounds_apart(packed: torch.Tensor, bias, in_features: int, dtype) -> bool:
    """Whether oneDNN computes a one-row call of ``packed`` with another kernel than a call of
    several rows (a probe row's result alone differs from its result beside another)."""
    probe = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    return not torch.equal(
        _linear_packed(probe[:1], packed, bias), _linear_packed(probe, packed, bias)[:1]
    )


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose small CPU calls (float32; bfloat16 where native) use a
    once-reordered weight (see the module docstring). Built by :meth:`wrap` around an existing
    layer's parameters."""

    max_rows: int
    _packed: torch.Tensor | None
    _packed_from: tuple | None
    _pad_one_row: bool
    """A one-row call runs as two rows (:func:`_one_row_rounds_apart` when packed)."""
    _buckets: tuple[torch.Tensor, torch.Tensor] | None
    """The weight packed by MKL for each of :data:`ROW_BUCKETS` rows, or ``None``:
    :meth:`pack_row_buckets`."""
    _buckets_from: tuple | None
    """The weight's key when it was packed for compiled graphs (:meth:`buckets_stale`)."""
    _plan: tuple[int, ...] | None
    """The kernel of a compiled graph's float32 call by its row count (see
    :data:`PLAN_ROWS`), or ``None``: PyTorch's default there."""

    @classmethod
    def wrap(cls, linear: nn.Linear, *, max_rows: int = MAX_PACKED_ROWS) -> PackedLinear:
        """A :class:`PackedLinear` sharing ``linear``'s ``weight`` and ``bias`` objects."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight, module.bias = linear.weight, linear.bias
        module.max_rows, module._packed, module._packed_from = max_rows, None, None
        module._pad_one_row = False
        module._buckets, module._buckets_from, module._plan = None, None, None
        module.train(linear.training)
        return module

    def pack_row_buckets(self, kernels: tuple[int, ...] = (MKL_BUCKET, ONEDNN)) -> None:
        """Pack the weight for compiled graphs: by MKL for :data:`ROW_BUCKETS` rows
        (``MKL_BUCKET`` in ``kernels``) and reordered by oneDNN (``ONEDNN``), which
        :meth:`use_plan` then chooses from; the weight must not change afterwards (a frozen
        target's; :meth:`buckets_stale` tells).

        Raises:
            ValueError: a weight that is trainable, not float32, or not on the CPU.
        """
        weight = self.weight
        if not bucketable(weight):
            raise ValueError(
                "row buckets need a frozen float32 CPU weight, got "
                f"{weight.dtype} on {weight.device} (requires_grad={weight.requires_grad})"
            )
        key, detached = self._weight_key(), weight.detach()
        if MKL_BUCKET in kernels:
            reorder = torch.ops.mkl._mkl_reorder_linear_weight
            self._buckets = tuple(reorder(detached, rows) for rows in ROW_BUCKETS)
        if ONEDNN in kernels and packed_linear_available() and self._packed_from != key:
            self._pack_onednn(key)  # unless its eager calls already reordered this weight
        self._buckets_from = key

    def use_plan(self, plan: tuple[int, ...] | None) -> None:
        """Run a compiled graph's float32 calls by ``plan`` (the kernel by row count, see
        :data:`PLAN_ROWS`; ``None``: PyTorch's default), dropping the packings it does not
        name (oneDNN's stays where eager calls use it too).

        Raises:
            ValueError: a plan of another length, naming a kernel that was not packed, or MKL's
                buckets for more rows than they hold.
        """
        if plan is not None:
            if len(plan) != PLAN_ROWS + 1 or not set(plan) <= set(KERNEL_NAMES):
                raise ValueError(f"a row plan has {PLAN_ROWS + 1} kernels of 0-2, got {plan}")
            if plan[PLAN_ROWS] == MKL_BUCKET:
                raise ValueError(f"MKL's buckets hold at most {ROW_BUCKETS[-1]} rows: {plan}")
            if MKL_BUCKET in plan[1:] and self._buckets is None:
                raise ValueError(f"the plan {plan} names MKL buckets this layer was not given")
            if ONEDNN in plan[1:] and self._packed_from != self._buckets_from:
                raise ValueError(f"the plan {plan} names oneDNN, whose packing is missing")
        self._plan = plan
        if plan is None or MKL_BUCKET not in plan[1:]:
            self._buckets = None
        if (plan is None or ONEDNN not in plan[1:]) and self.max_rows == 0:
            self._packed, self._packed_from = None, None

    def buckets_stale(self) -> bool:
        """Whether the weight changed since its row buckets were packed (a compiled graph
        cannot check: the caller refuses to run it)."""
        return self._plan is not None and self._buckets_from != self._weight_key()

    def __getstate__(self) -> dict:
        # packed weights are opaque tensors, which cannot be copied or pickled: a copy packs
        # its weight again on first use, and goes without row buckets (an engine gives its own
        # model buckets)
        unpacked = {"_packed": None, "_packed_from": None, "_buckets": None, "_buckets_from": None}
        unpacked["_plan"] = None
        return {**super().__getstate__(), **unpacked}

    def _weight_key(self) -> tuple:
        # the weight object, its storage and its in-place version: any change repacks
        return (id(self.weight), self.weight.data_ptr(), self.weight._version)

    def _usable(self, x: torch.Tensor) -> bool:
        weight = self.weight
        return (
            not torch.compiler.is_compiling()  # first: a traced graph sees nothing below
            and x.device.type == "cpu"
            and x.dtype == weight.dtype
            and weight.dtype in packed_dtypes()
            and type(weight) in (nn.Parameter, torch.Tensor)  # not a DTensor or other subclass
            and weight.device.type == "cpu"
            and x.dim() >= 1
            and x.shape[-1] == self.in_features
            and x.numel() <= self.max_rows * self.in_features
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def _plan_applies(self, x: torch.Tensor) -> bool:
        # a one-row graph (dynamic shapes specialise sizes 1) calls the op only where the plan
        # names another kernel than the default for one row
        return (
            self._plan is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad)
            and (math.prod(x.shape[:-1]) != 1 or self._plan[1] != DEFAULT)
        )

    def _pack_onednn(self, key: tuple) -> None:
        bias = None if self.bias is None else self.bias.detach()
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 4)
            self._pad_one_row = _one_row_rounds_apart(
                self._packed, bias, self.in_features, self.weight.dtype
            )
        self._packed_from = key

    def run_plan(self, x: torch.Tensor, plan: tuple[int, ...] | list[int]) -> torch.Tensor:
        """This layer over ``x`` through the op ``specforge::bucket_linear``
        (``engine/cpu/csrc/bucket_linear.cpp``), each row count by ``plan``'s kernel: what a
        compiled graph runs (and what :func:`~specforge.engine.cpu.row_buckets.measure_plan`
        times)."""
        (small, large), (small_rows, large_rows) = self._buckets or (None, None), ROW_BUCKETS
        onednn = self._packed if ONEDNN in plan[1:] else None
        args = (list(plan), onednn, self._pad_one_row, small, small_rows, large, large_rows)
        return torch.ops.specforge.bucket_linear(x, self.weight, self.bias, *args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self._plan_applies(x):
            return self.run_plan(x, self._plan)
        if not self._usable(x):
            return F.linear(x, self.weight, self.bias)
        key = self._weight_key()
        bias = None if self.bias is None else self.bias.detach()
        if self._packed_from != key:
            self._pack_onednn(key)
        if self._pad_one_row and x.numel() == self.in_features:
            # (..., 1, in) -> (2, in) -> first row (..., 1, out): a many-row call's bits
            twice = x.reshape(1, -1).expand(2, -1).contiguous()
            return _linear_packed(twice, self._packed, bias)[:1].reshape(*x.shape[:-1], -1)
        return _linear_packed(x, self._packed, bias)


def prepack_linears(
    model: nn.Module, *, max_rows: int | None = None, min_weight: int = MIN_PACKED_WEIGHT
) -> int:
    """Swap every ``nn.Linear`` of a CPU ``model`` in a dtype of :func:`packed_dtypes` whose
    weight has at least ``min_weight`` elements for a :class:`PackedLinear` sharing its
    parameters (nothing is packed until a call uses it), packing calls of up to ``max_rows``
    rows (default: :func:`max_packed_rows` of the model's dtype). Returns how many were
    swapped: 0 for a model on another device or in another dtype, or where this build lacks
    oneDNN."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype not in packed_dtypes():
        return 0
    if max_rows is None:
        max_rows = max_packed_rows(weight.dtype)
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.numel() >= min_weight
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear.wrap(child, max_rows=max_rows))
    return len(swaps)


@contextmanager
def default_linears(model: nn.Module) -> Iterator[None]:
    """PyTorch's default linear in every :class:`PackedLinear` of ``model`` while the context
    lasts: a before/after comparison on the same weights."""
    modules = [m for m in model.modules() if isinstance(m, PackedLinear)]
    saved = [m.max_rows for m in modules]
    for module in modules:
        module.max_rows = 0
    try:
        yield
    finally:
        for module, rows in zip(modules, saved, strict=True):
            module.max_rows = rows
