"""Prompts written by the target itself ("Magpie"): the chat template rendered up to the start
of a user message, sampled until the turn ends, is a user prompt in the target's own
distribution. With the target's answers (:mod:`specforge.distill.regenerate`) it gives any target
with a chat template an unlimited on-policy corpus, without a dataset.

What a user would not want to train on is dropped, each reason counted:

- ``unfinished``: the prompt ran into ``synthesize.max_prompt_tokens`` without ending its turn;
- ``too_short``: fewer than ``synthesize.min_words`` words;
- ``control_text``: it contains a special token's text (``<|im_start|>``, ...);
- ``degenerate``: mostly one repeated word, or mostly characters that are not letters;
- ``duplicate``: the same words as an accepted prompt, or word-trigram Jaccard similarity of at
  least ``synthesize.max_similarity`` with one (near duplicates);
- ``mt_bench``: it shares a 6-word run with an MT-Bench question (the evaluation set; the runs
  ship hashed in ``mt_bench_6word_runs.txt``).

Resumable: attempts are decided in attempt order, each as soon as every earlier one is, and
accepted prompts are appended to ``<output>.prompts.jsonl`` (``{"id", "prompt", "attempt"}``, and
``"topic"`` when steered) then, not when a round of attempts ends, so a kill loses none of them.
A rerun keeps them and continues from the next attempt, so asking for 96 after 64 adds 32.
Attempt ``a`` samples with its own seed, ``(seed, a)`` (the prompts a rerun adds can still
differ from an uninterrupted run's: other rows share the batch, and fp32 batched arithmetic
differs in its last bits).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from tqdm import tqdm

from specforge.config import SynthesizeConfig
from specforge.data.chat import (
    control_tokens,
    end_of_turn_ids,
    pad_id_of,
    render,
    with_system_prompt,
)
from specforge.data.conversations import Conversation
from specforge.engine.batch import batcher_for
from specforge.engine.generation import (
    Completion,
    GenerationSettings,
    Request,
)
from specforge.errors import UserError
from specforge.io import append_jsonl, read_jsonl

logger = logging.getLogger(__name__)

SENTINEL = "\x00SPECFORGE_USER_TURN\x00"
MT_BENCH_RUNS_FILE = "mt_bench_6word_runs.txt"


def words(text: str) -> list[str]:
    """Lowercase words (runs of ``[a-z0-9]``): the unit of every overlap check."""
    return re.findall(r"[a-z0-9]+", text.lower())


def word_runs(text: str, n: int) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive words."""
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def run_hash(run: tuple[str, ...]) -> str:
    return hashlib.sha1(" ".join(run).encode()).hexdigest()[:12]


def mt_bench_run_hashes() -> set[str]:
    """Hashes of the 6-word runs of the MT-Bench questions (shipped with the package)."""
    text = resources.files("specforge.data").joinpath(MT_BENCH_RUNS_FILE).read_text("utf-8")
    return {line for line in text.splitlines() if line and not line.startswith("#")}


def shares_mt_bench_run(text: str, hashes: set[str]) -> bool:
    return any(run_hash(run) in hashes for run in word_runs(text, 6))


TOPIC_SYSTEM_PROMPT = "You are a helpful assistant. The user's next request is about {topic}."
"""The system message that steers an attempt towards a topic (``synthesize.topics``)."""


def attempt_topic(topics: list[str], attempt: int) -> str | None:
    """The topic attempt ``attempt`` is steered to: ``topics`` in turn, or none."""
    return topics[attempt % len(topics)] if topics else None


def user_turn_prefix(tokenizer, history: list[dict[str, str]]) -> list[int]:
    """The chat template's ids of ``history`` (the messages before it) up to where the next
    user message's text begins.

    Raises:
        UserError: the template does not write a user message's text verbatim.
    """
    messages = [*history, {"role": "user", "content": SENTINEL}]
    text = render(tokenizer, messages, add_generation_prompt=False)
    if SENTINEL not in text:
        raise UserError("the chat template does not write user text verbatim: cannot synthesize")
    return tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


@dataclass
class PromptFilter:
    """Decides whether a synthesized prompt is kept (see the module docstring)."""

    cfg: SynthesizeConfig
    control_texts: list[str]
    mt_bench: set[str] = field(default_factory=mt_bench_run_hashes)
    seen: set[tuple[str, ...]] = field(default_factory=set)
    trigram_index: dict[tuple[str, ...], set[int]] = field(default_factory=dict)
    trigrams: list[set[tuple[str, ...]]] = field(default_factory=list)

    def reason_to_drop(self, text: str, stopped: bool) -> str | None:
        w = words(text)
        if not stopped:
            return "unfinished"
        if len(w) < self.cfg.min_words:
            return "too_short"
        if any(c in text for c in self.control_texts):
            return "control_text"
        letters = sum(ch.isalpha() for ch in text)
        if letters < 0.5 * len(text) or (len(w) >= 8 and len(set(w)) < 0.3 * len(w)):
            return "degenerate"
        if tuple(w) in self.seen or self._near_duplicate(word_runs(text, 3)):
            return "duplicate"
        if shares_mt_bench_run(text, self.mt_bench):
            return "mt_bench"
        return None

    def _near_duplicate(self, trigrams: set[tuple[str, ...]]) -> bool:
        candidates = set().union(*(self.trigram_index.get(t, set()) for t in trigrams))
        for index in candidates:
            other = self.trigrams[index]
            if len(trigrams & other) / max(len(trigrams | other), 1) >= self.cfg.max_similarity:
                return True
        return False

    def accept(self, text: str) -> None:
        self.seen.add(tuple(words(text)))
        trigrams = word_runs(text, 3)
        for t in trigrams:
            self.trigram_index.setdefault(t, set()).add(len(self.trigrams))
        self.trigrams.append(trigrams)


