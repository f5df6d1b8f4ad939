import json
from collections import Counter
from pathlib import Path

import pytest

from specforge.data.prompts import (
    CATEGORIES,
    builtin_conversations,
    builtin_prompt_records,
    is_eval_prompt,
)
from specforge.distill.synthesize import word_runs

MT_BENCH = Path(__file__).parents[3] / "shared" / "data" / "mt_bench" / "question.jsonl"


def test_at_least_300_diverse_prompts():
    records = builtin_prompt_records()
    assert len(records) >= 300
    assert len({r["id"] for r in records}) == len(records)
    assert len({r["turns"][0] for r in records}) == len(records)
    per_category = Counter(r["category"] for r in records)
    assert set(per_category) == set(CATEGORIES)
    assert min(per_category.values()) >= 30
    multi_turn = sum(len(r["turns"]) > 1 for r in records)
    assert 20 <= multi_turn < len(records)


def test_splits_partition_the_set():
    train = {c.id for c in builtin_conversations("train")}
    held_out = {c.id for c in builtin_conversations("eval")}
    everything = {c.id for c in builtin_conversations("all")}
    assert train.isdisjoint(held_out) and train | held_out == everything
    assert 0.05 < len(held_out) / len(everything) < 0.2
    assert all(is_eval_prompt(i) for i in held_out)
    with pytest.raises(ValueError, match="unknown built-in split 'dev'"):
        builtin_conversations("dev")


@pytest.mark.skipif(not MT_BENCH.is_file(), reason="MT-Bench questions not available")
def test_no_prompt_is_an_mt_bench_question():
    """No built-in prompt shares a 6-word run with any MT-Bench turn (the evaluation set)."""
    mt_bench = set()
    for line in MT_BENCH.read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            mt_bench |= word_runs(turn, 6)
    overlaps = [
        (r["id"], turn)
        for r in builtin_prompt_records()
        for turn in r["turns"]
        if word_runs(turn, 6) & mt_bench
    ]
    assert overlaps == []
