"""KV caches that append in place: buffers with spare columns, the cached positions a view of
their first columns, a crop only moving the end. Self-distillation's continuous batching and
the speculative runtime (target and draft) extend and crop their caches every step; an HF
``DynamicCache`` re-allocates the whole cache at every append (``torch.cat``)."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer


def cache_kwargs(module: torch.nn.Module, cache) -> dict:
    """``{keyword: cache}`` for ``module``'s forward. transformers 5.24 renamed the KV cache
    argument ``past_key_values`` to ``cache`` (the old name warns on every call and goes in
    5.40); earlier 5.x releases know only ``past_key_values``. The keyword is read from the
    forward's signature, once per class."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(cls: type) -> str:
    parameters = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def output_cache(outputs):
    """The KV cache a forward returned (``outputs.cache`` from transformers 5.24 on,
    ``outputs.past_key_values`` before), or ``None``."""
    key = next((k for k in ("cache", "past_key_values") if k in outputs), None)
    return None if key is None else outputs[key]


class GrowingKVLayer(DynamicLayer):
    """A cache layer whose keys/values sit in buffers with spare columns: appending writes in
    place (``keys``/``values`` are views), and the buffers grow by :attr:`SPARE` columns."""

    SPARE = 128

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self.key_buffer is None or self.length + new > self.key_buffer.shape[-2]:
            self._grow(key_states, value_states, self.length + new + self.SPARE)
        end = self.length + new
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        # (B, H, S, D) buffers with S = capacity; earlier columns copied once
        keys = key_states.new_empty(*key_states.shape[:2], capacity, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:2], capacity, value_states.shape[-1])
        if self.length:
            keys[:, :, : self.length] = self.key_buffer[:, :, : self.length]
            values[:, :, : self.length] = self.value_buffer[:, :, : self.length]
        self.key_buffer, self.value_buffer = keys, values

    def adopt(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        """Continue from buffers (B, H, capacity, D) whose first ``length`` columns hold the
        cached positions (after a compaction or a join), without copying them."""
        self.key_buffer, self.value_buffer, self.length = key_buffer, value_buffer, length
        self.keys = key_buffer[:, :, :length]
        self.values = value_buffer[:, :, :length]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (HF's convention: a negative count);
        the buffers keep their columns for the next append."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized or self.key_buffer is None:
            return
        self.length = max(self.length + tokens_to_remove, 0)
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]


def growing_cache() -> Cache:
    """An HF cache made of :class:`GrowingKVLayer` layers."""
    return Cache(layer_class_to_replicate=GrowingKVLayer)


RowSpan = tuple[int, int, int]
"""``(start, end, columns)``: batch rows ``start:end`` attend over their last ``columns`` keys.
Continuous batching passes a list of them to the model's forward as ``row_spans`` (the target's
grouped attention, :func:`~specforge.models.target.grouped_sdpa_attention`, reads it): for
left-padded (right-aligned) rows whose keys before that are padding in every row of the span, a
batch whose rows have very different lengths then reads only their real keys and values."""
