"""Benchmark question sets for the accept-length benchmark.

- MT-Bench as FastChat ships it (``question.jsonl``: ``question_id``, ``category``, ``turns``),
  or the HF dataset ``HuggingFaceH4/mt_bench_prompts`` (``prompt_id``, ``category``,
  ``prompt``);
- any conversations file (its user turns; category ``conversations``);
- ``builtin-eval``: the held-out split of the built-in prompts (never trained on), for offline
  machines without MT-Bench.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BUILTIN_EVAL = "builtin-eval"


@dataclass
class BenchQuestion:
    id: str
    category: str
    turns: list[str]


def _from_record(record: dict, index: int) -> BenchQuestion | None:
    turns = record.get("turns") or record.get("prompt")
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return None
    qid = next((record[k] for k in ("question_id", "prompt_id", "id") if k in record), index)
    return BenchQuestion(str(qid), str(record.get("category", "default")), turns)


def load_questions(source: str, *, limit: int | None = None) -> list[BenchQuestion]:
    """Read benchmark questions from a path, an HF dataset name, or ``builtin-eval``.

    Raises:
        ValueError: a source with no usable question.
    """
    if source == BUILTIN_EVAL:
        from specforge.data.prompts import builtin_prompt_records, is_eval_prompt

        questions = [
            BenchQuestion(r["id"], r["category"], r["turns"])
            for r in builtin_prompt_records()
            if is_eval_prompt(r["id"])
        ]
    elif Path(source).is_file():
        questions = []
        for index, line in enumerate(Path(source).read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            record = json.loads(line)
            question = _from_record(record, index)
            if question is None and ("messages" in record or "conversations" in record):
                from specforge.data.conversations import normalize_record

                record_id, messages = normalize_record(record)
                user = [m["content"] for m in messages if m["role"] == "user"]
                question = BenchQuestion(record_id or str(index), "conversations", user)
            if question is not None:
                questions.append(question)
    else:
        import datasets

        try:
            dataset = datasets.load_dataset(source, split="train")
        except Exception as err:  # datasets raises many types; keep the cause attached
            raise ValueError(f"cannot read benchmark questions from {source!r}: {err}") from err
        questions = [q for i, r in enumerate(dataset) if (q := _from_record(r, i)) is not None]
    if not questions:
        raise ValueError(f"{source}: no benchmark question found")
    return questions[:limit] if limit is not None else questions
