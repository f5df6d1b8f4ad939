"""Self-distillation: the target answers every user turn of the input conversations itself.

A draft learns the target's own distribution best from the target's own answers, so the input's
assistant turns are dropped and regenerated turn by turn (turn ``j`` of a conversation sees the
target's answers to turns ``< j``). Two in-process backends (``regenerate.backend``):

- ``continuous`` (default): :mod:`specforge.engine.generation`; rows leave the batch when their
  answer ends and waiting prompts (other conversations, or the next turn of one just answered)
  take their place;
- ``static``: ``model.generate`` on fixed batches of ``batch_size`` conversations, turn by turn
  (the earlier path, kept as the measured baseline and for caches continuous batching cannot
  reshape);
- ``server``: a running OpenAI-compatible server (SGLang, vLLM) answers,
  ``regenerate.concurrency`` conversations at a time (:mod:`specforge.data.server_client`).

Output: conversations JSONL, one ``{"id", "messages", "meta"}`` object per line, in input order.
``meta.token_ids`` holds each assistant turn's generated ids exactly as the target produced them
(end-of-turn id included when it stopped), so training can use them instead of re-encoding the
text; ``meta.finish_reasons`` says ``stop`` or ``length`` per turn.

Resumable and never half-written:

1. ids already present in the output file (or in its in-progress sidecar) are skipped;
2. each finished conversation is appended to the sidecar ``<output>.partial`` with one write +
   fsync, so a kill loses at most the conversations in flight (a torn last line is dropped on
   the next run);
3. at the end the output file is replaced atomically (temp file + rename) by the old records
   followed by the new ones in input order, and the sidecar is removed.

Sampled runs seed every answer from ``(regenerate.seed, conversation id, turn)``, so an answer
does not depend on batching or on where a run was interrupted. ``regenerate.num_samples`` > 1
answers each conversation that many times, as records ``<id>#s0``, ``<id>#s1``, ...
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specforge.config import RegenerateConfig
from specforge.data.chat import (
    control_text_in,
    end_of_turn_ids,
    left_padded,
    pad_id_of,
    prompt_ids,
    with_system_prompt,
)
from specforge.data.conversations import Conversation
from specforge.data.server_client import ChatClient
from specforge.engine.batch import batcher_for
from specforge.engine.generation import (
    GenerationSettings,
    Request,
    auto_batch_size,
)
from specforge.io import append_jsonl, read_jsonl, write_jsonl_atomic
from specforge.models.kv_cache import GrowingKVLayer

logger = logging.getLogger(__name__)


@dataclass
class RegenerateReport:
    """What one regeneration run did."""

    requested: int = 0
    already_done: int = 0
    written: int = 0
    turns: int = 0
    generated_tokens: int = 0
    hit_max_new_tokens: int = 0
    stopped_long_prompt: int = 0
    skipped_control_text: int = 0
    """Conversations not answered: a message holds special-token text (it would act as a
    control token; see :func:`specforge.data.chat.control_text_in`)."""
    reencode_mismatch_turns: int = 0
    """Answers whose text, tokenized again, is not the ids the target generated."""
    decode_steps: int = 0
    """Continuous backend: decode forwards run (generated tokens / steps = rows per step)."""
    batch_size: int = 0
    """Rows in flight (continuous) or conversations per batch (static) as run: ``auto``
    resolved; 0 for the server backend."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "requested": self.requested,
            "already_done": self.already_done,
            "written": self.written,
            "turns": self.turns,
            "generated_tokens": self.generated_tokens,
            "hit_max_new_tokens": self.hit_max_new_tokens,
            "stopped_long_prompt": self.stopped_long_prompt,
            "skipped_control_text": self.skipped_control_text,
            "reencode_mismatch_turns": self.reencode_mismatch_turns,
            "decode_steps": self.decode_steps,
            "batch_size": self.batch_size,
            "seconds": round(self.seconds, 1),
            "tokens_per_s": round(self.generated_tokens / max(self.seconds, 1e-9), 1),
        }


