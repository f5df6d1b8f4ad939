"""Export a DFlash block draft as the directory SGLang (``--speculative-algorithm DFLASH``) and
vLLM (``"method": "dflash"``) load, checked strictly first, written as EAGLE-3 exports are
(:func:`~specforge.serving.export.export_directory`).

What the engines read, and so what the directory holds:

- ``config.json``: ``architectures: ["DFlashDraftModel"]`` with a Qwen3 layer's geometry
  (``model_type: qwen3``: both engines' DFlash layers are Qwen3's, with per-head ``q_norm`` and
  ``k_norm``), ``num_hidden_layers`` draft layers, the target's vocabulary, positions and RoPE
  (both layouts, as for EAGLE-3; vLLM falls back to a theta of 1e6 where none is written), and
  ``dflash_config``: ``block_size``, ``mask_token_id`` and ``target_layer_ids`` (the target
  layers whose outputs ``fc`` fuses, as SGLang reads them: HF ``hidden_states[i + 1]``), with
  ``block_size`` also at the top level (older readers) and the same layers as vLLM's top-level
  ``eagle_aux_hidden_state_layer_ids`` (HF indices, ids + 1: what vLLM reads first);
- ``model.safetensors``: ``fc``, ``hidden_norm``, ``layers.{i}.*`` (q/k/v/o projections,
  ``q_norm``, ``k_norm``, the two layer norms, the SwiGLU MLP) and ``norm``; no embedding and no
  ``lm_head``: the engines use the target's (vLLM loads them only when a checkpoint ships them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specforge.config.resolve import torch_dtype
from specforge.families.dflash.model import FROZEN_WEIGHTS, DFlashConfig, DFlashDraftModel
from specforge.io import read_json, read_safetensors
from specforge.models.adapter import text_config
from specforge.serving.export import (
    ExportError,
    contract_problems,
    export_directory,
    layer_geometry,
    rope_problems,
)

ARCHITECTURE = "DFlashDraftModel"
"""What ``config.json``'s ``architectures`` names for both engines."""


def is_dflash_export(export_dir: str | Path) -> bool:
    """Whether ``export_dir`` holds a DFlash draft (its ``config.json`` names
    :data:`ARCHITECTURE`)."""
    return read_json(Path(export_dir) / "config.json").get("architectures") == [ARCHITECTURE]


