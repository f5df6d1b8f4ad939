"""The ``prepare`` recipe: conversations in, a clean conversations JSONL + statistics out.

1. read conversations (files, HF datasets, the ``builtin`` prompt set; the built-in set alone
   when there is nothing else);
2. optionally add prompts the target writes itself (``--synthesize N``,
   :mod:`specforge.distill.synthesize`) and answer every user turn with the target
   (self-distillation, ``--regenerate``; implied by ``--synthesize``), then give a share of
   the synthesized conversations a second turn (``synthesize.follow_ups``,
   :mod:`specforge.distill.follow_ups`);
3. write the conversations as OpenAI-messages JSONL (atomically);
4. tokenize them with the target's chat template and count tokens under the loss mask;
5. optionally write the draft vocabulary map (``d2t``/``t2d``) from those counts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge.config import SpecForgeConfig, to_dict
from specforge.data.batching import split_train_eval
from specforge.data.chat import end_of_turn_ids, set_chat_template, tokenize_conversations
from specforge.data.conversations import Conversation
from specforge.data.sources import load_conversations
from specforge.data.vocab import check_vocab_output, save_vocab_map, vocab_map_from_samples
from specforge.distill.follow_ups import add_follow_ups
from specforge.distill.regenerate import partial_path, regenerate_conversations
from specforge.distill.synthesize import synthesize_conversations
from specforge.errors import UserError
from specforge.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from specforge.models.adapter import architecture, recurrent_layers, text_config
from specforge.models.target import (
    load_generation_config,
    load_target,
    load_target_config,
    load_tokenizer,
)
from specforge.recipes.stage import start_stage

logger = logging.getLogger(__name__)


@dataclass
class PrepareResult:
    """Where prepare wrote its results and what it counted."""

    output: Path
    stats: dict[str, Any] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)


def prepare(cfg: SpecForgeConfig) -> PrepareResult:
    """Run the prepare stage described by ``cfg`` (see the module docstring).

    Returns:
        The output path, statistics and per-step timings; the statistics are also written to
        ``<output>.stats.json``.
    """
    cfg = start_stage(cfg)
    output = cfg.conversations_path
    if output.is_dir():
        raise UserError(
            f"the output {output} is a directory: name the conversations file to write "
            f"(e.g. {output / 'conversations.jsonl'})"
        )
    if cfg.prepare.vocab_output:
        check_vocab_output(cfg.prepare.vocab_output)
    for source in cfg.data.inputs:
        if Path(source).resolve() in (output.resolve(), partial_path(output).resolve()):
            raise UserError(
                f"the output {output} is also an input: prepare would replace the conversations "
                "it reads; write to another file"
            )
    result = PrepareResult(output=output)
    # 1. read the inputs (none with --synthesize alone: the built-in set only when listed)
    conversations = []
    if cfg.data.inputs or not cfg.synthesize.count:
        conversations = load_conversations(
            cfg.data.inputs,
            fmt=cfg.data.format,
            split=cfg.data.split,
            builtin_split=cfg.data.builtin_split,
            limit=cfg.data.limit,
        )
        source = ", ".join(cfg.data.inputs) or f"built-in prompts ({cfg.data.builtin_split} split)"
        logger.info("read %d conversations from %s", len(conversations), source)
    # 2. with the target: synthesize prompts, answer every user turn (self-distillation)
    if cfg.regenerate.enabled or cfg.synthesize.count:
        tokenizer, written = _self_distill(cfg, conversations, result)
    else:
        tokenizer = load_tokenizer(cfg.target)
        set_chat_template(tokenizer, cfg.data.chat_template)
        write_jsonl_atomic(output, (c.to_json() for c in conversations))
        written = conversations
    # 3. tokenize as training will, 4. the draft vocabulary
    clock = time.perf_counter()
    samples, token_stats = tokenize_conversations(
        tokenizer, written, max_length=cfg.data.max_length, system_prompt=cfg.data.system_prompt
    )
    result.timings_s["tokenize"] = time.perf_counter() - clock
    result.stats["tokens"] = token_stats.as_dict()
    if cfg.prepare.vocab_output:
        result.stats["vocab"] = _write_vocab_map(cfg, tokenizer, samples)
    result.stats["timings_s"] = {k: round(v, 1) for k, v in result.timings_s.items()}
    result.stats["config"] = to_dict(cfg)
    write_json_atomic(output.with_name(output.stem + ".stats.json"), result.stats)
    return result


def _self_distill(cfg: SpecForgeConfig, conversations, result: PrepareResult):
    """Load the target, add ``synthesize.count`` prompts it writes, answer every user turn;
    returns the tokenizer and the written conversations."""
    clock = time.perf_counter()
    if cfg.regenerate.backend == "server":  # the server answers: the tokenizer is enough
        if cfg.synthesize.count:
            raise UserError("synthesize.count needs the target in-process, not a server")
        model, tokenizer = None, load_tokenizer(cfg.target)
    else:
        model, tokenizer = load_target(cfg.target)
        cfg = _batchable(cfg, model)
    set_chat_template(tokenizer, cfg.data.chat_template)
    result.timings_s["load_target"] = time.perf_counter() - clock
    if cfg.synthesize.count:
        clock = time.perf_counter()
        synthesized, report = synthesize_conversations(
            model, tokenizer, result.output, cfg.synthesize, system_prompt=cfg.data.system_prompt
        )
        conversations = conversations + synthesized
        result.timings_s["synthesize"] = time.perf_counter() - clock
        result.stats["synthesize"] = report.as_dict()
    clock = time.perf_counter()
    report = regenerate_conversations(
        model,
        tokenizer,
        conversations,
        result.output,
        cfg.regenerate,
        system_prompt=cfg.data.system_prompt,
        target_name=cfg.target.name_or_path,
    )
    result.timings_s["regenerate"] = time.perf_counter() - clock
    result.stats["regenerate"] = report.as_dict()
    if cfg.synthesize.count and cfg.synthesize.follow_ups:
        follow_ups = add_follow_ups(
            model,
            tokenizer,
            result.output,
            {c.id for c in synthesized},
            cfg.synthesize,
            cfg.regenerate,
            target_name=cfg.target.name_or_path,
        )
        result.timings_s["follow_ups"] = follow_ups.seconds
        result.stats["follow_ups"] = follow_ups.as_dict()
    wanted = {c.id for c in conversations}
    records = [r for r in read_jsonl(result.output) if r["id"] in wanted]
    return tokenizer, [Conversation.from_record(r) for r in records]


def _batchable(cfg: SpecForgeConfig, model) -> SpecForgeConfig:
    """``cfg`` for a target whose layers continuous batching can reshape; for one with
    recurrent layers, regeneration falls back to ``model.generate`` on fixed batches (the
    ``static`` backend) and synthesis is refused before any generation."""
    layers = recurrent_layers(model)
    if layers is None:
        return cfg
    if cfg.synthesize.count:
        raise UserError(
            f"synthesize: {architecture(model.config)} has {layers} layers, whose state "
            "continuous batching cannot reshape; bring prompts (data.inputs) instead"
        )
    if cfg.regenerate.backend == "continuous":
        logger.warning(
            "%s has %s layers, whose state continuous batching cannot reshape: regenerating "
            "with model.generate on fixed batches (regenerate.backend static)",
            architecture(model.config),
            layers,
        )
        return dataclasses.replace(
            cfg, regenerate=dataclasses.replace(cfg.regenerate, backend="static")
        )
    return cfg


def _write_vocab_map(cfg: SpecForgeConfig, tokenizer, samples) -> dict:
    """The draft vocabulary training will build: counted over the same train split
    (``train.eval_fraction``), so the two maps are the same map."""
    train_samples, _ = split_train_eval(samples, cfg.train.eval_fraction)
    vocab_map, counts = vocab_map_from_samples(
        train_samples,
        vocab_size=text_config(load_target_config(cfg.target)).vocab_size,
        draft_vocab_size=cfg.vocab.draft_vocab_size,
        end_of_turn=end_of_turn_ids(tokenizer, load_generation_config(cfg.target)),
    )
    save_vocab_map(vocab_map, cfg.prepare.vocab_output)
    covered = counts[vocab_map.t2d].sum() / counts.sum().clamp(min=1)
    return {
        "path": cfg.prepare.vocab_output,
        "draft_vocab_size": vocab_map.draft_vocab_size,
        "distinct_assistant_tokens": int((counts > 0).sum()),
        "assistant_token_coverage": round(float(covered), 4),
    }
