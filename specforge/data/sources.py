"""Where a recipe's conversations come from: the sources in ``data.inputs`` (files, saved
datasets, HF dataset names) in order, or the built-in prompt set when there are none.

Every conversation id is unique across all inputs, because later stages key on it (regeneration
resumes by id, a capture stores hidden states by id, training splits train / eval by id). With
several sources each id is prefixed with its source's name: the file stem, or the whole source
as given when two sources share a stem (``a/train.jsonl`` and ``b/train.jsonl``); the built-in
set (source ``builtin``) keeps its ids, which are already its own (``builtin-...``), so adding a
source to it later does not rename what was answered. An id that still repeats across sources
is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from specforge.data.conversations import Conversation, MalformedRecord, read_conversations
from specforge.data.prompts import builtin_conversations
from specforge.errors import UserError
from specforge.io import iter_jsonl


def source_prefixes(sources: list[str]) -> list[str]:
    """The id prefix of each source: its file stem, or the source as given where stems clash."""
    stems = [Path(source).stem or source for source in sources]
    return [
        stem if stems.count(stem) == 1 else source.rstrip("/")
        for stem, source in zip(stems, sources, strict=True)
    ]


BUILTIN = "builtin"
"""The source name of the built-in prompt set (``data.builtin_split`` picks its split)."""


def load_conversations(
    sources: Iterable[str],
    *,
    fmt: str = "auto",
    split: str = "train",
    builtin_split: str = "train",
    limit: int | None = None,
) -> list[Conversation]:
    """Read several sources in order (or the built-in prompts when there are none; the source
    name ``builtin`` lists them among others).

    Raises:
        UserError: a source listed twice, or an id that two sources share.
    """
    sources = list(sources)
    if not sources:
        conversations = builtin_conversations(builtin_split)
        return conversations[:limit] if limit is not None else conversations
    repeated = sorted({s for s in sources if sources.count(s) > 1})
    if repeated:
        raise UserError(f"data.inputs lists {repeated[0]!r} more than once")
    conversations: list[Conversation] = []
    origin: dict[str, str] = {}
    prefixes = source_prefixes(sources) if len(sources) > 1 else [""]
    for source, prefix in zip(sources, prefixes, strict=True):
        if source == BUILTIN:  # its ids ("builtin-...") are its own namespace: kept as they are
            prefix = ""
        if source == BUILTIN:
            found = builtin_conversations(builtin_split)
        else:
            found, _ = read_conversations(source, fmt=fmt, split=split)
        for conversation in found:
            if prefix:
                conversation = Conversation(f"{prefix}/{conversation.id}", conversation.messages)
            if conversation.id in origin:
                raise UserError(
                    f"conversation id {conversation.id!r} is in both {origin[conversation.id]} "
                    f"and {source}; ids must be unique across data.inputs"
                )
            origin[conversation.id] = source
            conversations.append(conversation)
    return conversations[:limit] if limit is not None else conversations


def require_prepared(path: Path) -> Path:
    """The conversations file a stage reads, which ``specforge prepare`` writes.

    Raises:
        UserError: it does not exist (nothing runs prepare implicitly).
    """
    if not Path(path).is_file():
        raise UserError(
            f"{path} does not exist: run `specforge prepare` with the same config first "
            "(or point train.data_path at a conversations file)"
        )
    return Path(path)


def read_prepared(path: Path) -> list[Conversation]:
    """The conversations ``specforge prepare`` wrote to ``path``.

    Raises:
        UserError: the file is missing, or a line is not a prepared record (a raw dataset file
            given where prepare's output belongs), naming the line.
    """
    conversations = []
    for number, record in iter_jsonl(require_prepared(path)):
        try:
            conversations.append(Conversation.from_record(record))
        except MalformedRecord as err:
            raise UserError(
                f"{path}: line {number} is not a prepared conversation ({err}); training reads "
                "what `specforge prepare` writes: run it on this file first"
            ) from None
    return conversations
