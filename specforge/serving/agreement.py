"""Agreement between an engine and the built-in runtime serving the same export (the gate of
``bench --engine vllm --agree-with BENCH_JSON``).

On the same questions at the same depth, greedy, an engine that reads the export as the built-in
runtime does accepts about as much. When its accept length falls more than ``margin`` below the
built-in runtime's on the turns both ran, the report says so and lists the checks run on the
export (the contract the built-in runtime also loads it under): the files as the export wrote
them (their checksums: an edit after export is read alike by both sides), the config against the
target
(architecture, layers, tying, vocabulary, hidden size, positions, activation, RoPE), the
weights (names, shapes, dtypes, finite values, the EAGLE 3.1 norms where the config asks for
them), ``d2t`` as offsets with ``t2d`` consistent, and the aux layers within the target's. When
every check passes, the gap lies in how the engine serves the draft (its version, its dtype, a
key it reads differently), not in the export's contract. The checks are the export's family's
(:func:`specforge.families.dispatch.export_checks`). And an engine's own turns with the draft
beside the same turns without it (:func:`against_baseline`).
"""

from __future__ import annotations

from typing import Any

from specforge.errors import UserError

AGREEMENT_MARGIN = 0.10
"""The share by which an engine's accept length may fall below the built-in runtime's."""


def turn_key(turn: dict[str, Any], with_set: bool) -> tuple[str, int, str]:
    """A turn's question, its index, and its set where both reports record sets."""
    return str(turn["question_id"]), int(turn["turn"]), str(turn["set"]) if with_set else ""


def agreement(
    builtin: dict[str, Any], engine: dict[str, Any], margin: float = AGREEMENT_MARGIN
) -> dict[str, Any]:
    """The built-in bench's accept length on the engine's turns beside the engine's, the gap
    (``1 - engine / built-in``) and whether it is within ``margin``; acceptance per position of
    both.

    Raises:
        UserError: the two reports share no turn.
    """
    both = [*engine["turn_details"], *builtin["turn_details"]]
    with_set = all("set" in t for t in both)
    asked = {turn_key(t, with_set) for t in engine["turn_details"]}
    ours = [t for t in builtin["turn_details"] if turn_key(t, with_set) in asked]
    if not ours:
        raise UserError(
            "the built-in bench shares no turn with the engine's (same questions, same sets?)"
        )
    tau = sum(t["emitted"] for t in ours) / max(sum(t["verifications"] for t in ours), 1)
    gap = 1 - (engine["tau"] or 1.0) / tau
    return {
        "turns": len(ours),
        "builtin_tau": tau,
        "engine_tau": engine["tau"],
        "gap": gap,
        "margin": margin,
        "agrees": gap <= margin,
        "builtin_acceptance_per_position": builtin["acceptance_per_position"],
        "engine_acceptance_per_position": engine["acceptance_per_position"],
    }


def against_baseline(
    spec: list[dict[str, Any]], base: list[dict[str, Any]] | None, output: str
) -> dict[str, Any]:
    """An engine's turns with the draft (``spec``) beside the same turns without it (``base``,
    or ``None``), one row per turn with its ``tokens`` and ``seconds``: tokens/s both ways, the
    speedup, and whether each turn gave the same ``output`` (token ids, or text); a turn that
    only one side answered counts as a mismatch."""

    def speed(rows):
        return sum(r["tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)

    matches = [s[output] == b[output] for s, b in zip(spec, base or [], strict=False)]
    if base is not None and len(base) != len(spec):  # a turn one side lacks is a mismatch
        matches += [False] * abs(len(spec) - len(base))
    return {
        "tokens_per_s": {"speculative": speed(spec), "baseline": speed(base) if base else None},
        "speedup": speed(spec) / speed(base) if base else None,
        "all_match": all(matches) if base else None,
        "match_rate": sum(matches) / len(matches) if base else None,
    }
