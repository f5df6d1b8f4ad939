"""Typed configuration: dataclasses, YAML loading and dotted command-line overrides.

One config tree serves every stage. A YAML file holds the sections below; the command line adds
``section.field=value`` overrides (``data.max_length=1024``). Unknown keys and values of the wrong
type are errors that name the offending key, so a typo never silently falls back to a default.

Example::

    cfg = load_config("configs/smollm2-135m-eagle3.yaml", ["regenerate.max_new_tokens=64"])

By concern: a schema module per stage (:mod:`.target`, :mod:`.data`, :mod:`.capture`,
:mod:`.train`, :mod:`.export`, :mod:`.bench`, :mod:`.quickstart`; the whole tree in
:mod:`.recipe`), the loader and override parser (:mod:`.loader`), and :mod:`.resolve`, which
makes the hardware ``auto`` values concrete: the one module that imports torch, so loading and
checking a recipe needs none.
"""

from specforge.config.base import SUPPORTED_DEVICES, ConfigError, Dtype, DtypeOrAuto
from specforge.config.bench import (
    AUTO_MAX_DEPTH,
    AUTO_MAX_LOOKUP,
    ENGINE_OPTIONS,
    BenchConfig,
    EngineConfig,
)
from specforge.config.capture import CaptureConfig
from specforge.config.data import (
    MAX_SYNTHESIZE,
    DataConfig,
    PrepareConfig,
    RegenerateConfig,
    SynthesizeConfig,
    VocabConfig,
)
from specforge.config.export import ExportConfig
from specforge.config.loader import (
    DEFAULT_RECIPE,
    SHIPPED_RECIPES,
    apply_override,
    field_docs,
    from_dict,
    load_config,
    recipe_path,
    to_dict,
)
from specforge.config.quickstart import QuickstartConfig
from specforge.config.recipe import SpecForgeConfig
from specforge.config.target import TargetConfig
from specforge.config.train import DraftConfig, OnPolicyConfig, TrainConfig

__all__ = [
    "AUTO_MAX_DEPTH",
    "AUTO_MAX_LOOKUP",
    "DEFAULT_RECIPE",
    "ENGINE_OPTIONS",
    "MAX_SYNTHESIZE",
    "SHIPPED_RECIPES",
    "SUPPORTED_DEVICES",
    "BenchConfig",
    "CaptureConfig",
    "ConfigError",
    "DataConfig",
    "DraftConfig",
    "Dtype",
    "DtypeOrAuto",
    "EngineConfig",
    "ExportConfig",
    "OnPolicyConfig",
    "PrepareConfig",
    "QuickstartConfig",
    "RegenerateConfig",
    "SpecForgeConfig",
    "SynthesizeConfig",
    "TargetConfig",
    "TrainConfig",
    "VocabConfig",
    "apply_override",
    "field_docs",
    "from_dict",
    "load_config",
    "recipe_path",
    "to_dict",
]
