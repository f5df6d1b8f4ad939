"""A KV cache preallocated once and written by slot (docs/design.md §7).

Each layer holds ``(rows, kv_heads, capacity, head_dim)`` key and value buffers. A forward writes
its new tokens' keys and values at the slots the engine names on the cache
(:meth:`SlotKVCache.write_at`) and reads the first ``key_span`` slots, a size taken from a short
list of buckets, so a compiled forward sees few shapes. What the cache holds is a length: a crop
moves it, a tree's accepted path is moved into place by :func:`gather_cache` (as in any
HF cache, then cropped), and nothing is reallocated while a sequence lives. The caches of one
engine take their buffers from its :class:`SlotKVPool` in turn, so every sequence writes to the
same addresses (what a CUDA graph replays over).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specforge.models.eagle3 import DraftKVCache

SPAN_STEP = 256
"""Key spans are multiples of this many slots: the compiled attention reads at most this many
free slots beyond a sequence's end, and a sequence crosses a new span every 256 tokens."""


def whole_spans(slots: int) -> int:
    """``slots`` rounded up to a multiple of :data:`SPAN_STEP` (a cache's capacity, so that
    every key span is a bucket)."""
    return -(-slots // SPAN_STEP) * SPAN_STEP


def key_span(end: int, capacity: int) -> int:
    """The slots a forward whose last token sits at slot ``end - 1`` reads: ``end`` rounded up
    to a multiple of :data:`SPAN_STEP`, at most ``capacity``."""
    return min(whole_spans(end), capacity)


class SlotKVPool:
    """The buffers of one engine's caches, one sequence at a time: a cache's first forward takes
    the buffers the previous cache wrote (zeroed) when they are large enough, so a CUDA graph
    recorded over them replays for every later sequence instead of being recorded again at new
    addresses; larger ones are allocated only when a sequence needs more slots. Each take is a
    new claim, and a cache whose buffers a newer cache took refuses to run
    (:meth:`SlotKVCache.check_claim`): two live sequences never share slots."""

    def __init__(self):
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.claim = 0
        self.generation = 0
        """Counts the buffers allocated: what was recorded over older ones is stale."""

    def take(
        self, layer: int, keys_like: torch.Tensor, values_like: torch.Tensor, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value buffers ``(B, H_kv, >= slots, D_k)`` and ``(B, H_kv, >= slots,
        D_v)`` for ``layer``, shaped and typed like ``keys_like`` and ``values_like`` (the
        head sizes differ in multi-head latent attention), reused when the pool's fit."""
        held = self.buffers.get(layer)
        if held is not None and all(
            _fits(buffer, like, slots)
            for buffer, like in zip(held, (keys_like, values_like), strict=True)
        ):
            # zeros: a slot never written is masked, never NaN (NaN * 0 is NaN)
            return held[0].zero_(), held[1].zero_()
        keys, values = (
            like.new_zeros((*like.shape[:2], slots, like.shape[-1]))
            for like in (keys_like, values_like)
        )
        self.buffers[layer] = keys, values
        self.generation += 1
        return keys, values


def _fits(buffer: torch.Tensor, like: torch.Tensor, slots: int) -> bool:
    """Whether ``buffer`` (B, H, S, D) holds ``slots`` positions of states shaped like
    ``like`` (B, H, T, D)."""
    return (
        buffer.shape[:2] == like.shape[:2]
        and buffer.shape[3] == like.shape[3]
        and buffer.shape[2] >= slots
        and (buffer.dtype, buffer.device) == (like.dtype, like.device)
    )


class SlotKVLayer(CacheLayerMixin):
    """One layer's preallocated keys and values, written at the slots a forward names."""

    is_compileable = True
    is_croppable = True

    def __init__(self, capacity: int, pool: SlotKVPool, index: int):
        super().__init__()
        self.capacity = capacity
        self.pool, self.index = pool, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # (B, H_kv, capacity + 1 or more, D_k or D_v), from the pool: the spare last slot is
        # never read, so every span is a strict prefix of the buffers (a compiled read of all of
        # them would be another graph)
        self.keys, self.values = self.pool.take(
            self.index, key_states, value_states, self.capacity + 1
        )
        self.is_initialized = True

    def update(self, key_states, value_states, slots: torch.Tensor, span: int):
        """Write ``key_states``/``value_states`` (B, H_kv, T, D) at ``slots`` (T,) and return the
        first ``span`` slots of the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys[:, :, :span], self.values[:, :, :span]

    def get_seq_length(self) -> int:
        raise NotImplementedError("a SlotKVCache's length is the cache's, not a layer's")

    def get_max_length(self) -> int:
        return self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("the engine passes its own masks")


class NamedSlotsCache(Cache):
    """An HF cache whose layers write where the engine names: :meth:`write_at` before each
    forward, then every layer's ``update(keys, values, slots, key_span)``."""

    def __init__(self, layers: list[CacheLayerMixin]):
        super().__init__(layers=layers)
        self.slots: torch.Tensor | None = None
        """Where the forward in progress writes, set by :meth:`write_at`."""
        self.key_span = 0
        """How many slots the forward in progress reads."""

    def write_at(self, slots: torch.Tensor, key_span: int) -> None:
        """Name the slots the next forward writes and the span it reads. The engine sets them
        on the cache, not as keyword arguments of the layers: transformers hands a layer's
        extra arguments to ``Cache.update`` only from some 5.x releases on."""
        self.slots, self.key_span = slots, key_span

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Layer ``layer_idx``'s keys and values at the slots :meth:`write_at` named (what
        transformers passes beside them is not needed)."""
        if self.slots is None:
            raise RuntimeError(f"{type(self).__name__}.update before write_at named the slots")
        return self.layers[layer_idx].update(key_states, value_states, self.slots, self.key_span)


class SlotKVCache(NamedSlotsCache):
    """A preallocated HF cache of ``num_layers`` :class:`SlotKVLayer` layers holding ``length``
    positions in slots ``0 .. length - 1`` (slots (T,) named per forward); slots past
    ``length`` are free (masked)."""

    def __init__(self, num_layers: int, capacity: int, pool: SlotKVPool | None = None):
        self.pool = SlotKVPool() if pool is None else pool
        super().__init__([SlotKVLayer(capacity, self.pool, i) for i in range(num_layers)])
        self.capacity = capacity
        self.length = 0
        self.claim: int | None = None
        """The pool's claim this cache's buffers were taken under (at its first forward)."""

    def next_slots(self, count: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """Before a forward over ``count`` new tokens: their slots (the cache's next ones) and
        the key span it reads, once the cache has room and its claim holds.

        Raises:
            ValueError: more tokens than the cache has room for.
            RuntimeError: a newer cache of the same pool has taken the buffers.
        """
        end = self.length + count
        if end > self.capacity:
            raise ValueError(f"{end} tokens exceed the cache's capacity of {self.capacity}")
        self.check_claim()
        return torch.arange(self.length, end, device=device), key_span(end, self.capacity)

    def append(self, key_states, value_states):
        """A one-layer cache as the draft's attention writes it (the interface of
        :class:`~specforge.models.eagle3.DraftKVCache`): layer 0's :meth:`update`."""
        return self.update(key_states, value_states, 0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    @property
    def allocated(self) -> bool:
        """Whether a forward has taken the buffers (the first one does)."""
        return self.layers[0].is_initialized

    def check_claim(self) -> None:
        """Before a forward: a new cache takes a new claim of the pool's buffers; one whose
        buffers a newer cache took raises.

        Raises:
            RuntimeError: a newer cache of the same pool has taken the buffers.
        """
        if self.claim is None:
            self.pool.claim += 1
            self.claim = self.pool.claim
        elif self.claim != self.pool.claim:
            raise RuntimeError(
                "this cache's buffers were taken by a newer cache of the same engine: one "
                "sequence at a time per engine"
            )

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (HF's convention: a negative count drops that
        many from the end)."""
        self.length = max(self.length + max_length if max_length < 0 else max_length, 0)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of an HF cache or a :class:`DraftKVCache`."""
    if isinstance(cache, DraftKVCache):
        cache.crop(length)
        return
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def gather_cache(cache, prefix: int, rows: list[int]) -> None:
    """Keep the first ``prefix`` positions of every layer of an HF cache and, after them,
    positions ``prefix + r`` for ``r`` in ``rows`` (increasing); the rest is dropped. Rows
    already in their slot stay; the others move into place, then the cache is cropped."""
    if isinstance(cache, SlotKVCache):
        cache.check_claim()
    moved = next((slot for slot, row in enumerate(rows) if row != slot), len(rows))
    end = prefix + len(rows)
    if moved < len(rows):
        index = torch.tensor([prefix + r for r in rows[moved:]], dtype=torch.long)
        for layer in cache.layers:
            index = index.to(layer.keys.device)
            # the source rows are gathered first, so overlapping slots are safe
            layer.keys[:, :, prefix + moved : end] = layer.keys[:, :, index]
            layer.values[:, :, prefix + moved : end] = layer.values[:, :, index]
    crop_cache(cache, end)
