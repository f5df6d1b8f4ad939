import pytest

from specforge.io import append_jsonl, atomic_directory, read_jsonl, write_jsonl_atomic


def test_atomic_directory_replaces_only_on_success(tmp_path):
    final = tmp_path / "out"
    with atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("first")
    assert (final / "a.txt").read_text() == "first"
    with pytest.raises(RuntimeError), atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("half-written")
        raise RuntimeError("killed")
    assert (final / "a.txt").read_text() == "first"
    with atomic_directory(final, replace=False) as tmp:
        (tmp / "a.txt").write_text("late writer")
    assert (final / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folders left


def test_write_jsonl_atomic_leaves_no_temp_file(tmp_path):
    path = tmp_path / "x.jsonl"
    write_jsonl_atomic(path, [{"a": 1}, {"b": "é"}])
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n{"b": "é"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["x.jsonl"]


def test_append_jsonl_creates_its_folder(tmp_path):
    """A first run appends into an output folder nothing has created yet (the quickstart's
    synthesized prompts)."""
    path = tmp_path / "fresh" / "run" / "x.prompts.jsonl"
    append_jsonl(path, [{"id": "a"}])
    append_jsonl(path, [{"id": "b"}])
    assert read_jsonl(path) == [{"id": "a"}, {"id": "b"}]
