import json

from specforge.cli import main
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
