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
key it reads differently), not in the export's contract.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from specforge.errors import UserError
from specforge.io import read_json, read_safetensors
from specforge.models.eagle3 import Eagle3Config
from specforge.serving.export import (
    check_as_written,
    check_export_config,
    check_export_tensors,
    contract_problems,
    exported_aux_layer_ids,
)
from specforge.serving.export_dflash import (
    check_dflash_config,
    dflash_contract,
    draft_config_of,
    is_dflash_export,
)

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


def export_checks(export_dir: str | Path, target_config) -> list[dict[str, str | None]]:
    """The export's contract, check by check: ``{"check": what, "problem": None or why}``."""
    export_dir = Path(export_dir)
    exported = read_json(export_dir / "config.json")
    tensors = read_safetensors(export_dir / "model.safetensors")
    layers = target_config.num_hidden_layers
    if is_dflash_export(export_dir):
        checks = [
            (
                "config.json against the target (architecture, tying, vocabulary, hidden size, "
                "positions, activation, target layers, RoPE)",
                lambda: check_dflash_config(exported, target_config),
            ),
            (
                "weights: names, shapes, dtypes, finite values",
                lambda: _dflash_tensors(exported, tensors),
            ),
        ]
    else:
        checks = [
            (
                "config.json against the target (architecture, one layer, tying, vocabulary, "
                "hidden size, positions, activation, RoPE)",
                lambda: check_export_config(exported, target_config),
            ),
            (
                "weights: names, shapes, dtypes, finite values, the EAGLE 3.1 norms the config "
                "asks for; d2t as offsets (arange + d2t injective, in range) and t2d consistent",
                lambda: _eagle_tensors(exported, tensors, export_dir),
            ),
            (
                f"aux layer ids within the target's {layers} layers",
                lambda: _aux_layers(export_dir, layers),
            ),
        ]
    checks.insert(
        0,
        (
            "files as written (the checksums of config.json and model.safetensors in "
            "specforge-export.json)",
            lambda: check_as_written(export_dir),
        ),
    )
    report = []
    for name, check in checks:
        try:
            check()
            report.append({"check": name, "problem": None})
        except (UserError, ValueError) as err:
            report.append({"check": name, "problem": str(err)})
    return report


def _eagle_tensors(exported: dict, tensors: dict[str, torch.Tensor], export_dir: Path) -> None:
    fields = {f.name for f in dataclasses.fields(Eagle3Config)}
    config = Eagle3Config.from_dict(
        {k: v for k, v in exported.items() if k in fields}, str(export_dir / "config.json")
    )
    dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.bfloat16
    check_export_tensors(tensors, config, dtype)


def _dflash_tensors(exported: dict, tensors: dict[str, torch.Tensor]) -> None:
    config = draft_config_of(exported, "config.json")
    dtype = tensors["fc.weight"].dtype if "fc.weight" in tensors else torch.bfloat16
    expected = {name: (shape, dtype) for name, shape in dflash_contract(config).items()}
    problems = contract_problems(tensors, expected)
    if problems:
        raise UserError("; ".join(problems))


def _aux_layers(export_dir: Path, layers: int) -> None:
    ids = exported_aux_layer_ids(export_dir, layers)
    if not all(0 <= i < layers for i in ids):
        raise UserError(f"aux layer ids {ids} are outside the target's {layers} layers")
