"""Benchmark question sets for the accept-length benchmark, and the way their turns are asked.

- MT-Bench as FastChat ships it (``question.jsonl``: ``question_id``, ``category``, ``turns``),
  or the HF dataset ``HuggingFaceH4/mt_bench_prompts`` (``prompt_id``, ``category``,
  ``prompt``);
- any conversations file (its user turns; category ``conversations``);
- ``builtin-eval``: the held-out split of the built-in prompts (never trained on), for offline
  machines without MT-Bench;
- ``auto``: MT-Bench from the HF hub when it is reachable, else ``builtin-eval``.

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
            raise UserError(f"{path}: line {number}: no 'turns', 'prompt' or 'messages' field")
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


def load_questions(source: str, *, limit: int | None = None) -> list[BenchQuestion]:
    """Read benchmark questions from a path, an HF dataset name, ``builtin-eval`` or ``auto``.

    Raises:
        UserError: an unreadable line (named), a source with no usable question, or a
            ``limit`` below 1.
    """
    if limit is not None and limit < 1:
        raise UserError(f"limit must be >= 1, got {limit}")
    source = resolve_question_set(source)
    if source == BUILTIN_EVAL:
        questions = [
            BenchQuestion(r["id"], r["category"], r["turns"])
            for r in builtin_prompt_records()
            if is_eval_prompt(r["id"])
        ]
    elif Path(source).is_file():
        questions = _from_file(Path(source))
    elif Path(source).exists():
        raise UserError(f"{source}: not a question file")
    else:
        require_local(source, "question set")
        import datasets

        try:
            dataset = datasets.load_dataset(source, split="train")
        except Exception as err:  # datasets raises many types; keep the cause attached
            raise UserError(f"cannot read benchmark questions from {source!r}: {err}") from err
        questions = [q for i, r in enumerate(dataset) if (q := _from_record(r, i)) is not None]
    if not questions:
        raise UserError(f"{source}: no benchmark question found")
    return questions[:limit] if limit is not None else questions


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
