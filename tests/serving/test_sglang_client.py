"""The SGLang client against a real HTTP server on loopback that speaks SGLang's /generate
protocol, backed by our own speculative runtime on a tiny target."""

import json

import pytest
import torch

from specforge.cli import main
from specforge.config import TargetConfig
from specforge.serving.sglang_client import sglang_generate
from specforge.serving.speculative import SpeculativeDecoder
from tests.helpers import sglang_loopback


@pytest.fixture
def server(tiny_target_dir):
    from specforge.models.target import load_target

    target, _ = load_target(TargetConfig(str(tiny_target_dir), dtype="float32"))
    decoder = SpeculativeDecoder(target, random_draft(target), aux_layer_ids=[1, 1, 0], num_steps=3)
    with sglang_loopback(decoder) as url_and_counts:
        yield url_and_counts


def random_draft(target):
    """A random draft over the tiny target's vocabulary and width."""
    from specforge.data.vocab import build_vocab_map
    from specforge.models.eagle3 import Eagle3Config, build_draft_model

    config = Eagle3Config.from_target(target.config, draft_vocab_size=64)
    vocab = build_vocab_map(torch.arange(target.config.vocab_size), 64)
    return build_draft_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=target.get_output_embeddings().weight,
        d2t=vocab.d2t,
        t2d=vocab.t2d,
        seed=1,
    )


def test_bench_against_a_loopback_sglang_server(server, tiny_target_dir, tmp_path):
    url, served = server
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "math", "turns": ["add", "again"]}) + "\n"
    )
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--engine",
            "sglang",
            "--url",
            url,
            "--target",
            str(tiny_target_dir),
            "--questions",
            str(questions),
            "--max-new-tokens",
            "10",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["turns"] == 2
    expected = served["completion_tokens"] / served["spec_verify_ct"]
    assert result["tau_sglang"] == pytest.approx(expected)
    assert result["per_category"]["math"] == pytest.approx(expected)


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(ValueError, match="did not answer /generate"):
        sglang_generate("http://127.0.0.1:9", [1, 2], max_new_tokens=2, timeout=2)
