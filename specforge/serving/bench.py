"""The accept-length benchmark: the target alone, transformers' prompt-lookup decoding, and our
speculative runtime on the same prompts in the same run (batch size 1, greedy).

MT-Bench is run as EAGLE and SpecForge run it: every turn is a fresh prefill, the second turn is
asked after the model's own first answer (the target's greedy answer, which every method
reproduces when it is lossless), the template's default system prompt unless one is given.

Reported: ``tau`` = emitted tokens / verifications, token-weighted over all turns, excluding the
token that comes from the prefill (DESIGN §3.6); ``tau_sglang`` = completion tokens /
verifications (SGLang's ``completion_tokens / spec_verify_ct``, prefill token included); both
overall and per category; acceptance rate per draft position; the accepted-length histogram;
tokens/s of every method and the speedups over the target alone; whether every output matched
the target's (and the match rate).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.data.benchmarks import load_questions
from specforge.data.vocab import end_of_turn_ids
from specforge.io import write_json_atomic, write_text_atomic
from specforge.models.target import DTYPES, default_aux_layer_ids, load_target
from specforge.serving.export import load_exported_draft
from specforge.serving.speculative import SpecStats, SpeculativeDecoder


@dataclass
class BenchSettings:
    """What one benchmark run measures."""

    target: str
    draft: str
    questions: str
    num_steps: int = 5
    topk: int = 1
    num_draft_tokens: int | None = None
    max_new_tokens: int = 256
    dtype: str = "float32"
    system_prompt: str | None = None
    limit: int | None = None
    prompt_lookup_num_tokens: int = 10
    output: str = "outputs/bench"
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


def _aux_ids(export_dir: Path, num_layers: int) -> list[int]:
    config = json.loads((export_dir / "config.json").read_text())
    custom = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(custom) if custom else default_aux_layer_ids(num_layers)


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png``."""
    target, tokenizer = load_target(settings.target, dtype=settings.dtype, device=settings.device)
    export_dir = Path(settings.draft)
    draft = load_exported_draft(
        export_dir,
        target_config=target.config,
        target_embedding=target.get_input_embeddings().weight.detach().float(),
        dtype=DTYPES[settings.dtype],
    ).to(settings.device)
    decoder = SpeculativeDecoder(
        target,
        draft,
        aux_layer_ids=_aux_ids(export_dir, target.config.num_hidden_layers),
        num_steps=settings.num_steps,
        topk=settings.topk,
        num_draft_tokens=settings.num_draft_tokens,
    )
    eos = end_of_turn_ids(tokenizer, target.generation_config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    questions = load_questions(settings.questions, limit=settings.limit)

    def target_generate(ids, **extra):
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=settings.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            **extra,
        )
        return out[0, ids.shape[1] :].tolist()

    # warm up every path once (allocations, lazy init) before timing
    warm = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"].to(settings.device)
    target_generate(warm)
    decoder.generate(warm, max_new_tokens=8, eos_token_ids=eos)

    turns, total = [], SpecStats(num_steps=settings.num_steps)
    seconds = {"target": 0.0, "prompt_lookup": 0.0, "eagle3": 0.0}
    tokens = {"target": 0, "prompt_lookup": 0, "eagle3": 0}
    for question in questions:
        history = []
        if settings.system_prompt is not None:
            history.append({"role": "system", "content": settings.system_prompt})
        for turn_index, text in enumerate(question.turns):
            history.append({"role": "user", "content": text})
            ids = tokenizer.apply_chat_template(
                history, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"].to(settings.device)
            reference, t_target = _timed(lambda ids=ids: target_generate(ids))
            lookup, t_lookup = _timed(
                lambda ids=ids: target_generate(
                    ids, prompt_lookup_num_tokens=settings.prompt_lookup_num_tokens
                )
            )
            (spec, stats), t_spec = _timed(
                lambda ids=ids: decoder.generate(
                    ids, max_new_tokens=settings.max_new_tokens, eos_token_ids=eos
                )
            )
            total.merge(stats)
            for name, out, spent in (
                ("target", reference, t_target),
                ("prompt_lookup", lookup, t_lookup),
                ("eagle3", spec, t_spec),
            ):
                seconds[name] += spent
                tokens[name] += len(out)
            turns.append(
                {
                    "question_id": question.id,
                    "category": question.category,
                    "turn": turn_index,
                    "prompt_tokens": ids.shape[1],
                    "tokens": len(spec),
                    "verifications": stats.verifications,
                    "emitted": stats.emitted,
                    "accepted_per_round": stats.accepted_per_round,
                    "match": spec == reference,
                    "prompt_lookup_match": lookup == reference,
                }
            )
            history.append(
                {
                    "role": "assistant",
                    "content": tokenizer.decode(reference, skip_special_tokens=True),
                }
            )

    result = summarize(turns, total, seconds, tokens, settings)
    write_report(result, Path(settings.output))
    return result


def _tau(rows) -> dict[str, float]:
    verifications = sum(r["verifications"] for r in rows)
    return {
        "tau": sum(r["emitted"] for r in rows) / max(verifications, 1),
        "tau_sglang": sum(r["tokens"] for r in rows) / max(verifications, 1),
        "turns": len(rows),
    }


def round_costs(total: SpecStats, target_seconds: float, target_tokens: int) -> dict[str, float]:
    """Where a verification round's time goes, against one token of the target alone.

    ``round_ms`` spreads the whole speculative time (prefill, draft-cache extension and
    acceptance included) over the rounds; the speedup is about ``tau * target_ms_per_token /
    round_ms``, so ``tau_for_1x`` / ``tau_for_1.3x`` are the accept lengths these costs need.
    """
    rounds = max(total.verifications, 1)
    round_ms = 1000 * total.seconds / rounds
    target_ms = 1000 * target_seconds / max(target_tokens, 1)
    return {
        "target_ms_per_token": target_ms,
        "draft_ms_per_round": 1000 * total.draft_seconds / rounds,
        "verify_ms_per_round": 1000 * total.verify_seconds / rounds,
        "other_ms_per_round": round_ms
        - 1000 * (total.draft_seconds + total.verify_seconds) / rounds,
        "round_ms": round_ms,
        "tau_for_1x": round_ms / target_ms,
        "tau_for_1.3x": 1.3 * round_ms / target_ms,
    }


def summarize(turns, total: SpecStats, seconds, tokens, settings: BenchSettings) -> dict[str, Any]:
    speed = {name: tokens[name] / max(seconds[name], 1e-9) for name in seconds}
    categories = sorted({r["category"] for r in turns})
    return {
        **_tau(turns),
        "speedup": speed["eagle3"] / speed["target"],
        "speedup_prompt_lookup": speed["prompt_lookup"] / speed["target"],
        "all_match": all(r["match"] for r in turns),
        "match_rate": sum(r["match"] for r in turns) / max(len(turns), 1),
        "prompt_lookup_all_match": all(r["prompt_lookup_match"] for r in turns),
        "tokens_per_s": speed,
        "seconds": seconds,
        "generated_tokens": tokens,
        "cost": round_costs(total, seconds["target"], tokens["target"]),
        "acceptance_per_position": total.acceptance_per_position,
        "accepted_length_histogram": {str(k): v for k, v in total.histogram.items()},
        "per_category": {c: _tau([r for r in turns if r["category"] == c]) for c in categories},
        "settings": {k: v for k, v in vars(settings).items() if k != "extra"},
        "turn_details": turns,
    }


def write_report(result: dict[str, Any], out: Path) -> None:
    """``bench.json`` (everything), ``bench.md`` (tables) and ``bench.png`` (plots)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "bench.json", result)
    s = result["settings"]
    lines = [
        f"# Accept length: {s['questions']} ({result['turns']} turns)",
        "",
        f"target `{s['target']}` ({s['dtype']}, {s['device']}), draft `{s['draft']}`, "
        f"num_steps={s['num_steps']}, topk={s['topk']}, num_draft_tokens={s['num_draft_tokens']},"
        f" max_new_tokens={s['max_new_tokens']}, greedy, batch size 1",
        "",
        "| metric | value |",
        "|---|---|",
        f"| tau (emitted / verifications, prefill token excluded) | {result['tau']:.3f} |",
        f"| tau_sglang (completion tokens / verify count) | {result['tau_sglang']:.3f} |",
        f"| speedup over the target alone | {result['speedup']:.2f}x |",
        f"| prompt-lookup speedup | {result['speedup_prompt_lookup']:.2f}x |",
        f"| all outputs identical to the target's | {result['all_match']} "
        f"({result['match_rate']:.1%}) |",
        "",
        "| method | tokens/s |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in result["tokens_per_s"].items()],
        "",
        "| round cost (ms; tau needed) | value |",
        "|---|---|",
        *[f"| {k} | {v:.2f} |" for k, v in result["cost"].items()],
        "",
        "| category | turns | tau | tau_sglang |",
        "|---|---|---|---|",
        *[
            f"| {c} | {v['turns']} | {v['tau']:.3f} | {v['tau_sglang']:.3f} |"
            for c, v in result["per_category"].items()
        ],
        "",
        "| draft position | acceptance rate |",
        "|---|---|",
        *[f"| {i + 1} | {r:.3f} |" for i, r in enumerate(result["acceptance_per_position"])],
    ]
    write_text_atomic(out / "bench.md", "\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rates = result["acceptance_per_position"]
    left.bar(range(1, len(rates) + 1), rates)
    left.set(
        xlabel="draft position",
        ylabel="acceptance rate (given earlier accepted)",
        ylim=(0, 1),
        title=f"tau = {result['tau']:.2f}",
    )
    histogram = result["accepted_length_histogram"]
    right.bar([int(k) for k in histogram], list(histogram.values()))
    right.set(
        xlabel="draft tokens accepted per verification",
        ylabel="verifications",
        title="accepted-length histogram",
    )
    fig.tight_layout()
    tmp = out / ".bench.png.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out / "bench.png")
