"""Second user turns the target writes itself (multi-turn "Magpie"): after the target answered
a synthesized prompt, the chat template rendered up to the next user message and sampled until
the turn ends is a follow-up in the target's own distribution, which the target then answers.
MT-Bench asks half of its turns this way, over a first answer; prompts synthesized one at a
time give a corpus of first turns.

``synthesize.follow_ups`` is the share of the synthesized conversations that get one, picked by
a hash of ``(synthesize.seed, id)``; a first answer cut at ``regenerate.max_new_tokens`` is
followed up as it stands (as MT-Bench's second turns follow first answers cut at the bench's
``max_new_tokens``). A follow-up is sampled and filtered as a first prompt is
(:class:`~specforge.distill.synthesize.PromptFilter`: unfinished, too short, control text,
degenerate, near duplicate of another follow-up, a 6-word run of MT-Bench); a dropped one leaves
its conversation single-turn. The answer is generated as every regenerated turn is
(``regenerate.*``), its ids recorded beside the first answer's.

Resumable: each decision is appended to ``<output>.follow_ups.jsonl`` as it is made
(``{"id", "prompt"}`` or ``{"id", "dropped"}``, in candidate order) and each answered
conversation to a sidecar; a rerun decides and answers only what is left, then the
conversations file is rewritten (atomically) with the answered conversations in place.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specforge.config import RegenerateConfig, SynthesizeConfig
from specforge.data.batching import split_key
from specforge.data.chat import control_tokens
from specforge.data.conversations import Conversation
from specforge.distill.regenerate import ConversationState, answer_states
from specforge.distill.synthesize import (
    PromptFilter,
    SynthesisReport,
    in_key_order,
    prompt_settings,
    user_turn_prefix,
)
from specforge.engine.batch import batcher_for
from specforge.engine.generation import Request
from specforge.io import append_jsonl, read_jsonl, write_jsonl_atomic


@dataclass
class FollowUpReport(SynthesisReport):
    """What one follow-up run did: the synthesis counts over the follow-ups (``requested``:
    the conversations of the share; ``attempts``, ``accepted``, ``dropped``,
    ``generated_tokens``: the follow-ups sampled this run), and their answers."""

    answered: int = 0
    """Conversations whose follow-up was answered (this run)."""
    answer_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {**super().as_dict(), "answered": self.answered, "answer_tokens": self.answer_tokens}


def follow_ups_path(output: Path) -> Path:
    """Where the follow-up decisions of ``output`` are kept."""
    return output.with_name(output.stem + ".follow_ups.jsonl")


def follow_up_hash(cfg: SynthesizeConfig, record_id: str) -> int:
    """Conversation ``record_id``'s draw: it picks the conversation and seeds its follow-up."""
    return zlib.crc32(f"{cfg.seed}:follow-up:{record_id}".encode())


def picked(cfg: SynthesizeConfig, record_id: str) -> bool:
    """Whether conversation ``record_id`` is one of the ``cfg.follow_ups`` share."""
    return follow_up_hash(cfg, record_id) % 10_000 < round(cfg.follow_ups * 10_000)


def is_candidate(record: dict, synthesized: set[str], cfg: SynthesizeConfig) -> bool:
    """An answered synthesized single-turn conversation of the share."""
    return (
        split_key(record["id"]) in synthesized  # without regenerate.num_samples' "#s<k>"
        and [m["role"] for m in record["messages"]][-2:] == ["user", "assistant"]
        and sum(m["role"] == "user" for m in record["messages"]) == 1
        and picked(cfg, record["id"])
    )


def add_follow_ups(
    model,
    tokenizer,
    output: str | Path,
    synthesized: set[str],
    cfg: SynthesizeConfig,
    regenerate: RegenerateConfig,
    *,
    target_name: str = "",
) -> FollowUpReport:
    """Give ``cfg.follow_ups`` of the synthesized conversations in ``output`` (ids
    ``synthesized``) a second user turn the target writes, and its answer (see the module
    docstring); rewrites ``output`` with them."""
    output = Path(output)
    start = time.perf_counter()
    records = read_jsonl(output)
    candidates = [r for r in records if is_candidate(r, synthesized, cfg)]
    report = FollowUpReport(requested=len(candidates))
    decisions = {d["id"]: d for d in read_jsonl(follow_ups_path(output), repair=True)}
    report.already_done = len(decisions.keys() & {r["id"] for r in candidates})
    todo = [r for r in candidates if r["id"] not in decisions]
    _decide(model, tokenizer, output, todo, cfg, decisions, report)
    sidecar = output.with_name(output.name + ".follow_ups.partial")
    answered = {r["id"]: r for r in read_jsonl(sidecar, repair=True)}
    states = [
        _state(record, decisions[record["id"]]["prompt"])
        for record in candidates
        if "prompt" in decisions.get(record["id"], {}) and record["id"] not in answered
    ]
    run = answer_states(
        model, tokenizer, states, sidecar, regenerate, target_name=target_name, desc="follow-ups"
    )
    report.answered = len(run.records)
    report.answer_tokens = run.report.generated_tokens
    answered |= run.records
    if answered:
        write_jsonl_atomic(output, (answered.get(r["id"], r) for r in records))
    sidecar.unlink(missing_ok=True)
    report.seconds = time.perf_counter() - start
    return report


def _decide(
    model,
    tokenizer,
    output: Path,
    todo: list[dict],
    cfg: SynthesizeConfig,
    decisions: dict[str, dict],
    report: FollowUpReport,
) -> None:
    """Sample a follow-up for each conversation of ``todo`` and keep or drop it, in ``todo``'s
    order (so the near-duplicate check does not depend on which row ends first), appending
    each decision to the decisions file as soon as the earlier ones are made."""
    if not todo:
        return
    prompt_filter = PromptFilter(cfg, control_tokens(tokenizer))
    for decision in decisions.values():
        if "prompt" in decision:
            prompt_filter.accept(decision["prompt"])
    settings = prompt_settings(model, tokenizer, cfg)
    pending = [
        Request(
            index,
            user_turn_prefix(tokenizer, record["messages"]),
            seed=follow_up_hash(cfg, record["id"]),
        )
        for index, record in enumerate(todo)
    ]
    pending.reverse()  # of equal-length prompts the batcher takes the last listed first
    for completion in in_key_order(batcher_for(model, settings).run(pending), 0):
        report.attempts += 1
        report.generated_tokens += len(completion.tokens)
        content = completion.tokens[:-1] if completion.stopped else completion.tokens
        text = tokenizer.decode(content, skip_special_tokens=True).strip()
        reason = prompt_filter.reason_to_drop(text, completion.stopped)
        decision = {"id": todo[completion.key]["id"]}
        if reason is None:
            prompt_filter.accept(text)
            decision["prompt"] = text
            report.accepted += 1
        else:
            decision["dropped"] = reason
            report.dropped[reason] += 1
        append_jsonl(follow_ups_path(output), [decision])
        decisions[decision["id"]] = decision


def _state(record: dict, follow_up: str) -> ConversationState:
    """The conversation of ``record`` with its first turn answered and ``follow_up`` to
    answer next."""
    messages = record["messages"]
    meta = record.get("meta", {})
    state = ConversationState(
        Conversation(record["id"], [*messages, {"role": "user", "content": follow_up}]),
        history=list(messages),
        user_turns=[m["content"] for m in messages if m["role"] == "user"] + [follow_up],
        finish_reasons=list(meta["finish_reasons"]),
    )
    if "token_ids" in meta:
        state.token_ids = [list(ids) for ids in meta["token_ids"]]
    return state
