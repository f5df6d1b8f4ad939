"""Continuous batching for self-distillation: many prompts answered by the target at once, with
rows leaving the batch when they finish and waiting prompts joining in their place.

Why not ``model.generate`` on fixed batches: a fixed batch runs until its longest answer ends,
so finished rows keep costing compute, and an HF ``DynamicCache`` copies the whole cache at
every step (``torch.cat``). Here:

1. **join**: waiting prompts (by :attr:`Request.priority`, then longest first, so lengths in a
   batch stay close) are prefilled in groups of close lengths, left-padded, and their
   keys/values merged into the running cache;
2. **step**: one forward over the last token of every row (explicit positions, a padding mask);
3. **leave**: a row that emitted an end-of-turn id or reached ``max_new_tokens`` is done. Its
   slot is reclaimed when enough rows are done (or new prompts wait), in one compaction that
   also drops the columns only padding fills.

Keys/values live in :class:`~specforge.models.kv_cache.GrowingKVLayer` buffers with spare
columns: a step writes in place instead of re-allocating the cache. Greedy rows take the
argmax; sampled rows draw from the temperature / top-p warped distribution with a generator of
their own (seeded per request), so a request's answer does not depend on which other requests
share its batch. The generated token ids are returned as the target produced them.

Works for decoder-only HF models whose cache is a per-layer ``keys``/``values`` pair (the
Llama family and most others, sliding-window layers included: every column is kept and the
model's own mask applies the window); recurrent layers need the ``static`` backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache

from specforge.data.chat import left_padded
from specforge.engine.cpu.decode_kernel import check_decode_kernel_mode, decode_attention_for
from specforge.models.kv_cache import (
    GrowingKVLayer,
    RowSpan,
    cache_kwargs,
    growing_cache,
)

NUCLEUS_CANDIDATES = 1024
"""Tokens :func:`warp_probs` ranks first; a row needs all its tokens sorted only when these hold
less than ``top_p`` of its mass (7% of SmolLM2's positions in its own prompts at ``top_p``
0.95, temperature 1)."""


def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities (float32) after temperature and nucleus (top-p) filtering, per row."""
    if temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:
        flat = probs.reshape(-1, probs.shape[-1])
        # the nucleus lies within the top k of a row whose top k hold top_p of its mass: ranking
        # those alone gives the same nucleus as sorting the whole vocabulary (on a 2-core CPU,
        # one thread: 64 rows of 49152 sorted in ~300 ms, their top 1024 found in ~30 ms)
        values, order = flat.topk(min(NUCLEUS_CANDIDATES, flat.shape[-1]), -1)
        mass = values.cumsum(-1)
        kept = _keep_nucleus(flat, values, order, top_p, mass)
        wide = mass[:, -1] < top_p  # the same sums as the full sort's prefix
        if wide.any():
            kept[wide] = _keep_nucleus(flat[wide], *flat[wide].sort(-1, descending=True), top_p)
        probs = (kept / kept.sum(-1, keepdim=True)).reshape(probs.shape)
    return probs


def _keep_nucleus(probs, values, order, top_p: float, mass=None) -> torch.Tensor:
    """``probs`` (B, V) zeroed outside each row's nucleus, from its tokens ranked by probability
    (``values``, ``order``: (B, k), descending; ``mass``: their running sums, if at hand): the
    smallest prefix whose mass reaches ``top_p`` (the first token always kept)."""
    mass = values.cumsum(-1) if mass is None else mass
    values = values.masked_fill(mass - values >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, values)


PREFILL_PADDING = 0.25
"""A prefill group's padding may add at most this share to its real prompt tokens
(:func:`prefill_groups`)."""


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[range]:
    """Consecutive groups of prompts, by index, to prefill in one forward each: a group grows
    while left-padding its prompts to its longest adds at most ``padding`` of their real tokens.
    One forward over all joining prompts would pad every one to the longest: a follow-up turn
    that carries a 300-token answer beside 50-token first turns makes the prefill mostly
    padding."""
    groups, start, longest, real = [], 0, 0, 0
    for index, length in enumerate(lengths):
        longest, real = max(longest, length), real + length
        if index > start and longest * (index + 1 - start) > (1 + padding) * real:
            groups.append(range(start, index))
            start, longest, real = index, length, length
    if lengths:
        groups.append(range(start, len(lengths)))
    return groups


