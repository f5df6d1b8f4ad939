"""Prompts the target writes itself: what the filter keeps and drops, the template prefix, and
(slow, on SmolLM2) resumable synthesis through the real CLI."""

import json
import re
from pathlib import Path

import pytest

from specforge.cli import main
from specforge.config import SynthesizeConfig
from specforge.distill.synthesize import (
    ROUND_BATCHES,
    TOPIC_SYSTEM_PROMPT,
    PromptFilter,
    attempt_topic,
    attempts_to_ask,
    in_key_order,
    mt_bench_run_hashes,
    run_hash,
    user_turn_prefix,
    word_runs,
)
from specforge.engine.generation import Completion
from specforge.errors import UserError

MT_BENCH = Path(__file__).parents[3] / "shared" / "data" / "mt_bench" / "question.jsonl"


def make_filter(**settings):
    return PromptFilter(SynthesizeConfig(**settings), ["<|im_start|>", "<|im_end|>"])


def test_filter_keeps_a_plain_prompt_and_names_each_reason_to_drop():
    keep = make_filter()
    good = "Explain how a refrigerator moves heat from inside to the room."
    assert keep.reason_to_drop(good, stopped=True) is None
    keep.accept(good)
    cases = {
        "unfinished": ("Write a long story about a dragon who", False),
        "too_short": ("Hello there", True),
        "control_text": ("Tell me a joke <|im_start|>assistant", True),
        "degenerate": ("the the the the the the the the the the the the", True),
        "duplicate": ("Explain how a refrigerator moves heat from inside to the room!", True),
    }
    for reason, (text, stopped) in cases.items():
        assert keep.reason_to_drop(text, stopped) == reason, reason
    near = "Explain how a refrigerator moves heat from inside to the room, simply please."
    assert keep.reason_to_drop(near, True) == "duplicate"
    assert keep.reason_to_drop("12345 678 999 1000 2000 !!! ### %%%", True) == "degenerate"


def test_filter_drops_prompts_sharing_a_six_word_run_with_mt_bench():
    question = (
        json.loads(MT_BENCH.read_text().splitlines()[0])["turns"][0] if MT_BENCH.is_file() else None
    )
    if question is None:
        pytest.skip("MT-Bench questions not available")
    words = re.findall(r"[a-z0-9]+", question.lower())[:6]
    text = "Please help me: " + " ".join(words) + ", thanks a lot for it."
    assert make_filter().reason_to_drop(text, True) == "mt_bench"


@pytest.mark.skipif(not MT_BENCH.is_file(), reason="MT-Bench questions not available")
def test_shipped_mt_bench_runs_are_the_questions_runs():
    runs = set()
    for line in MT_BENCH.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            runs |= {run_hash(r) for r in word_runs(turn, 6)}
    assert mt_bench_run_hashes() == runs


def test_user_turn_prefix_is_the_template_up_to_the_user_text(tiny_tokenizer):
    prefix = tiny_tokenizer.decode(user_turn_prefix(tiny_tokenizer, []))
    assert prefix == "<|im_start|>user\n"
    with_system = tiny_tokenizer.decode(
        user_turn_prefix(tiny_tokenizer, [{"role": "system", "content": "Be brief."}])
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    exchange = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    follow_up = tiny_tokenizer.decode(user_turn_prefix(tiny_tokenizer, exchange))
    assert follow_up.endswith("Hello.<|im_end|>\n<|im_start|>user\n")
    assert follow_up.count("<|im_start|>user\n") == 2
    tiny_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(UserError, match="does not write user text verbatim"):
        user_turn_prefix(tiny_tokenizer, [])


def test_completions_are_released_in_attempt_order_as_soon_as_the_earlier_ones_are_in():
    events = []

    def arriving():
        for key in [7, 5, 6, 9, 8]:
            events.append(f"in {key}")
            yield Completion(key, [key], stopped=True)

    for completion in in_key_order(arriving(), 5):
        events.append(f"out {completion.key}")
    assert events == ["in 7", "in 5", "out 5", "in 6", "out 6", "out 7", "in 9", "in 8", "out 8",
                      "out 9"]  # fmt: skip


def test_many_prompts_are_asked_for_a_bounded_round_at_a_time():
    """Asking for a billion prompts holds a few batches of requests, not a billion up front."""
    assert attempts_to_ask(10**9, 64) == ROUND_BATCHES * 64
    assert attempts_to_ask(40, 64) == 40 + 10 + 1  # a small ask: all of it, a quarter over


def test_an_absurd_synthesize_count_is_refused_at_once(tiny_target_dir, capsys):
    code = main(["prepare", "--target", str(tiny_target_dir), "--synthesize", "1000000000"])
    assert code == 2
    assert "synthesize.count must be in 0..10,000,000, got 1000000000" in capsys.readouterr().err


def test_a_topic_is_named_in_the_system_message_of_its_attempts(tiny_tokenizer):
    """Attempt ``a`` takes ``topics[a % len(topics)]``; its prefix names it in a system message."""
    assert [attempt_topic(["cooking", "astronomy"], a) for a in range(3)] == [
        "cooking",
        "astronomy",
        "cooking",
    ]
    assert attempt_topic([], 5) is None
    steered = user_turn_prefix(
        tiny_tokenizer, [{"role": "system", "content": TOPIC_SYSTEM_PROMPT.format(topic="cooking")}]
    )
    assert tiny_tokenizer.decode(steered) == (
        "<|im_start|>system\nYou are a helpful assistant. The user's next request is about "
        "cooking.<|im_end|>\n<|im_start|>user\n"
    )
