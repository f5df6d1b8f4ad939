"""The DFlash block draft, top to bottom: a few non-causal decoder layers that predict a whole
block of tokens in one forward, reading the target's context as keys and values.

    context = hidden_norm(fc(cat(target layers' states)))      (B, S, n*Ht) -> (B, S, H)
    block   = embed_tokens([anchor, MASK, ..., MASK])          (B, Bk, H), the target's embedding
    every layer:
        x = input_layernorm(block stream)
        q = q_norm(q_proj(x))                                  the block's queries only
        k, v = k_norm(k_proj(.)), v_proj(.) of [context | x]   the context injected as K/V
        block stream += o_proj(attention(q, k, v))             non-causal inside the block
        block stream += mlp(post_attention_layernorm(block stream))
    logits = lm_head(norm(block stream))                       the target's lm_head

Slot ``k`` of a block whose anchor sits at position ``a`` runs at rotary position ``a + k`` and
predicts the token at ``a + k`` (slot 0 holds the anchor itself: at serving time the last token
the target emitted, whose own states the target has not computed yet). So a block sees the
context strictly before its anchor and every slot of its own block, nothing else.

Attention runs in two modes that must agree (a test pins it):

- :meth:`DFlashDraftModel.forward` with a :class:`DFlashCache`: serving. The context's keys and
  values are computed once per new context position and kept per layer; a block attends to all
  of them and to itself, and is never cached (the next round's block replaces it);
- :meth:`DFlashDraftModel.train_blocks`: training. The whole sequence is the context and many
  blocks (one per sampled anchor) are predicted at once under :func:`block_mask`.

The draft's width is the target's (its logits come through the target's ``lm_head``); its
embedding and ``lm_head`` are frozen copies of the target's and never saved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from specforge.errors import UserError
from specforge.models.eagle3 import config_from_dict, llama_config, rotary, target_geometry
from specforge.models.kv_cache import GrowingKVLayer

FROZEN_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
"""The target's input embedding and output head, held by the draft and never saved."""


