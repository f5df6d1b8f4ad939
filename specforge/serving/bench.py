"""The accept-length benchmark's measurements (the ``bench`` recipe runs them): the target
alone, prompt-lookup decoding (n-gram drafting, through the same engine:
:mod:`specforge.engine.prompt_lookup`), and our speculative runtime on the same prompts in the
same run (batch size 1, greedy).

MT-Bench is run as EAGLE and SpecForge run it: every turn is a fresh prefill, the second turn is
asked after the model's own first answer (the target's greedy answer, which every method
reproduces when it is lossless), the template's default system prompt unless one is given.

Reported: ``tau`` = emitted tokens / verifications, token-weighted over all turns, excluding the
token that comes from the prefill (docs/design.md §3.6); ``tau_sglang`` = completion tokens /
verifications (SGLang's ``completion_tokens / spec_verify_ct``, prefill token included); both
overall and per category; acceptance rate per draft position; the accepted-length histogram;
tokens/s of every method and the speedups over the target alone; whether every output matched
the target's (and the match rate).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.engine.target import TargetEngine
from specforge.io import write_json_atomic, write_text_atomic
from specforge.serving.advice import advice_markdown, sglang_advice
from specforge.serving.speculative import SpeculativeDecoder
from specforge.serving.stats import SpecStats

logger = logging.getLogger(__name__)


METHODS = ("target", "target_hf", "prompt_lookup", "eagle3")
"""The target alone through the engine the runtime verifies with (compiled where
``engine.compile`` says; HF ``generate`` where no engine runs the target), the target alone
through HF's default ``generate`` (the reference outputs), prompt-lookup decoding (through the
same engine as ``target``, or HF ``generate``'s where no engine runs), and our EAGLE-3 runtime.
Speedups are against ``target``."""


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


@dataclass
class BenchTally:
    """What a benchmark run has measured so far: every turn and the totals per method."""

    num_steps: int
    turns: list[dict[str, Any]] = field(default_factory=list)
    stats: SpecStats = field(init=False)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(METHODS, 0.0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))
    prompt_lookup_rounds: int = 0
    """Prompt lookup's verification rounds after the prefills (through the engine only)."""
    divergences: list[dict[str, Any]] = field(default_factory=list)
    """Each turn whose output left the target's: where, and whether it was a numerical tie."""
    set_stats: dict[str, SpecStats] = field(default_factory=dict)
    """The runtime's statistics of each question set's turns (a suite's parts)."""

    def __post_init__(self) -> None:
        self.stats = SpecStats(num_steps=self.num_steps)


def compiled_generate_kwargs() -> dict:
    """``generate`` keyword arguments for a static KV cache with ``torch.compile`` on any
    device (transformers compiles by itself on CUDA only)."""
    from transformers import CompileConfig

    compile_config = CompileConfig(mode="default", dynamic=False)
    compile_config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": compile_config}


def greedy_generate(
    target,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    **extra,
) -> list[int]:
    """The target alone, greedy, on ``ids`` (1, T) with HF ``generate``: the new token ids (the
    bench's baseline and reference; ``extra`` goes to ``generate``)."""
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_ids,
        pad_token_id=pad_token_id,
        **extra,
    )
    return out[0, ids.shape[1] :].tolist()


TIE_MARGIN = 1e-3
"""A divergence where the target's top two logits lie within this of each other is a numerical
tie (a different kernel's rounding can flip it), reported apart from a mismatch."""


@torch.no_grad()
def divergence(target, ids: torch.Tensor, reference: list[int], other: list[int]) -> dict:
    """Where ``other`` first leaves the target's own ``reference`` continuation of ``ids``
    (1, T): the position in the generated tokens, both tokens there, and the target's top-2
    logit margin at it (one forward over the prompt and the reference's tokens before it);
    ``tie`` when that margin is under :data:`TIE_MARGIN`."""
    position = next(
        (i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b),
        min(len(reference), len(other)),
    )
    prefix = torch.tensor([reference[:position]], dtype=ids.dtype, device=ids.device)
    logits = target(torch.cat([ids, prefix], dim=1)).logits[0, -1].float()
    top = logits.topk(2).values
    margin = float(top[0] - top[1])
    return {
        "position": position,
        "reference_token": reference[position] if position < len(reference) else None,
        "token": other[position] if position < len(other) else None,
        "margin": margin,
        "tie": margin < TIE_MARGIN,
    }


