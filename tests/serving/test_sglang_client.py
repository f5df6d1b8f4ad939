"""The SGLang client against a real HTTP server on loopback that speaks SGLang's /generate
protocol, backed by our own speculative runtime on a tiny target."""

import json

import pytest
import torch

from specforge.cli import main
from specforge.config import TargetConfig
from specforge.serving.sglang_client import acceptance_from_histogram, sglang_generate
from specforge.serving.speculative import SpeculativeDecoder
from tests.helpers import sglang_loopback


@pytest.fixture
def decoder(tiny_target_dir):
    from specforge.models.target import load_target

    target, _ = load_target(TargetConfig(str(tiny_target_dir), dtype="float32"))
    return SpeculativeDecoder(target, random_draft(target), aux_layer_ids=[1, 1, 0], num_steps=3)


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


def test_bench_against_loopback_sglang_servers_with_and_without_the_draft(
    decoder, tiny_target_dir, tmp_path
):
    """Accept length from SGLang's verify count, acceptance per position from its histogram,
    and the speedup over a second server without speculation, whose outputs are compared."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "math", "turns": ["add", "again"]}) + "\n"
    )
    out = tmp_path / "bench"
    with (
        sglang_loopback(decoder) as (url, served),
        sglang_loopback(decoder, speculative=False) as (baseline, plain),
    ):
        code = main(
            [
                "bench",
                *("--engine", "sglang", "--url", url, "--baseline-url", baseline),
                *("--target", str(tiny_target_dir), "--questions", str(questions)),
                *("--max-new-tokens", "10", "--output", str(out)),
            ]
        )
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["turns"] == 2 and plain["completion_tokens"] == served["completion_tokens"]
    expected = served["completion_tokens"] / served["spec_verify_ct"]
    assert result["tau"] == pytest.approx(expected)
    assert result["per_category"]["math"] == pytest.approx(expected)
    # per position, from the summed histogram: P(k accepted | k - 1 accepted)
    histogram = result["accept_histogram"]
    assert sum(histogram) == served["spec_verify_ct"]
    rates = result["acceptance_per_position"]
    assert len(rates) == len(histogram) - 1 and all(0 <= r <= 1 for r in rates)
    assert rates[0] == pytest.approx(sum(histogram[1:]) / sum(histogram))
    # the baseline: same outputs, a speedup from both servers' tokens/s
    assert result["all_match"] is True and result["match_rate"] == 1.0
    speeds = result["tokens_per_s"]
    assert result["speedup"] == pytest.approx(speeds["speculative"] / speeds["baseline"])
    assert "speedup over SGLang without the draft" in (out / "bench.md").read_text()


def test_acceptance_per_position_from_a_histogram():
    # 10 verifications: 4 accepted none, 3 one, 2 two, 1 three
    assert acceptance_from_histogram([4, 3, 2, 1]) == pytest.approx([0.6, 0.5, 1 / 3])
    assert acceptance_from_histogram([0]) == []


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(ValueError, match="did not answer /generate"):
        sglang_generate("http://127.0.0.1:9", [1, 2], max_new_tokens=2, timeout=2)
