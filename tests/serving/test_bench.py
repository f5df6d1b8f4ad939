import json
from pathlib import Path

import pytest
import torch

from specforge.cli import main
from specforge.data.questions import BUILTIN_EVAL, load_questions
from specforge.recipes.train import train
from specforge.serving.bench import TIE_MARGIN, accept_length_by_context, divergence
from tests.helpers import tiny_train_config
from tests.serving.test_vllm_client import write_questions


def _bench(tmp_path, peaked_target_dir, *options: str, suite: bool = False) -> Path:
    """Train a draft 3 steps on the peaked tiny target, export it and bench it on three turns
    with ``options`` (``suite``: and on a second question file in the same run); returns the
    bench folder."""
    folder, data = peaked_target_dir
    run = train(tiny_train_config(folder, data, tmp_path / "run", "train.max_steps=3"))
    export = tmp_path / "export"
    assert main(["export", str(run.checkpoint), str(export), "--dtype", "float32"]) == 0
    questions = write_questions(tmp_path)
    out = tmp_path / "bench"
    asked = str(questions)
    if suite:
        second = tmp_path / "gsm8k.jsonl"
        second.write_text(json.dumps({"question": "the thin end of the numbers"}) + "\n")
        asked = f"{questions},{second}"
    arguments = ["--target", str(folder), "--draft", str(export), "--questions", asked]
    assert main(["bench", *arguments, "--output", str(out), *options]) == 0
    return out


def test_bench_cli_end_to_end(tmp_path, peaked_target_dir, capsys):
    out = _bench(
        tmp_path,
        peaked_target_dir,
        *("--num-steps", "3", "--max-new-tokens", "12"),
        "--target-compile",  # the compiled baseline's outputs are the reference too
        *("--compile", "true"),  # auto would not compile for 3 short turns
    )
    result = json.loads((out / "bench.json").read_text())
    for key in (
        "tau",
        "tau_sglang",
        "speedup",
        "all_match",
        "per_category",
        "acceptance_per_position",
        "tokens_per_s",
    ):
        assert key in result
    assert result["all_match"] is True and result["turns"] == 3
    assert set(result["per_category"]) == {"math", "writing"}
    assert len(result["acceptance_per_position"]) == 3 and result["tau"] >= 1.0
    assert result["tau_sglang"] >= result["tau"]
    cost = result["cost"]
    assert cost["draft_ms_per_round"] > 0 and cost["verify_ms_per_round"] > 0
    names = ("draft", "verify", "extend", "prefill", "other")
    parts = sum(cost[f"{name}_ms_per_round"] for name in names)
    assert abs(parts - cost["round_ms"]) < 1e-6 and cost["prefill_ms_per_round"] > 0
    # the target's own prefill is part of the prefills; the rest of "outside" is what
    # speculation adds
    assert 0 < cost["target_prefill_ms_per_round"] < cost["prefill_ms_per_round"]
    outside = cost["round_ms"] - cost["draft_ms_per_round"] - cost["verify_ms_per_round"]
    assert abs(cost["added_ms_per_round"] + cost["target_prefill_ms_per_round"] - outside) < 1e-6
    # depth 3, except where fewer tokens were left of a turn's budget (at most 3 such rounds)
    turns = result["turn_details"]
    histogram = result["depth_histogram"]
    assert sum(histogram.values()) == sum(len(t["accepted_per_round"]) for t in turns)
    assert set(histogram) <= {"0", "1", "2", "3"}
    assert sum(histogram.values()) - histogram["3"] <= 3 * len(turns)
    assert result["sglang_advice"]["sglang_flags"].startswith("--speculative-algorithm EAGLE3")
    report = (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 1000 and "tau_sglang" in report
    # the draft's dtype (bench.draft_dtype, resolved) is recorded and shown
    draft_dtype = result["settings"]["draft_dtype"]
    quantize = result["settings"]["draft_quantize"]  # resolved too: int8 or none
    weights = ", int8 weights" if quantize == "int8" else ""
    assert draft_dtype in ("bfloat16", "float32") and f"({draft_dtype}{weights})" in report
    assert quantize in ("int8", "none")
    # the baseline is the target alone through the engine the runtime verifies with,
    # compiled (engine.compile true), within its two graphs, and its outputs were HF
    # generate's; the report names it and the speedup over HF generate too
    engine = result["engine"]
    assert result["settings"]["engine_compile"] == "true" and engine["compiled"] is True
    assert engine["path"] == "compiled" and engine["why"] == "engine.compile is true"
    assert 1 <= engine["compilations"] <= 2 and engine["warm_up_seconds"] > 0
    # compiled before anything was timed (the longest turn's buffers taken first)
    assert engine["prepared_graphs"] >= 1 and engine["graphs_in_timed_turns"] == 0
    assert result["engine_all_match"] is True and result["speedup_vs_hf_generate"] > 0
    assert "the target alone through the same engine, compiled" in report
    assert result["tokens_per_s"]["target"] > 0 and result["tokens_per_s"]["target_hf"] > 0
    # prompt lookup (on by default) is verified through the same engine: the target's outputs,
    # at least a token a round
    assert result["prompt_lookup_all_match"] is True and result["tau_prompt_lookup"] >= 1.0
    lookup = f"{result['speedup_prompt_lookup']:.2f}x (tau {result['tau_prompt_lookup']:.3f})"
    assert lookup in report
    assert result["lookup_rounds"] == 0  # a fixed depth verifies the draft's tokens only
    progress = capsys.readouterr().err  # a sign of life: turns done, tokens/s, running tau
    assert "bench: 100%" in progress and "3/3" in progress and "tau=" in progress


def test_bench_auto_depth_reports_its_calibration_and_chosen_depths(tmp_path, peaked_target_dir):
    out = _bench(
        tmp_path,
        peaked_target_dir,
        *("--num-steps", "auto", "--max-new-tokens", "24", "--compile", "false"),
    )
    result = json.loads((out / "bench.json").read_text())
    assert result["all_match"] is True and result["engine_all_match"] is True
    assert result["engine"]["compiled"] is False and result["engine"]["compilations"] == 0
    assert result["engine"]["path"] == "eager engine"
    rounds = sum(len(t["accepted_per_round"]) for t in result["turn_details"])
    assert sum(result["depth_histogram"].values()) == rounds
    assert 0 <= result["dormant_rounds"] <= result["depth_histogram"].get("0", 0)
    assert 0 <= result["sibling_hits"] <= result["sibling_rounds"] <= rounds
    calibration = result["calibration"]
    # the verifications calibrated: the last token and up to 10 of prompt lookup's (wider
    # than the draft's 7)
    assert len(calibration["verify_ms"]) == 11 and all(ms > 0 for ms in calibration["verify_ms"])
    assert len(calibration["final_acceptance_estimate"]) == 7
    report = (out / "bench.md").read_text()
    assert "calibration (num_steps auto)" in report and "the draft slept through" in report
    assert "rounds with siblings of the first token" in report
    assert result["settings"]["auto_lookup"] == 10  # prompt lookup competes with the draft
    assert 0 <= result["lookup_rounds"] <= rounds
    assert f"(rounds that verified prompt lookup's tokens) | {result['lookup_rounds']} |" in report


def test_a_suite_reports_each_set_apart(tmp_path, peaked_target_dir):
    """``--questions A,B``: one run, the totals over every turn, and per set its turns,
    ``tau``, speedup, identical outputs and acceptance per position, a table each in
    bench.md."""
    out = _bench(
        tmp_path,
        peaked_target_dir,
        *("--num-steps", "2", "--max-new-tokens", "8", "--compile", "false"),
        suite=True,
    )
    result = json.loads((out / "bench.json").read_text())
    first, second = str(tmp_path / "question.jsonl"), str(tmp_path / "gsm8k.jsonl")
    assert list(result["per_set"]) == [first, second] and result["turns"] == 4
    assert [result["per_set"][s]["turns"] for s in (first, second)] == [3, 1]
    for part in result["per_set"].values():
        assert part["all_match"] is True and part["speedup"] > 0 and part["tau"] >= 1.0
        assert len(part["acceptance_per_position"]) == 2
    report = (out / "bench.md").read_text()
    assert f"## {first} (3 turns)" in report and f"## {second} (1 turns)" in report


def test_question_sources(tmp_path):
    held_out = load_questions(BUILTIN_EVAL)
    assert 20 < len(held_out) < 60 and all(q.turns for q in held_out)
    conversations = tmp_path / "c.jsonl"
    conversations.write_text(
        json.dumps(
            {
                "id": "x",
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "c"},
                ],
            }
        )
        + "\n"
    )
    (question,) = load_questions(str(conversations))
    assert question.turns == ["a", "c"] and question.category == "conversations"


