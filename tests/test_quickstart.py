import json
import logging
import re

import pytest

from specforge.config import ConfigError, QuickstartConfig, load_config
from specforge.errors import UserError
from specforge.recipes.bench import DRAFTING_PASSES
from specforge.recipes.quickstart import (
    COMPILATIONS,
    _train_budget,
    estimate_bench_seconds,
    next_round_fits,
    quickstart_config,
    train_minutes,
)


def test_training_gets_the_budget_less_prepare_and_the_bench_estimate():
    qc = QuickstartConfig(minutes=60)
    assert train_minutes(qc, prepare_seconds=20 * 60, bench_seconds=10 * 60) == pytest.approx(30)
    with pytest.raises(UserError, match=r"prepare took 39\.0 and the bench needs about 20\.0"):
        train_minutes(qc, prepare_seconds=39 * 60, bench_seconds=20 * 60)


def test_the_corpus_grows_while_the_next_round_fits_in_the_data_share():
    qc = QuickstartConfig(minutes=60, data_share=0.4, synthesize_step=200)  # 1440 s for data
    # 400 conversations in 600 s: 200 more take ~300 s
    assert next_round_fits(qc, spent_seconds=1100, round_seconds=600, round_answered=400)
    assert not next_round_fits(qc, spent_seconds=1200, round_seconds=600, round_answered=400)
    # a round that answered nothing (synthesis gave up, finished work) ends the growth
    assert not next_round_fits(qc, spent_seconds=10, round_seconds=5, round_answered=0)
    # without a share, or without a budget, the recipe's count alone
    for unbounded in (QuickstartConfig(minutes=60), QuickstartConfig(data_share=0.4)):
        assert not next_round_fits(unbounded, spent_seconds=0, round_seconds=1, round_answered=9)


def _questions(path, turns_per_question: int, questions: int = 2):
    with path.open("w") as f:
        for i in range(questions):
            turns = [f"question {i}, turn {t}: say a few words" for t in range(turns_per_question)]
            f.write(json.dumps({"question_id": i, "category": "writing", "turns": turns}) + "\n")
    return path


def test_the_bench_estimate_is_timed_once_and_kept_for_reruns(tmp_path, tiny_target_dir):
    """The first run times the bench's own target (the tiny one, in bench.dtype) on the bench's
    questions; training gets the hour less prepare and that estimate; a rerun keeps both."""
    common = [
        f"target.name_or_path={tiny_target_dir}",
        f"output_dir={tmp_path / 'out'}",
        f"bench.questions={_questions(tmp_path / 'q.jsonl', turns_per_question=2)}",
        "bench.max_new_tokens=16",
    ]
    cfg = load_config(None, [*common, "quickstart.minutes=60"])
    first = _train_budget(cfg, prepare_seconds=600)
    plan = json.loads((tmp_path / "out" / "quickstart.json").read_text())
    assert plan["prepare_seconds"] == 600.0 and plan["bench_seconds"] > 0
    assert first.train.max_minutes == pytest.approx(60 - (600 + plan["bench_seconds"]) / 60)
    # the rerun's prepare found its work done (seconds): the budget stays the first run's
    assert _train_budget(cfg, prepare_seconds=3).train.max_minutes == first.train.max_minutes
    # a new budget on the rerun is applied to the first run's prepare time and estimate
    longer = load_config(None, [*common, "quickstart.minutes=90"])
    assert _train_budget(longer, prepare_seconds=3).train.max_minutes == pytest.approx(
        first.train.max_minutes + 30
    )
    assert json.loads((tmp_path / "out" / "quickstart.json").read_text()) == plan


def test_the_bench_estimate_times_the_target_through_hf_and_the_compiled_engine(
    tmp_path, tiny_target_dir, caplog
):
    """The estimate: every turn at HF generate's per-token time once and at the engine's for
    the engine's passes (the target alone, the draft's margin, prompt lookup), plus the
    bench's compilations, each as the log reports it."""
    questions = _questions(tmp_path / "q.jsonl", turns_per_question=2, questions=3)
    cfg = load_config(
        None,
        [
            f"target.name_or_path={tiny_target_dir}",
            f"bench.questions={questions}",
            "bench.max_new_tokens=16",
            "bench.prompt_lookup_num_tokens=10",
            "engine.compile=true",
        ],
    )
    with caplog.at_level(logging.INFO, logger="specforge.recipes.quickstart"):
        seconds = estimate_bench_seconds(cfg)
    timed = re.search(
        r"([\d.]+) ms a token through HF generate, ([\d.]+) through the engine \(its decoding "
        r"graph compiled in (\d+) s\)",
        caplog.text,
    )
    hf, engine, compiled = (float(value) for value in timed.groups())
    passes = 1 + DRAFTING_PASSES + 1  # the target alone, the runtime, prompt lookup
    expected = 6 * 16 * (hf + passes * engine) / 1000 + COMPILATIONS * compiled
    # the log rounds each figure: 0.05 ms a token, half a second of compilation
    assert seconds == pytest.approx(expected, abs=COMPILATIONS * 0.5 + 0.05)
    assert hf > 0 and engine > 0
    sglang = load_config(None, [f"bench.questions={questions}", "bench.engine=sglang"])
    assert estimate_bench_seconds(sglang) == 0.0


def test_a_plan_from_before_the_estimate_keeps_its_prepare_time(tmp_path, tiny_target_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "quickstart.json").write_text(json.dumps({"prepare_seconds": 900.0}))
    questions = _questions(tmp_path / "q.jsonl", turns_per_question=1)
    cfg = load_config(
        None,
        [
            f"target.name_or_path={tiny_target_dir}",
            f"output_dir={out}",
            f"bench.questions={questions}",
            "bench.max_new_tokens=8",
            "quickstart.minutes=60",
            "engine.compile=false",  # the estimate times the eager engine, compiling nothing
        ],
    )
    budget = _train_budget(cfg, prepare_seconds=5).train.max_minutes
    plan = json.loads((out / "quickstart.json").read_text())
    assert plan["prepare_seconds"] == 900.0 and plan["bench_seconds"] > 0
    assert budget == pytest.approx(60 - (900 + plan["bench_seconds"]) / 60)


def test_the_quickstart_recipe_has_an_hour_and_bad_budgets_are_refused():
    assert quickstart_config().quickstart.minutes == 60
    bad_settings = (
        "quickstart.minutes=0",
        "quickstart.minutes=-5",
        "quickstart.data_share=1",
        "quickstart.data_share=0",
        "quickstart.synthesize_step=0",
    )
    for bad in bad_settings:
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="regenerate.backend server cannot"):
        load_config(
            None, ["quickstart.data_share=0.4", "regenerate.server_url=http://127.0.0.1:9/v1"]
        )
    with pytest.raises(ConfigError, match="quickstart.bench_share"):
        load_config(None, ["quickstart.bench_share=0.6"])  # replaced by the measured estimate
