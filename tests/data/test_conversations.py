import json
import logging

import pytest

from specforge.data.conversations import (
    MalformedRecord,
    normalize_record,
    read_conversations,
)
from specforge.data.sources import load_conversations

OPENAI = {
    "id": "a",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
}
SHAREGPT = {
    "id": "b",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
    ],
}
ULTRACHAT = {"prompt_id": "c", "data": ["Hi", "Hello!", "How are you?", "Fine."]}


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_layouts_normalize_to_openai_messages():
    expected = OPENAI["messages"]
    assert normalize_record(OPENAI) == ("a", expected)
    assert normalize_record(SHAREGPT) == ("b", expected)  # system prompt kept
    assert normalize_record(ULTRACHAT) == (
        "c",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
            {"role": "assistant", "content": "Fine."},
        ],
    )

    gsm8k = {"question": "2+2?", "answer": "2+2=4\n#### 4"}
    assert normalize_record(gsm8k) == (
        None,
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "2+2=4\n#### 4"}],
    )
    mt_bench = {"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]}
    assert normalize_record(mt_bench) == (
        "81",
        [{"role": "user", "content": "Write."}, {"role": "user", "content": "Again."}],
    )


def test_forced_format_rejects_other_layouts():
    with pytest.raises(MalformedRecord, match="'conversations' must be a non-empty list"):
        normalize_record(OPENAI, "sharegpt")


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"text": "hi"}, "no 'messages', 'conversations', 'data', 'question' or 'turns'"),
        ({"turns": ["a", 3]}, "turn 1: expected a string, got int"),
        ({"question": "hi"}, "needs an 'answer'"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "first non-system message"),
        ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown speaker 'alien'"),
        ({"messages": [{"role": "user"}]}, "needs 'role' and 'content'"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
            "only the first may be one",
        ),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_records_say_why(record, reason):
    with pytest.raises(MalformedRecord, match=reason):
        normalize_record(record)


def test_jsonl_skips_malformed_with_line_numbers(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [OPENAI, "{not json", SHAREGPT, {"messages": []}, "", ULTRACHAT, {"data": [1]}],
    )
    with caplog.at_level(logging.WARNING):
        conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == ["a", "b", "c"]
    assert report.records == 6 and report.skipped == 3
    assert [where.split(":")[0] for where in report.skipped_at] == ["line 2", "line 4", "line 7"]
    assert "skipped 3 malformed of 6 records" in caplog.text and "line 2" in caplog.text


def test_json_array_and_generated_ids_and_duplicates(tmp_path):
    path = tmp_path / "set.json"
    no_id = {"messages": OPENAI["messages"]}
    path.write_text(json.dumps([no_id, OPENAI, OPENAI]))
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == ["set-0", "a", "a#1"]
    assert report.renamed_duplicates == 1


def test_file_without_valid_records_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"x": 1}, "oops"])
    with pytest.raises(ValueError, match="no valid conversation in 2 records.*line 1"):
        read_conversations(str(path))


def test_unknown_extension_and_missing_source(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(ValueError, match="expected a .json or .jsonl file"):
        read_conversations(str(path))
    # a path that does not exist is a local error at once (no hub lookup and its retries)
    with pytest.raises(ValueError, match="missing.jsonl'?: no such file or folder"):
        read_conversations(str(tmp_path / "missing.jsonl"))


def test_saved_hf_dataset_folder(tmp_path):
    import datasets

    dataset = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [OPENAI, {"id": "d", "messages": OPENAI["messages"]}]
            ),
            "test": datasets.Dataset.from_list([{"id": "t", "messages": OPENAI["messages"]}]),
        }
    )
    dataset.save_to_disk(str(tmp_path / "ds"))
    train, _ = read_conversations(str(tmp_path / "ds"))
    test, _ = read_conversations(str(tmp_path / "ds"), split="test")
    assert [c.id for c in train] == ["a", "d"] and [c.id for c in test] == ["t"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        read_conversations(str(tmp_path / "ds"), split="validation")
    # a source may name its own split (UltraChat's is train_sft beside ShareGPT's train)
    both = load_conversations([str(tmp_path / "ds"), f"{tmp_path / 'ds'}:test"])
    assert [c.id for c in both] == ["ds/a", "ds/d", "ds:test/t"]


def test_load_several_sources_prefixes_ids_and_limits(tmp_path):
    first = write_jsonl(tmp_path / "one.jsonl", [OPENAI])
    second = write_jsonl(tmp_path / "two.jsonl", [OPENAI, SHAREGPT])
    conversations = load_conversations([str(first), str(second)], limit=2)
    assert [c.id for c in conversations] == ["one/a", "two/a"]


def test_no_source_means_builtin_prompts():
    conversations = load_conversations([], builtin_split="train", limit=5)
    assert len(conversations) == 5
    assert all(m["role"] == "user" for c in conversations for m in c.messages)
