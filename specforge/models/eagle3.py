"""The EAGLE-3 draft model (``LlamaForCausalLMEagle3`` semantics, docs/design.md §3.2), top to
bottom.

    aux (B, T, 3*Ht) --fc--> hidden (B, T, H)          (step 0; later steps feed back own hidden)
    embeds = embed_tokens(next token)                  (frozen copy of the target's embedding)
    x = cat(input_layernorm(embeds), hidden_norm(hidden))          (B, T, 2H)
    hidden = hidden + o_proj(attention(q/k/v_proj(x)))             residual from the hidden stream
    hidden = hidden + mlp(post_attention_layernorm(hidden))        SwiGLU
    logits = lm_head(norm(hidden))                                 (B, T, draft_vocab_size)

The pre-norm ``hidden`` is what the next draft step receives (what SGLang feeds back).

EAGLE 3.1 (``fc_norm``, ``norm_output`` in the config, as vLLM, SGLang, SpecForge and
speculators read them) changes two things against "attention drift" at deeper steps:
``fc_norm`` RMS-normalizes each of the three aux states on its own before ``fc`` (weights
``fc_norm.{0,1,2}.weight``), and ``norm_output`` hands the next step the post-``norm`` state
instead of the pre-norm residual (``lm_head`` reads that same state, so it is normed once).
Position ``t`` receives the target feature at ``t`` and the embedding of token ``t + 1`` and
predicts token ``t + 2``. ``d2t``/``t2d`` map the reduced draft vocabulary to target ids.

Attention runs in two modes that must agree (a test pins it):

- :meth:`Eagle3DraftModel.forward` with a :class:`DraftKVCache`: ordinary incremental decoding,
  as serving runs the draft (prefix once, then one token per step);
- :meth:`Eagle3DraftModel.ttt_step`: the training-time-test unroll, where position ``t`` at step
  ``k`` sees the step-0 keys at positions ``<= t`` plus its own keys of steps ``1..k``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    repeat_kv,
    rotate_half,
)

from specforge.data.vocab import hot_ids
from specforge.errors import UserError
from specforge.models.kv_cache import GrowingKVLayer

AUX_STATES = 3
"""Target layers whose residual streams ``fc`` fuses (low, middle, high)."""

FROZEN_WEIGHTS = ("embed_tokens.weight",)
"""The draft's frozen copy of the target embedding: never saved in checkpoints or (at equal
widths) exports; filled from the target on load."""


@dataclass
class Eagle3Config:
    """Geometry of the draft; defaults follow the target (:meth:`from_target`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    """The target's vocabulary size (input embedding rows, ``t2d`` length)."""
    draft_vocab_size: int
    """Rows of ``lm_head``: the reduced draft vocabulary."""
    target_hidden_size: int
    """Width of one target aux hidden state; ``fc`` takes 3x this."""
    max_position_embeddings: int
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    """The target's RoPE settings (the draft runs at absolute target positions)."""
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    fc_norm: bool = False
    """EAGLE 3.1: an RMSNorm on each aux state before ``fc``."""
    norm_output: bool = False
    """EAGLE 3.1: the next step receives the post-``norm`` hidden state."""

    def __post_init__(self) -> None:
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_target(cls, target_config, *, draft_vocab_size: int, **overrides) -> Eagle3Config:
        """A draft config matching an HF target config's geometry, RoPE and vocabulary (the
        text config of a multimodal checkpoint). The draft's activation is SiLU whatever the
        target's (SGLang's and vLLM's EAGLE-3 drafts run nothing else), its norm an RMSNorm
        with the target's epsilon, its RoPE the target's full-attention settings."""
        values = {
            **target_geometry(target_config),
            "draft_vocab_size": draft_vocab_size,
            "hidden_act": "silu",
        }
        values["target_hidden_size"] = values["hidden_size"]
        values.update(overrides)
        return cls(**values)

    def to_llama_config(self) -> LlamaConfig:
        """The equivalent one-layer LlamaConfig (for transformers' RoPE, MLP and norms)."""
        return llama_config(self, num_hidden_layers=1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str) -> Eagle3Config:
        """A config from saved values (``draft_config.json``, an export's ``config.json``).

        Raises:
            UserError: unknown or missing keys, or inconsistent values, naming ``where``.
        """
        return config_from_dict(cls, values, where, "draft")


def target_geometry(target_config) -> dict[str, Any]:
    """A draft's shape from an HF target config (the text config of a multimodal checkpoint):
    width, heads, vocabulary, positions, the target's full-attention RoPE and its norm
    epsilon, whatever the family calls them."""
    from specforge.models.adapter import config_value, draft_rope_parameters, norm_eps
    from specforge.models.adapter import text_config as text_of

    config = text_of(target_config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    return {
        "hidden_size": hidden,
        "intermediate_size": config_value(
            config, "intermediate_size", "ffn_hidden_size", default=4 * hidden
        ),
        "num_attention_heads": heads,
        "num_key_value_heads": config_value(
            config, "num_key_value_heads", "num_kv_heads", default=heads
        ),
        "head_dim": config_value(config, "head_dim", default=hidden // heads),
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config_value(config, "max_position_embeddings", default=4096),
        "rope_parameters": draft_rope_parameters(config),
        "rms_norm_eps": norm_eps(config),
    }


def llama_config(config, *, num_hidden_layers: int) -> LlamaConfig:
    """The LlamaConfig of a draft config's geometry (for transformers' RoPE, MLP and norms)."""
    return LlamaConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=dict(config.rope_parameters),
        rms_norm_eps=config.rms_norm_eps,
        hidden_act=config.hidden_act,
        num_hidden_layers=num_hidden_layers,
    )


def config_from_dict(cls, values: dict[str, Any], where: str, what: str):
    """A draft config dataclass ``cls`` from saved values.

    Raises:
        UserError: unknown or missing keys, or inconsistent values, naming ``where``.
    """
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise UserError(f"{where}: unknown {what} config keys {unknown}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise UserError(f"{where}: not a valid {what} config: {err}") from None


class DraftKVCache:
    """Keys/values of the draft's single layer for incremental decoding (post-RoPE), appended
    in place (a :class:`~specforge.models.kv_cache.GrowingKVLayer`)."""

    def __init__(self) -> None:
        self.layer = GrowingKVLayer()

    @property
    def length(self) -> int:
        return self.layer.get_seq_length()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add (B, num_key_value_heads, T, head_dim) keys/values; returns all cached ones."""
        return self.layer.update(keys, values)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions (drop rejected draft tokens)."""
        self.layer.crop(min(length - self.length, 0))


@dataclass
class TTTCache:
    """Keys/values of every TTT step so far: step 0 over all positions, steps >= 1 diagonal."""

    keys: list[torch.Tensor] = field(default_factory=list)
    """Per step, (B, num_key_value_heads, T, head_dim)."""
    values: list[torch.Tensor] = field(default_factory=list)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, heads, T, head_dim) with (B, T, head_dim) ``cos``/``sin``."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v read the ``2H``-wide concatenation of embedding and hidden."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, query_start=0):
        """Queries of positions ``query_start..T-1``, keys and values of all ``T``, with RoPE."""
        batch, length, _ = x.shape
        queries = length - query_start
        # (B, T, 2H) -> (B, heads, T, head_dim); queries only from query_start
        q = self.q_proj(x[:, query_start:]).view(batch, queries, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = rotary(q.transpose(1, 2), cos[:, query_start:], sin[:, query_start:])
        return q, rotary(k, cos, sin), v

    def _output(self, attn: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = attn.shape
        # (B, heads, T, head_dim) -> (B, T, heads * head_dim) -> (B, T, H)
        return self.o_proj(attn.transpose(1, 2).reshape(batch, length, -1))

    def forward(self, x, cos, sin, *, cache: DraftKVCache, attention_mask: torch.Tensor | None):
        """Incremental attention: new positions attend to the cache and to each other.

        ``attention_mask`` is a bool (B, 1, T_new, S_total) "may attend" mask, or ``None`` for
        causal attention over the cache plus the new positions.
        """
        q, k, v = self._project(x, cos, sin)
        past = cache.length
        keys, values = cache.append(k, v)
        if attention_mask is None:
            new, total = q.shape[2], keys.shape[2]
            # (T_new, S_total): new position i sees cached keys and new keys <= i
            attention_mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(past)
        # grouped-query heads share their key/value head inside the kernel (no repeat copy)
        attn = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=attention_mask, enable_gqa=True
        )
        return self._output(attn)

    def forward_ttt(
        self, x, cos, sin, *, cache: TTTCache, key_padding_mask: torch.Tensor, start: int = 0
    ):
        """TTT attention at step ``k = len(cache.keys)``: position ``t`` sees the step-0 keys
        at positions ``<= t`` (and not padding) plus its own keys of steps ``1..k``.

        Only positions ``start..T-1`` are computed: at step 0, ``x`` spans all ``T`` positions
        (every one is a step-0 key) and queries start at ``start``; at later steps ``x`` holds
        positions ``start..T-1`` alone (their keys are only ever read on the diagonal).
        ``key_padding_mask``: (B, T) bool, True for real tokens.
        """
        q, k, v = self._project(x, cos, sin, query_start=start if not cache.keys else 0)
        cache.keys.append(k)
        cache.values.append(v)
        groups = self.num_heads // self.num_kv_heads
        scale = self.head_dim**-0.5
        queries, length = q.shape[2], key_padding_mask.shape[1]
        k0 = repeat_kv(cache.keys[0], groups)
        v0 = repeat_kv(cache.values[0], groups)
        # 1. causal scores against step 0: (B, heads, T - start, T); query i is position start+i
        scores = torch.matmul(q, k0.transpose(2, 3)) * scale
        causal = torch.ones(queries, length, dtype=torch.bool, device=q.device)
        causal = causal.tril(length - queries)
        allowed = causal[None, None] & key_padding_mask[:, None, None, :]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        # 2. diagonal scores against steps 1..k: (B, heads, T - start, k)
        diagonal_keys = [repeat_kv(key, groups) for key in cache.keys[1:]]
        diagonal = [(q * key).sum(-1, keepdim=True) * scale for key in diagonal_keys]
        # (B, heads, T', T) + k x (B, heads, T', 1) -> (B, heads, T', T + k)
        weights = torch.cat([scores, *diagonal], dim=-1).softmax(dim=-1, dtype=torch.float32)
        weights = weights.to(q.dtype)
        # 3. weighted values: step 0 by matmul, steps 1..k elementwise on the diagonal
        attn = torch.matmul(weights[..., :length], v0)
        for j, value in enumerate(cache.values[1:]):
            attn = attn + weights[..., length + j : length + j + 1] * repeat_kv(value, groups)
        return self._output(attn)


class Eagle3DecoderLayer(nn.Module):
    """The draft's single decoder layer (``midlayer``)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config.to_llama_config())

    def forward(self, embeds, hidden, cos, sin, attend) -> torch.Tensor:
        """``attend(x, cos, sin)`` runs one of the attention modes on the ``2H`` input; it may
        return only the last ``T'`` positions (TTT's ``start``), and so does this layer."""
        # (B, T, H) + (B, T, H) -> (B, T, 2H)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn = attend(x, cos, sin)
        # residual from the hidden stream at the positions attention returned: (B, T', H)
        hidden = hidden[:, hidden.shape[1] - attn.shape[1] :] + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 draft: ``embed_tokens`` (frozen), ``fc``, ``midlayer``, ``norm``,
    ``lm_head`` and the ``d2t``/``t2d`` vocabulary maps."""

    frozen_weights = FROZEN_WEIGHTS
    """The target's tensors the draft holds: never saved, filled from the target on load."""
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(
                LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps)
                for _ in range(AUX_STATES)
            )
        self.fc = nn.Linear(AUX_STATES * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.to_llama_config())
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- small verbs ---------------------------------------------------------------------------

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, 3 * Ht) target aux states -> (B, T, H) draft hidden stream."""
        # the draft's dtype from its norm: fc may hold int8 weights (engine.cpu.int8_linear)
        aux = aux_hidden_states.to(self.norm.weight.dtype)
        if self.config.fc_norm:
            # (B, T, 3 * Ht) -> 3 x (B, T, Ht), each normed on its own -> (B, T, 3 * Ht)
            chunks = aux.chunk(AUX_STATES, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(aux)

    def feedback(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output (B, T, H) -> the state the next step receives and
        :meth:`logits` reads: the pre-norm residual, or with ``norm_output`` the normed one."""
        return self.norm(hidden) if self.config.norm_output else hidden

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """(B, T, H) a state from :meth:`feedback` -> (B, T, draft_vocab_size) logits."""
        return self.lm_head(state if self.config.norm_output else self.norm(state))

    def unrolled_inputs(
        self, input_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What an unrolled step ``k > 0`` reads (training-time test, and a chain's next draft
        step): the shifted tokens (B, T) and the previous step's state (B, T, H), as they are.
        A family that drafts differently past its first token overrides this."""
        return input_ids, hidden

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft vocabulary ids to target ids (``d + d2t[d]``)."""
        return draft_ids + self.d2t[draft_ids]

    @property
    def hot_ids(self) -> torch.Tensor:
        """(draft_vocab_size,) the target ids of the draft vocabulary, on the maps' device."""
        return hot_ids(self.d2t)

    # -- the two attention modes ---------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        cache: DraftKVCache,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One incremental draft step over ``T`` new positions (the serving path).

        Args:
            input_ids: (B, T) the tokens whose embeddings enter (token ``t + 1`` at position t).
            hidden: (B, T, H) the hidden stream: target aux states fused by :meth:`fuse`, or
                the draft's own pre-norm output of the previous step.
            position_ids: (B, T) absolute positions (RoPE).
            cache: keys/values of earlier positions; extended in place.
            attention_mask: optional bool (B, 1, T, S + T) "may attend" mask (trees); causal
                over cache + new positions when ``None``.
            logits_to_keep: logits of the last this many positions only (0: all), as HF's
                argument of that name (an extension needs its last position's alone).

        Returns:
            ``(logits (B, T or logits_to_keep, draft_vocab_size), hidden (B, T, H))``;
            ``hidden`` is the state handed to the next step (:meth:`feedback`).
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)

        def attend(x, cos, sin):
            return self.midlayer.self_attn(x, cos, sin, cache=cache, attention_mask=attention_mask)

        hidden = self.feedback(self.midlayer(embeds, hidden, cos, sin, attend))
        return self.logits(hidden[:, -logits_to_keep:]), hidden

    def ttt_step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        cache: TTTCache,
        key_padding_mask: torch.Tensor,
        start: int = 0,
    ) -> torch.Tensor:
        """One training-time-test step (see module docstring); returns the state handed to
        the next step (:meth:`feedback`), (B, T - start, H) of positions ``start..T-1``
        (logits: :meth:`logits`).

        Step ``k = len(cache.keys)`` before the call. Arguments as in :meth:`forward`, with
        ``position_ids`` = base positions + ``k`` and ``key_padding_mask`` (B, T) bool. At step
        0 the inputs span all ``T`` positions (all are step-0 keys); at later steps only
        positions ``start..T-1``, whose outputs the caller needs.
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)

        def attend(x, cos, sin):
            return self.midlayer.self_attn.forward_ttt(
                x, cos, sin, cache=cache, key_padding_mask=key_padding_mask, start=start
            )

        return self.feedback(self.midlayer(embeds, hidden, cos, sin, attend))


def build_draft_model(
    config: Eagle3Config,
    *,
    target_embedding: torch.Tensor,
    target_lm_head: torch.Tensor,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    target_norm: torch.Tensor | None = None,
    seed: int = 0,
    model_class: type[Eagle3DraftModel] | None = None,
) -> Eagle3DraftModel:
    """A fresh draft initialized from the target: the frozen embedding copied, ``lm_head`` rows
    copied from the target's rows of the draft vocabulary (and ``norm`` from the target's final
    norm, so that ``lm_head(norm(.))`` starts as the target's own output head), the maps
    installed.

    Args:
        config: the draft geometry.
        target_embedding: (V, Ht) the target's input embedding.
        target_lm_head: (V, Ht) the target's output embedding.
        target_norm: (Ht,) the target's final norm weight, or ``None`` to keep ones.
        d2t: (Vd,) int64 offsets; t2d: (V,) bool (see :mod:`specforge.data.vocab`).
        seed: initialization seed for the other weights.
        model_class: the draft class (a family that extends EAGLE-3: its own); default
            :class:`Eagle3DraftModel`.

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
    if d2t.shape != (config.draft_vocab_size,) or t2d.shape != (config.vocab_size,):
        raise ValueError(
            f"vocab maps d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
            f"draft_vocab_size={config.draft_vocab_size}, vocab_size={config.vocab_size}"
        )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = (model_class or Eagle3DraftModel)(config)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target_embedding)
        model.lm_head.weight.copy_(target_lm_head[hot_ids(d2t)])
        if target_norm is not None:
            model.norm.weight.copy_(target_norm)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


