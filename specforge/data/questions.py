"""Benchmark question sets for the accept-length benchmark, and the way their turns are asked.

- MT-Bench as FastChat ships it (``question.jsonl``: ``question_id``, ``category``, ``turns``),
  or the HF dataset ``HuggingFaceH4/mt_bench_prompts`` (``prompt_id``, ``category``,
  ``prompt``);
- any conversations file (its user turns; category ``conversations``);
- ``builtin-eval``: the held-out split of the built-in prompts (never trained on), for offline
  machines without MT-Bench;
- ``auto``: MT-Bench from the HF hub when it is reachable, else ``builtin-eval``;
- a set by name (:data:`EVAL_SETS`: ``mt_bench``, ``gsm8k``, ``humaneval``, ``math500``),
  read through ``datasets`` with its own config and split, from the hub or its cache; a local
  JSONL copy of any of them reads by the same fields (GSM8K's ``question``, HumanEval's
  ``prompt`` and ``task_id``, MATH-500's ``problem`` and ``unique_id``);
- a suite: several of the above separated by commas (``mt_bench,gsm8k``), each question
  tagged with its set so a report can keep one table per set.

Multi-turn questions are asked as EAGLE and SpecForge ask MT-Bench: turn ``j`` follows the
model's own answers to turns ``< j`` (:func:`ask_turns`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge.data.conversations import MalformedRecord, normalize_record
from specforge.data.prompts import builtin_prompt_records, is_eval_prompt
from specforge.errors import UserError
from specforge.io import iter_jsonl, require_local

logger = logging.getLogger(__name__)

BUILTIN_EVAL = "builtin-eval"
AUTO = "auto"
MT_BENCH_HF = "HuggingFaceH4/mt_bench_prompts"
HUB_HOST = ("huggingface.co", 443)
HUB_PROBE_SECONDS = 3.0
TURN_FIELDS = ("turns", "prompt", "question", "problem")
"""Where a question record keeps its user turn(s): FastChat's MT-Bench, HF's MT-Bench prompts
and HumanEval, GSM8K, MATH-500."""
ID_FIELDS = ("question_id", "prompt_id", "id", "task_id", "unique_id")


@dataclass(frozen=True)
class EvalSet:
    """A benchmark question set on the HF hub: the dataset, its config and split, and the
    category its questions get when a record names none."""

    dataset: str
    config: str | None
    split: str
    category: str


EVAL_SETS = {
    "mt_bench": EvalSet(MT_BENCH_HF, None, "train", "mt_bench"),
    "gsm8k": EvalSet("openai/gsm8k", "main", "test", "gsm8k"),
    "humaneval": EvalSet("openai/openai_humaneval", None, "test", "humaneval"),
    "math500": EvalSet("HuggingFaceH4/MATH-500", None, "test", "math500"),
}
"""The sets ``bench --questions NAME`` reads by name (SpecForge's default benchmarks)."""


@dataclass
class BenchQuestion:
    id: str
    category: str
    turns: list[str]
    set: str = ""
    """The question set it came from (one of a suite's parts)."""


def _from_record(record: dict, index: int, category: str = "default") -> BenchQuestion | None:
    turns = next((record[k] for k in TURN_FIELDS if record.get(k)), None)
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return None
    qid = next((record[k] for k in ID_FIELDS if k in record), index)
    return BenchQuestion(str(qid), str(record.get("category", category)), turns)


def _from_file(path: Path) -> list[BenchQuestion]:
    questions = []
    for number, record in iter_jsonl(path):
        if not isinstance(record, dict):
            raise UserError(f"{path}: line {number}: expected a JSON object, got {record!r:.60}")
        question = _from_record(record, number)
        if question is None and ("messages" in record or "conversations" in record):
            try:
                record_id, messages = normalize_record(record)
            except MalformedRecord as err:
                raise UserError(f"{path}: line {number}: {err}") from None
            user = [m["content"] for m in messages if m["role"] == "user"]
            question = BenchQuestion(record_id or str(number), "conversations", user)
        if question is None:
            fields = ", ".join(f"'{k}'" for k in (*TURN_FIELDS, "messages"))
            raise UserError(f"{path}: line {number}: none of the fields {fields} holds a question")
        questions.append(question)
    return questions


def hub_reachable() -> bool:
    """Whether the HF hub answers (one quick TCP connect; no retries). ``HF_HUB_OFFLINE=1``
    says no without trying."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        with socket.create_connection(HUB_HOST, timeout=HUB_PROBE_SECONDS):
            return True
    except OSError:
        return False


def resolve_question_set(source: str) -> str:
    """``auto`` -> MT-Bench from the hub when reachable, else ``builtin-eval`` (logged);
    anything else unchanged."""
    if source != AUTO:
        return source
    if hub_reachable():
        return MT_BENCH_HF
    logger.warning(
        "the HF hub is not reachable: benchmarking on %s, the held-out built-in prompts "
        "(pass --questions question.jsonl for MT-Bench)",
        BUILTIN_EVAL,
    )
    return BUILTIN_EVAL


def question_sets(source: str) -> list[str]:
    """The parts of a ``--questions`` value: one source, or a comma-separated suite.

    Raises:
        UserError: an empty part (``"mt_bench,"``) or a set named twice.
    """
    parts = [part.strip() for part in source.split(",")]
    if not all(parts):
        raise UserError(f"questions {source!r}: an empty name in the list")
    if len(set(parts)) < len(parts):
        raise UserError(f"questions {source!r}: a set named twice")
    return parts


def load_questions(source: str, *, limit: int | None = None) -> list[BenchQuestion]:
    """Read benchmark questions from a path, a set's name (:data:`EVAL_SETS`), an HF dataset
    name, ``builtin-eval``, ``auto``, or a comma-separated suite of these (``limit`` questions
    of each); every question records its set.

    Raises:
        UserError: an unreadable line (named), a source with no usable question, or a
            ``limit`` below 1.
    """
    if limit is not None and limit < 1:
        raise UserError(f"limit must be >= 1, got {limit}")
    questions = []
    for part in question_sets(source):
        name = resolve_question_set(part)
        found = _load_one(name)
        if not found:
            raise UserError(f"{name}: no benchmark question found")
        for question in found[:limit] if limit is not None else found:
            question.set = name
            questions.append(question)
    return questions


def _load_one(source: str) -> list[BenchQuestion]:
    """The questions of one source (not a suite, ``auto`` resolved)."""
    if source == BUILTIN_EVAL:
        return [
            BenchQuestion(r["id"], r["category"], r["turns"])
            for r in builtin_prompt_records()
            if is_eval_prompt(r["id"])
        ]
    if Path(source).is_file():
        return _from_file(Path(source))
    if Path(source).exists():
        raise UserError(f"{source}: not a question file")
    require_local(source, "question set")
    named = EVAL_SETS.get(source, EvalSet(source, None, "train", "default"))
    import datasets

    try:
        dataset = datasets.load_dataset(named.dataset, named.config, split=named.split)
    except Exception as err:  # datasets raises many types; keep the cause attached
        known = ", ".join(EVAL_SETS)
        raise UserError(
            f"cannot read benchmark questions from {source!r} (sets by name: {known}; or a "
            f"question file, an HF dataset with a train split): {err}"
        ) from err
    return [
        question
        for index, record in enumerate(dataset)
        if (question := _from_record(record, index, named.category)) is not None
    ]


def ask_turns(
    question: BenchQuestion,
    answer: Callable[[int, list[dict[str, str]]], tuple[str, Any]],
    *,
    system_prompt: str | None = None,
) -> Iterator[tuple[int, list[dict[str, str]], Any]]:
    """Ask a question's turns in order, each after the model's own earlier answers.

    Args:
        question: the question.
        answer: called with the turn index and the messages so far (ending with the user
            turn); returns the answer text (appended to the history) and whatever the caller
            measures.
        system_prompt: a system message first, or ``None`` for the template's default.

    Yields:
        ``(turn index, the messages asked, what answer returned beside the text)``.
    """
    history: list[dict[str, str]] = []
    if system_prompt is not None:
        history.append({"role": "system", "content": system_prompt})
    for turn_index, text in enumerate(question.turns):
        history.append({"role": "user", "content": text})
        asked = list(history)
        reply, measured = answer(turn_index, asked)
        history.append({"role": "assistant", "content": reply})
        yield turn_index, asked, measured
