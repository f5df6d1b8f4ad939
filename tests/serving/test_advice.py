"""SGLang launch advice from the acceptance per draft position."""

import pytest

from specforge.serving.advice import advice_markdown, sglang_advice


def test_a_draft_that_holds_up_gets_the_deep_tier_and_the_adaptive_mode():
    advice = sglang_advice([0.9] * 7, "test")
    assert advice["tiers"]["7"]["predicted_accept_length"] == pytest.approx(
        1 + sum(0.9**k for k in range(1, 8)), abs=1e-3
    )
    assert advice["num_steps"] == 7 and advice["adaptive_mode_suits"]
    assert "--speculative-num-steps 7" in advice["sglang_flags"]
    assert "--speculative-num-draft-tokens 8" in advice["sglang_flags"]
    assert advice["vllm_speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 7}
    assert '"num_speculative_tokens": 7}' in advice_markdown(advice)


def test_a_weak_draft_gets_a_short_chain_no_adaptive_mode_and_a_tree_hint():
    advice = sglang_advice([0.3, 0.2, 0.1], "test")
    assert advice["num_steps"] == 1 and not advice["adaptive_mode_suits"]
    assert advice["tiers"]["5"]["extrapolated"] and not advice["tiers"]["3"]["extrapolated"]
    assert any("tree" in note for note in advice["notes"])
    assert "| 1 | 1.30 |" in advice_markdown(advice)


def test_no_acceptance_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        sglang_advice([], "test")