def dflash_contract(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes of ``model.safetensors`` (all float, in the export dtype)."""
    hidden, head = config.hidden_size, config.head_dim
    attention, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    inner = config.intermediate_size
    shapes = {
        "fc.weight": (hidden, len(config.target_layer_ids) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(config.num_hidden_layers):
        layer = f"layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (attention, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, attention),
            f"{layer}.self_attn.q_norm.weight": (head,),
            f"{layer}.self_attn.k_norm.weight": (head,),
            f"{layer}.mlp.gate_proj.weight": (inner, hidden),
            f"{layer}.mlp.up_proj.weight": (inner, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inner),
        }
    return shapes


def dflash_config_dict(config: DFlashConfig, *, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of an exported DFlash draft (see the module docstring)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": config.num_hidden_layers,
        **layer_geometry(config),
        "target_hidden_size": config.hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": config.block_size,
        "dflash_config": {
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
        },
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "torch_dtype": dtype,
    }


def draft_config_of(exported: dict[str, Any], where: str) -> DFlashConfig:
    """The draft's config from an export's ``config.json`` (its ``dflash_config`` entries)."""
    dflash = exported.get("dflash_config") or {}
    values = {
        "hidden_size": exported.get("hidden_size"),
        "intermediate_size": exported.get("intermediate_size"),
        "num_hidden_layers": exported.get("num_hidden_layers"),
        "num_attention_heads": exported.get("num_attention_heads"),
        "num_key_value_heads": exported.get("num_key_value_heads"),
        "head_dim": exported.get("head_dim"),
        "vocab_size": exported.get("vocab_size"),
        "target_layer_ids": dflash.get("target_layer_ids"),
        "block_size": dflash.get("block_size", exported.get("block_size")),
        "mask_token_id": dflash.get("mask_token_id"),
        "max_position_embeddings": exported.get("max_position_embeddings"),
        "rope_parameters": exported.get("rope_parameters"),
        "rms_norm_eps": exported.get("rms_norm_eps"),
        "hidden_act": exported.get("hidden_act"),
    }
    missing = sorted(k for k, v in values.items() if v is None)
    if missing:
        raise ExportError(f"{where}: a DFlash config.json without {missing}")
    return DFlashConfig.from_dict(values, where)


def check_dflash_config(exported: dict[str, Any], target_config) -> None:
    """Check a DFlash ``config.json`` against the target it will serve with.

    Raises:
        ExportError: listing every mismatch.
    """
    target = text_config(target_config)
    config = draft_config_of(exported, "config.json")
    problems = []
    if exported.get("architectures") != [ARCHITECTURE]:
        problems.append(
            f"architectures is {exported.get('architectures')}, expected ['{ARCHITECTURE}']"
        )
    if exported.get("tie_word_embeddings") is not False:
        problems.append("tie_word_embeddings must be false")
    for key, want in (
        ("vocab_size", target.vocab_size),
        ("hidden_size", target.hidden_size),
        ("target_hidden_size", target.hidden_size),
        ("max_position_embeddings", target.max_position_embeddings),
        ("hidden_act", "silu"),
    ):
        if exported.get(key) != want:
            problems.append(f"{key} is {exported.get(key)!r}, the target needs {want!r}")
    layers = config.target_layer_ids
    if not all(0 <= i < target.num_hidden_layers for i in layers):
        problems.append(
            f"target_layer_ids {layers} are outside the target's {target.num_hidden_layers} layers"
        )
    if exported.get("eagle_aux_hidden_state_layer_ids") != [i + 1 for i in layers]:
        problems.append(
            "eagle_aux_hidden_state_layer_ids must be dflash_config.target_layer_ids + 1 "
            "(vLLM reads it first)"
        )
    problems += rope_problems(exported, target)
    if problems:
        raise ExportError("DFlash export config breaks the contract:\n  " + "\n  ".join(problems))


def write_dflash_export(
    out_dir: str | Path,
    *,
    model: DFlashDraftModel,
    target_config,
    dtype: str = "bfloat16",
    tokenizer=None,
) -> Path:
    """Check and write a DFlash export directory atomically.

    Raises:
        ExportError: the draft does not fit the contract or the target.
    """
    float_dtype = torch_dtype(dtype)
    exported = dflash_config_dict(model.config, dtype=dtype)
    check_dflash_config(exported, target_config)
    state = model.state_dict()
    tensors = {
        name: state[name].detach().cpu().to(float_dtype).contiguous()
        for name in dflash_contract(model.config)
    }
    expected = {name: (shape, float_dtype) for name, shape in dflash_contract(model.config).items()}
    problems = contract_problems(tensors, expected)
    if problems:
        raise ExportError("DFlash export breaks the contract:\n  " + "\n  ".join(problems))
    with export_directory(out_dir, exported, tensors, tokenizer):
        pass
    return Path(out_dir)


def load_exported_dflash(
    export_dir: str | Path,
    *,
    target_config,
    target_embedding: torch.Tensor,
    target_lm_head: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> DFlashDraftModel:
    """Load a DFlash export as a draft model (what the built-in runtime serves), checking it
    against the contract first; its embedding and ``lm_head`` are the target's.

    Raises:
        ExportError: a directory that breaks the contract.
    """
    export_dir = Path(export_dir)
    exported = read_json(export_dir / "config.json")
    check_dflash_config(exported, target_config)
    config = draft_config_of(exported, str(export_dir / "config.json"))
    tensors = read_safetensors(export_dir / "model.safetensors")
    float_dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.bfloat16
    expected = {name: (shape, float_dtype) for name, shape in dflash_contract(config).items()}
    problems = contract_problems(tensors, expected)
    if problems:
        raise ExportError(f"{export_dir} breaks the DFlash contract:\n  " + "\n  ".join(problems))
    model = DFlashDraftModel(config)
    frozen = dict(zip(FROZEN_WEIGHTS, (target_embedding, target_lm_head), strict=True))
    model.load_state_dict({**tensors, **frozen}, strict=True)
    return model.to(dtype).eval()