def partial_path(output: Path) -> Path:
    """The in-progress sidecar of ``output``."""
    return output.with_name(output.name + ".partial")


@dataclass
class ConversationState:
    """One conversation being answered: its history so far and what is left to ask."""

    conversation: Conversation
    history: list[dict[str, str]]
    user_turns: list[str]
    finish_reasons: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def turn(self) -> int:
        return len(self.finish_reasons)

    @property
    def done(self) -> bool:
        return self.turn >= len(self.user_turns)

    def next_prompt(self) -> list[dict[str, str]]:
        return self.history + [{"role": "user", "content": self.user_turns[self.turn]}]

    def record(self, target_name: str) -> dict[str, Any]:
        meta = {"generated_by": target_name, "finish_reasons": self.finish_reasons}
        if len(self.token_ids) == len(self.finish_reasons):
            meta["token_ids"] = self.token_ids
        return {"id": self.conversation.id, "messages": self.history, "meta": meta}


class Regeneration:
    """The bookkeeping both backends share: prompts, answers, the report and the sidecar."""

    def __init__(self, model, tokenizer, cfg: RegenerateConfig, sidecar: Path, target_name: str):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.sidecar = sidecar
        self.target_name = target_name
        generation_config = getattr(model, "generation_config", None)  # None: server backend
        self.eos_ids = end_of_turn_ids(tokenizer, generation_config)
        self.pad_id = pad_id_of(tokenizer, generation_config)
        self.report = RegenerateReport()
        self.records: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        """Guards the report (the server backend answers from several threads)."""

    def prompt(self, state: ConversationState) -> list[int] | None:
        """The next turn's prompt ids, or ``None`` when the conversation ends here (its prompt
        grew past ``max_prompt_length``; it is written if it has an answer)."""
        ids = prompt_ids(self.tokenizer, state.next_prompt())
        if len(ids) > self.cfg.max_prompt_length:
            with self.lock:
                self.report.stopped_long_prompt += 1
            state.user_turns = state.user_turns[: state.turn]
            return None
        return ids

    def answered(self, state: ConversationState, tokens: list[int], stopped: bool) -> None:
        """Add a generated answer to the conversation (text without the end-of-turn id)."""
        content = tokens[:-1] if stopped else tokens
        text = self.tokenizer.decode(content, skip_special_tokens=True).strip()
        reencoded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        with self.lock:
            self.report.reencode_mismatch_turns += reencoded != content
        state.token_ids.append(list(tokens))
        self.answered_text(state, text, stopped, len(tokens))

    def answered_text(self, state: ConversationState, text: str, stopped: bool, tokens: int):
        """Add an answer's text to the conversation's history (server answers: no ids)."""
        state.history = state.next_prompt() + [{"role": "assistant", "content": text}]
        state.finish_reasons.append("stop" if stopped else "length")
        with self.lock:
            self.report.turns += 1
            self.report.generated_tokens += tokens
            self.report.hit_max_new_tokens += not stopped

    def finish(self, state: ConversationState) -> None:
        """Write a finished conversation to the sidecar (nothing when no turn was answered)."""
        if state.finish_reasons:
            record = state.record(self.target_name)
            append_jsonl(self.sidecar, [record])
            self.records[record["id"]] = record

    def seed(self, state: ConversationState) -> int:
        return zlib.crc32(f"{self.cfg.seed}:{state.conversation.id}:{state.turn}".encode())


def resolve_batch_size(model, cfg: RegenerateConfig) -> RegenerateConfig:
    """``cfg`` with ``batch_size: auto`` made concrete: :func:`auto_batch_size` for rows whose
    caches grow to a longest prompt and answer; ``cfg`` itself otherwise (and for the server
    backend, which does not batch)."""
    if cfg.batch_size != "auto" or cfg.backend == "server":
        return cfg
    longest = cfg.max_prompt_length + cfg.max_new_tokens + GrowingKVLayer.SPARE
    resolved = replace(cfg, batch_size=auto_batch_size(model, longest))
    logger.info("regenerate.batch_size auto: %d rows in flight", resolved.batch_size)
    return resolved