def _right_aligned(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """(B_i, H, S_i, D) keys or values stacked into one (sum of B_i, H, width + spare, D)
    buffer of a :class:`~specforge.models.kv_cache.GrowingKVLayer`, each part ending at column
    ``width`` (left-padded with zeros): the running batch's and the joining rows' caches in one
    copy."""
    first = parts[0]
    capacity = width + GrowingKVLayer.SPARE
    buffer = first.new_empty(sum(len(p) for p in parts), first.shape[1], capacity, first.shape[3])
    row = 0
    for part in parts:
        rows, pad = slice(row, row + len(part)), width - part.shape[2]
        buffer[rows, :, :pad] = 0
        buffer[rows, :, pad:width] = part
        row += len(part)
    return buffer


def _pad_left(tensor: torch.Tensor, columns: int, dim: int) -> torch.Tensor:
    if columns == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim)


@dataclass
class Request:
    """One prompt to answer."""

    key: Any
    """The caller's handle, returned with the answer."""
    prompt: list[int]
    """Token ids, ending with the generation prompt."""
    seed: int = 0
    """Seed of this request's sampling generator (unused when greedy)."""
    priority: int = 0
    """Waiting requests join in order of priority, then of prompt length (both highest first).
    A conversation's turns run one after another, so regeneration gives each turn the count
    of turns that follow it: the batch does not drain slowly at the end around the late
    second turns of conversations that started late."""


@dataclass
class Completion:
    """One answer, as the target produced it."""

    key: Any
    tokens: list[int]
    """Generated ids; the end-of-turn id included when ``stopped``."""
    stopped: bool
    """Ended with an end-of-turn id (else it reached ``max_new_tokens``)."""


@dataclass
class GenerationSettings:
    max_new_tokens: int
    eos_ids: list[int]
    pad_id: int
    max_batch_size: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    reclaim_fraction: float = 0.125
    """Finished rows stay (ignored) until this share of the batch is finished or prompts wait
    for a slot; then one compaction reclaims them. Waiting prompts join when this share of
    the batch is free. Each compaction and join copies the whole cache once; on a 2-core CPU
    (400 prompts, 128 in flight, bf16) an eighth ran 121 rows a step where a quarter ran 113,
    for 2.5% more tokens/s."""
    rows_per_span: int | None = None
    """Decode attention runs over spans of this many consecutive rows, each reading only the
    key columns its longest row fills (:data:`~specforge.models.kv_cache.RowSpan`).
    None: :func:`default_rows_per_span` for the model's device."""
    decode_kernel: str = "auto"
    """Decode steps' attention on CPU
    (:data:`~specforge.engine.cpu.decode_kernel.DECODE_KERNEL_MODES`)."""
    cuda_graphs: bool = True
    """On a CUDA device, batch through the engine's slot cache with each decode step replayed
    as a CUDA graph (:func:`~specforge.engine.batch.batcher_for`)."""

    def __post_init__(self) -> None:
        check_decode_kernel_mode(self.decode_kernel)


CPU_ROWS_PER_SPAN = 16
"""Rows per attention span on a CPU (``regenerate.rows_per_span: auto``)."""


def default_rows_per_span(device: torch.device, max_batch_size: int) -> int:
    """:data:`CPU_ROWS_PER_SPAN` on a CPU, where decode attention is bound by the memory it
    reads; the whole batch (one span) elsewhere: on a GPU every span is its own kernel
    launches, which cost more than the padding columns they skip."""
    return CPU_ROWS_PER_SPAN if device.type == "cpu" else max(1, max_batch_size)


AUTO_ROWS = {"cpu": 256}
"""``regenerate.batch_size: auto``'s most rows in flight on a device type;
:data:`AUTO_ROWS_DEFAULT` elsewhere. On a 2-core CPU (400 prompts, bf16) 64, 128 and 256 rows
gave 348, 362 and 390 tokens/s."""

AUTO_ROWS_DEFAULT = 1024
"""``auto``'s most rows on a GPU: there a decode step is bound by the host issuing its
kernels, so more rows cost little (an H100 with SmolLM2: 56 ms a step for 1,024 rows, 49 for
256)."""

AUTO_MEMORY_SHARE = 0.5
"""The share of the device's free memory ``auto`` gives the KV cache."""


def kv_bytes_per_token(model) -> int:
    """Bytes of cached keys and values per token over all of ``model``'s layers, measured: one
    token through the model into the cache the batcher uses (whatever its family calls its
    head counts and sizes, which the draft's config reads in the model layer above)."""
    cache = growing_cache()
    device = next(model.parameters()).device
    with torch.no_grad():
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            use_cache=True,
            **cache_kwargs(model, cache),
            logits_to_keep=1,
        )
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: CUDA's free memory, or the host's available
    memory (psutil) for a CPU and any other device."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def auto_batch_size(model, tokens_per_row: int, free_bytes: int | None = None) -> int:
    """Rows in flight for ``regenerate.batch_size: auto``: as many as
    :data:`AUTO_MEMORY_SHARE` of the free memory holds when every row caches
    ``tokens_per_row`` tokens (all rows are as wide as the longest one), at most
    :data:`AUTO_ROWS` of the device type, and at least 1."""
    device = next(model.parameters()).device
    if free_bytes is None:
        free_bytes = free_memory(device)
    fits = int(AUTO_MEMORY_SHARE * free_bytes) // (tokens_per_row * kv_bytes_per_token(model))
    return max(1, min(AUTO_ROWS.get(device.type, AUTO_ROWS_DEFAULT), fits))


