import argparse
import json
from pathlib import Path

import pytest
import torch

from specforge.cli import (
    FLAG_NAMES,
    Stage,
    add_config_arguments,
    build_parser,
    flag_overrides,
    flag_table,
    main,
    parse_args,
    stage_config,
)
from specforge.data.vocab import load_vocab_map


def test_prepare_converts_sharegpt_and_writes_vocab_map(tmp_path, tiny_target_dir, capsys):
    data = tmp_path / "sharegpt.json"
    data.write_text(
        json.dumps(
            [
                {
                    "id": "s1",
                    "conversations": [
                        {"from": "human", "value": "hi"},
                        {"from": "gpt", "value": "the thin end"},
                    ],
                },
                {
                    "id": "s2",
                    "conversations": [
                        {"from": "human", "value": "more"},
                        {"from": "gpt", "value": "in the end"},
                        {"from": "human", "value": "ok"},
                        {"from": "gpt", "value": "then"},
                    ],
                },
                {"id": "bad", "conversations": [{"from": "gpt", "value": "no user"}]},
            ]
        )
    )
    output = tmp_path / "out" / "conversations.jsonl"
    vocab = tmp_path / "out" / "vocab.safetensors"
    code = main(
        [
            "prepare",
            "--target",
            str(tiny_target_dir),
            "--data",
            str(data),
            "--output",
            str(output),
            "--draft-vocab-size",
            "16",
            "--vocab-output",
            str(vocab),
            "data.max_length=64",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in records] == ["s1", "s2"]
    assert records[1]["messages"][2] == {"role": "user", "content": "ok"}
    stats = json.loads((tmp_path / "out" / "conversations.stats.json").read_text())
    assert stats["tokens"]["samples"] == 2 and stats["tokens"]["assistant_tokens"] > 0
    assert stats["config"]["data"]["max_length"] == 64
    vocab_map = load_vocab_map(vocab)
    assert vocab_map.draft_vocab_size == 16
    eos_id = 260  # <|im_end|> of the tiny tokenizer
    assert bool(vocab_map.t2d[eos_id])
    printed = capsys.readouterr().out
    assert "assistant_tokens" in printed and str(output) in printed


def test_prepare_reports_a_missing_input(tmp_path, tiny_target_dir, capsys):
    code = main(
        [
            "prepare",
            "--target",
            str(tiny_target_dir),
            "--data",
            str(tmp_path / "x.jsonl"),
            "--output",
            str(tmp_path / "o.jsonl"),
        ]
    )
    assert code == 2
    assert "x.jsonl" in capsys.readouterr().err


def test_flags_are_generated_from_config_fields():
    """Every stage's flags come from the config fields it reads; given flags become overrides
    that win over the file, and a flag names the field in its help."""
    parser = build_parser()
    args = parser.parse_args(
        ["prepare", "--target", "t", "--regenerate", "--limit", "3", "--data", "a.jsonl", "b.json"]
    )
    assert sorted(flag_overrides(args)) == [
        'data.inputs=["a.jsonl", "b.json"]',
        "data.limit=3",
        "regenerate.enabled=true",
        'target.name_or_path="t"',
    ]
    cfg = stage_config(args)
    assert (
        cfg.regenerate.enabled and cfg.data.limit == 3 and cfg.data.inputs == ["a.jsonl", "b.json"]
    )
    args = parser.parse_args(["export", "CKPT", "OUT", "--dtype", "float32"])
    cfg = stage_config(args)
    assert (cfg.export.checkpoint, cfg.export.output, cfg.export.dtype) == (
        "CKPT",
        "OUT",
        "float32",
    )
    args = parser.parse_args(["quickstart", "--output", "q", "--num-steps", "3"])
    cfg = stage_config(args)
    assert cfg.output_dir == "q" and cfg.bench.num_steps == 3 and cfg.train.resume
    assert cfg.target.name_or_path == "smollm2-135m"  # the shipped default recipe
    help_text = parser._subparsers._group_actions[0].choices["capture"].format_help()
    assert "--store-dtype" in help_text and "(capture.dtype)" in help_text


def test_a_user_mistake_is_one_line_and_names_the_value(tmp_path, capsys):
    code = main(["export", str(tmp_path / "no-such-checkpoint"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no-such-checkpoint" in err and "Traceback" not in err


def test_train_without_prepared_data_says_to_run_prepare(tmp_path, tiny_target_dir, capsys):
    code = main(
        ["train", "--output-dir", str(tmp_path / "run"), f"target.name_or_path={tiny_target_dir}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "specforge prepare" in err
    assert str(tmp_path / "run" / "conversations.jsonl") in err
    # what the docs and train --help say of it is what it does
    reference = " ".join(
        (Path(__file__).parents[1] / "docs" / "configuration.md").read_text().split()
    )
    entry = reference[reference.index("### `train.data_path`") :][:400]
    assert "is an error that says to run `specforge prepare`" in entry
    assert "prepared first" not in entry


def test_dotted_overrides_are_never_a_flags_value():
    """An override after a list flag or in a positional's place is an override, not a second
    input or the checkpoint path."""
    cfg = stage_config(parse_args(["prepare", "--data", "a.jsonl", "regenerate.max_new_tokens=64"]))
    assert cfg.data.inputs == ["a.jsonl"] and cfg.regenerate.max_new_tokens == 64
    cfg = stage_config(parse_args(["export", "export.dtype=float32"]))
    assert cfg.export.checkpoint is None and cfg.export.dtype == "float32"
    cfg = stage_config(parse_args(["export", "CKPT", "output_dir=o", "OUT"]))
    assert (cfg.export.checkpoint, cfg.export.output, cfg.output_dir) == ("CKPT", "OUT", "o")


def test_every_stages_flags_match_the_snapshot():
    """Adding or renaming a config field cannot move a flag unnoticed: the flags of every
    subcommand, and the field each sets, are pinned (update tests/cli_flags.json on purpose)."""
    snapshot = json.loads((Path(__file__).parent / "cli_flags.json").read_text())
    assert flag_table() == snapshot


def test_two_fields_with_one_flag_name_are_an_error():
    """A clash is never settled by section order: without an explicit name it is an error."""
    stage = Stage(lambda args, cfg: 0, "both", ("regenerate", "synthesize"))
    parser = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="--temperature would set both regenerate.temperature"):
        add_config_arguments(parser, stage, {})
    add_config_arguments(argparse.ArgumentParser(), stage, FLAG_NAMES)


def _one_line_error(capsys, argv: list[str]) -> str:
    """``specforge`` on ``argv``: exit 2 and one line on stderr, no traceback; returns it."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


MISSING_TARGET = "target.name_or_path=/nonexistent/target"
"""A target that cannot load: an error about the other input shows it was checked first."""


def test_a_vllm_python_that_cannot_run_is_refused_naming_it(tmp_path, capsys):
    for python in (tmp_path / "nope" / "python", tmp_path):
        argv = ["bench", "--engine", "vllm", "--num-steps", "3", "--vllm-python", str(python)]
        err = _one_line_error(capsys, [*argv, MISSING_TARGET])
        assert f"bench.vllm_python {python} is" in err


def test_an_output_dir_that_is_a_file_is_refused_before_anything_loads(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("mine\n")
    err = _one_line_error(capsys, ["train", "--output-dir", str(path), MISSING_TARGET])
    assert f"output_dir {path} is a file" in err
    assert path.read_text() == "mine\n"


def test_an_engine_check_without_vllm_is_refused_before_exporting(tmp_path, capsys):
    out = tmp_path / "export"
    argv = ["export", str(tmp_path / "checkpoint"), str(out), "--verify-engine", "vllm"]
    err = _one_line_error(capsys, argv)
    assert "bench.url" in err and "bench.vllm_python" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--url", "http://127.0.0.1:1"], "bench.url='http://127.0.0.1:1'"),
        (["--vllm-args", "--no-enforce-eager"], "bench.vllm_args=['--no-enforce-eager']"),
        (["--engine", "sglang", "--url", "http://x", "--vllm-args", "--a"], "bench.vllm_args="),
    ],
)
def test_an_engine_option_the_engine_does_not_read_is_refused(flags, key, capsys):
    err = _one_line_error(capsys, ["bench", *flags, MISSING_TARGET])
    assert key in err and "does nothing with bench.engine" in err


def test_vllm_args_take_the_words_after_them_dashes_and_all():
    args = parse_args(
        ["bench", "--engine", "vllm", "--vllm-args", "--no-enforce-eager", "--max-num-seqs", "1"]
        + ["--limit", "3", "bench.num_steps=4"]
    )
    cfg = stage_config(args)
    assert cfg.bench.vllm_args == ["--no-enforce-eager", "--max-num-seqs", "1"]
    assert (cfg.bench.limit, cfg.bench.num_steps) == (3, 4)
    cfg = stage_config(parse_args(["bench", "--vllm-args=--no-enforce-eager", "--limit", "2"]))
    assert cfg.bench.vllm_args == ["--no-enforce-eager"] and cfg.bench.limit == 2
    help_text = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "--vllm-args --no-enforce-eager" in " ".join(help_text.split())


def test_a_prompt_past_the_targets_context_is_refused_before_decoding(
    tmp_path, tiny_target_dir, capsys
):
    from transformers import AutoConfig

    from specforge.families.dflash.export import write_dflash_export
    from specforge.families.dflash.model import DFlashConfig, build_dflash_model

    target_config = AutoConfig.from_pretrained(tiny_target_dir)
    config = DFlashConfig.from_target(target_config, mask_token_id=0, block_size=4)
    shape = (target_config.vocab_size, target_config.hidden_size)
    draft = build_dflash_model(
        config, target_embedding=torch.zeros(shape), target_lm_head=torch.zeros(shape)
    )
    export = write_dflash_export(
        tmp_path / "export", model=draft, target_config=target_config, dtype="float32"
    )
    questions = tmp_path / "long.jsonl"
    long = " ".join(["word"] * 2100)
    questions.write_text(json.dumps({"question_id": 7, "category": "x", "turns": [long]}) + "\n")
    argv = ["bench", "--target", str(tiny_target_dir), "--questions", str(questions)]
    argv += ["--draft", str(export), "--num-steps", "3", "--max-new-tokens", "4"]
    err = _one_line_error(capsys, argv)
    assert "question '7' is" in err and "past the target's context of 2048 tokens" in err