@dataclass
class SynthesisReport:
    requested: int = 0
    already_done: int = 0
    attempts: int = 0
    accepted: int = 0
    dropped: Counter = field(default_factory=Counter)
    generated_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "requested": self.requested,
            "already_done": self.already_done,
            "attempts": self.attempts,
            "accepted": self.accepted,
            "dropped": dict(sorted(self.dropped.items())),
            "generated_tokens": self.generated_tokens,
            "seconds": round(self.seconds, 1),
        }


def in_key_order(completions: Iterable[Completion], first: int) -> Iterator[Completion]:
    """``completions`` keyed ``first``, ``first + 1``, ... (arriving in any order) in key order,
    each as soon as every lower key has arrived."""
    waiting: dict[int, Completion] = {}
    for completion in completions:
        waiting[completion.key] = completion
        while first in waiting:
            yield waiting.pop(first)
            first += 1


ROUND_BATCHES = 8
"""A round of attempts fills the batch at most this many times over, so asking for many
prompts holds a bounded list of requests, not one per attempt up front."""


def attempts_to_ask(wanted: int, batch_size: int) -> int:
    """The attempts of the next round: the prompts still wanted plus a quarter for those that
    will be dropped, at most :data:`ROUND_BATCHES` batches."""
    return min(wanted + wanted // 4 + 1, ROUND_BATCHES * batch_size)


def prompt_settings(model, tokenizer, cfg: SynthesizeConfig) -> GenerationSettings:
    """How the target samples a user turn: ``synthesize``'s temperature, top-p, batch and
    length, until the turn ends."""
    return GenerationSettings(
        max_new_tokens=cfg.max_prompt_tokens,
        eos_ids=end_of_turn_ids(tokenizer, model.generation_config),
        pad_id=pad_id_of(tokenizer, model.generation_config),
        max_batch_size=cfg.batch_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
    )


def prompts_path(output: Path) -> Path:
    """Where the synthesized prompts of ``output`` are kept."""
    return output.with_name(output.stem + ".prompts.jsonl")


def synthesize_conversations(
    model, tokenizer, output: Path, cfg: SynthesizeConfig, *, system_prompt: str | None = None
) -> tuple[list[Conversation], SynthesisReport]:
    """``cfg.count`` user-only conversations whose prompts the target wrote (see the module
    docstring); returns them, in attempt order, and what was done."""
    path = prompts_path(Path(output))
    kept = read_jsonl(path, repair=True)
    report = SynthesisReport(requested=cfg.count, already_done=len(kept))
    prompt_filter = PromptFilter(cfg, control_tokens(tokenizer))
    for record in kept:
        prompt_filter.accept(record["prompt"])
    prefixes = {
        topic: user_turn_prefix(
            tokenizer,
            with_system_prompt(
                [], system_prompt if topic is None else TOPIC_SYSTEM_PROMPT.format(topic=topic)
            ),
        )
        for topic in cfg.topics or [None]
    }
    settings = prompt_settings(model, tokenizer, cfg)
    attempt = 1 + max((r["attempt"] for r in kept), default=-1)
    start = time.perf_counter()
    progress = tqdm(total=cfg.count, initial=min(len(kept), cfg.count), desc="synthesize")
    while len(kept) < cfg.count and report.attempts < cfg.max_attempts_factor * cfg.count:
        # over-ask a little (some prompts are dropped), a bounded round at a time; listed last
        # attempt first, since the batcher takes equal-length prompts from the end: the lowest
        # attempts start first
        asked = range(attempt, attempt + attempts_to_ask(cfg.count - len(kept), cfg.batch_size))
        pending = [
            Request(
                a,
                prefixes[attempt_topic(cfg.topics, a)],
                seed=zlib.crc32(f"{cfg.seed}:{a}".encode()),
            )
            for a in asked
        ]
        pending.reverse()
        # decided in attempt order (deterministic) as soon as the earlier attempts are, so
        # accepted prompts are written as they come; the attempts still running when enough
        # prompts are kept are abandoned
        for completion in in_key_order(batcher_for(model, settings).run(pending), attempt):
            attempt += 1
            report.attempts += 1
            report.generated_tokens += len(completion.tokens)
            content = completion.tokens[:-1] if completion.stopped else completion.tokens
            text = tokenizer.decode(content, skip_special_tokens=True).strip()
            reason = prompt_filter.reason_to_drop(text, completion.stopped)
            if reason is not None:
                report.dropped[reason] += 1
                continue
            prompt_filter.accept(text)
            record = {"id": f"synth-{cfg.seed}-{completion.key}", "prompt": text}
            record["attempt"] = completion.key
            if cfg.topics:
                record["topic"] = attempt_topic(cfg.topics, completion.key)
            append_jsonl(path, [record])
            kept.append(record)
            progress.update(1)
            if len(kept) == cfg.count:
                break
    progress.close()
    report.seconds = time.perf_counter() - start
    report.accepted = len(kept) - report.already_done
    if len(kept) < cfg.count:
        logger.warning(
            "synthesized %d of %d prompts in %d attempts (dropped: %s)",
            len(kept),
            cfg.count,
            report.attempts,
            dict(report.dropped),
        )
    conversations = [
        Conversation(r["id"], [{"role": "user", "content": r["prompt"]}]) for r in kept[: cfg.count]
    ]
    return conversations, report