class MethodComparison:
    """Generates one prompt with the three methods, greedy, batch size 1, timing each."""

    def __init__(
        self,
        target,
        decoder: SpeculativeDecoder,
        *,
        max_new_tokens: int,
        prompt_lookup_num_tokens: int,
        eos_token_ids: list[int],
        pad_token_id: int,
        target_compile: bool = False,
        engine: TargetEngine | None = None,
    ):
        self.target = target
        self.engine = engine
        self.engine_matched: bool | None = None
        """Whether the last turn's target alone through the engine equalled HF's output."""
        self.target_kwargs = compiled_generate_kwargs() if target_compile else {}
        self.decoder = decoder
        self.max_new_tokens = max_new_tokens
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.prompt_lookup = (
            SpeculativeDecoder.prompt_lookup(engine, prompt_lookup_num_tokens)
            if engine is not None and prompt_lookup_num_tokens
            else None
        )
        """Prompt-lookup decoding through the runtime's loop on the engine (``None``: HF's
        ``generate`` decodes it, or it is off)."""
        self.eos = eos_token_ids
        self.pad = pad_token_id

    def target_generate(self, ids: torch.Tensor, max_new_tokens: int, **extra) -> list[int]:
        return greedy_generate(
            self.target, ids, max_new_tokens, eos_token_ids=self.eos, pad_token_id=self.pad, **extra
        )

    def engine_generate(self, ids: torch.Tensor) -> list[int]:
        """The target alone through the engine (greedy)."""
        return self.engine.generate(ids, max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos)

    def prompt_lookup_generate(self, ids: torch.Tensor) -> tuple[list[int], int | None]:
        """Prompt-lookup decoding (greedy) through the engine, or HF ``generate``'s where no
        engine runs the target: the new token ids and the verification rounds (``None``:
        HF's, not counted)."""
        if self.prompt_lookup is None:
            kwargs = {"prompt_lookup_num_tokens": self.prompt_lookup_num_tokens}
            return self.target_generate(ids, self.max_new_tokens, **kwargs), None
        tokens, stats = self.prompt_lookup.generate(
            ids, max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos
        )
        return tokens, stats.verifications

    def prepare(self, tokens: int) -> int:
        """Before the warm-up: the engine's buffers for sequences of up to ``tokens`` tokens
        and every graph the methods' forwards will need, captured (or compiled) now rather
        than in a timed turn (:meth:`SpeculativeDecoder.prepare`). Returns the graphs built."""
        lookup = self.prompt_lookup_num_tokens
        # prompt lookup's verifications run through the same engine, over the same buffers
        return self.decoder.prepare(tokens, widest=lookup + 1 if lookup else 0)

    def warm_up(self, ids: torch.Tensor) -> float:
        """Every path once (allocations, lazy init, compilation) before anything is timed;
        returns the seconds it took (with a cold compile cache, mostly compilation)."""
        start = time.perf_counter()
        self.target_generate(ids, self.max_new_tokens, **self.target_kwargs)
        self.target_generate(ids, self.max_new_tokens)
        if self.engine is not None:
            self.engine_generate(ids)
        if self.prompt_lookup_num_tokens:
            self.prompt_lookup_generate(ids)
        self.decoder.generate(ids, max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos)
        return time.perf_counter() - start

    def run(self, ids: torch.Tensor, tally: BenchTally, **turn_info) -> list[int]:
        """Generate ``ids`` (1, T) with each method, add the turn to ``tally``; returns the
        target's own answer (what the conversation continues with)."""
        seconds, tokens = dict(tally.seconds), dict(tally.tokens)
        reference, lookup = self.run_baselines(ids, tally)
        self.run_decoder(self.decoder, ids, reference, tally, lookup=lookup, **turn_info)
        tally.turns[-1]["seconds"] = {m: tally.seconds[m] - seconds[m] for m in METHODS}
        tally.turns[-1]["method_tokens"] = {m: tally.tokens[m] - tokens[m] for m in METHODS}
        return reference

    def run_baselines(self, ids: torch.Tensor, tally: BenchTally) -> tuple[list[int], list]:
        """The target alone (through HF ``generate``, and through the engine when there is
        one) and prompt-lookup decoding (when on) on ``ids``, timed into ``tally``; returns the
        reference (HF ``generate``'s output) and prompt lookup's. Whether the engine's output
        was the reference is kept for the turn (:attr:`engine_matched`)."""
        reference, t_hf = _timed(
            lambda: self.target_generate(ids, self.max_new_tokens, **self.target_kwargs)
        )
        t_target, self.engine_matched = t_hf, None
        if self.engine is not None:
            alone, t_target = _timed(lambda: self.engine_generate(ids))
            self.engine_matched = alone == reference
        lookup, t_lookup = [], 0.0
        if self.prompt_lookup_num_tokens:
            (lookup, rounds), t_lookup = _timed(lambda: self.prompt_lookup_generate(ids))
            tally.prompt_lookup_rounds += rounds or 0
        for name, out, spent in (
            ("target", reference, t_target),
            ("target_hf", reference, t_hf),
            ("prompt_lookup", lookup, t_lookup),
        ):
            tally.seconds[name] += spent
            tally.tokens[name] += len(out)
        return reference, lookup

    def run_decoder(
        self,
        decoder: SpeculativeDecoder,
        ids: torch.Tensor,
        reference: list[int],
        tally: BenchTally,
        *,
        lookup: list[int] | None = None,
        **turn_info,
    ) -> list[int]:
        """Generate ``ids`` with ``decoder``, timed into ``tally`` (as ``eagle3``) with the
        turn and whether it equals ``reference``; returns its output."""
        (spec, stats), spent = _timed(
            lambda: decoder.generate(
                ids, max_new_tokens=self.max_new_tokens, eos_token_ids=self.eos
            )
        )
        tally.stats.merge(stats)
        if spec != reference:
            tally.divergences.append({**turn_info, **divergence(self.target, ids, reference, spec)})
        name = turn_info.get("set", "")
        tally.set_stats.setdefault(name, SpecStats(num_steps=tally.num_steps)).merge(stats)
        tally.seconds["eagle3"] += spent
        tally.tokens["eagle3"] += len(spec)
        tally.turns.append(
            {
                **turn_info,
                "prompt_tokens": ids.shape[1],
                "tokens": len(spec),
                "verifications": stats.verifications,
                "emitted": stats.emitted,
                "accepted_per_round": stats.accepted_per_round,
                "match": spec == reference,
                "engine_match": self.engine_matched,
                "prompt_lookup_match": lookup == reference
                if self.prompt_lookup_num_tokens
                else None,
            }
        )
        return spec


