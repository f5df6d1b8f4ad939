"""Conversation readers: ShareGPT, OpenAI messages and UltraChat-style records, from local
``.json``/``.jsonl`` files, folders written by ``datasets.save_to_disk``, or HF dataset names.

Every record becomes a :class:`Conversation`: an ``id`` and OpenAI-style ``messages``
(``role`` in ``system``/``user``/``assistant``). System prompts are kept. Malformed records are
skipped, counted, and the first few locations logged; a source with no valid record is an error.

Accepted record layouts (``format: auto`` picks per record by its keys):

- ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``
- OpenAI messages: ``{"id": ..., "messages": [{"role": ..., "content": ...}]}``
- UltraChat-style: ``{"id": ..., "data": ["user turn", "assistant turn", ...]}``
- Question/answer (GSM8K and similar): ``{"question": ..., "answer": ...}``, one exchange
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge.errors import UserError
from specforge.io import BadLine, iter_jsonl, require_local

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
ID_KEYS = ("id", "conversation_id", "prompt_id", "question_id")
MAX_LOGGED_LOCATIONS = 5


class MalformedRecord(ValueError):
    """A record that cannot be read as a conversation; the message says why."""


@dataclass
class Conversation:
    """One conversation in OpenAI message form."""

    id: str
    messages: list[dict[str, str]]
    token_ids: list[list[int]] | None = None
    """Per assistant message, the ids the target generated for it (``meta.token_ids`` of a
    self-distilled record); tokenization then uses them instead of re-encoding the text."""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "messages": self.messages}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Conversation:
        """A conversation from a record this project wrote (``{"id", "messages", "meta"}``)."""
        record_id, messages = normalize_record(record, "openai")
        return cls(record_id or "", messages, recorded_token_ids(record, messages))

    @property
    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]


@dataclass
class ReadReport:
    """What reading a source found."""

    source: str
    records: int = 0
    skipped: int = 0
    skipped_at: list[str] = field(default_factory=list)
    """Locations (``line 7``, ``record 3``, ``row 12``) and reasons of the first skips."""
    renamed_duplicates: int = 0

    def skip(self, where: str, reason: str) -> None:
        self.skipped += 1
        if len(self.skipped_at) < MAX_LOGGED_LOCATIONS:
            self.skipped_at.append(f"{where}: {reason}")


# ---------------------------------------------------------------------------------------------
# Record normalization


def normalize_record(record: Any, fmt: str = "auto") -> tuple[str | None, list[dict[str, str]]]:
    """Turn one raw record into ``(id or None, messages)``.

    Raises:
        MalformedRecord: the record matches no layout or breaks one's rules.
    """
    if not isinstance(record, dict):
        raise MalformedRecord(f"expected a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = next((f for f, key in _FORMAT_KEYS.items() if key in record), "")
        if not fmt:
            raise MalformedRecord(
                "no 'messages', 'conversations', 'data', 'question' or 'turns' field"
            )
    if fmt == "qa":
        messages = _read_qa(record)
    else:
        key = _FORMAT_KEYS[fmt]
        turns = record.get(key)
        if not isinstance(turns, list) or not turns:
            raise MalformedRecord(f"'{key}' must be a non-empty list")
        messages = _READERS[fmt](turns)
    _check_messages(messages)
    record_id = next((record[k] for k in ID_KEYS if record.get(k) not in (None, "")), None)
    return (None if record_id is None else str(record_id)), messages


def recorded_token_ids(record: Any, messages: list[dict[str, str]]) -> list[list[int]] | None:
    """``meta.token_ids`` of a record, when it holds one list of ids per assistant message."""
    meta = record.get("meta") if isinstance(record, dict) else None
    ids = meta.get("token_ids") if isinstance(meta, dict) else None
    answers = sum(m["role"] == "assistant" for m in messages)
    if (
        not isinstance(ids, list)
        or len(ids) != answers
        or not all(isinstance(t, list) and all(isinstance(i, int) for i in t) for t in ids)
    ):
        return None
    return ids


def _read_openai(turns: list[Any]) -> list[dict[str, str]]:
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise MalformedRecord(f"message {i} needs 'role' and 'content'")
        messages.append({"role": turn["role"], "content": turn["content"]})
    return messages


def _read_sharegpt(turns: list[Any]) -> list[dict[str, str]]:
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise MalformedRecord(f"turn {i} needs 'from' and 'value'")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise MalformedRecord(f"turn {i} has unknown speaker {turn['from']!r}")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _read_ultrachat(turns: list[Any]) -> list[dict[str, str]]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]


def _read_questions(turns: list[Any]) -> list[dict[str, str]]:
    """A benchmark question's turns (MT-Bench's ``turns``): user messages, unanswered."""
    for i, text in enumerate(turns):
        if not isinstance(text, str):
            raise MalformedRecord(f"turn {i}: expected a string, got {type(text).__name__}")
    return [{"role": "user", "content": text} for text in turns]


def _read_qa(record: dict[str, Any]) -> list[dict[str, str]]:
    if "answer" not in record:
        raise MalformedRecord("a 'question' record needs an 'answer'")
    return [
        {"role": "user", "content": record["question"]},
        {"role": "assistant", "content": record["answer"]},
    ]


_FORMAT_KEYS = {
    "openai": "messages",
    "sharegpt": "conversations",
    "ultrachat": "data",
    "qa": "question",
    "questions": "turns",
}
_READERS = {
    "openai": _read_openai,
    "sharegpt": _read_sharegpt,
    "ultrachat": _read_ultrachat,
    "questions": _read_questions,
}


def _check_messages(messages: list[dict[str, str]]) -> None:
    for i, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise MalformedRecord(f"message {i} has unknown role {message['role']!r}")
        if not isinstance(message["content"], str):
            raise MalformedRecord(f"message {i} content must be a string")
        if message["role"] == "system" and i != 0:
            raise MalformedRecord(f"system message at position {i}; only the first may be one")
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is None or first["role"] != "user":
        raise MalformedRecord("the first non-system message must be a user turn")


# ---------------------------------------------------------------------------------------------
# Sources


def _iter_source(source: str, split: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, raw record)`` pairs from a file, a saved dataset, or an HF name; a
    dataset (saved or by name) may name its own split after a colon
    (``HuggingFaceH4/ultrachat_200k:train_sft``), else ``split``."""
    if not Path(source).exists() and ":" in source:
        source, split = source.rsplit(":", 1)
    path = Path(source)
    if path.is_file():
        if path.suffix == ".jsonl":
            yield from _iter_jsonl(path)
        elif path.suffix == ".json":
            yield from _iter_json(path)
        else:
            raise UserError(f"{source}: expected a .json or .jsonl file")
        return
    require_local(source, "data source")
    import datasets

    if path.is_dir():
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise UserError(f"{source}: no split {split!r} (has {list(dataset)})")
            dataset = dataset[split]
    else:
        try:
            dataset = datasets.load_dataset(source, split=split)
        except Exception as err:  # datasets raises many types; keep the cause attached
            raise UserError(
                f"{source!r} is neither a local file/folder nor a loadable HF dataset: {err}"
            ) from err
    for row, record in enumerate(dataset):
        yield f"row {row}", record


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    for number, value in iter_jsonl(path, strict=False):
        if isinstance(value, BadLine):
            value = MalformedRecord(value.reason)
        yield f"line {number}", value


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: invalid JSON at line {err.lineno}: {err.msg}") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of records")
    for index, record in enumerate(data):
        yield f"record {index}", record


