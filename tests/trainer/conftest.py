import json

import pytest

from specforge.config import load_config
from tests.conftest import make_tiny_llama, make_tiny_tokenizer


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


def tiny_train_config(folder, data, output_dir, *extra):
    return load_config(
        None,
        [
            f"target.name_or_path={folder}",
            "target.dtype=float32",
            f"train.data_path={data}",
            f"output_dir={output_dir}",
            "train.dtype=float32",
            "train.lr=3e-3",
            "train.warmup_steps=3",
            "vocab.draft_vocab_size=64",
            "train.eval_fraction=0.2",
            "train.log_every=1",
            "train.ttt_length=3",
            *extra,
        ],
    )