def _tau(rows) -> dict[str, float]:
    verifications = sum(r["verifications"] for r in rows)
    return {
        "tau": sum(r["emitted"] for r in rows) / max(verifications, 1),
        "tau_sglang": sum(r["tokens"] for r in rows) / max(verifications, 1),
        "turns": len(rows),
    }


CONTEXT_EDGES = (256, 512, 1024, 2048, 4096, 8192)
"""The bounds of ``accept_length_by_context``'s buckets (tokens of context a round starts at)."""


def accept_length_by_context(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accept length by the context a verification round starts at (its prompt and what the
    turn generated before it), in buckets bounded by :data:`CONTEXT_EDGES`: whether acceptance
    holds past the lengths the draft was trained on. A round's tokens are its accepted ones
    and the target's own; the turn's first token comes from the prefill."""
    edges = (0, *CONTEXT_EDGES, None)
    buckets = [
        {"from": a, "to": b, "rounds": 0, "tokens": 0}
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]
    for turn in turns:
        position = turn["prompt_tokens"] + 1
        for accepted in turn["accepted_per_round"]:
            bucket = next(b for b in buckets if b["to"] is None or position < b["to"])
            bucket["rounds"] += 1
            bucket["tokens"] += accepted + 1
            position += accepted + 1
    return [{**b, "tau": b["tokens"] / b["rounds"]} for b in buckets if b["rounds"]]


def _set_report(rows: list[dict[str, Any]], stats: SpecStats) -> dict[str, Any]:
    """One question set's part of a suite: ``tau``, the speedups over its own turns (from each
    turn's seconds and tokens per method), identical outputs and acceptance per position."""

    def speed(method: str) -> float:
        seconds = sum(r["seconds"][method] for r in rows)
        return sum(r["method_tokens"][method] for r in rows) / max(seconds, 1e-9)

    lookup = any(r["method_tokens"]["prompt_lookup"] for r in rows)
    return {
        **_tau(rows),
        "speedup": speed("eagle3") / speed("target"),
        "speedup_prompt_lookup": speed("prompt_lookup") / speed("target") if lookup else None,
        "all_match": all(r["match"] for r in rows),
        "acceptance_per_position": stats.acceptance_per_position,
    }


def round_costs(total: SpecStats, target_seconds: float, target_tokens: int) -> dict[str, float]:
    """Where a verification round's time goes, against one token of the target alone.

    ``round_ms`` spreads the whole speculative time over the rounds: drafting, verification,
    the draft's extension over the accepted tokens, the prefills (target and draft over each
    prompt, spread over its rounds) and the rest (``other``: acceptance, cache crops, Python).
    ``target_prefill_ms_per_round`` is the part of the prefills the target alone pays too, so
    ``added_ms_per_round`` (extension, the draft's prefill and the rest) is what speculation
    adds outside drafting and verification.
    The speedup is about ``tau * target_ms_per_token / round_ms``, so ``tau_for_1x`` /
    ``tau_for_1.3x`` are the accept lengths these costs need.
    """
    rounds = max(total.verifications, 1)
    round_ms = 1000 * total.seconds / rounds
    target_ms = 1000 * target_seconds / max(target_tokens, 1)
    parts = total.draft_seconds + total.verify_seconds
    outside = total.seconds - parts
    rest = outside - total.extend_seconds - total.prefill_seconds
    return {
        "target_ms_per_token": target_ms,
        "draft_ms_per_round": 1000 * total.draft_seconds / rounds,
        "verify_ms_per_round": 1000 * total.verify_seconds / rounds,
        "extend_ms_per_round": 1000 * total.extend_seconds / rounds,
        "prefill_ms_per_round": 1000 * total.prefill_seconds / rounds,
        "other_ms_per_round": 1000 * rest / rounds,
        "target_prefill_ms_per_round": 1000 * total.target_prefill_seconds / rounds,
        "added_ms_per_round": 1000 * (outside - total.target_prefill_seconds) / rounds,
        "round_ms": round_ms,
        "tau_for_1x": round_ms / target_ms,
        "tau_for_1.3x": 1.3 * round_ms / target_ms,
    }


def measured_advice(stats: SpecStats, settings: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang launch advice from the acceptance this run measured: for a draft SGLang serves
    as ``EAGLE3`` chains (``settings["sglang_algorithm"]``; a tree's positions are not a
    chain's, and other families' depths are not EAGLE's step-by-step chains)."""
    deepest = max(stats.depth_histogram, default=0)
    eagle = settings.get("sglang_algorithm", "EAGLE3") == "EAGLE3"
    chain = settings.get("topk", 1) == 1 and eagle
    if not chain or deepest == 0:
        return None
    return sglang_advice(
        stats.acceptance_per_position[:deepest],
        f"this benchmark's measured acceptance ({stats.verifications} rounds)",
    )


def bench_report(
    tally: BenchTally, settings: dict[str, Any], calibration: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Everything ``bench.json`` holds, from the tally, the settings it ran with and, for
    ``num_steps: auto``, the device calibration."""
    turns, seconds, tokens = tally.turns, tally.seconds, tally.tokens
    speed = {name: tokens[name] / max(seconds[name], 1e-9) for name in seconds}
    lookup = tokens["prompt_lookup"] > 0  # bench.prompt_lookup_num_tokens 0 skips it
    categories = sorted({r["category"] for r in turns})
    return {
        **_tau(turns),
        "speedup": speed["eagle3"] / speed["target"],
        "speedup_vs_hf_generate": speed["eagle3"] / speed["target_hf"],
        "target_vs_hf_generate": speed["target"] / speed["target_hf"],
        "speedup_prompt_lookup": speed["prompt_lookup"] / speed["target"] if lookup else None,
        # prompt lookup's accept length, counted as ``tau`` (through the engine only)
        "tau_prompt_lookup": (tokens["prompt_lookup"] - len(turns)) / tally.prompt_lookup_rounds
        if tally.prompt_lookup_rounds
        else None,
        "all_match": all(r["match"] for r in turns),
        # where outputs differ: a tie (top-2 margin < TIE_MARGIN) or a mismatch
        "divergences": tally.divergences,
        "ties": sum(d["tie"] for d in tally.divergences),
        "mismatches": sum(not d["tie"] for d in tally.divergences),
        # the target alone through the engine gave HF generate's outputs (None: no engine)
        "engine_all_match": None
        if any(r.get("engine_match") is None for r in turns)
        else all(r["engine_match"] for r in turns),
        "match_rate": sum(r["match"] for r in turns) / max(len(turns), 1),
        "prompt_lookup_all_match": all(r["prompt_lookup_match"] for r in turns) if lookup else None,
        "tokens_per_s": speed,
        "seconds": seconds,
        "generated_tokens": tokens,
        "cost": round_costs(tally.stats, seconds["target"], tokens["target"]),
        "acceptance_per_position": tally.stats.acceptance_per_position,
        "accepted_length_histogram": {str(k): v for k, v in tally.stats.histogram.items()},
        "depth_histogram": {str(k): v for k, v in tally.stats.depth_histogram.items()},
        "dormant_rounds": tally.stats.dormant_rounds,
        "sibling_rounds": tally.stats.sibling_rounds,
        "sibling_hits": len(tally.stats.sibling_hit_rounds),
        # rounds that verified prompt-lookup tokens instead of the draft's (bench.auto_lookup)
        "lookup_rounds": len(tally.stats.lookup_rounds),
        "calibration": calibration,
        "sglang_advice": measured_advice(tally.stats, settings),
        "per_category": {c: _tau([r for r in turns if r["category"] == c]) for c in categories},
        "accept_length_by_context": accept_length_by_context(turns),
        "per_set": {
            name: _set_report(rows, stats)
            for name, stats in tally.set_stats.items()
            if (rows := [r for r in turns if r.get("set", "") == name and "seconds" in r])
        },
        "settings": settings,
        "turn_details": turns,
    }


def baseline_words(engine: dict[str, Any] | None) -> str:
    """What the target alone that speedups are measured against ran on (``bench.md``)."""
    if not engine or "compiled" not in engine:
        return "the target alone through HF generate (no engine ran this target)"
    how = "compiled" if engine["compiled"] else "eager"
    return (
        f"the target alone through the same engine, {how} ({engine['compilations']} graphs "
        f"compiled, {engine['warm_up_seconds']} s of warm-up)"
    )


def _times(ratio: float | None) -> str:
    return "(not run)" if ratio is None else f"{ratio:.2f}x"


def _lookup_words(result: dict[str, Any]) -> str:
    """Prompt lookup's speedup and, where it ran through the engine, its ``tau``."""
    speedup, tau = _times(result["speedup_prompt_lookup"]), result["tau_prompt_lookup"]
    return speedup if tau is None else f"{speedup} (tau {tau:.3f})"


def _set_tables(per_set: dict[str, dict[str, Any]]) -> list[str]:
    """``bench.md``'s table for each set of a suite."""
    lines = []
    for name, part in per_set.items():
        lines += [
            "",
            f"## {name} ({part['turns']} turns)",
            "",
            "| metric | value |",
            "|---|---|",
            f"| tau | {part['tau']:.3f} |",
            f"| speedup over the target alone | {part['speedup']:.2f}x |",
            f"| prompt-lookup speedup | {_times(part['speedup_prompt_lookup'])} |",
            f"| all outputs identical | {part['all_match']} |",
            *[
                f"| acceptance at draft position {i + 1} | {r:.3f} |"
                for i, r in enumerate(part["acceptance_per_position"])
            ],
        ]
    return lines


def write_report(result: dict[str, Any], out: Path) -> None:
    """``bench.json`` (everything), ``bench.md`` (tables) and ``bench.png`` (plots)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "bench.json", result)
    s = result["settings"]
    lines = [
        f"# Accept length: {s['questions']} ({result['turns']} turns)",
        "",
        f"target `{s['target']}` ({s['dtype']}, {s['device']}), draft `{s['draft']}` "
        f"({s['draft_dtype']}{', int8 weights' if s.get('draft_quantize') == 'int8' else ''}), "
        f"num_steps={s['num_steps']}, topk={s['topk']}, num_draft_tokens={s['num_draft_tokens']},"
        f" max_new_tokens={s['max_new_tokens']}, greedy, batch size 1; speedups are against "
        + baseline_words(result.get("engine")),
        "",
        "| metric | value |",
        "|---|---|",
        f"| tau (emitted / verifications, prefill token excluded) | {result['tau']:.3f} |",
        f"| tau_sglang (completion tokens / verify count) | {result['tau_sglang']:.3f} |",
        f"| speedup over the target alone (the baseline above) | {result['speedup']:.2f}x |",
        f"| speedup over HF generate | {result['speedup_vs_hf_generate']:.2f}x |",
        f"| the target alone through the engine, against HF generate | "
        f"{result['target_vs_hf_generate']:.2f}x (outputs identical: "
        f"{result['engine_all_match']}) |",
        f"| prompt-lookup speedup (the same target forward; its tau) | {_lookup_words(result)} |",
        f"| all outputs identical to the target's | {result['all_match']} "
        f"({result['match_rate']:.1%}) |",
        f"| outputs that differ: numerical ties (top-2 margin < {TIE_MARGIN}) / mismatches | "
        f"{result['ties']} / {result['mismatches']} |",
        "",
        "| method | tokens/s |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in result["tokens_per_s"].items() if v],
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
        "",
        "| context tokens at the round | rounds | tau |",
        "|---|---|---|",
        *[
            f"| {b['from']}-{b['to'] or ''} | {b['rounds']} | {b['tau']:.3f} |"
            for b in result["accept_length_by_context"]
        ],
        "",
        "| verified depth | rounds |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in result["depth_histogram"].items()],
    ]
    if s["num_steps"] == "auto":
        lines.append(f"| (of the 0s, the draft slept through) | {result['dormant_rounds']} |")
        lines.append(
            f"| (rounds with siblings of the first token; a sibling accepted) | "
            f"{result['sibling_rounds']}; {result['sibling_hits']} |"
        )
        if s.get("auto_lookup"):
            lines.append(
                f"| (rounds that verified prompt lookup's tokens) | {result['lookup_rounds']} |"
            )
    if len(result.get("per_set", {})) > 1:
        lines += _set_tables(result["per_set"])
    if result.get("sglang_advice"):
        lines += ["", advice_markdown(result["sglang_advice"]).replace("# ", "## ", 1)]
    if result.get("calibration"):
        lines += ["", "| calibration (num_steps auto) | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in result["calibration"].items()]
    write_text_atomic(out / "bench.md", "\n".join(lines) + "\n")
    plot_report(result, out)


def plot_report(result: dict[str, Any], out: Path) -> None:
    """``bench.png``: acceptance per draft position and the accepted-length histogram
    (needs matplotlib, the ``plots`` extra; skipped with a note without it)."""
    try:
        import matplotlib
    except ImportError:
        logger.info("matplotlib is not installed: no bench.png (pip install matplotlib)")
        return
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
