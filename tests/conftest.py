"""Shared fixtures: a tiny byte-level tokenizer with a hand-written chat template and tiny random
Llama targets, all built in-process (no downloads)."""

from __future__ import annotations

import json

import pytest
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<pad>"]


def make_tiny_tokenizer(chat_template: str | None = CHATML_TEMPLATE):
    """A byte-level BPE tokenizer (one token per byte, a few merges) with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = chat_template
    return tokenizer


def make_tiny_llama(
    vocab_size: int,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    eos_token_id: int | None = None,
    initializer_range: float = 0.02,
):
    """A random Llama causal LM small enough to run many forwards per test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_target(tiny_tokenizer):
    """(model, tokenizer): a 4-layer random Llama over the tiny tokenizer's vocabulary."""
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    return make_tiny_llama(len(tiny_tokenizer), eos_token_id=eos), tiny_tokenizer


@pytest.fixture
def tiny_target_dir(tmp_path, tiny_target):
    """The tiny target saved as an HF folder (model + tokenizer), loadable by path."""
    model, tokenizer = tiny_target
    folder = tmp_path / "tiny-target"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def peaked_target_dir(tmp_path):
    """A tiny random target with large weights (a peaked, learnable next-token distribution)
    and a small memorizable conversation set."""
    tokenizer = make_tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_llama(len(tokenizer), eos_token_id=eos, initializer_range=0.3)
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for i in range(12):
            messages = [
                {"role": "user", "content": f"count {i}"},
                {"role": "assistant", "content": "one two three four five six seven " * 2},
            ]
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return folder, data
