"""SpecForge's and speculators' training launch flags: each maps onto the config it means, a flag
without an effect here is accepted with a note, one without an equivalent is refused in one line
naming it, and SpecForge's own launch command trains and exports a tiny draft as it is."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specforge.cli import main, parse_args, stage_config
from specforge.errors import UserError
from specforge.upstream import UPSTREAM_FLAGS, translate

REPO = Path(__file__).parents[1]


def config_of(*argv: str):
    return stage_config(parse_args(["train", *argv]))


def test_specforge_flags_become_the_config_they_mean(tmp_path):
    draft_config = tmp_path / "draft.json"
    draft_config.write_text(
        json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                    "hidden_size": 4096, "draft_vocab_size": 32000})
    )  # fmt: skip
    cfg = config_of(
        *("--target-model-path", "some/target", "--draft-model-config", str(draft_config)),
        *("--output-dir", str(tmp_path / "o"), "--num-epochs", "2", "--batch-size", "1"),
        *("--learning-rate", "3e-4", "--max-length", "1024", "--warmup-ratio", "0.02"),
        *("--ttt-length", "5", "--chat-template", "llama3", "--cache-dir", "./cache"),
        *("--save-interval", "100", "--eval-interval", "50", "--report-to", "tensorboard"),
    )
    assert cfg.target.name_or_path == "some/target" and cfg.vocab.draft_vocab_size == 32000
    assert cfg.train.epochs == 2 and cfg.train.lr == 3e-4 and cfg.data.max_length == 1024
    assert cfg.train.warmup_ratio == 0.02 and cfg.train.ttt_length == 5
    assert cfg.train.save_every == 100 and cfg.train.eval_every == 50 and cfg.train.tensorboard
    assert cfg.output_dir == str(tmp_path / "o")


def test_a_step_count_wins_over_epochs_and_offline_capture_maps_to_offline_mode(tmp_path):
    cfg = config_of("--num-epochs", "3", "--max-num-steps", "40")
    assert cfg.train.epochs is None and cfg.train.max_steps == 40
    cfg = config_of("--train-hidden-states-path", str(tmp_path / "hs"))
    assert cfg.data.mode == "offline" and cfg.capture.output == str(tmp_path / "hs")


def test_speculators_flags_become_the_config_they_mean():
    cfg = config_of(
        *("--verifier", "some/target", "--speculator-type", "peagle", "--epochs", "1"),
        *("--lr", "2e-4", "--total-seq-len", "4096", "--draft-vocab-size", "8192"),
        *("--num-depths", "5", "--trust-remote-code", "--save-path", "out", "--logger", "wandb"),
    )
    assert cfg.target.name_or_path == "some/target" and cfg.draft.type == "peagle"
    assert cfg.train.epochs == 1 and cfg.train.lr == 2e-4 and cfg.train.batch_tokens == 4096
    assert cfg.vocab.draft_vocab_size == 8192 and cfg.train.ttt_length == 5
    assert cfg.target.trust_remote_code and cfg.output_dir == "out" and cfg.train.wandb


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp-size", "2"], "--tp-size 2 has no equivalent here: shard the target"),
        (["--is-vlm"], "--is-vlm (SpecForge scripts/train_eagle3.py) has no equivalent here"),
        (["--wandb-project", "p"], "--wandb-project (SpecForge scripts/train_eagle3.py)"),
        (["--report-to", "mlflow"], "--report-to mlflow: mlflow has no equivalent here"),
        (["--learning-rate"], "--learning-rate (SpecForge scripts/train_eagle3.py) needs a value"),
    ],
)
def test_a_flag_without_an_equivalent_is_one_line_naming_it(argv, message, capsys):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        translate(argv)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.split(" (")[0] in err[0]


def test_a_published_drafts_flag_starts_from_it():
    """speculators' ``--from-pretrained`` and SpecForge's ``--ckpt-dir`` name the draft to
    start from (``train.from_pretrained``)."""
    for flag in ("--from-pretrained", "--ckpt-dir"):
        cfg = stage_config(parse_args(["train", flag, "drafts/published"]))
        assert cfg.train.from_pretrained == "drafts/published"


def test_an_unknown_flag_is_one_line_naming_it_for_the_train_command(capsys):
    assert main(["train", "--no-such-flag", "--config", "smollm2-135m-eagle3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("specforge train: error: unrecognized arguments: --no-such-flag")


def test_a_draft_config_of_several_layers_is_refused(tmp_path):
    path = tmp_path / "draft.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "draft_vocab_size": 100}))
    with pytest.raises(UserError, match="num_hidden_layers 2"):
        translate(["--draft-model-config", str(path)])


def test_the_help_lists_every_upstream_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "--help"])
    shown = capsys.readouterr().out
    assert all(entry.flag in shown for entry in UPSTREAM_FLAGS)


@pytest.mark.integration
def test_specforge_launch_command_trains_and_exports_a_tiny_draft(tmp_path, peaked_target_dir):
    """SpecForge's launch command, flag for flag, on a tiny target and 20 steps: its raw
    ShareGPT file is prepared once, the draft trains for 20 steps and exports."""
    folder, data = peaked_target_dir
    sharegpt = tmp_path / "sharegpt.jsonl"
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    with sharegpt.open("w") as out:
        for row in rows:
            turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                     for m in row["messages"]]  # fmt: skip
            out.write(json.dumps({"id": row["id"], "conversations": turns}) + "\n")
    draft_config = tmp_path / "draft.json"
    draft_config.write_text(json.dumps({"num_hidden_layers": 1, "draft_vocab_size": 64}))
    run = tmp_path / "run"
    command = [
        *(sys.executable, "scripts/train_eagle3.py", "--target-model-path", str(folder)),
        *("--draft-model-config", str(draft_config), "--train-data-path", str(sharegpt)),
        *("--output-dir", str(run), "--num-epochs", "1", "--batch-size", "1"),
        *("--learning-rate", "1e-4", "--max-length", "2048", "--chat-template", "llama3"),
        *("--cache-dir", str(tmp_path / "cache"), "--max-num-steps", "20", "--ttt-length", "3"),
        *("target.dtype=float32", "train.dtype=float32"),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--chat-template (SpecForge scripts/train_eagle3.py)" in done.stderr
    state = json.loads((run / "checkpoints" / "step_20" / "trainer_state.json").read_text())
    assert state["step"] == 20 and (run / "conversations.jsonl").is_file()
    export = tmp_path / "export"
    assert main(["export", str(run / "checkpoints" / "step_20"), str(export)]) == 0
    assert json.loads((export / "config.json").read_text())["draft_vocab_size"] == 64


def test_epochs_and_a_warmup_ratio_become_steps_once_the_data_is_read(tmp_path, peaked_target_dir):
    from specforge.recipes.train import train
    from tests.helpers import tiny_train_config

    folder, data = peaked_target_dir
    extra = ("train.epochs=1", "train.warmup_ratio=0.25", "train.eval_every=1000")
    result = train(tiny_train_config(folder, data, tmp_path / "run", *extra))
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    steps = state["config"]["train"]["max_steps"]
    train_samples = round(len(Path(data).read_text().splitlines()) * (1 - 0.2))  # batch 1
    assert state["step"] == steps and abs(steps - train_samples) <= 1
    assert state["config"]["train"]["warmup_steps"] == round(0.25 * steps)