LLAMA_LAYER_WEIGHTS = {
    *(f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
}
"""The weights of a Llama-shaped decoder layer (pre-norm attention, then a pre-norm gated
MLP): whose norms and MLP mean in the target what they mean in the draft."""


def init_from_target_layer(
    model: Eagle3DraftModel, layer: dict[str, torch.Tensor], *, target_act: str | None = "silu"
) -> list[str]:
    """Start the draft's decoder layer from the target's last layer, and ``fc`` as the identity
    on the top aux layer: at initialisation the draft applies the target's last layer to the
    target's top aux state, then the target's norm and (draft-vocabulary) head.

    Where shapes allow: ``q/k/v_proj`` read ``[embedding | hidden]`` (2H wide) in the draft and
    H in the target, so their hidden half gets the target's weights (the embedding half keeps
    its random start); ``o_proj`` copies as it is. The MLP and the norms copy only from a
    Llama-shaped layer (:data:`LLAMA_LAYER_WEIGHTS`) whose activation is SiLU, as the draft's
    is: the target's ``input_layernorm`` (its measured scale, see
    :func:`specforge.models.target.target_head`) becomes the draft's ``hidden_norm``. A weight
    whose shape differs is left as initialised.

    Args:
        model: a freshly built draft (:func:`build_draft_model`).
        layer: the target's last decoder layer weights by name inside the layer.
        target_act: the target's activation name.

    Returns:
        The draft parameter names that were set from the target.
    """
    hidden = model.config.hidden_size
    sources = {f"self_attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"}
    if set(layer) <= LLAMA_LAYER_WEIGHTS and target_act in ("silu", "swish"):
        sources |= {f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        sources |= {
            "hidden_norm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight",
        }
    params = dict(model.midlayer.named_parameters())
    done = []
    with torch.no_grad():
        for name, source in sources.items():
            weight, target = params[name], layer.get(source)
            if target is None:
                continue
            if weight.shape == target.shape:
                weight.copy_(target)
            elif weight.dim() == 2 and weight.shape == (target.shape[0], 2 * target.shape[1]):
                weight[:, hidden:].copy_(target)  # the hidden half of [embedding | hidden]
            else:
                continue
            done.append(f"midlayer.{name}")
        if model.config.target_hidden_size == hidden:
            model.fc.weight.zero_()
            model.fc.weight[:, 2 * hidden :].copy_(torch.eye(hidden))
            done.append("fc.weight")
    return done


def load_draft_weights(model: Eagle3DraftModel, weights: dict[str, torch.Tensor], where: str):
    """Load saved draft weights (a checkpoint's or an export's) into ``model``; the frozen
    embedding may be absent (it is the target's).

    Raises:
        UserError: names that do not fit the draft, or shapes that differ, naming ``where``.
    """
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise UserError(f"{where}: weights do not fit the draft: {err}") from None
    missing = [k for k in missing if k not in getattr(model, "frozen_weights", FROZEN_WEIGHTS)]
    if missing or unexpected:
        raise UserError(
            f"{where}: weights do not fit the draft (missing {missing}, unexpected {unexpected})"
        )
