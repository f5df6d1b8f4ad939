"""What the pipeline needs from any HF causal LM, found without assuming Llama's attribute names
(docs/design.md §3.1): the text config of a multimodal checkpoint, the decoder and its layers,
the final norm as a module (and the per-channel scale it applies), the norm epsilon, the
transform the model applies to its logits after ``lm_head``, the RoPE the draft runs with, and
whether the runtime can serve its cache. Where a piece cannot be found, one :class:`UserError`
names the architecture and the missing piece, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specforge.errors import UserError
from specforge.models.kv_cache import output_cache

LAYER_LIST_NAMES = ("layers", "h", "blocks")
"""Attributes of a decoder module that hold its layer list (Llama, GPT-2/Falcon, others)."""

FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
"""Attributes of a decoder module that hold its final norm, when no single child is a norm."""

EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
"""Config keys that hold the norm epsilon, by architecture family."""

ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
"""``config.layer_types`` entries the runtime serves: attention layers with a growing cache."""

TREE_ATTENTION = {"sdpa", "eager", "flex_attention"}
"""Attention implementations whose masks are built from a mask function (which tree
verification remaps, see :func:`specforge.serving.tree.tree_attention`)."""


def architecture(config) -> str:
    """A short name for messages: ``model_type`` (and the class the checkpoint names)."""
    names = getattr(config, "architectures", None) or []
    kind = getattr(config, "model_type", "?")
    return f"{kind} ({names[0]})" if names else kind


def text_config(config):
    """The decoder's config: ``config`` itself, or the text part of a multimodal checkpoint
    (``text_config`` of Gemma 3, Llama 4, ...)."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter else config


