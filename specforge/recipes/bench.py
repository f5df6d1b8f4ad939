"""The ``bench`` recipe: the target alone, prompt-lookup decoding and our
speculative runtime on the same prompts in the same run (batch size 1, greedy), or, with
``bench.engine: sglang``, the accept length a running SGLang server reports.

MT-Bench is run as EAGLE and SpecForge run it: every turn is a fresh prefill, the second turn is
asked after the target's own first answer (which every lossless method reproduces), the
template's default system prompt unless ``bench.system_prompt`` is set. A progress bar shows the
turns done, tokens/s and the running accept length.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
from tqdm import tqdm

from specforge.config import BenchConfig, SpecForgeConfig, to_dict
from specforge.data.chat import end_of_turn_ids, pad_id_of, prompt_ids
from specforge.data.questions import ask_turns, load_questions, resolve_question_set
from specforge.engine.target import EnginePath, build_engine
from specforge.errors import UserError
from specforge.families.dispatch import drafting_depth, family_of_export
from specforge.models.adapter import text_config
from specforge.models.target import load_target, load_target_config, load_tokenizer
from specforge.recipes.stage import start_stage
from specforge.serving.bench import BenchTally, MethodComparison, bench_report, write_report
from specforge.serving.speculative import SpeculativeDecoder

logger = logging.getLogger(__name__)

DRAFTING_PASSES = 2.0
"""The bench's speculative pass over a turn, in passes of the target alone through the same
engine: it ran at 0.57-1.2x that speed on the CPUs measured (the slowest a draft trained for
ten minutes, docs/results.md), so 2.0 leaves a margin."""


def engine_passes(bc: BenchConfig) -> float:
    """The bench's passes over each turn through the engine, in passes of the target alone:
    the target alone, the speculative runtime (:data:`DRAFTING_PASSES`) and prompt lookup
    when it is on."""
    return 1 + DRAFTING_PASSES + (1 if bc.prompt_lookup_num_tokens else 0)


def engine_tokens(bc: BenchConfig, turns: int) -> int:
    """The tokens a bench of ``turns`` turns decodes through the engine, at most (what
    ``engine.compile: auto`` weighs the compilation against)."""
    return round(turns * bc.max_new_tokens * engine_passes(bc))


def bench_settings(cfg: SpecForgeConfig, questions: str) -> dict[str, Any]:
    """The settings a report records (``bench.json``'s ``settings``)."""
    draft_family = family_of_export(cfg.bench_draft)
    return {
        **to_dict(cfg.bench),
        "engine_compile": cfg.engine.compile,
        "target": cfg.target.name_or_path,
        "device": cfg.target.device,
        "draft": str(cfg.bench_draft),
        "draft_family": draft_family.name,
        "sglang_algorithm": draft_family.engines.sglang,
        "questions": questions,
        "output": str(cfg.bench_dir),
    }


def load_bench_draft(cfg: SpecForgeConfig, target, dtype: str, quantize: str):
    """The exported draft ``cfg.bench_draft`` in ``dtype`` on the target's device, sharing the
    target's tensors as its family says; its linear layers int8 for ``quantize`` ``int8``
    (``bench.draft_quantize``, resolved), else prepacked where the target's are (families
    whose steps run one row at a time)."""
    return family_of_export(cfg.bench_draft).load_export(
        cfg.bench_draft,
        target=target,
        dtype=dtype,
        quantize=quantize,
        prepack=cfg.target.prepack_linear,
    )


def build_comparison(cfg: SpecForgeConfig, turns: int) -> tuple[MethodComparison, Any, EnginePath]:
    """Load the target (in ``bench.dtype``) and the exported draft (in ``bench.draft_dtype``,
    its weights as ``bench.draft_quantize`` says) for a bench of ``turns`` turns; returns the
    comparison, the tokenizer and the path the target's forwards take."""
    bc = cfg.bench
    target, tokenizer = load_target(cfg.target, dtype=bc.dtype)
    draft_family = family_of_export(cfg.bench_draft)
    aux_layer_ids = draft_family.aux_layer_ids(cfg.bench_draft, target.config)
    engine, path = build_engine(
        target,
        aux_layer_ids=aux_layer_ids,
        compile=cfg.engine.compile,
        tokens=engine_tokens(bc, turns),
    )
    decoder = SpeculativeDecoder(
        target,
        load_bench_draft(cfg, target, bc.draft_dtype, bc.draft_quantize),
        proposer=draft_family.proposer,
        aux_layer_ids=aux_layer_ids,
        num_steps=bc.num_steps,
        topk=bc.topk,
        num_draft_tokens=bc.num_draft_tokens,
        max_siblings=bc.auto_siblings,
        lookup_tokens=bc.auto_lookup if bc.num_steps == "auto" else 0,
        engine=engine,
    )
    comparison = MethodComparison(
        target,
        decoder,
        max_new_tokens=bc.max_new_tokens,
        prompt_lookup_num_tokens=bc.prompt_lookup_num_tokens,
        eos_token_ids=end_of_turn_ids(tokenizer, target.generation_config),
        pad_token_id=pad_id_of(tokenizer, target.generation_config),
        target_compile=bc.target_compile,
        engine=engine,
    )
    return comparison, tokenizer, path


def checked_inputs(cfg: SpecForgeConfig, questions_source: str):
    """What the built-in bench runs on, checked before any model loads: the export, at the
    depth its family drafts (:func:`specforge.families.dispatch.drafting_depth`), then the questions
    (none past the target's context); returns ``cfg`` with that depth and the questions.

    Raises:
        UserError: no export, a depth the family cannot draft, or a question past the context.
    """
    bc = cfg.bench
    if not (cfg.bench_draft / "config.json").is_file():
        raise UserError(f"{cfg.bench_draft} is not an export directory: run specforge export")
    steps = drafting_depth(cfg.bench_draft, bc.num_steps, bc.topk)  # the export alone decides
    questions = load_questions(questions_source, limit=bc.limit)
    context = getattr(text_config(load_target_config(cfg.target)), "max_position_embeddings", None)
    check_context(questions, load_tokenizer(cfg.target), bc, context)
    return dataclasses.replace(cfg, bench=dataclasses.replace(bc, num_steps=steps)), questions


def bench(cfg: SpecForgeConfig) -> dict[str, Any]:
    """Run the benchmark ``cfg.bench`` describes; writes ``bench.json``, ``bench.md`` and
    ``bench.png`` to ``cfg.bench_dir`` and returns what ``bench.json`` holds.

    Raises:
        UserError: a missing draft or URL, or an unreadable question set.
    """
    cfg = start_stage(cfg)
    bc = cfg.bench
    bc.check_engine_options()
    questions_source = resolve_question_set(bc.questions)
    if bc.engine == "sglang":
        return _bench_sglang(cfg, questions_source)
    if bc.engine == "vllm":
        from specforge.recipes.bench_vllm import bench_vllm

        return bench_vllm(cfg, questions_source)
    cfg, questions = checked_inputs(cfg, questions_source)
    bc = cfg.bench
    logger.info("benchmarking on %s (%d questions)", questions_source, len(questions))
    turns = sum(len(q.turns) for q in questions)
    comparison, tokenizer, path = build_comparison(cfg, turns)
    device = cfg.target.device
    hello = prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    began = time.perf_counter()
    prepared = comparison.prepare(longest_sequence(questions, tokenizer, bc))
    prepare_seconds = time.perf_counter() - began
    warm_up_seconds = comparison.warm_up(torch.tensor([hello], device=device))
    built = comparison.engine.stats.compilations if comparison.engine else 0
    decoder = comparison.decoder
    tally = BenchTally(num_steps=decoder.num_steps)
    progress = tqdm(total=turns, desc="bench", unit="turn")
    for question in questions:

        def answer(turn, messages, question=question):
            ids = torch.tensor([prompt_ids(tokenizer, messages)], device=device)
            info = {"question_id": question.id, "category": question.category, "turn": turn}
            info["set"] = question.set
            reference = comparison.run(ids, tally, **info)
            return tokenizer.decode(reference, skip_special_tokens=True), None

        for _ in ask_turns(question, answer, system_prompt=bc.system_prompt):
            progress.update(1)
            progress.set_postfix(
                tau=f"{tally.stats.tau:.2f}",
                tok_s=f"{tally.tokens['eagle3'] / max(tally.seconds['eagle3'], 1e-9):.1f}",
            )
    progress.close()
    calibration = decoder.policy.report()  # None at a fixed depth
    result = bench_report(tally, bench_settings(cfg, questions_source), calibration)
    result["engine"] = {"path": path.path, "why": path.why}
    if comparison.engine is not None:
        engine = comparison.engine.stats.as_dict()
        if engine["fallback"]:  # the compiled forwards failed: the run is not what was chosen
            result["engine"] = {"path": "eager engine", "why": f"compiled: {engine['fallback']}"}
        result["engine"] |= {
            **engine,
            "warm_up_seconds": round(warm_up_seconds, 1),
            # graphs built before timing (the longest turn's buffers), and during the turns
            "prepared_graphs": prepared,
            "prepare_seconds": round(prepare_seconds, 1),
            "graphs_in_timed_turns": comparison.engine.stats.compilations - built,
        }
        if decoder.draft_engine is not None:  # the draft's CUDA graphs
            result["engine"]["draft_graphs"] = decoder.draft_engine.captures
    write_report(result, cfg.bench_dir)
    return result


SEQUENCE_SLACK = 16
"""Tokens a turn may add to a question's bound: an answer decoded to text and tokenized again
in the next turn's prompt need not split the same way."""


def _prompt_tokens(question, tokenizer, bc) -> int:
    """The tokens of a question's turns with empty answers in the chat template."""
    messages = [] if bc.system_prompt is None else [{"role": "system", "content": bc.system_prompt}]
    for text in question.turns:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
    return len(prompt_ids(tokenizer, messages[:-1]))


def longest_sequence(questions, tokenizer, bc) -> int:
    """A bound on the tokens of any sequence the bench runs: each question's turns with empty
    answers in the chat template, plus ``max_new_tokens`` (and :data:`SEQUENCE_SLACK`) a
    turn."""
    return max(
        (
            _prompt_tokens(q, tokenizer, bc) + len(q.turns) * (bc.max_new_tokens + SEQUENCE_SLACK)
            for q in questions
        ),
        default=0,
    )


def check_context(questions, tokenizer, bc, context: int | None) -> None:
    """Refuse, before decoding, a question whose prompt (its turns, with empty answers) fills
    the target's context (``max_position_embeddings``; no limit when the config has none):
    nothing could be answered within it. A question whose answers (``max_new_tokens`` a turn)
    could run past it is warned about: past it the target's outputs are not what it was
    trained to give.

    Raises:
        UserError: naming the question, its prompt's tokens and the context.
    """
    if not context:
        return
    for question in questions:
        tokens = _prompt_tokens(question, tokenizer, bc)
        if tokens >= context:
            raise UserError(
                f"question {question.id!r} is {tokens} tokens, past the target's context of "
                f"{context} tokens: drop it from the set"
            )
        if tokens + len(question.turns) * bc.max_new_tokens > context:
            logger.warning(
                "question %r is %d tokens: with %d answers of up to bench.max_new_tokens %d it "
                "may run past the target's context of %d tokens",
                question.id,
                tokens,
                len(question.turns),
                bc.max_new_tokens,
                context,
            )


def _bench_sglang(cfg: SpecForgeConfig, questions: str) -> dict[str, Any]:
    from specforge.serving.sglang_client import run_sglang_bench

    if not cfg.bench.url:
        raise UserError("bench.engine sglang needs bench.url (the running server, --url)")
    if (cfg.bench_draft / "config.json").is_file():
        served = family_of_export(cfg.bench_draft)
        if served.engines.sglang is None:
            raise UserError(f"SGLang does not serve a {served.name} draft ({cfg.bench_draft})")
    return run_sglang_bench(
        cfg.bench.url,
        load_tokenizer(cfg.target),
        questions,
        max_new_tokens=cfg.bench.max_new_tokens,
        output=str(cfg.bench_dir),
        system_prompt=cfg.bench.system_prompt,
        limit=cfg.bench.limit,
        baseline_url=cfg.bench.baseline_url,
    )
