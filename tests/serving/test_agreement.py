"""The engine gate: an engine's accept length beside the built-in runtime's on the same turns,
and the export's contract check by check (a zeroed ``d2t`` named; a good export clean)."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from specforge.cli import main
from specforge.errors import UserError
from specforge.recipes.train import train
from specforge.serving.agreement import agreement, export_checks
from tests.helpers import tiny_train_config
from tests.serving.test_vllm_client import bench_against_standins


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
def export(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    run = train(tiny_train_config(folder, data, tmp_path / "run", "train.max_steps=2"))
    out = tmp_path / "export"
    assert main(["export", str(run.checkpoint), str(out), "--dtype", "float32"]) == 0
    return folder, out


def test_the_export_checks_pass_a_good_export_and_name_a_zeroed_d2t(tmp_path, export):
    folder, good = export
    target = AutoConfig.from_pretrained(folder)
    assert [c["problem"] for c in export_checks(good, target)] == [None, None, None]
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["d2t"].zero_()  # draft id d read as target id d: in range, injective, wrong
    save_file(tensors, broken / "model.safetensors")
    problems = {c["check"][:8]: c["problem"] for c in export_checks(broken, target)}
    assert problems["config.j"] is None and problems["aux laye"] is None
    assert "t2d" in problems["weights:"] or "d2t" in problems["weights:"]


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
