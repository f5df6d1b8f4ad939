"""Tiny random models of the HF architectures users bring (hidden 64, 4 layers, the tiny
tokenizer's vocabulary, a sliding window or attention chunk of 16 where the architecture has
one), for the architecture matrix in ``test_architectures.py``."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 16
"""Sliding window / attention chunk of the tiny models: short enough that a test's prompts
and outputs cross it."""

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
}

MOE = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}

MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "num_key_value_heads": 4,
    "head_dim": 8,
}

SLIDING = {"sliding_window": WINDOW}

SLIDING_MIXED = {
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    # name: (model_type, settings on top of COMMON)
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral_window": ("mistral", SLIDING),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", MOE),
    "qwen2_moe": ("qwen2_moe", MOE),
    "mixtral": ("mixtral", MOE),
    "phi3": ("phi3", {"sliding_window": None}),
    "phi3_window": ("phi3", SLIDING),
    "olmo2": ("olmo2", {}),
    "glm4": ("glm4", {}),
    "glm4_moe": ("glm4_moe", MOE),
    "deepseek_v2": ("deepseek_v2", {**MOE, **MLA}),
    "deepseek_v3": ("deepseek_v3", {**MOE, **MLA}),
    "minicpm3": ("minicpm3", {**MLA, "dim_model_base": 16}),
    "granite": ("granite", {"logits_scaling": 4.0}),
    "granitemoe": ("granitemoe", {**MOE, "logits_scaling": 4.0}),
    "smollm3": ("smollm3", {}),
    "seed_oss": ("seed_oss", {}),
    "ernie4_5": ("ernie4_5", {}),
    "helium": ("helium", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {**SLIDING_MIXED, "final_logit_softcapping": 2.0}),
    "gemma3_text": (
        "gemma3_text",
        {
            **SLIDING_MIXED,
            "final_logit_softcapping": 2.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    "olmo3": ("olmo3", SLIDING_MIXED),
    "exaone4": ("exaone4", SLIDING_MIXED),
    "cohere2": ("cohere2", {**SLIDING_MIXED, "logit_scale": 0.5}),
    "llama4_text": (
        "llama4_text",
        {
            "attention_chunk_size": WINDOW,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 128,
        },
    ),
    "gpt_oss": ("gpt_oss", {**MOE, **SLIDING_MIXED}),
    "olmo": ("olmo", {}),
    "phi": ("phi", {}),
    "gpt_neox": ("gpt_neox", {}),
    "falcon": ("falcon", {"head_dim": None, "new_decoder_architecture": True, "num_kv_heads": 2}),
    "cohere": ("cohere", {"logit_scale": 0.5}),
    "starcoder2": ("starcoder2", {"sliding_window": None}),
    "stablelm": ("stablelm", {}),
    "nemotron": ("nemotron", {}),
    "apertus": ("apertus", {}),
    "gemma3": ("gemma3", {}),
    "qwen3_next": (
        "qwen3_next",
        {**MOE, "layer_types": ["linear_attention", "full_attention"] * 2},
    ),
    "lfm2": ("lfm2", {"layer_types": ["conv", "full_attention"] * 2}),
    "jamba": ("jamba", {**MOE, "attn_layer_period": 2, "attn_layer_offset": 1}),
}
"""The architecture matrix. ``mistral_window`` and ``phi3_window`` are the same classes with a
sliding window; ``gemma3`` is the multimodal checkpoint layout (``text_config``)."""


def tiny_config(name: str, vocab_size: int, eos_token_id: int):
    """The HF config of architecture ``name`` (see :data:`ARCHITECTURES`)."""
    from transformers import AutoConfig

    model_type, settings = ARCHITECTURES[name]
    values = {**COMMON, "vocab_size": vocab_size, "eos_token_id": eos_token_id, **settings}
    values = {k: v for k, v in values.items() if not (k == "head_dim" and v is None)}
    if model_type == "gemma3":  # multimodal: the text part holds the decoder
        text = {k: v for k, v in values.items() if k not in ("tie_word_embeddings",)}
        text |= SLIDING_MIXED | {"final_logit_softcapping": 2.0}
        vision = {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        }
        return AutoConfig.for_model(
            "gemma3",
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=vocab_size - 1,
            boi_token_index=vocab_size - 2,
            eoi_token_index=vocab_size - 3,
            tie_word_embeddings=False,
        )
    return AutoConfig.for_model(model_type, **values)


def save_tiny_target(name: str, tokenizer, folder: Path, seed: int = 0) -> Path:
    """A random fp32 model of architecture ``name`` over ``tokenizer``, saved as an HF folder
    (model, tokenizer and a generation config whose EOS is the tokenizer's)."""
    from transformers import AutoModelForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = tiny_config(name, len(tokenizer), eos)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # larger weights than the default init: peaked next-token distributions, like a real model
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = COMMON["pad_token_id"]
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
