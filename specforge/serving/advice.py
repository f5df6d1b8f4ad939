"""SGLang launch flags (and vLLM's speculative config) that fit a draft's measured acceptance
per position.

From the conditional acceptance ``c_k`` of draft position ``k`` (given positions ``< k`` were
accepted; the training evaluation's ``cond_acc_k`` or what ``specforge bench`` measured), the
predicted accept length of a chain of depth ``K`` is ``1 + sum_{k<=K} prod_{j<=k} c_j``. The
advice:

- each tier of SGLang's adaptive speculative decoding (depths 1, 3, 5, 7) with its predicted
  accept length (positions past the measured ones repeat the deepest measured rate, marked
  extrapolated);
- ``--speculative-num-steps``: the shallowest tier whose accept length is within 5% of the
  deepest tier's (deeper chains cost draft steps and verification width for little more);
  ``--speculative-eagle-topk 1`` and ``--speculative-num-draft-tokens`` = steps + 1 (a chain;
  a tree is worth trying when the first position's acceptance is low, and the advice says so);
- vLLM's ``--speculative-config`` at the same depth (``num_speculative_tokens`` = steps; vLLM
  has no adaptive tiers);
- whether the adaptive mode suits this draft: it switches among the tiers by the running accept
  length, which pays only when the chain's acceptance holds up to depth 7 (here: every
  conditional acceptance through 7 at least 0.5, so each deeper tier still adds tokens).
"""

from __future__ import annotations

import json
from typing import Any

from specforge.serving.adaptive import expected_tokens

SGLANG_TIERS = (1, 3, 5, 7)
"""The step tiers of SGLang's adaptive speculative decoding."""

NEAR_BEST = 0.95
"""A tier within this share of the deepest tier's accept length is deep enough."""

HOLDS_UP = 0.5
"""Conditional acceptance every position through depth 7 needs for the adaptive mode."""

LOW_FIRST = 0.6
"""Below this first-position acceptance a tree (``topk > 1``) is worth a try."""


def sglang_advice(acceptance: list[float], source: str) -> dict[str, Any]:
    """The advice for conditional acceptances ``acceptance[k - 1] = c_k`` (see the module
    docstring); ``source`` says where they come from."""
    if not acceptance:
        raise ValueError("need the acceptance of at least one draft position")
    deepest = max(SGLANG_TIERS)
    rates = list(acceptance[:deepest]) + [acceptance[-1]] * (deepest - len(acceptance))
    tiers = {
        depth: {
            "predicted_accept_length": round(expected_tokens(rates, depth), 3),
            "extrapolated": depth > len(acceptance),
        }
        for depth in SGLANG_TIERS
    }
    best = tiers[deepest]["predicted_accept_length"]
    steps = next(d for d in SGLANG_TIERS if tiers[d]["predicted_accept_length"] >= NEAR_BEST * best)
    flags = (
        "--speculative-algorithm EAGLE3 "
        f"--speculative-num-steps {steps} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {steps + 1}"
    )
    adaptive = all(rate >= HOLDS_UP for rate in rates[:deepest])
    notes = [
        f"chain of {steps}: predicted accept length {tiers[steps]['predicted_accept_length']}"
        f" (the deepest tier, {deepest}, {best})",
        "adaptive mode suits this draft: acceptance holds up to depth 7"
        if adaptive
        else "adaptive mode does not suit this draft: acceptance falls below "
        f"{HOLDS_UP} before depth 7, so the deep tiers add little; keep a fixed depth",
    ]
    if rates[0] < LOW_FIRST:
        notes.append(
            f"first-position acceptance {rates[0]:.2f} < {LOW_FIRST}: a tree "
            "(--speculative-eagle-topk 4 --speculative-num-draft-tokens 16) may accept more"
        )
    return {
        "source": source,
        "conditional_acceptance": [round(r, 4) for r in acceptance],
        "tiers": {str(d): v for d, v in tiers.items()},
        "num_steps": steps,
        "sglang_flags": flags,
        "vllm_speculative_config": {"method": "eagle3", "num_speculative_tokens": steps},
        "adaptive_mode_suits": adaptive,
        "notes": notes,
    }


def advice_markdown(advice: dict[str, Any]) -> str:
    """The advice as a short Markdown page."""
    vllm = {"method": "eagle3", "model": "EXPORT", **advice["vllm_speculative_config"]}
    lines = [
        "# SGLang launch advice",
        "",
        f"From {advice['source']}.",
        "",
        "```",
        advice["sglang_flags"],
        "```",
        "",
        "vLLM, the same depth (EXPORT: this directory):",
        "",
        "```",
        f"--speculative-config '{json.dumps(vllm)}'",
        "```",
        "",
        "| SGLang tier (steps) | predicted accept length | extrapolated |",
        "|---|---|---|",
        *[
            f"| {d} | {t['predicted_accept_length']:.2f} | {t['extrapolated']} |"
            for d, t in advice["tiers"].items()
        ],
        "",
        *[f"- {note}" for note in advice["notes"]],
    ]
    return "\n".join(lines) + "\n"
