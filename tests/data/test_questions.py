"""Benchmark question sets by name, by file in each set's own fields, and as suites."""

import json
import subprocess
import sys

import pytest

from specforge.data import questions as question_module
from specforge.data.questions import EVAL_SETS, EvalSet, load_questions
from specforge.errors import UserError

LOCAL_COPIES = {
    "gsm8k": {"question": "Ann has 3 apples and buys 4. How many?", "answer": "7"},
    "humaneval": {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "test": "..."},
    "math500": {"problem": "What is 2 + 2?", "unique_id": "test/x/1.json", "subject": "x"},
    "mt_bench": {"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]},
}
"""One record of each named set, in the fields its hub dataset has."""


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


EXPECTED = {
    "gsm8k": ("1", ["Ann has 3 apples and buys 4. How many?"]),
    "humaneval": ("HumanEval/0", ["def add(a, b):\n"]),
    "math500": ("test/x/1.json", ["What is 2 + 2?"]),
    "mt_bench": ("81", ["Write.", "Again."]),
}
"""Each record's question id and turns as the bench asks them."""


@pytest.mark.parametrize("name", sorted(LOCAL_COPIES))
def test_a_local_copy_of_each_named_set_reads_by_its_own_fields(tmp_path, name):
    path = write_jsonl(tmp_path / f"{name}.jsonl", [LOCAL_COPIES[name]])
    (question,) = load_questions(str(path))
    assert (question.id, question.turns) == EXPECTED[name] and question.set == str(path)


def test_a_named_set_reads_its_config_and_split_through_datasets(tmp_path, monkeypatch):
    """``--questions gsm8k`` asks ``datasets`` for the set's own split (GSM8K has no train
    questions to bench on): a folder holding only a ``test`` split stands where the hub's
    copy would, read by the real library."""
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    write_jsonl(folder / "test.jsonl", [LOCAL_COPIES["gsm8k"]] * 3)
    monkeypatch.setitem(EVAL_SETS, "gsm8k", EvalSet(str(folder), None, "test", "gsm8k"))
    found = load_questions("gsm8k", limit=2)
    assert [q.turns for q in found] == [[LOCAL_COPIES["gsm8k"]["question"]]] * 2
    assert {(q.set, q.category) for q in found} == {("gsm8k", "gsm8k")}


def test_a_suite_tags_each_question_with_its_set_and_limits_each_set(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [LOCAL_COPIES["gsm8k"]] * 3)
    b = write_jsonl(tmp_path / "b.jsonl", [LOCAL_COPIES["math500"]] * 3)
    found = load_questions(f"{a}, {b}", limit=2)
    assert [q.set for q in found] == [str(a), str(a), str(b), str(b)]
    for bad, words in ((f"{a},", "empty name"), (f"{a},{a}", "named twice")):
        with pytest.raises(UserError, match=words):
            load_questions(bad)


def test_a_named_set_out_of_reach_is_one_error_naming_the_sets(tmp_path):
    """Offline with no cached copy: one line naming the set and the sets known by name."""
    code = (
        "from specforge.data.questions import load_questions\n"
        "from specforge.errors import UserError\n"
        "try:\n    load_questions('humaneval')\n"
        "except UserError as err:\n    print(err)\n"
    )
    env = {**question_module.os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "cannot read benchmark questions from 'humaneval'" in done.stdout
    assert "mt_bench, gsm8k, humaneval, math500" in done.stdout


def test_a_record_without_a_question_names_the_fields_it_looked_for(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"answer": "7"}])
    with pytest.raises(UserError, match="line 1: none of the fields 'turns', 'prompt', 'question'"):
        load_questions(str(path))