def regenerate_conversations(
    model,
    tokenizer,
    conversations: list[Conversation],
    output: str | Path,
    cfg: RegenerateConfig,
    *,
    system_prompt: str | None = None,
    target_name: str = "",
) -> RegenerateReport:
    """Answer every user turn of ``conversations`` with the target and write them to ``output``.

    Args:
        model: the target causal LM (eval mode); ``None`` with the server backend.
        tokenizer: its tokenizer, with a chat template.
        conversations: inputs; their assistant turns are ignored, user and system turns kept.
        output: the conversations JSONL to write or extend.
        cfg: backend, batch size, sampling settings, token limits.
        system_prompt: prepended to conversations without a system message.
        target_name: recorded in each record's ``meta``.

    Returns:
        Counts and timing of the run.
    """
    output = Path(output)
    sidecar = partial_path(output)
    if cfg.num_samples > 1:  # one record per answer, each with its own seed
        conversations = [
            Conversation(f"{c.id}#s{k}", c.messages)
            for c in conversations
            for k in range(cfg.num_samples)
        ]
    old_records = read_jsonl(output)
    earlier = read_jsonl(sidecar, repair=True)
    done = {r["id"] for r in old_records} | {r["id"] for r in earlier}
    states = [
        ConversationState(
            conversation,
            with_system_prompt(
                [m for m in conversation.messages if m["role"] == "system"], system_prompt
            ),
            conversation.user_turns,
        )
        for conversation in conversations
        if conversation.id not in done
    ]
    if len(states) < len(conversations):
        logger.info(
            "%s: %d conversations already done, %d to go",
            output,
            len(conversations) - len(states),
            len(states),
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    run = answer_states(model, tokenizer, states, sidecar, cfg, target_name=target_name)
    run.report.requested, run.report.already_done = (
        len(conversations),
        len(done & {c.id for c in conversations}),
    )
    run.report.written = len(earlier) + len(run.records)
    order = {c.id: i for i, c in enumerate(conversations)}
    new_records = earlier + list(run.records.values())  # disjoint: earlier ids were skipped
    new_records.sort(key=lambda r: order.get(r["id"], len(order)))
    if new_records or not output.exists():
        write_jsonl_atomic(output, old_records + new_records)
    sidecar.unlink(missing_ok=True)
    return run.report


def answer_states(
    model,
    tokenizer,
    states: list[ConversationState],
    sidecar: Path,
    cfg: RegenerateConfig,
    *,
    target_name: str = "",
    desc: str = "regenerate",
) -> Regeneration:
    """Answer the user turns left in ``states`` through ``cfg.backend``; each finished
    conversation is appended to ``sidecar`` and kept in the returned run's ``records``
    (conversations holding special-token text are skipped and counted)."""
    cfg = resolve_batch_size(model, cfg)
    run = Regeneration(model, tokenizer, cfg, sidecar, target_name)
    run.report.batch_size = 0 if cfg.backend == "server" else cfg.batch_size
    clean = [s for s in states if not control_text_in(tokenizer, s.conversation.messages)]
    run.report.skipped_control_text, states = len(states) - len(clean), clean
    start = time.perf_counter()
    progress = tqdm(total=len(states), desc=desc, unit="conv", disable=not states)
    backend = {"continuous": run_continuous, "static": run_static, "server": run_server}[
        cfg.backend
    ]
    backend(model, run, states, progress, start)
    progress.close()
    run.report.seconds = time.perf_counter() - start
    return run


def _show_rate(progress: tqdm, run: Regeneration, start: float, conversations: int) -> None:
    progress.update(conversations)
    elapsed = time.perf_counter() - start
    progress.set_postfix(tok_s=f"{run.report.generated_tokens / max(elapsed, 1e-9):.0f}")


def run_continuous(model, run: Regeneration, states, progress: tqdm, start: float) -> None:
    """Every conversation's turns through one :class:`ContinuousBatcher` stream."""
    cfg = run.cfg
    settings = GenerationSettings(
        max_new_tokens=cfg.max_new_tokens,
        eos_ids=run.eos_ids,
        pad_id=run.pad_id,
        max_batch_size=cfg.batch_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        rows_per_span=None if cfg.rows_per_span == "auto" else cfg.rows_per_span,
        decode_kernel=cfg.decode_kernel,
    )
    pending: list[Request] = []

    def ask_next(state: ConversationState) -> None:
        ids = None if state.done else run.prompt(state)
        if ids is None:
            run.finish(state)
            _show_rate(progress, run, start, 1)
        else:
            later_turns = len(state.user_turns) - state.turn - 1
            pending.append(Request(state, ids, seed=run.seed(state), priority=later_turns))

    for state in states:
        ask_next(state)
    batcher = batcher_for(model, settings)
    for completion in batcher.run(pending):
        run.answered(completion.key, completion.tokens, completion.stopped)
        ask_next(completion.key)
    run.report.decode_steps = batcher.steps


def run_static(model, run: Regeneration, states, progress: tqdm, start: float) -> None:
    """Fixed batches of ``batch_size`` conversations, turn by turn, with ``model.generate``."""
    for index in range(0, len(states), run.cfg.batch_size):
        batch = states[index : index + run.cfg.batch_size]
        if run.cfg.temperature > 0:
            torch.manual_seed(run.cfg.seed + index // run.cfg.batch_size)
        while True:
            asked = [(s, ids) for s in batch if not s.done and (ids := run.prompt(s)) is not None]
            if not asked:
                break
            answers = generate_batch(model, [ids for _, ids in asked], run)
            for (state, _), (tokens, stopped) in zip(asked, answers, strict=True):
                run.answered(state, tokens, stopped)
        for state in batch:
            run.finish(state)
        _show_rate(progress, run, start, len(batch))


def run_server(model, run: Regeneration, states, progress: tqdm, start: float) -> None:
    """``regenerate.concurrency`` conversations at a time through the server's chat API
    (:mod:`specforge.data.server_client`); each finished one goes to the sidecar at once."""
    cfg = run.cfg
    client = ChatClient(
        cfg.server_url,
        model=cfg.server_model or run.target_name,
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        retries=cfg.retries,
        backoff_s=cfg.retry_backoff_s,
        timeout_s=cfg.request_timeout_s,
    )

    def converse(state: ConversationState) -> ConversationState:
        while not state.done and run.prompt(state) is not None:
            seed = run.seed(state) if cfg.temperature > 0 else None
            answer = client.answer(state.next_prompt(), seed=seed)
            stopped = answer.finish_reason != "length"
            run.answered_text(state, answer.text, stopped, answer.completion_tokens)
        return state

    pool = ThreadPoolExecutor(max_workers=cfg.concurrency)
    try:
        for future in as_completed([pool.submit(converse, state) for state in states]):
            run.finish(future.result())
            _show_rate(progress, run, start, 1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@torch.no_grad()
def generate_batch(
    model, prompts: list[list[int]], run: Regeneration
) -> list[tuple[list[int], bool]]:
    """One left-padded ``model.generate`` call; ``(generated ids, stopped at end-of-turn)`` per
    prompt, the ids cut after the first end-of-turn id."""
    from transformers import GenerationConfig

    cfg = run.cfg
    batch = left_padded(prompts, run.pad_id)
    sample = cfg.temperature > 0
    generation_config = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sample,
        temperature=cfg.temperature if sample else None,
        top_p=cfg.top_p if sample else None,
        top_k=None,
        eos_token_id=run.eos_ids,
        pad_token_id=run.pad_id,
    )
    output = model.generate(
        input_ids=batch["input_ids"].to(model.device),
        attention_mask=batch["attention_mask"].to(model.device),
        generation_config=generation_config,
    )
    results = []
    # (B, prompt + new) -> (B, new)
    for row in output[:, batch["input_ids"].shape[1] :].cpu():
        is_eos = torch.isin(row, torch.tensor(run.eos_ids))
        stopped = bool(is_eos.any())
        length = int(is_eos.int().argmax()) + 1 if stopped else len(row)
        results.append((row[:length].tolist(), stopped))
    return results