def read_conversations(
    source: str, *, fmt: str = "auto", split: str = "train"
) -> tuple[list[Conversation], ReadReport]:
    """Read every valid conversation of one source.

    Args:
        source: a ``.json``/``.jsonl`` path, a ``save_to_disk`` folder, or an HF dataset name.
        fmt: ``auto``, ``sharegpt``, ``openai``, ``ultrachat`` or ``qa``.
        split: the split to read from datasets.

    Returns:
        The conversations (ids made unique) and a report of what was skipped.

    Raises:
        UserError: unreadable source, or no valid record in it.
    """
    report = ReadReport(source=source)
    conversations: list[Conversation] = []
    seen: set[str] = set()
    stem = Path(source).stem or source
    for index, (where, record) in enumerate(_iter_source(source, split)):
        report.records += 1
        try:
            if isinstance(record, MalformedRecord):
                raise record
            record_id, messages = normalize_record(record, fmt)
        except MalformedRecord as err:
            report.skip(where, str(err))
            continue
        record_id = record_id or f"{stem}-{index}"
        if record_id in seen:
            report.renamed_duplicates += 1
            suffix = 1
            while f"{record_id}#{suffix}" in seen:
                suffix += 1
            record_id = f"{record_id}#{suffix}"
        seen.add(record_id)
        token_ids = recorded_token_ids(record, messages)
        conversations.append(Conversation(record_id, messages, token_ids))
    if report.skipped:
        logger.warning(
            "%s: skipped %d malformed of %d records; first: %s",
            source,
            report.skipped,
            report.records,
            "; ".join(report.skipped_at),
        )
    if report.renamed_duplicates:
        logger.warning("%s: %d duplicate ids got a #N suffix", source, report.renamed_duplicates)
    if not conversations:
        detail = f" (first problems: {'; '.join(report.skipped_at)})" if report.skipped_at else ""
        raise UserError(f"{source}: no valid conversation in {report.records} records{detail}")
    return conversations, report
