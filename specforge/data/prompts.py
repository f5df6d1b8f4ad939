"""The built-in prompt set: 317 prompts written for this project (single- and multi-turn,
8 categories: writing, roleplay, reasoning, math, coding, extraction, stem, humanities).

It lets the main job run offline on a fresh machine: the target answers these prompts itself
(self-distillation) and the draft trains on its answers. None of the prompts is an MT-Bench
question or a paraphrase of one, since MT-Bench is the evaluation set.

A fixed, hash-based 10% of the prompts form the ``eval`` split, which training never reads; the
accept-length benchmark falls back to it when MT-Bench is not reachable.
"""

from __future__ import annotations

import zlib
from importlib import resources
from typing import Any

from specforge.data.conversations import Conversation
from specforge.errors import UserError
from specforge.io import iter_jsonl

PROMPTS_FILE = "builtin_prompts.jsonl"
CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
"""The set's categories: MT-Bench's, by name."""
EVAL_BUCKETS = 10
"""A prompt is held out for evaluation when ``crc32(id) % EVAL_BUCKETS == 0``."""


def builtin_prompt_records() -> list[dict[str, Any]]:
    """All built-in prompts as ``{"id", "category", "turns"}`` records, in file order."""
    with resources.as_file(resources.files("specforge.data").joinpath(PROMPTS_FILE)) as path:
        return [record for _, record in iter_jsonl(path)]


def is_eval_prompt(prompt_id: str) -> bool:
    """Whether a built-in prompt belongs to the held-out ``eval`` split."""
    return zlib.crc32(prompt_id.encode("utf-8")) % EVAL_BUCKETS == 0


def builtin_conversations(split: str = "train") -> list[Conversation]:
    """The built-in prompts of one split (``train``, ``eval`` or ``all``) as user-only
    conversations, ready to be answered by the target.

    Raises:
        UserError: unknown split.
    """
    if split not in ("train", "eval", "all"):
        raise UserError(f"unknown built-in split {split!r}; choose train, eval or all")
    conversations = []
    for record in builtin_prompt_records():
        if split != "all" and is_eval_prompt(record["id"]) != (split == "eval"):
            continue
        messages = [{"role": "user", "content": turn} for turn in record["turns"]]
        conversations.append(Conversation(record["id"], messages))
    return conversations