@dataclass
class _Batch:
    """The running rows: their requests, tokens so far, and the model state."""

    requests: list[Request] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    cache: Cache | None = None
    mask: torch.Tensor | None = None
    """(B, S) 1 on real tokens, 0 on left padding."""
    positions: torch.Tensor | None = None
    """(B,) the position of each row's next token."""

    def __len__(self) -> int:
        return len(self.requests)


class Rows(Protocol):
    """Where a batcher keeps its rows' keys and values, and how a decode step reads them: the
    verbs :meth:`ContinuousBatcher.run` schedules (:class:`PaddedRows`, or the engine's slot
    rows, :class:`~specforge.engine.batch.SlotRows`)."""

    def new_batch(self) -> _Batch: ...

    def join(self, batch: _Batch, joining: list[Request]) -> None: ...

    def step(self, batch: _Batch) -> None: ...

    def compact(self, batch: _Batch) -> None: ...


class ContinuousBatcher:
    """Answers a stream of requests with continuous batching (see the module docstring): the
    schedule (who joins, who is done, each row's next token) over rows that keep the keys and
    values and run the forwards.

    Args:
        rows: ``(batcher) -> Rows``, called once: :class:`PaddedRows` (a left-padded HF cache)
            by default, or the engine's slot rows (:func:`~specforge.engine.batch.batcher_for`).
    """

    def __init__(self, model, settings: GenerationSettings, rows=None):
        self.model = model
        self.settings = settings
        self.device = next(model.parameters()).device
        self.steps = 0
        """Decode forwards run (for throughput reports)."""
        self.rows: Rows = (rows or PaddedRows)(self)

    @torch.no_grad()
    def run(self, pending: list[Request]) -> Iterator[Completion]:
        """Yield completions as rows finish. ``pending`` is read as it changes: the caller may
        append follow-up requests (say, a conversation's next turn) after any completion."""
        batch = self.rows.new_batch()
        while pending or len(batch):
            live = len(batch) - sum(batch.finished)
            free = self.settings.max_batch_size - live
            if pending and free > 0 and (free >= self._join_size() or live == 0):
                self.rows.compact(batch)
                pending.sort(key=lambda r: (r.priority, len(r.prompt)))
                joining = [pending.pop() for _ in range(min(free, len(pending)))]
                self.rows.join(batch, joining)
            elif live == 0:
                break
            else:
                self.rows.step(batch)
                self.steps += 1
            yield from self._collect(batch)
            if sum(batch.finished) >= max(1, self.settings.reclaim_fraction * len(batch)):
                self.rows.compact(batch)

    def _join_size(self) -> int:
        return max(1, int(self.settings.reclaim_fraction * self.settings.max_batch_size))

    def next_tokens(self, logits: torch.Tensor, generators) -> torch.Tensor:
        """(B, V) last-position logits -> (B,) next ids (greedy, or each row's own sample)."""
        if self.settings.temperature <= 0:
            # the first maximum, as argmax, but ~4x faster over a bf16 vocabulary on CPU
            return logits.max(-1).indices
        probs = warp_probs(logits, self.settings.temperature, self.settings.top_p)
        drawn = [
            torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)
        ]
        return torch.cat(drawn)

    def prefill(self, requests: list[Request]):
        """One forward over ``requests``' prompts, left-padded: their cache, mask (B, S), first
        generated ids and sampling generators."""
        inputs = left_padded([r.prompt for r in requests], self.settings.pad_id)
        mask = inputs["attention_mask"].to(self.device)
        cache = growing_cache()
        out = self.model(
            input_ids=inputs["input_ids"].to(self.device),
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            **cache_kwargs(self.model, cache),
            logits_to_keep=1,
        )
        generators = [self._generator(r) for r in requests]
        first = self.next_tokens(out.logits[:, -1], generators).tolist()
        return cache, mask, first, generators

    def _generator(self, request: Request) -> torch.Generator | None:
        if self.settings.temperature <= 0:
            return None
        return torch.Generator(device=self.device).manual_seed(request.seed)

    def _collect(self, batch: _Batch) -> Iterator[Completion]:
        """Mark rows that just ended and yield their completions."""
        eos = set(self.settings.eos_ids)
        for row, tokens in enumerate(batch.tokens):
            if batch.finished[row]:
                continue
            stopped = tokens[-1] in eos
            if stopped or len(tokens) >= self.settings.max_new_tokens:
                batch.finished[row] = True
                yield Completion(batch.requests[row].key, tokens, stopped)


