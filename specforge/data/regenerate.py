"""Self-distillation: the target answers every user turn of the input conversations itself.

A draft learns the target's own distribution best from the target's own answers, so the input's
assistant turns are dropped and regenerated turn by turn (turn ``j`` of a conversation sees the
target's answers to turns ``< j``). Conversations are generated in batches with left padding.

Output: conversations JSONL, one ``{"id", "messages", "meta"}`` object per line, in input order.

Resumable and never half-written:

1. ids already present in the output file (or in its in-progress sidecar) are skipped;
2. each finished batch is appended to the sidecar ``<output>.partial`` with one write + fsync,
   so a kill loses at most the batch in flight (a torn last line is dropped on the next run);
3. at the end the output file is replaced atomically (temp file + rename) by the old records
   followed by the new ones, and the sidecar is removed.

Sampled runs reseed each batch with ``seed + batch index``; a resumed sampled run therefore
draws differently for the batches after the interruption (greedy runs are unaffected).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specforge.config import RegenerateConfig
from specforge.data.chat import (
    end_of_turn_ids,
    left_padded,
    pad_id_of,
    prompt_ids,
    with_system_prompt,
)
from specforge.data.conversations import Conversation
from specforge.io import append_jsonl, read_jsonl, write_jsonl_atomic

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
            "seconds": round(self.seconds, 1),
            "tokens_per_s": round(self.generated_tokens / max(self.seconds, 1e-9), 1),
        }


def partial_path(output: Path) -> Path:
    """The in-progress sidecar of ``output``."""
    return output.with_name(output.name + ".partial")


@torch.no_grad()
def generate_answers(
    model, tokenizer, prompts: list[list[dict[str, str]]], cfg: RegenerateConfig
) -> list[tuple[str, int, bool]]:
    """Answer a batch of chat prompts with the target.

    Args:
        model: the target causal LM.
        tokenizer: its tokenizer (with a chat template).
        prompts: message lists, each ending with a user turn.
        cfg: generation settings.

    Returns:
        ``(answer text, generated tokens, stopped at end-of-turn)`` per prompt.
    """
    from transformers import GenerationConfig

    eos_ids = end_of_turn_ids(tokenizer, model.generation_config)
    pad_id = pad_id_of(tokenizer, model.generation_config)
    batch = left_padded([prompt_ids(tokenizer, messages) for messages in prompts], pad_id)
    sample = cfg.temperature > 0
    generation_config = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sample,
        temperature=cfg.temperature if sample else None,
        top_p=cfg.top_p if sample else None,
        top_k=None,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )
    output = model.generate(
        input_ids=batch["input_ids"].to(model.device),
        attention_mask=batch["attention_mask"].to(model.device),
        generation_config=generation_config,
    )
    # (B, prompt + new) -> (B, new)
    new_tokens = output[:, batch["input_ids"].shape[1] :].cpu()
    results = []
    for row in new_tokens:
        is_eos = torch.isin(row, torch.tensor(eos_ids))
        stopped = bool(is_eos.any())
        length = int(is_eos.int().argmax()) + 1 if stopped else len(row)
        text = tokenizer.decode(row[:length], skip_special_tokens=True).strip()
        results.append((text, length, stopped))
    return results


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
        model: the target causal LM (eval mode).
        tokenizer: its tokenizer, with a chat template.
        conversations: inputs; their assistant turns are ignored, user and system turns kept.
        output: the conversations JSONL to write or extend.
        cfg: batch size, sampling settings, token limits.
        system_prompt: prepended to conversations without a system message.
        target_name: recorded in each record's ``meta``.

    Returns:
        Counts and timing of the run.
    """
    output = Path(output)
    sidecar = partial_path(output)
    report = RegenerateReport(requested=len(conversations))
    old_records = read_jsonl(output)
    new_records = read_jsonl(sidecar, repair=True)
    done = {r["id"] for r in old_records} | {r["id"] for r in new_records}
    todo = [c for c in conversations if c.id not in done]
    report.already_done = len(conversations) - len(todo)
    if report.already_done:
        logger.info(
            "%s: %d conversations already done, %d to go", output, report.already_done, len(todo)
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    progress = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not todo)
    for batch_index in range(0, len(todo), cfg.batch_size):
        if cfg.temperature > 0:
            torch.manual_seed(cfg.seed + batch_index // cfg.batch_size)
        batch = todo[batch_index : batch_index + cfg.batch_size]
        records = _regenerate_batch(
            model, tokenizer, batch, cfg, system_prompt, target_name, report
        )
        append_jsonl(sidecar, records)
        new_records.extend(records)
        progress.update(len(batch))
        elapsed = time.perf_counter() - start
        progress.set_postfix(tok_s=f"{report.generated_tokens / max(elapsed, 1e-9):.0f}")
    progress.close()
    report.seconds = time.perf_counter() - start
    report.written = len(new_records)
    if new_records or not output.exists():
        write_jsonl_atomic(output, old_records + new_records)
    sidecar.unlink(missing_ok=True)
    return report


def _regenerate_batch(model, tokenizer, batch, cfg, system_prompt, target_name, report):
    """Generate all turns of a batch of conversations; returns their output records."""
    # 1. keep the system turn (or the configured system prompt); drop the input's answers
    histories = [
        with_system_prompt([m for m in c.messages if m["role"] == "system"], system_prompt)
        for c in batch
    ]
    user_turns = [c.user_turns for c in batch]
    finish: list[list[str]] = [[] for _ in batch]
    active = [True] * len(batch)
    for turn in range(max(len(turns) for turns in user_turns)):
        # 2. the prompts of this turn; a conversation whose prompt grew too long stops here
        rows, prompts = [], []
        for i in range(len(batch)):
            if not active[i] or turn >= len(user_turns[i]):
                continue
            prompt = histories[i] + [{"role": "user", "content": user_turns[i][turn]}]
            if len(prompt_ids(tokenizer, prompt)) > cfg.max_prompt_length:
                active[i] = False
                report.stopped_long_prompt += 1
                continue
            rows.append(i)
            prompts.append(prompt)
        if not rows:
            continue
        # 3. answer them together and extend the histories
        answers = generate_answers(model, tokenizer, prompts, cfg)
        for i, prompt, (text, n_tokens, stopped) in zip(rows, prompts, answers, strict=True):
            histories[i] = prompt + [{"role": "assistant", "content": text}]
            finish[i].append("stop" if stopped else "length")
            report.turns += 1
            report.generated_tokens += n_tokens
            report.hit_max_new_tokens += not stopped
    return [
        {
            "id": c.id,
            "messages": histories[i],
            "meta": {"generated_by": target_name, "finish_reasons": finish[i]},
        }
        for i, c in enumerate(batch)
        if finish[i]  # a conversation whose first prompt was too long yields nothing
    ]
