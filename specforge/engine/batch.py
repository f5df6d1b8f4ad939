"""Continuous batching through the engine: every row's keys and values in one preallocated
cache of ``rows x capacity`` slots, each row written at its own next slot, and the decode step
replayed as a CUDA graph per row bucket and key span on a GPU, where the eager step is bound by
launching its kernels (an H100 took 49-56 ms a step for 64 to 1,024 rows of SmolLM2).

:class:`SlotRows` are a :class:`~specforge.engine.generation.ContinuousBatcher`'s rows (the
batcher schedules, the rows keep the keys and values and run the forwards). What changes against
the default :class:`~specforge.engine.generation.PaddedRows` (same requests, same completions):
a row keeps its index while it lives; a finished row's index is taken by the
next prompt to join, whose keys and values are copied to the front of that row (from a prefill
over its group, left-padded, through the target's own forward). A decode step covers the rows
in use rounded up to a power of two (at least :data:`MIN_ROW_BUCKET`) and reads the key span
that the longest live row needs (a multiple of :data:`~specforge.engine.cache.SPAN_STEP`),
masked per row; finished and unused rows run along and write a slot no one reads, until so few
rows live that the live ones move to the front and the steps take a smaller bucket. A longer
prompt grows the cache in place, layer by layer (never two whole caches at once); what one
``run()`` knows of its rows dies with it. :func:`batcher_for` picks it on a CUDA device for a
target the engine takes (else the transformers-based batcher).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specforge.engine.cache import NamedSlotsCache, key_span, whole_spans
from specforge.engine.generation import (
    ContinuousBatcher,
    GenerationSettings,
    _Batch,
    prefill_groups,
)
from specforge.engine.graphs import graph_runner
from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from specforge.models.adapter import text_config
from specforge.models.target import default_aux_layer_ids

MIN_ROW_BUCKET = 8
"""The fewest rows a decode step covers (row buckets are powers of two from here)."""


def row_bucket(used: int, rows: int) -> int:
    """The rows a decode step covers for ``used`` rows in use, in a cache of ``rows``: a power
    of two, at least :data:`MIN_ROW_BUCKET`."""
    return min(max(MIN_ROW_BUCKET, 1 << max(used - 1, 0).bit_length()), rows)


class RowSlotLayer(CacheLayerMixin):
    """One layer's keys and values, ``(rows, kv_heads, capacity + 1, head_dim)``: a decode
    step writes each row's new token at that row's slot and reads the first ``span`` slots of
    the rows it covers."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        raise RuntimeError("a RowSlotLayer is allocated by its cache")

    def update(self, key_states, value_states, slots: torch.Tensor, span: int):
        """Write ``key_states``/``value_states`` (R, H_kv, 1, D) at slot ``slots[r]`` of row
        ``r`` and return the first ``span`` slots of the first ``R`` rows."""
        rows = torch.arange(len(slots), device=slots.device)
        self.keys[rows, :, slots] = key_states[:, :, 0]
        self.values[rows, :, slots] = value_states[:, :, 0]
        return self.keys[: len(slots), :, :span], self.values[: len(slots), :, :span]

    def get_seq_length(self) -> int:
        raise NotImplementedError("rows hold lengths of their own")

    def get_max_length(self) -> int:
        return self.keys.shape[2] - 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("the engine passes its own masks")