def config_value(config, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the (text) config sets to something other than ``None``."""
    config = text_config(config)
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def norm_eps(config) -> float:
    """The target's norm epsilon, whatever its family calls it (``1e-6`` if none does)."""
    return float(config_value(config, *EPS_KEYS, default=1e-6))


# ---------------------------------------------------------------------------------------------
# Decoder, layers and the final norm


def _layer_list(module: nn.Module, num_layers: int) -> nn.ModuleList | None:
    for name in LAYER_LIST_NAMES:
        layers = getattr(module, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
            return layers
    return None


def find_decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The text decoder (the module whose forward returns ``last_hidden_state`` after the
    final norm) and its layer list.

    Raises:
        UserError: naming the architecture, if no decoder with ``num_hidden_layers`` layers is
            found where HF models keep it.
    """
    num_layers = text_config(model.config).num_hidden_layers
    candidates = []
    for module in (model.get_decoder() if hasattr(model, "get_decoder") else None, model):
        if module is None:
            continue
        candidates.append(module)
        candidates.extend(
            getattr(module, name)
            for name in ("model", "language_model", "transformer")
            if isinstance(getattr(module, name, None), nn.Module)
        )
    for module in candidates:
        layers = _layer_list(module, num_layers)
        if layers is not None:
            return module, layers
    raise UserError(
        f"{architecture(model.config)}: cannot find the decoder's {num_layers} layers "
        f"(looked for {'/'.join(LAYER_LIST_NAMES)} on the decoder of {type(model).__name__})"
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (``model.layers``, ``transformer.h``, ...)."""
    return find_decoder(model)[1]


def final_norm(model: nn.Module) -> nn.Module:
    """The decoder's final norm module: its one direct child that is a norm, or a child with a
    known final-norm name.

    Raises:
        UserError: naming the architecture, if there is none or the choice is ambiguous.
    """
    decoder, _ = find_decoder(model)
    norms = [m for _, m in decoder.named_children() if "norm" in type(m).__name__.lower()]
    if len(norms) == 1:
        return norms[0]
    for name in FINAL_NORM_NAMES:
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    raise UserError(
        f"{architecture(model.config)}: cannot find the final norm of {type(decoder).__name__} "
        f"(children: {[n for n, _ in decoder.named_children()]})"
    )


@torch.no_grad()
def norm_scale(norm: nn.Module, width: int, params: dict[str, torch.Tensor] | None = None):
    """The per-channel scale (width,) a norm applies after normalising, measured: ``w`` for
    RMSNorm, ``1 + w`` for Gemma-style norms, the weight of a LayerNorm (its bias and mean
    centring are what an RMSNorm draft cannot copy), ones for a norm without weights.

    The norm runs on ``x`` and ``-x`` for a zero-mean probe of RMS 100 (an even width keeps
    the mean exactly zero): ``(norm(x) - norm(-x)) / 2`` is the scale times the normalised
    probe. ``params`` gives the norm's tensors by name (a module built on the meta device).
    """
    probe = torch.ones(width, dtype=torch.float32)
    probe[1::2] = -1.0
    probe *= 100.0
    state = {k: v.float() for k, v in params.items()} if params is not None else None
    x = torch.stack([probe, -probe])
    weight = next(norm.parameters() if state is None else iter(state.values()), None)
    if weight is not None:  # the probe where the norm's tensors are (a target on a GPU)
        probe, x = probe.to(weight.device), x.to(weight.device, weight.dtype)
    if state is None:
        out = norm(x).float()
    else:
        out = torch.func.functional_call(norm, state, (x,)).float()
    normalised = probe / probe.pow(2).mean().sqrt()
    return (out[0] - out[1]) / 2 / normalised


# ---------------------------------------------------------------------------------------------
# Logits


@dataclass(frozen=True)
class LogitTransform:
    """What the model does to ``lm_head``'s output: ``softcap * tanh(scale * z / softcap)``
    (granite and minicpm3 divide by ``logits_scaling``, cohere multiplies by ``logit_scale``,
    falcon-h1 by ``lm_head_multiplier``; the gemma family soft-caps)."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def as_dict(self) -> dict[str, float | None]:
        return {"scale": self.scale, "softcap": self.softcap}


def logit_transform(config, *, text: bool = True) -> LogitTransform:
    """The logit transform a target's config declares (see :class:`LogitTransform`): its text
    config's, or (``text=False``) the top-level config's own keys only (a multimodal class may
    not apply its text model's soft-capping; :func:`check_logits` decides by measuring)."""
    source = text_config(config) if text else config

    def value(name: str):
        return getattr(source, name, None)

    scale = 1.0
    if (divisor := value("logits_scaling")) is not None:
        scale /= float(divisor)
    for name in ("logit_scale", "lm_head_multiplier"):
        if (factor := value(name)) is not None:
            scale *= float(factor)
    softcap = value("final_logit_softcapping")
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


def lm_head_bias(model: nn.Module) -> torch.Tensor | None:
    """The output layer's bias (phi has one), or ``None``."""
    bias = getattr(model.get_output_embeddings(), "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


@torch.no_grad()
def logit_tolerance(dtype: torch.dtype, largest: float) -> tuple[float, float]:
    """``(rtol, atol)`` within which a reconstructed logit counts as the model's own: the model
    and the reconstruction apply the same transform, the model in its own dtype, so they differ
    by a few roundings of that dtype relative to each logit (``2 * eps``), plus half an
    ``eps`` of the largest logit for values near zero. In bfloat16 that refuses an undeclared
    scale of 1.02x or more, or a soft-cap that bends the top logits by as much; in float32 a
    change in the seventh digit."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    if dtype == torch.float32:
        return 1e-5, 1e-5 * max(1.0, largest)  # kernels for another shape may round apart
    return 2 * eps, eps / 2 * max(1.0, largest)


def check_logits(model: nn.Module) -> LogitTransform:
    """The transform that makes ``transform(lm_head(last hidden state))`` the model's own
    logits, checked with one forward over a few tokens (the text config's declared transform,
    else the top-level config's), so the training targets and verification logits the pipeline
    derives are the model's.

    Raises:
        UserError: naming the architecture, if neither reproduces the model's logits (it does
            something else after the decoder).
    """
    decoder, _ = find_decoder(model)
    vocab = text_config(model.config).vocab_size
    device = next(model.parameters()).device
    ids = (torch.arange(1, 9, device=device) * 7919 % vocab)[None]
    expected = model(input_ids=ids).logits.float()
    raw = model.get_output_embeddings()(decoder(input_ids=ids).last_hidden_state).float()
    rtol, atol = logit_tolerance(model.dtype, expected.abs().max().item())
    declared = logit_transform(model.config)
    errors = {}
    for transform in (declared, logit_transform(model.config, text=False)):
        # each logit within a few roundings of the model's dtype of its own value
        excess = (expected - transform(raw)).abs() - rtol * expected.abs()
        errors[transform] = excess.max().item()
        if errors[transform] <= atol:
            return transform
    raise UserError(
        f"{architecture(model.config)}: the model's logits differ from its lm_head's output by "
        f"up to {min(errors.values()) + atol:.3g} beyond rounding after the known transforms "
        f"{[t.as_dict() for t in errors]}; training targets and verification would use a "
        "wrong distribution, so this architecture is not supported"
    )


# ---------------------------------------------------------------------------------------------
# The draft's settings from the target


def draft_rope_parameters(config) -> dict[str, Any]:
    """The RoPE the draft runs with: the target's full-attention settings (per-layer-type
    settings, as Gemma 3 and OLMo 3 nest them, give their ``full_attention`` entry), with
    full rotary dimensions (the draft's attention is its own)."""
    config = text_config(config)
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    return {k: v for k, v in dict(rope).items() if k != "partial_rotary_factor"}


# ---------------------------------------------------------------------------------------------
# Serving


@torch.no_grad()
def recurrent_layers(model: nn.Module) -> str | None:
    """What is not an attention layer in this model, or ``None``: the cache the model builds for
    itself (one forward over two tokens) must be a ``DynamicCache`` of attention layers, whose
    entries can be cropped back and batched; a recurrent or convolutional layer's state can't."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = torch.ones(1, 2, dtype=torch.long, device=device)
    cache = output_cache(model(input_ids=ids, use_cache=True))
    linear = [i for i, flag in enumerate(getattr(cache, "is_linear", [])) if flag]
    if isinstance(cache, DynamicCache) and not linear:
        return None
    layer_types = getattr(text_config(model.config), "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    return "/".join(other) if other else f"non-attention ({type(cache).__name__})"


def serving_refusal(model: nn.Module) -> str | None:
    """Why the runtime cannot serve this target, or ``None``."""
    kinds = recurrent_layers(model)
    if kinds is None:
        return None
    return (
        f"{architecture(model.config)} has {kinds} layers: their recurrent state cannot be "
        "cropped to the accepted draft tokens, so speculative decoding is not supported"
    )


def tree_refusal(model: nn.Module) -> str | None:
    """Why tree verification cannot run on this target's attention, or ``None``."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation in TREE_ATTENTION or implementation == "specforge_grouped_sdpa":
        return None
    return (
        f"tree drafting needs attention masks built from a mask function (sdpa, eager or "
        f"flex_attention); {architecture(model.config)} runs {implementation!r}: set "
        "target.attn_implementation, or draft a chain (topk 1)"
    )
