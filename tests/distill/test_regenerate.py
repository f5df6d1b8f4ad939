import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specforge.config import RegenerateConfig
from specforge.data.conversations import Conversation
from specforge.distill.regenerate import partial_path, regenerate_conversations
from specforge.engine.generation import AUTO_ROWS

CONVERSATIONS = [
    Conversation("one", [{"role": "user", "content": "the cat"}]),
    Conversation(
        "two",
        [
            {"role": "system", "content": "short"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "OLD ANSWER"},
            {"role": "user", "content": "and then"},
        ],
    ),
    Conversation("three", [{"role": "user", "content": "a much longer question in the end"}]),
    Conversation("four", [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]),
    Conversation("five", [{"role": "user", "content": "thin"}]),
]
CFG = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=2)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_user_turn_is_answered_by_the_target(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    output = tmp_path / "out.jsonl"
    report = regenerate_conversations(
        model, tokenizer, CONVERSATIONS, output, CFG, target_name="tiny"
    )
    records = read(output)
    assert [r["id"] for r in records] == [c.id for c in CONVERSATIONS]
    assert report.written == 5 and report.turns == 7 and not partial_path(output).exists()
    two = records[1]["messages"]
    assert [m["role"] for m in two] == ["system", "user", "assistant", "user", "assistant"]
    assert "OLD ANSWER" not in json.dumps(records)
    assert len(records[1]["meta"]["finish_reasons"]) == 2
    # Turn 2 was generated after the target's own first answer.
    alone = tmp_path / "alone.jsonl"
    regenerate_conversations(model, tokenizer, [Conversation("two", two[:2])], alone, CFG)
    assert two[2]["content"] == read(alone)[0]["messages"][2]["content"]


def test_batched_left_padding_matches_one_at_a_time(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    batched, single = tmp_path / "b.jsonl", tmp_path / "s.jsonl"
    regenerate_conversations(model, tokenizer, CONVERSATIONS, batched, CFG)
    one_cfg = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=1)
    regenerate_conversations(model, tokenizer, CONVERSATIONS, single, one_cfg)
    assert read(batched) == read(single)


def test_auto_batch_size_is_resolved_and_reported(tmp_path, tiny_target):
    """``batch_size: auto`` on a CPU with memory to spare: AUTO_ROWS rows in flight, the same
    answers as any other batch size (fp32, greedy)."""
    model, tokenizer = tiny_target
    auto_cfg = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size="auto")
    auto, fixed = tmp_path / "auto.jsonl", tmp_path / "fixed.jsonl"
    report = regenerate_conversations(model, tokenizer, CONVERSATIONS, auto, auto_cfg)
    assert report.batch_size == report.as_dict()["batch_size"] == AUTO_ROWS["cpu"]
    assert regenerate_conversations(model, tokenizer, CONVERSATIONS, fixed, CFG).batch_size == 2
    assert read(auto) == read(fixed)


def test_rerun_with_larger_limit_adds_only_missing(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    output = tmp_path / "out.jsonl"
    regenerate_conversations(model, tokenizer, CONVERSATIONS[:3], output, CFG)
    before = output.read_bytes()
    report = regenerate_conversations(model, tokenizer, CONVERSATIONS, output, CFG)
    assert report.already_done == 3 and report.written == 2
    assert output.read_bytes().startswith(before)
    assert [r["id"] for r in read(output)] == [c.id for c in CONVERSATIONS]


def test_torn_partial_file_is_repaired_and_kept_records_reused(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    output = tmp_path / "out.jsonl"
    kept = {
        "id": "one",
        "messages": [
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "KEPT"},
        ],
        "meta": {},
    }
    partial_path(output).write_text(json.dumps(kept) + "\n" + '{"id": "two", "mess')
    report = regenerate_conversations(model, tokenizer, CONVERSATIONS, output, CFG)
    records = read(output)
    assert report.already_done == 1
    assert records[0] == kept and [r["id"] for r in records] == [c.id for c in CONVERSATIONS]


def test_too_long_prompts_stop_the_conversation(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=4, max_prompt_length=40)
    long = Conversation("long", [{"role": "user", "content": "word " * 50}])
    two_turns = Conversation(
        "grow", [{"role": "user", "content": "hi"}, {"role": "user", "content": "again " * 5}]
    )
    output = tmp_path / "out.jsonl"
    report = regenerate_conversations(model, tokenizer, [long, two_turns], output, cfg)
    records = read(output)
    assert [r["id"] for r in records] == ["grow"]
    assert [m["role"] for m in records[0]["messages"]] == ["user", "assistant"]
    assert report.stopped_long_prompt == 2


def test_sampling_is_seeded(tmp_path, tiny_target):
    model, tokenizer = tiny_target
    cfg = RegenerateConfig(enabled=True, max_new_tokens=12, batch_size=2, temperature=1.0, seed=3)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    regenerate_conversations(model, tokenizer, CONVERSATIONS, first, cfg)
    regenerate_conversations(model, tokenizer, CONVERSATIONS, second, cfg)
    assert read(first) == read(second)


def _prepare_cmd(target_dir, data, output):
    return [
        sys.executable,
        "-m",
        "specforge.cli",
        "prepare",
        "--target",
        str(target_dir),
        "--data",
        str(data),
        "--output",
        str(output),
        "--regenerate",
        "--dtype",
        "float32",
        "--batch-size",
        "1",
        "--max-new-tokens",
        "24",
    ]


@pytest.mark.integration
def test_sigkill_then_rerun_equals_uninterrupted_run(tmp_path, tiny_target_dir):
    """A real process killed mid-run loses at most its batch in flight; the rerun finishes with
    exactly the output of an uninterrupted run."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]})
            + "\n"
            for i in range(60)
        )
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    killed, reference = tmp_path / "killed.jsonl", tmp_path / "reference.jsonl"
    process = subprocess.Popen(
        _prepare_cmd(tiny_target_dir, data, killed),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sidecar = partial_path(killed)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if sidecar.exists() and sidecar.read_text().count("\n") >= 5:
            break
        time.sleep(0.02)
    assert process.poll() is None, "the run finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not killed.exists()  # the final file only ever appears complete
    done_before = sidecar.read_text().count("\n")

    subprocess.run(
        _prepare_cmd(tiny_target_dir, data, killed), env=env, check=True, capture_output=True
    )
    subprocess.run(
        _prepare_cmd(tiny_target_dir, data, reference), env=env, check=True, capture_output=True
    )
    assert read(killed) == read(reference)
    assert len(read(killed)) == 60 and done_before >= 5
    assert not sidecar.exists()


@pytest.mark.parametrize("bad", ["--limit=0", "data.max_length=x"])
def test_cli_bad_input_is_a_clear_error(tmp_path, tiny_target_dir, bad):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specforge.cli",
            "prepare",
            "--target",
            str(tiny_target_dir),
            "--output",
            str(tmp_path / "o.jsonl"),
            bad,
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert (
        "data.limit must be >= 1" in result.stderr
        or "data.max_length must be an integer" in result.stderr
    )
    assert not (tmp_path / "o.jsonl").exists()