def test_accept_length_by_context_follows_each_round_along_its_turn():
    """A round starts where the prompt, the prefill's token and the earlier rounds end; its
    tokens are its accepted ones and the bonus token."""
    turns = [
        {"prompt_tokens": 250, "accepted_per_round": [2, 0, 4]},  # rounds at 251, 254, 255
        {"prompt_tokens": 600, "accepted_per_round": [1]},  # at 601
    ]
    assert accept_length_by_context(turns) == [
        {"from": 0, "to": 256, "rounds": 3, "tokens": 9, "tau": 3.0},
        {"from": 512, "to": 1024, "rounds": 1, "tokens": 2, "tau": 2.0},
    ]
    far = accept_length_by_context([{"prompt_tokens": 10_000, "accepted_per_round": [0]}])
    assert far == [{"from": 8192, "to": None, "rounds": 1, "tokens": 1, "tau": 1.0}]


def test_a_divergence_names_its_position_and_the_targets_top_two_margin(tiny_target):
    model, _ = tiny_target
    ids = torch.tensor([[3, 5, 7, 11]])
    reference, other = [13, 17, 19], [13, 23, 19]
    found = divergence(model, ids, reference, other)
    logits = model(torch.tensor([[3, 5, 7, 11, 13]])).logits[0, -1].float()
    first, second = logits.topk(2).values.tolist()
    assert found["position"] == 1 and (found["reference_token"], found["token"]) == (17, 23)
    assert found["margin"] == pytest.approx(first - second)
    assert found["tie"] == (found["margin"] < TIE_MARGIN)
    shorter = divergence(model, ids, reference, [13])  # stopped early: leaves at its end
    assert (shorter["position"], shorter["token"]) == (1, None)


def test_a_turn_only_one_side_answered_is_a_mismatch():
    """Against the baseline, a missing turn is not skipped: ``all_match`` is False and the
    match rate counts it."""
    from specforge.serving.agreement import against_baseline

    spec = [{"tokens": 4, "seconds": 1.0, "token_ids": [1, 2]} for _ in range(3)]
    report = against_baseline(spec, spec[:2], "token_ids")
    assert report["all_match"] is False and report["match_rate"] == 2 / 3
    assert against_baseline(spec, spec, "token_ids")["all_match"] is True