class PaddedRows:
    """Rows in one left-padded HF cache (:class:`~specforge.models.kv_cache.GrowingKVLayer`
    buffers with spare columns): joins merge the prefills' caches, a step appends a column,
    a compaction copies the live rows once and drops the columns only padding fills."""

    def __init__(self, batcher: ContinuousBatcher):
        self.batcher, self.model, self.device = batcher, batcher.model, batcher.device
        settings = batcher.settings
        self.rows_per_span = settings.rows_per_span or default_rows_per_span(
            self.device, settings.max_batch_size
        )
        self.decode_attention = decode_attention_for(settings.decode_kernel)
        """What decode steps pass the model as ``decode_kernel`` (None: its own attention)."""

    def new_batch(self) -> _Batch:
        """A run's rows: nothing of one run outlives it."""
        return _Batch()

    def join(self, batch: _Batch, joining: list[Request]) -> None:
        """Prefill ``joining`` in groups of close lengths (:func:`prefill_groups`) and merge
        their caches into the batch's, all left-padded to one width."""
        parts = [] if batch.cache is None else [(batch.cache, batch.mask)]
        positions = [] if batch.positions is None else [batch.positions]
        for group in prefill_groups([len(r.prompt) for r in joining]):
            requests = joining[group.start : group.stop]
            cache, mask, first, generators = self.batcher.prefill(requests)
            batch.requests += requests
            batch.tokens += [[t] for t in first]
            batch.finished += [False] * len(requests)
            batch.generators += generators
            parts.append((cache, mask))
            positions.append(mask.sum(-1))
        width = max(mask.shape[1] for _, mask in parts)
        if len(parts) > 1:
            for layers in zip(*(cache.layers for cache, _ in parts), strict=True):
                keys = _right_aligned([layer.keys for layer in layers], width)
                values = _right_aligned([layer.values for layer in layers], width)
                layers[0].adopt(keys, values, width)
        batch.cache = parts[0][0]
        batch.mask = torch.cat([_pad_left(mask, width - mask.shape[1], 1) for _, mask in parts])
        batch.positions = torch.cat(positions)

    def step(self, batch: _Batch) -> None:
        """One decode forward over every row's last token."""
        last = torch.tensor([t[-1] for t in batch.tokens], device=self.device)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch), 1)], 1)
        spans = self._row_spans(batch.mask)
        out = self.model(
            input_ids=last[:, None],
            attention_mask=batch.mask,
            position_ids=batch.positions[:, None],
            use_cache=True,
            **cache_kwargs(self.model, batch.cache),
            logits_to_keep=1,
            row_spans=spans,  # options of the target's attention, passed down by HF
            decode_kernel=self.decode_attention,
        )
        batch.positions = batch.positions + 1
        for row, token in enumerate(
            self.batcher.next_tokens(out.logits[:, -1], batch.generators).tolist()
        ):
            if not batch.finished[row]:
                batch.tokens[row].append(token)

    def _row_spans(self, mask: torch.Tensor) -> list[RowSpan]:
        """(start, end, columns) per ``rows_per_span`` rows (:class:`GenerationSettings`): rows are
        left-padded, so a span's real keys are its last ``columns``, from its earliest first
        real column on. Rows join in order of age, so neighbours hold similar lengths."""
        # the first maximum: each row's first real column
        lengths = (mask.shape[1] - mask.max(-1).indices).tolist()
        step = max(1, self.rows_per_span)
        return [
            (start, min(start + step, len(lengths)), max(lengths[start : start + step]))
            for start in range(0, len(lengths), step)
        ]

    def compact(self, batch: _Batch) -> None:
        """Drop finished rows, and the leading columns that are padding in every row left."""
        if not any(batch.finished):
            return
        keep = [row for row, done in enumerate(batch.finished) if not done]
        for name in ("requests", "tokens", "generators"):
            setattr(batch, name, [getattr(batch, name)[row] for row in keep])
        batch.finished = [False] * len(keep)
        if not keep:
            batch.cache = batch.mask = batch.positions = None
            return
        index = torch.tensor(keep, device=self.device)
        mask = batch.mask[index]
        start = int(mask.any(0).nonzero()[0])
        for layer in batch.cache.layers:  # the kept rows' buffers, copied once
            keys, values = layer.key_buffer[index, :, start:], layer.value_buffer[index, :, start:]
            layer.adopt(keys, values, layer.length - start)
        batch.mask, batch.positions = mask[:, start:], batch.positions[index]