def default_target_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """``count`` target layers spread evenly from layer 1 to layer ``L - 3`` (the outputs of
    those decoder layers, as the aux layer ids count them), or the middle layer alone for one:
    the rule SGLang applies to a DFlash config without ``target_layer_ids`` (Python's
    rounding, halves to even), so both read the same layers. DFlash's published drafts read 5.

    Raises:
        UserError: a target too shallow for ``count`` distinct layers.
    """
    if count == 1:
        return [num_layers // 2]
    last = num_layers - 3
    if count < 1 or last < count:
        raise UserError(f"{count} target layers need a target with >= {count + 3} layers")
    return [round(1 + i * (last - 1) / (count - 1)) for i in range(count)]


@dataclass
class DFlashConfig:
    """Geometry of the block draft; defaults follow the target (:meth:`from_target`)."""

    hidden_size: int
    """The target's hidden size (the draft's logits come through the target's ``lm_head``)."""
    intermediate_size: int
    num_hidden_layers: int
    """Draft decoder layers."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    """Target decoder layers whose outputs ``fc`` fuses into the context (aux-layer
    convention: layer ``i``'s output is HF ``hidden_states[i + 1]``)."""
    block_size: int
    """Tokens per block, the anchor included: a round proposes ``block_size - 1`` tokens."""
    mask_token_id: int
    """The target id whose embedding fills a block's slots after the anchor."""
    max_position_embeddings: int
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    """The target's RoPE settings (the draft runs at absolute target positions)."""
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be in 0..{self.vocab_size - 1}, got {self.mask_token_id}"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_target(
        cls,
        target_config,
        *,
        mask_token_id: int,
        num_hidden_layers: int = 1,
        block_size: int = 8,
        target_layer_ids: list[int] | None = None,
        **overrides,
    ) -> DFlashConfig:
        """A draft config matching an HF target config's width, heads, RoPE and vocabulary;
        SiLU and RMSNorm with the target's epsilon whatever the target's (what the engines'
        DFlash drafts run)."""
        from specforge.models.adapter import text_config as text_of

        layers = text_of(target_config).num_hidden_layers
        values = {
            **target_geometry(target_config),
            "num_hidden_layers": num_hidden_layers,
            "target_layer_ids": target_layer_ids
            or default_target_layer_ids(layers, count=min(5, max(layers - 3, 1))),
            "block_size": block_size,
            "mask_token_id": mask_token_id,
        }
        values.update(overrides)
        return cls(**values)

    def to_llama_config(self) -> LlamaConfig:
        """The equivalent LlamaConfig (for transformers' RoPE, MLP and norms)."""
        return llama_config(self, num_hidden_layers=self.num_hidden_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str) -> DFlashConfig:
        """A config from saved values.

        Raises:
            UserError: unknown or missing keys, or inconsistent values, naming ``where``.
        """
        return config_from_dict(cls, values, where, "DFlash")


class DFlashCache:
    """Serving: every draft layer's context keys and values (post-norm, post-RoPE), appended
    in place; a block is never cached."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [GrowingKVLayer() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Context positions cached."""
        return self.layers[0].get_seq_length()

    def crop(self, length: int) -> None:
        """Keep the first ``length`` context positions."""
        for layer in self.layers:
            layer.crop(min(length - self.length, 0))


def block_mask(anchors: torch.Tensor, keep: torch.Tensor, context: int, block_size: int):
    """Training's attention mask: (B, 1, N * Bk, S + N * Bk) bool "may attend" for ``N``
    blocks (anchors (B, N), ``keep`` (B, N) bool) over an ``S``-position context followed by
    the blocks. A block sees the context strictly before its anchor and its own slots; a
    block not kept sees its own slots only (no empty row for attention to divide by)."""
    batch, blocks = anchors.shape
    device = anchors.device
    queries = blocks * block_size
    # (N * Bk,) the block of each query slot, and of each block key
    query_block = torch.arange(queries, device=device) // block_size
    key_position = torch.arange(context, device=device)
    # (B, N * Bk, S): context keys before the query's anchor, in kept blocks
    anchor_of_query = anchors[:, query_block]
    sees_context = (key_position[None, None] < anchor_of_query[..., None]) & keep[
        :, query_block, None
    ]
    # (N * Bk, N * Bk): the query's own block
    own_block = query_block[:, None] == query_block[None, :]
    mask = torch.cat([sees_context, own_block[None].expand(batch, -1, -1)], dim=-1)
    return mask[:, None]


class DFlashAttention(nn.Module):
    """The block's queries over the context's and the block's keys, with per-head q/k norms."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) -> keys and values (B, kv_heads, T, head_dim), keys normed and rotated."""
        batch, length, _ = x.shape
        # (B, T, H) -> (B, T, kv_heads, head_dim) -> (B, kv_heads, T, head_dim)
        k = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        return rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(self, x, cos, sin, context_keys, context_values, mask) -> torch.Tensor:
        """The block ``x`` (B, Q, H) at rotary ``cos``/``sin`` (B, Q, head_dim) over the
        context's keys/values (B, kv_heads, S, head_dim) and its own; ``mask`` (B, 1, Q,
        S + Q) bool, or ``None``: everything visible."""
        batch, length, _ = x.shape
        # (B, Q, H) -> (B, heads, Q, head_dim)
        q = self.q_norm(self.q_proj(x).view(batch, length, self.num_heads, self.head_dim))
        q = rotary(q.transpose(1, 2), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        # (B, kv_heads, S, D) + (B, kv_heads, Q, D) -> (B, kv_heads, S + Q, D)
        keys, values = torch.cat([context_keys, k], 2), torch.cat([context_values, v], 2)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        # (B, heads, Q, head_dim) -> (B, Q, heads * head_dim) -> (B, Q, H)
        return self.o_proj(attn.transpose(1, 2).reshape(batch, length, -1))


class DFlashDecoderLayer(nn.Module):
    """One non-causal draft layer: attention over ``[context | block]``, then a SwiGLU MLP."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.to_llama_config())

    def forward(self, block, rope, context_keys, context_values, mask) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(block), *rope, context_keys, context_values, mask
        )
        block = block + attn
        return block + self.mlp(self.post_attention_layernorm(block))


class DFlashDraftModel(nn.Module):
    """The DFlash draft: ``fc``, ``hidden_norm``, ``layers``, ``norm``, and the target's
    ``embed_tokens`` and ``lm_head`` (frozen)."""

    frozen_weights = FROZEN_WEIGHTS
    """The target's tensors the draft holds: never saved, filled from the target on load."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.to_llama_config())

    # -- small verbs ---------------------------------------------------------------------------

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """(B, S, n * Ht) the target layers' states -> (B, S, H) the context the layers read."""
        return self.hidden_norm(self.fc(features.to(self.norm.weight.dtype)))

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """(B, N) anchor tokens -> (B, N * Bk) block ids: each anchor, then mask tokens."""
        batch, blocks = anchors.shape
        ids = torch.full(
            (batch, blocks, self.config.block_size),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchors.device,
        )
        ids[:, :, 0] = anchors
        return ids.view(batch, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, Q, H) the draft's output -> (B, Q, V) logits through the target's ``lm_head``."""
        batch, queries, width = hidden.shape
        # (B, Q, H) -> (B * Q, H): a 3-D bfloat16 input sent the product through a batched
        # matmul that copied the whole (V, H) head on every call (77 of 90 ms a round on
        # SmolLM2 on a CPU)
        return self.lm_head(hidden.reshape(batch * queries, width)).view(batch, queries, -1)

    def _blocks(self, block_ids, block_positions, context_kv, mask) -> torch.Tensor:
        """The layers over blocks ``block_ids`` (B, Q) at ``block_positions`` (B, Q), each layer
        reading its context keys/values from ``context_kv(index, layer)``; returns the normed
        output (B, Q, H)."""
        stream = self.embed_tokens(block_ids).to(self.norm.weight.dtype)
        rope = self.rotary_emb(stream, block_positions)
        for index, layer in enumerate(self.layers):
            keys, values = context_kv(index, layer)
            stream = layer(stream, rope, keys, values, mask)
        return self.norm(stream)

    # -- the two attention modes ---------------------------------------------------------------

    def forward(
        self,
        features: torch.Tensor,
        anchor: torch.Tensor,
        *,
        cache: DFlashCache,
    ) -> torch.Tensor:
        """Serving: extend the cached context by ``features`` (B, S_new, n * Ht), the target's
        states at the next ``S_new`` positions, then predict the block whose anchor ``anchor``
        (B,) sits right after them.

        Returns:
            (B, Bk - 1, V) logits of the tokens after the anchor (the block's slots 1..Bk-1).
        """
        start, count = cache.length, features.shape[1]
        batch, device = features.shape[0], features.device
        context = self.context(features)
        positions = torch.arange(start, start + count, device=device).expand(batch, -1)
        context_rope = self.rotary_emb(context, positions)
        anchor_position = start + count
        block_positions = torch.arange(
            anchor_position, anchor_position + self.config.block_size, device=device
        ).expand(batch, -1)

        def context_kv(index, layer):
            keys, values = layer.self_attn.keys_values(context, *context_rope)
            return cache.layers[index].update(keys, values)

        hidden = self._blocks(self.block_ids(anchor[:, None]), block_positions, context_kv, None)
        return self.logits(hidden[:, 1:])

    def train_blocks(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Training: ``N`` blocks per sequence in one forward. The context is the whole
        sequence's target states ``features`` (B, S, n * Ht) at positions ``0..S-1``; block
        ``j`` is anchored at ``anchors[:, j]`` (B, N) with token ``input_ids`` there and sees
        the context before it (:func:`block_mask`); ``keep`` (B, N) bool marks real blocks.

        Returns:
            (B, N, Bk, V) logits; slot ``k`` of block ``j`` predicts the token at
            ``anchors[:, j] + k`` (slot 0, the anchor, is given).
        """
        batch, length, _ = features.shape
        block_size = self.config.block_size
        context = self.context(features)
        positions = torch.arange(length, device=features.device).expand(batch, -1)
        context_rope = self.rotary_emb(context, positions)
        # (B, N) -> (B, N, Bk) -> (B, N * Bk): slot k of block j at anchors[j] + k
        offsets = torch.arange(block_size, device=features.device)
        block_positions = (anchors[..., None] + offsets).view(batch, -1)
        mask = block_mask(anchors, keep, length, block_size)

        def context_kv(index, layer):
            return layer.self_attn.keys_values(context, *context_rope)

        block_ids = self.block_ids(input_ids.gather(1, anchors))
        hidden = self._blocks(block_ids, block_positions, context_kv, mask)
        # (B, N * Bk, V) -> (B, N, Bk, V)
        return self.logits(hidden).view(batch, anchors.shape[1], block_size, -1)


def build_dflash_model(
    config: DFlashConfig,
    *,
    target_embedding: torch.Tensor,
    target_lm_head: torch.Tensor,
    target_norm: torch.Tensor | None = None,
    seed: int = 0,
) -> DFlashDraftModel:
    """A fresh DFlash draft holding the target's embedding and ``lm_head`` (frozen); its
    ``norm`` starts as the target's final norm when given, so that its head starts as the
    target's own.

    Raises:
        ValueError: shapes that do not match the config.
    """
    expected = (config.vocab_size, config.hidden_size)
    for name, tensor in (
        ("target_embedding", target_embedding),
        ("target_lm_head", target_lm_head),
    ):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = DFlashDraftModel(config)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target_embedding)
        model.lm_head.weight.copy_(target_lm_head)
        if target_norm is not None:
            model.norm.weight.copy_(target_norm)
    return model
