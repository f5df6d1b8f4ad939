"""The real embedded default target, SmolLM2-135M-Instruct (slow: loads ~260 MB)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from specforge.config import TargetConfig
from specforge.data.chat import tokenize_conversation
from specforge.data.conversations import Conversation
from specforge.models.target import (
    default_aux_layer_ids,
    embedded_target_dir,
    load_target,
    target_hidden_states,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_target(TargetConfig("smollm2-135m", dtype="float32"))


def test_conversion_is_cached_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORGE_CACHE", str(tmp_path))
    folder = embedded_target_dir("smollm2-135m", "bfloat16")
    assert folder.parent == tmp_path / "targets"
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert 200e6 < weights.stat().st_size < 320e6  # bf16, 135M parameters
    assert embedded_target_dir("smollm2-135m", "bfloat16") == folder
    assert weights.stat().st_mtime_ns == stamp  # the second load did not convert again
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp leftovers
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True


def test_model_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    assert default_aux_layer_ids(model.config.num_hidden_layers) == [1, 14, 26]
    # Digits are split one by one, as llama.cpp tokenizes SmolLM2.
    ids = tokenizer("year 2024, pi 3.14159", add_special_tokens=False)["input_ids"]
    digits = [t for t in tokenizer.convert_ids_to_tokens(ids) if t.strip("Ġ").isdigit()]
    assert digits == list("2024314159")


def test_capture_on_the_real_target(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    states = target_hidden_states(model, ids, aux_layer_ids=[1, 14, 26])
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True)
    for slot, layer in enumerate([1, 14, 26]):
        torch.testing.assert_close(
            states.aux_hidden_states[..., slot * 576 : (slot + 1) * 576],
            reference.hidden_states[layer + 1],
        )
    next_token = model.lm_head(states.last_hidden_state[0, -1]).argmax()
    assert tokenizer.decode(next_token).strip() == "Paris"


def test_real_template_mask_token_by_token(smollm2):
    _, tokenizer = smollm2
    conversation = Conversation(
        "c",
        [
            {"role": "user", "content": "Add 12 and 30."},
            {"role": "assistant", "content": "12 + 30 = 42."},
            {"role": "user", "content": "Now say it in words."},
            {"role": "assistant", "content": "Forty-two."},
        ],
    )
    sample = tokenize_conversation(tokenizer, conversation, max_length=4096)
    tokens = tokenizer.convert_ids_to_tokens(sample.input_ids.tolist())
    mask = sample.loss_mask.tolist()
    # Reference: the tokens of "<content><|im_end|>" follow each "<|im_start|>assistant\n".
    expected = [False] * len(tokens)
    for answer in ("12 + 30 = 42.", "Forty-two."):
        answer_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        header_ids = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        pattern = header_ids + answer_ids
        ids = sample.input_ids.tolist()
        start = next(i for i in range(len(ids)) if ids[i : i + len(pattern)] == pattern)
        for i in range(start + len(header_ids), start + len(pattern)):
            expected[i] = True
    assert mask == expected, list(zip(tokens, mask, strict=True))
    assert tokens[-1] == "Ċ" and not mask[-1]  # newline after the last <|im_end|>
    reference = tokenizer.apply_chat_template(conversation.messages, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert sample.input_ids.tolist() == list(reference)


def test_cli_self_distillation_resumes(tmp_path):
    output = tmp_path / "distilled.jsonl"

    def run(limit):
        cmd = [
            sys.executable,
            "-m",
            "specforge.cli",
            "prepare",
            "--target",
            "smollm2-135m",
            "--regenerate",
            "--limit",
            str(limit),
            "--max-new-tokens",
            "24",
            "--output",
            str(output),
        ]
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ))
        return [json.loads(line) for line in output.read_text().splitlines()]

    first = run(2)
    second = run(3)
    assert len(first) == 2 and len(second) == 3 and second[:2] == first
    stats = json.loads((tmp_path / "distilled.stats.json").read_text())
    assert stats["regenerate"]["already_done"] == 2 and stats["regenerate"]["written"] == 1
    for record in second:
        roles = [m["role"] for m in record["messages"]]
        assert roles[-1] == "assistant" and set(roles) <= {"user", "assistant"}
        answer = record["messages"][-1]["content"]
        assert len(answer.split()) >= 3  # real text, not empty or special tokens
        assert "<|im_end|>" not in answer


def test_cli_capture_then_offline_training(tmp_path):
    """`specforge capture` on the real target, `--verify`, then two offline training steps."""
    data = tmp_path / "gsm8k.jsonl"
    with data.open("w") as f:
        for i in range(6):
            question = f"Tom has {i + 3} apples and buys {2 * i + 1} more. How many now?"
            answer = f"Tom has {i + 3} + {2 * i + 1} = {3 * i + 4} apples.\n#### {3 * i + 4}"
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    out = tmp_path / "capture"
    cli = [sys.executable, "-m", "specforge.cli"]
    capture = ["capture", "--target", "smollm2-135m", "--data", str(data), "--output", str(out)]
    done = subprocess.run(cli + capture, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == 6 and manifest["aux_layer_ids"] == [1, 14, 26]
    assert manifest["target"]["hidden_size"] == 576 and manifest["dtype"] == "bfloat16"
    assert manifest["bytes_per_token"] < 8 * 576  # the aux + last-for-every-token layout, bf16
    verify = subprocess.run(cli + ["capture", "--verify", str(out)], capture_output=True, text=True)
    assert verify.returncode == 0 and "OK" in verify.stdout
    train = [
        "train",
        "--max-steps",
        "2",
        "--output-dir",
        str(tmp_path / "run"),
        "data.mode=offline",
        f"capture.output={out}",
        "vocab.draft_vocab_size=512",
        "train.eval_fraction=0",
    ]
    done = subprocess.run(cli + train, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "draft.safetensors").is_file()


def test_cli_quickstart_leaves_the_export_and_a_bench(tmp_path):
    """`specforge quickstart` end to end on the real target, shrunk by recipe overrides:
    self-distill 3 built-in prompts and 2 self-written ones, grown 2 at a time while the
    next round fits in 72 s (data_share 0.02 of the hour), 2 training steps, export, bench 2
    turns; a rerun keeps the corpus and the budget."""
    questions = tmp_path / "question.jsonl"
    questions.write_text(
        json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2 + 3?", "And 4?"]})
        + "\n"
    )
    out = tmp_path / "quickstart"
    cmd = [
        sys.executable,
        "-m",
        "specforge.cli",
        "quickstart",
        "--output",
        str(out),
        "--questions",
        str(questions),
        "--max-new-tokens",
        "12",
        "data.limit=3",
        "synthesize.count=2",
        "quickstart.synthesize_step=2",
        "quickstart.data_share=0.02",
        "regenerate.max_new_tokens=24",
        "train.max_steps=2",
        "train.eval_fraction=0",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accept length tau" in done.stdout and f"questions: {questions}" in done.stdout
    # the recipe's hour: training got what prepare and the bench's estimate left
    plan = json.loads((out / "quickstart.json").read_text())
    assert 0 < plan["prepare_seconds"] < 60 * 60 and "training gets" in done.stderr
    # the corpus grew by whole rounds (as many as the machine's pace allowed), all answered
    count = plan["synthesize_count"]
    assert plan["data_done"] and count >= 2 and count % 2 == 0
    assert (count > 2) == ("more prompts" in done.stderr)
    conversations = (out / "conversations.jsonl").read_text().splitlines()
    assert len(conversations) == 3 + count
    export = out / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (export / "model.safetensors").is_file() and (export / "freq_8192.pt").is_file()
    bench = json.loads((out / "bench" / "bench.json").read_text())
    assert bench["turns"] == 2 and bench["all_match"] is True
    assert bench["settings"]["questions"] == str(questions)
    # the rerun finds its data done: same corpus, same plan, no growth
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((out / "quickstart.json").read_text()) == plan
    assert (out / "conversations.jsonl").read_text().splitlines() == conversations
    assert "more prompts" not in again.stderr


def test_cli_synthesize_writes_distinct_prompts_and_resumes(tmp_path):
    """`specforge prepare --synthesize N` on SmolLM2: N conversations whose user turns the
    target wrote, all distinct and none sharing a 6-word run with MT-Bench; asking for more
    later adds only the difference."""
    from specforge.cli import main
    from specforge.distill.synthesize import mt_bench_run_hashes, shares_mt_bench_run

    out = tmp_path / "synth.jsonl"
    args = ["prepare", "--target", "smollm2-135m", "--output", str(out)]
    args += ["regenerate.max_new_tokens=24", "--synthesize"]
    assert main([*args, "6"]) == 0
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert main([*args, "9"]) == 0
    second = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(first) == 6 and len(second) == 9
    assert second[:6] == first  # kept, not redone
    prompts = [r["messages"][0]["content"] for r in second]
    assert len(set(prompts)) == 9
    hashes = mt_bench_run_hashes()
    assert not any(shares_mt_bench_run(p, hashes) for p in prompts)
    assert all(r["messages"][1]["role"] == "assistant" for r in second)
    stats = json.loads((tmp_path / "synth.stats.json").read_text())
    assert stats["synthesize"]["accepted"] == 3 and stats["synthesize"]["already_done"] == 6


def test_cli_synthesize_steered_by_topics_records_each_attempts_topic(tmp_path):
    """`--topics`: attempts take the topics in turn, each kept prompt's record names its
    attempt's topic, and the conversation is the prompt and the target's answer."""
    from specforge.cli import main
    from specforge.distill.synthesize import prompts_path
    from specforge.io import read_jsonl

    out = tmp_path / "steered.jsonl"
    args = ["prepare", "--target", "smollm2-135m", "--output", str(out), "--synthesize", "4",
            "--topics", "cooking", "astronomy", "regenerate.max_new_tokens=8"]  # fmt: skip
    assert main(args) == 0
    records = read_jsonl(prompts_path(out))
    assert len(records) == 4
    assert [r["topic"] for r in records] == [
        ("cooking", "astronomy")[r["attempt"] % 2] for r in records
    ]
    conversations = read_jsonl(out)
    assert [c["messages"][0]["content"] for c in conversations] == [r["prompt"] for r in records]
    assert all([m["role"] for m in c["messages"]] == ["user", "assistant"] for c in conversations)


def test_cli_follow_ups_give_synthesized_conversations_a_second_turn_once(tmp_path):
    """`synthesize.follow_ups=1`: every synthesized conversation gets a second user turn
    SmolLM2 wrote over its own answer, kept or dropped by the prompt filter, and a kept one is
    answered, with the ids of both answers; a rerun redoes nothing."""
    from specforge.cli import main
    from specforge.distill.follow_ups import follow_ups_path
    from specforge.io import read_jsonl
    from specforge.models.target import load_tokenizer

    out = tmp_path / "multi.jsonl"
    args = ["prepare", "--target", "smollm2-135m", "--output", str(out), "--synthesize", "6",
            "synthesize.follow_ups=1", "regenerate.max_new_tokens=32"]  # fmt: skip
    assert main(args) == 0
    decisions = read_jsonl(follow_ups_path(out))
    stats = json.loads((tmp_path / "multi.stats.json").read_text())["follow_ups"]
    records = read_jsonl(out)
    assert stats["requested"] == stats["attempts"] == len(decisions) == len(records) == 6
    kept = {d["id"]: d["prompt"] for d in decisions if "prompt" in d}
    assert stats["accepted"] == stats["answered"] == len(kept) >= 1
    assert sum(stats["dropped"].values()) == len(decisions) - len(kept)
    tokenizer = load_tokenizer(TargetConfig("smollm2-135m"))
    for r in records:
        roles = [m["role"] for m in r["messages"]]
        if r["id"] not in kept:
            assert roles == ["user", "assistant"]
            continue
        assert roles == ["user", "assistant", "user", "assistant"]
        assert r["messages"][2]["content"] == kept[r["id"]]
        ids, reasons = r["meta"]["token_ids"], r["meta"]["finish_reasons"]
        assert len(ids) == len(reasons) == 2
        answer = ids[1][:-1] if reasons[1] == "stop" else ids[1]
        assert (
            tokenizer.decode(answer, skip_special_tokens=True).strip()
            == r["messages"][3]["content"]
        )
    before = out.read_text()
    assert main(args) == 0
    again = json.loads((tmp_path / "multi.stats.json").read_text())["follow_ups"]
    # the kept ones have their second turn; the dropped ones are decided: nothing is redone
    assert again["requested"] == again["already_done"] == len(decisions) - len(kept)
    assert again["attempts"] == again["answered"] == 0 and out.read_text() == before


def test_synthesis_killed_mid_round_keeps_its_prompts_and_the_rerun_continues(tmp_path):
    """Prompts are written as they are decided (in attempt order), not when the whole round of
    attempts ends: a SIGKILL while the round runs leaves them, and the rerun keeps them and adds
    the rest."""
    from specforge.cli import main
    from specforge.distill.synthesize import prompts_path
    from specforge.io import read_jsonl

    # one attempt in flight at a time: attempt 0 is decided (and written) while the later ones
    # still run, whatever lengths this CPU's sampling gives them (with 4 in flight, a long
    # attempt 0 was decided last and every prompt was written at once)
    def args(out):
        return ["prepare", "--target", "smollm2-135m", "--output", str(out), "--synthesize", "12",
                "regenerate.max_new_tokens=8", "synthesize.batch_size=1"]  # fmt: skip

    killed = tmp_path / "killed.jsonl"
    path = prompts_path(killed)
    cmd = [sys.executable, "-m", "specforge.cli", *args(killed)]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # poll for a complete line (the writer may be mid-line), then kill
    while process.poll() is None and not (path.exists() and b"\n" in path.read_bytes()):
        time.sleep(0.05)
    process.kill()
    process.wait()
    kept = read_jsonl(path, repair=True)  # as the rerun reads it: a torn last line dropped
    assert 0 < len(kept) < 12, "the kill came after the round, not during it"
    assert [r["attempt"] for r in kept] == sorted(r["attempt"] for r in kept)
    assert main(args(killed)) == 0
    after = read_jsonl(path)
    assert after[: len(kept)] == kept  # nothing redone or lost
    assert len(after) == 12 and len({r["prompt"] for r in after}) == 12
    assert [r["attempt"] for r in after] == sorted({r["attempt"] for r in after})
    assert len(killed.read_text().splitlines()) == 12


def test_regeneration_through_the_decode_kernel_writes_what_sdpa_writes(smollm2, tmp_path):
    """fp32, greedy: continuous batching with decode steps through the CPU kernel answers
    token for token as with PyTorch's SDPA (rows of different lengths, left-padded)."""
    from specforge.config import RegenerateConfig
    from specforge.data.prompts import builtin_conversations
    from specforge.distill.regenerate import regenerate_conversations
    from tests.helpers import kernel_or_skip

    kernel_or_skip()
    model, tokenizer = smollm2
    conversations = builtin_conversations("train")[:6]
    written = {}
    for mode in ("off", "on"):
        cfg = RegenerateConfig(
            enabled=True, max_new_tokens=32, batch_size=6, rows_per_span=2, decode_kernel=mode
        )
        output = tmp_path / f"{mode}.jsonl"
        report = regenerate_conversations(model, tokenizer, conversations, output, cfg)
        assert report.written == 6
        written[mode] = output.read_text().splitlines()
    assert written["on"] == written["off"]