class RowSlotCache(NamedSlotsCache):
    """The batch's cache: :class:`RowSlotLayer` layers over ``rows`` rows of ``capacity``
    slots (a multiple of :data:`~specforge.engine.cache.SPAN_STEP`; one spare slot each, never
    read), one slot a row (R,) named per decode step."""

    def __init__(self, like: list[torch.Tensor], rows: int, capacity: int):
        # like: a prefill's keys per layer, (B, H_kv, S, D): the shape and dtype of a row
        shape = lambda keys: (rows, keys.shape[1], capacity + 1, keys.shape[3])  # noqa: E731
        layers = [
            RowSlotLayer(keys.new_zeros(shape(keys)), keys.new_zeros(shape(keys))) for keys in like
        ]
        super().__init__(layers)
        self.rows, self.capacity = rows, capacity

    def grow(self, capacity: int, done: Callable[[int], None] | None = None) -> None:
        """Room for ``capacity`` slots a row, in place, layer by layer: each layer's larger
        buffers take its keys and values and the old ones go before the next layer's are
        allocated, so growing holds one layer twice at most, not the whole cache (``done``,
        if given, is called with each layer's index once its old buffers are dropped)."""
        for index, layer in enumerate(self.layers):
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((*old.shape[:2], capacity + 1, old.shape[3]))
                new[:, :, : old.shape[2]] = old
                setattr(layer, name, new)
                del old
            if done is not None:
                done(index)
        self.capacity = capacity

    def move_rows(self, rows: list[int]) -> None:
        """Row ``rows[i]``'s keys and values to row ``i`` (a draining batch's live rows to the
        front, so its decode steps cover fewer rows)."""
        index = torch.tensor(rows, device=self.layers[0].keys.device)
        for layer in self.layers:
            layer.keys[: len(rows)] = layer.keys[index]
            layer.values[: len(rows)] = layer.values[index]

    def place(self, prefill: Cache, rows: list[int], lengths: list[int]) -> None:
        """Copy a left-padded prefill's keys and values (B, H_kv, S, D) per layer to the front
        of ``rows``: prompt ``b``'s ``lengths[b]`` real columns (its last ones) to slots
        ``0 .. lengths[b] - 1`` of row ``rows[b]``, in one indexed copy per tensor."""
        width = prefill.layers[0].keys.shape[2]
        device = self.layers[0].keys.device
        row = torch.tensor([r for r, n in zip(rows, lengths, strict=True) for _ in range(n)])
        slot = torch.cat([torch.arange(n) for n in lengths])
        source = torch.cat([torch.full((n,), b) for b, n in enumerate(lengths)])
        column = torch.cat([torch.arange(width - n, width) for n in lengths])
        row, slot, source, column = (t.to(device) for t in (row, slot, source, column))
        for ours, theirs in zip(self.layers, prefill.layers, strict=True):
            ours.keys[row, :, slot] = theirs.keys[source, :, column]
            ours.values[row, :, slot] = theirs.values[source, :, column]


@dataclass
class _SlotBatch(_Batch):
    """A run's rows in a :class:`RowSlotCache`, with what only that run may read."""

    lengths: list[int] = field(default_factory=list)
    """Per row in use: the slots it fills (its next token's slot and position)."""


