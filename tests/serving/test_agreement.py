"""The engine gate: an engine's accept length beside the built-in runtime's on the same turns,
and the export's contract check by check (a zeroed ``d2t`` named; a good export clean)."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from specforge.cli import main, parse_args, stage_config
from specforge.errors import UserError
from specforge.families.dispatch import export_checks
from specforge.recipes.export import check_with_vllm
from specforge.recipes.train import train
from specforge.serving.agreement import agreement
from tests.helpers import tiny_train_config
from tests.serving.test_vllm_client import bench_against_standins, write_questions
from tests.serving.vllm_standin import serve_in_thread


def turns(*rows):
    return [{"question_id": q, "turn": t, "emitted": e, "verifications": v} for q, t, e, v in rows]


def test_the_gate_compares_the_turns_both_ran():
    builtin = {
        "turn_details": turns((1, 0, 20, 10), (1, 1, 30, 10), (2, 0, 99, 1)),
        "acceptance_per_position": [0.6, 0.5],
    }
    engine = {
        "tau": 2.2,
        "turn_details": [{"question_id": 1, "turn": 0}, {"question_id": 1, "turn": 1}],
        "acceptance_per_position": [0.55, 0.5],
    }
    found = agreement(builtin, engine, margin=0.10)
    assert found["turns"] == 2 and found["builtin_tau"] == 2.5  # (20 + 30) / 20
    assert found["gap"] == pytest.approx(0.12) and not found["agrees"]
    assert agreement(builtin, engine, margin=0.15)["agrees"]
    with pytest.raises(UserError, match="shares no turn"):
        agreement(builtin, {**engine, "turn_details": [{"question_id": 9, "turn": 0}]})


@pytest.fixture
def checkpoint(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    return train(tiny_train_config(folder, data, tmp_path / "run", "train.max_steps=2")).checkpoint


@pytest.fixture
def export(tmp_path, peaked_target_dir, checkpoint):
    folder, _ = peaked_target_dir
    out = tmp_path / "export"
    assert main(["export", str(checkpoint), str(out), "--dtype", "float32"]) == 0
    return folder, out


def test_the_export_checks_pass_a_good_export_and_name_a_zeroed_d2t_or_a_flipped_norm(
    tmp_path, export
):
    folder, good = export
    target = AutoConfig.from_pretrained(folder)
    assert [c["problem"] for c in export_checks(good, target)] == [None] * 4
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["d2t"].zero_()  # draft id d read as target id d: in range, injective, wrong
    save_file(tensors, broken / "model.safetensors")
    problems = {c["check"][:8]: c["problem"] for c in export_checks(broken, target)}
    assert problems["config.j"] is None and problems["aux laye"] is None
    assert "t2d" in problems["weights:"] or "d2t" in problems["weights:"]
    assert "model.safetensors changed since specforge wrote" in problems["files as"]
    # norm_output flipped by hand: a valid config both runtimes would read alike
    flipped = tmp_path / "flipped"
    shutil.copytree(good, flipped)
    config = json.loads((flipped / "config.json").read_text())
    (flipped / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    problems = {c["check"][:8]: c["problem"] for c in export_checks(flipped, target)}
    assert problems == {**dict.fromkeys(problems), "files as": problems["files as"]}
    assert "config.json changed since specforge wrote" in problems["files as"]


def test_bench_reports_the_gate_beside_vllms_figures(tmp_path, export, caplog):
    folder, good = export
    builtin = tmp_path / "builtin.json"
    builtin.write_text(
        json.dumps(
            {
                "turn_details": turns((1, 0, 40, 10), (1, 1, 40, 10), (2, 0, 40, 10)),
                "acceptance_per_position": [0.9, 0.8, 0.7],
            }
        )
    )
    _, out = bench_against_standins(
        tmp_path, folder, "--draft", str(good), "--agree-with", str(builtin)
    )
    found = json.loads((out / "bench.json").read_text())["agreement"]
    # the stand-in accepted 1 + 12/18 a round against the built-in 4.0: far below the margin
    assert found["builtin_tau"] == 4.0 and not found["agrees"]
    assert all(c["problem"] is None for c in found["checks"])
    assert "Against the built-in runtime (3 turns): DISAGREE" in (out / "bench.md").read_text()
    assert "export checks failed: none" in caplog.text


def test_export_verify_engine_gates_and_records_in_the_export(tmp_path, checkpoint, caplog):
    """``export --verify-engine vllm``: the built-in runtime and vLLM (the stand-in) on the same
    turns after writing, the outcome in specforge-export.json; the same gate on a copy whose
    ``d2t`` is zeroed fails, naming the check, and records that too."""
    spec, spec_url = serve_in_thread(speculative=True)
    base, base_url = serve_in_thread(speculative=False)
    out, run = tmp_path / "export", tmp_path / "run"
    try:
        code = main(
            [
                "export",
                *(str(checkpoint), str(out), "--dtype", "float32"),
                *("--verify-engine", "vllm", "--url", spec_url),
                *("--questions", str(write_questions(tmp_path)), "--verify-questions", "1"),
                *("--output-dir", str(run), f"bench.baseline_url={base_url}"),
                "bench.max_new_tokens=8",
            ]
        )
        record = json.loads((out / "specforge-export.json").read_text())["engine_check"]
        assert code == 0 and record["passed"] and record["engine"] == "vllm"
        assert record["turns"] == 2 and record["num_steps"] == 5  # question 1's two turns
        assert record["agrees"] == (record["gap"] <= record["margin"] == 0.10)
        assert record["failed_checks"] == [] and record["engine_tau"] > 1
        assert (run / "engine_check" / "vllm" / "bench.json").is_file()
        broken = tmp_path / "broken"
        shutil.copytree(out, broken)
        tensors = load_file(broken / "model.safetensors")
        tensors["d2t"].zero_()
        save_file(tensors, broken / "model.safetensors")
        cfg = stage_config(parse_args(["export", *run_flags(tmp_path, spec_url, base_url)]))
        with pytest.raises(UserError, match="the engine check of .* failed, not served.*t2d"):
            check_with_vllm(cfg, broken)
    finally:
        spec.shutdown(), base.shutdown()
    record = json.loads((broken / "specforge-export.json").read_text())["engine_check"]
    assert not record["passed"] and record["failed_checks"]


def run_flags(tmp_path, spec_url: str, base_url: str) -> list[str]:
    return [
        *("--url", spec_url, "--questions", str(tmp_path / "question.jsonl")),
        *("--output-dir", str(tmp_path / "run"), f"bench.baseline_url={base_url}"),
        *("bench.max_new_tokens=8", "export.verify_questions=1"),
        f"target.name_or_path={tmp_path / 'target'}",
    ]
