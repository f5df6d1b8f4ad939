"""Checkpoints: written whole into a temp folder and renamed, so a folder named ``step_N`` is
always complete. Contents:

- ``draft.safetensors``: the draft's trainable weights + ``d2t``/``t2d`` (the frozen
  ``embed_tokens`` is the target's and is not stored);
- ``draft_config.json``: the draft geometry (:class:`Eagle3Config`);
- ``optimizer.pt``: AdamW state (tensors only; read with ``weights_only=True``);
- ``rng.pt``: torch RNG state; ``trainer_state.json``: the step (the data position and the LR
  schedule follow from it) and the config used.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specforge.errors import UserError
from specforge.io import (
    atomic_directory,
    file_problem,
    file_sha256,
    read_safetensors,
    write_json_atomic,
)
from specforge.models.eagle3 import FROZEN_WEIGHTS, load_draft_weights

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")


def draft_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's state dict without the target's tensors it holds (``frozen_weights``: the
    embedding, and whatever else its family shares with the target), contiguous, on CPU."""
    frozen = getattr(model, "frozen_weights", FROZEN_WEIGHTS)
    return {
        k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in frozen
    }


def save_checkpoint(
    folder: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    draft_config: dict[str, Any],
    state: dict[str, Any],
) -> Path:
    """Write ``folder/step_<step>`` atomically and return it. ``trainer_state.json`` records
    the sha256 of every other file, checked before a resume reads them."""
    final = folder / f"step_{step}"
    with atomic_directory(final) as tmp:
        save_file(draft_state(model), str(tmp / "draft.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state()}, tmp / "rng.pt")
        write_json_atomic(tmp / "draft_config.json", draft_config)
        checksums = {p.name: file_sha256(p) for p in sorted(tmp.iterdir())}
        write_json_atomic(tmp / "trainer_state.json", {"step": step, **state, "sha256": checksums})
    return final


def checkpoint_steps(folder: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step_N`` in ``folder``, newest first (temp folders and
    anything else ignored)."""
    if not folder.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return sorted(steps, reverse=True)


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint with the highest step in ``folder`` (temp folders ignored)."""
    steps = checkpoint_steps(folder)
    return steps[0][1] if steps else None


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (missing files, a checksum that differs from
    the one recorded at save time), or ``None``."""
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        return f"trainer_state.json is unreadable ({err})"
    for name, digest in state.get("sha256", {}).items():
        if (problem := file_problem(path / name, digest)) is not None:
            return f"{name} {problem}"
    return None


def latest_sound_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint whose files are intact; broken newer ones are skipped with a
    warning naming the problem (a kill or a disk fault)."""
    for _, path in checkpoint_steps(folder):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning("%s cannot be resumed from: %s; trying the previous one", path, problem)
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json`` (the step and the config it was trained with).

    Raises:
        UserError: ``path`` is not a checkpoint folder, or its state file is missing or damaged.
    """
    path = Path(path)
    if not (path / "draft.safetensors").is_file():
        raise UserError(f"{path} is not a training checkpoint (no draft.safetensors)")
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is not a complete checkpoint (no trainer_state.json)") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path}/trainer_state.json cannot be read ({err})") from None


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer=None) -> dict[str, Any]:
    """Load weights (and optimizer/RNG state) from ``path``; returns the trainer state.

    Raises:
        UserError: damaged files or weights that do not fit, naming the checkpoint.
    """
    load_draft_weights(model, read_safetensors(path / "draft.safetensors"), str(path))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        rng = torch.load(path / "rng.pt", weights_only=True)
        torch.set_rng_state(rng["torch"])
    return json.loads((path / "trainer_state.json").read_text())