class SlotRows:
    """A :class:`~specforge.engine.generation.ContinuousBatcher`'s rows in a
    :class:`RowSlotCache`, its decode steps through the engine's layer loop, replayed as CUDA
    graphs with ``graphs`` (see the module docstring).

    Raises:
        UserError: a target the engine cannot run exactly (:class:`TargetEngine`).
    """

    def __init__(self, batcher: ContinuousBatcher, *, graphs: bool):
        self.batcher, self.settings, self.device = batcher, batcher.settings, batcher.device
        model = batcher.model
        aux = default_aux_layer_ids(text_config(model.config).num_hidden_layers)
        self.engine = TargetEngine(model, aux_layer_ids=aux, compile=False)
        self.graphs = graphs
        self.capacity = 0
        """Slots a row of the last run's cache holds (0 before the first prompt joins)."""
        self.rows_per_step: Counter[int] = Counter()
        """How many decode steps covered each row bucket."""
        self._run = self.engine._layers

    def new_batch(self) -> _SlotBatch:
        return _SlotBatch()

    def join(self, batch, joining) -> None:
        """Prefill ``joining`` in groups of close lengths and place each prompt in a free row
        (a finished one, else a new one), growing the cache when a prompt needs more slots."""
        needed = max(len(r.prompt) for r in joining) + self.settings.max_new_tokens
        for group in prefill_groups([len(r.prompt) for r in joining]):
            requests = joining[group.start : group.stop]
            prefill, _, first, generators = self.batcher.prefill(requests)
            self._reserve(batch, prefill, needed)
            free = [row for row, done in enumerate(batch.finished) if done]
            rows = (free + list(range(len(batch), self.settings.max_batch_size)))[: len(requests)]
            lengths = [len(r.prompt) for r in requests]
            batch.cache.place(prefill, rows, lengths)
            for row, request, token, generator, length in zip(
                rows, requests, first, generators, lengths, strict=True
            ):
                if row == len(batch):
                    batch.requests.append(request)
                    batch.tokens.append([token])
                    batch.finished.append(False)
                    batch.generators.append(generator)
                    batch.lengths.append(length)
                else:
                    batch.requests[row], batch.tokens[row] = request, [token]
                    batch.finished[row], batch.generators[row] = False, generator
                    batch.lengths[row] = length

    def _reserve(self, batch, prefill, needed: int) -> None:
        """A cache of every row with room for ``needed`` slots a row: the batch's, grown in
        place layer by layer when it is short (:meth:`RowSlotCache.grow`)."""
        if batch.cache is not None and batch.cache.capacity >= needed:
            return
        capacity = self.capacity = whole_spans(needed)
        if batch.cache is None:
            keys = [layer.keys for layer in prefill.layers]
            batch.cache = RowSlotCache(keys, self.settings.max_batch_size, capacity)
        else:
            batch.cache.grow(capacity)
        if self.graphs:  # graphs over the new buffers (the old ones go), which stay put
            self._run = graph_runner(self.device)(self.engine._layers)

    def step(self, batch) -> None:
        """One decode forward over the rows in use (their bucket) at each row's next slot."""
        used = len(batch)
        rows = row_bucket(used, batch.cache.rows)
        self.rows_per_step[rows] += 1
        live = [row for row, done in enumerate(batch.finished) if not done]
        end = max(batch.lengths[row] for row in live) + 1
        lengths = batch.lengths + [0] * (rows - used)
        slots = torch.tensor(lengths, device=self.device)
        tokens = [t[-1] for t in batch.tokens] + [0] * (rows - used)
        tokens = torch.tensor(tokens, device=self.device)[:, None]
        # each row sees its own filled slots and the new one
        mask = torch.arange(key_span(end, batch.cache.capacity), device=self.device)
        mask = (mask[None] <= slots[:, None])[:, None, None]
        hidden, _ = self._run(tokens, slots[:, None], slots, mask, cache=batch.cache)
        logits = self.engine.transform(self.engine.head(hidden[:used, -1]))
        chosen = self.batcher.next_tokens(logits, batch.generators)[live].tolist()
        for row, token in zip(live, chosen, strict=True):
            batch.tokens[row].append(token)
            batch.lengths[row] += 1

    def compact(self, batch) -> None:
        """Where that makes the decode steps' row bucket smaller (a draining batch), the live
        rows move to the front (their keys and values with them) and finished rows are dropped;
        otherwise nothing moves and a finished row waits for the next prompt to take its index.
        The cache's buffers stay (and the graphs recorded over them)."""
        keep = [row for row, done in enumerate(batch.finished) if not done]
        if batch.cache is None or row_bucket(len(keep), batch.cache.rows) >= row_bucket(
            len(batch), batch.cache.rows
        ):
            return
        if keep and keep != list(range(len(keep))):
            batch.cache.move_rows(keep)
        for name in ("requests", "tokens", "generators", "lengths"):
            setattr(batch, name, [getattr(batch, name)[row] for row in keep])
        batch.finished = [False] * len(keep)


def batcher_for(model, settings: GenerationSettings) -> ContinuousBatcher:
    """The batcher for ``model``: on a CUDA device, with ``settings.cuda_graphs``, one over
    :class:`SlotRows` replaying CUDA graphs where the engine takes the target; else over the
    default left-padded rows."""
    device = next(model.parameters()).device
    if graph_runner(device) is not None and settings.cuda_graphs:
        try:
            return slot_batcher(model, settings, graphs=True)
        except UserError:
            pass  # a target the engine refuses: transformers' forward
    return ContinuousBatcher(model, settings)


def slot_batcher(model, settings: GenerationSettings, *, graphs: bool) -> ContinuousBatcher:
    """A :class:`~specforge.engine.generation.ContinuousBatcher` over :class:`SlotRows`
    (``batcher.rows``), replaying CUDA graphs with ``graphs``.

    Raises:
        UserError: a target the engine cannot run exactly.
    """
    return ContinuousBatcher(model, settings, rows=lambda b: SlotRows(b, graphs=graphs))
