"""What every stage does when it starts, before its first matrix product:

1. cap oneDNN's per-shape primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=16``, unless the
   environment already sets it). oneDNN, PyTorch's CPU matmul library, caches a compiled
   primitive per matmul shape, 1,024 by default; training's shapes change with every sequence
   length, so on a CPU that cache grew a run's memory by about 1 GB per 100 steps, while 16
   entries cost no speed. oneDNN reads the value when it first builds a primitive, so it is set
   here, when the stage starts, not when the package is imported.
2. refuse an ``output_dir`` that is a file, and options that ``draft.type``'s family does not
   read (another family's, or an offline capture for a family that trains online:
   :func:`specforge.families.dispatch.check_options`), before any model loads;
3. resolve the config's hardware-dependent ``auto`` values for the machine that runs it
   (:func:`specforge.config.resolve_auto`), so the stage's outputs record what actually ran.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from specforge.config import SpecForgeConfig
from specforge.config.resolve import resolve_auto
from specforge.errors import UserError
from specforge.families.dispatch import check_options

logger = logging.getLogger(__name__)

ONEDNN_PRIMITIVE_CACHE_CAPACITY = "16"
"""oneDNN's primitive cache size the stages run with (an environment value the user set wins)."""

AUTO_FIELDS = (
    ("target", "dtype"),
    ("train", "dtype"),
    ("train", "compile"),
    ("bench", "draft_dtype"),
    ("bench", "draft_quantize"),
)
"""The fields :func:`specforge.config.resolve_auto` may change."""


def start_stage(cfg: SpecForgeConfig) -> SpecForgeConfig:
    """The config a stage runs with: ``cfg`` checked and with its ``auto`` values resolved
    (logged when one changes), after the oneDNN cache cap is in place (see the module
    docstring)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE_CAPACITY)
    if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise UserError(f"output_dir {cfg.output_dir} is a file: give a folder")
    check_options(cfg)
    resolved = resolve_auto(cfg)
    for section, name in AUTO_FIELDS:
        before = getattr(getattr(cfg, section), name)
        after = getattr(getattr(resolved, section), name)
        if before != after:
            logger.info("%s.%s: %s resolved to %s here", section, name, before, after)
    return resolved
