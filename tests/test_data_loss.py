"""Regression tests for the data-loss defects: nothing the program did not write is deleted,
and conversation ids stay unique across every input (real files, the real CLI)."""

from __future__ import annotations

import json

import pytest

from specforge.cli import main
from specforge.data.sources import load_conversations
from specforge.errors import UserError
from specforge.recipes.train import train
from tests.helpers import tiny_train_config


@pytest.fixture
def trained_run(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    run = tmp_path / "run"
    train(tiny_train_config(folder, data, run, "train.max_steps=2", "train.save_every=1"))
    return run


def tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_export_refuses_a_folder_it_did_not_write_and_deletes_nothing(trained_run, capsys):
    checkpoint = trained_run / "checkpoints" / "step_2"
    before = tree(trained_run)
    assert main(["export", str(checkpoint), str(trained_run)]) == 2  # the run folder itself
    assert "not empty and not a previous export" in capsys.readouterr().err
    assert tree(trained_run) == before


def test_export_into_the_current_directory_is_refused(trained_run, monkeypatch, capsys):
    checkpoint = trained_run / "checkpoints" / "step_2"
    monkeypatch.chdir(trained_run / "checkpoints")
    before = tree(trained_run)
    assert main(["export", str(checkpoint), "."]) == 2
    assert tree(trained_run) == before


def test_export_replaces_only_a_previous_export(trained_run, tmp_path):
    out = tmp_path / "export"
    assert main(["export", str(trained_run / "checkpoints" / "step_1"), str(out)]) == 0
    first = (out / "model.safetensors").read_bytes()
    assert main(["export", str(trained_run / "checkpoints" / "step_2"), str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() != first  # step 2's weights now
    (out / "notes.txt").write_text("mine")  # something the user added
    assert main(["export", str(trained_run / "checkpoints" / "step_1"), str(out)]) == 2
    assert (out / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".export-*"))  # no temp folders left behind


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def chat(user, answer):
    return {
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    }


def test_same_file_names_in_two_folders_keep_distinct_ids(tmp_path):
    first, second = tmp_path / "a" / "train.jsonl", tmp_path / "b" / "train.jsonl"
    write_jsonl(first, [chat("one", "1"), chat("two", "2")])  # no ids: generated per source
    write_jsonl(second, [chat("three", "3"), chat("four", "4")])
    conversations = load_conversations([str(first), str(second)])
    ids = [c.id for c in conversations]
    assert len(set(ids)) == 4
    assert [c.messages[0]["content"] for c in conversations] == ["one", "two", "three", "four"]


def test_an_id_shared_by_two_sources_is_refused_naming_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "p" / "x.jsonl", [{"id": "1", **chat("one", "1")}])
    write_jsonl(tmp_path / "q" / "x.jsonl", [{"id": "1", **chat("two", "2")}])
    # the stems clash, so each prefix is the whole source: p/x.jsonl/1 and q/x.jsonl/1
    assert len({c.id for c in load_conversations(["p/x.jsonl", "q/x.jsonl"])}) == 2
    # a third source whose own id spells the same final id is refused, naming both sources
    write_jsonl(tmp_path / "p.jsonl", [{"id": "x.jsonl/1", **chat("three", "3")}])
    with pytest.raises(UserError, match=r"'p/x.jsonl/1' is in both p/x.jsonl and p.jsonl"):
        load_conversations(["p/x.jsonl", "q/x.jsonl", "p.jsonl"])
    with pytest.raises(UserError, match="more than once"):
        load_conversations(["p/x.jsonl", "p/x.jsonl"])


def test_regenerating_two_same_named_files_keeps_both(tmp_path, tiny_target_dir):
    first, second = tmp_path / "a" / "train.jsonl", tmp_path / "b" / "train.jsonl"
    write_jsonl(first, [chat("one", "1"), chat("two", "2")])
    write_jsonl(second, [chat("three", "3"), chat("four", "4")])
    out = tmp_path / "distilled.jsonl"
    args = ["prepare", "--target", str(tiny_target_dir), "--data", str(first), str(second)]
    args += ["--regenerate", "--output", str(out), "regenerate.max_new_tokens=4"]
    assert main([*args, "--limit", "2"]) == 0
    assert main(args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in records] == ["one", "two", "three", "four"]


def test_builtin_ids_do_not_change_when_a_source_is_added(tmp_path):
    extra = tmp_path / "extra.jsonl"
    write_jsonl(extra, [chat("one", "1")])
    alone = [c.id for c in load_conversations(["builtin"])]
    together = [c.id for c in load_conversations(["builtin", str(extra)])]
    assert together[: len(alone)] == alone and together[-1] == "extra/extra-0"
