"""The draft families: ``draft.type`` -> the :class:`~specforge.families.base.DraftFamily`
that answers everything the recipes ask of it (:mod:`.dispatch` asks). A family is a folder here
and one line of :data:`REGISTRY`; nothing outside its folder names it. The folder's ``record``
module holds its ``FAMILY``; an ``options`` module, where it has one, its config section
``draft.<name>`` (an ``Options`` dataclass, and ``UPSTREAM_FLAGS``: the upstream training
flags that set its keys). This module imports no torch: the config composes the sections
from it.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache

from specforge.errors import UserError

REGISTRY: dict[str, str] = {
    "eagle3": "specforge.families.eagle3",
    "dflash": "specforge.families.dflash",
    "peagle": "specforge.families.peagle",
}
"""``draft.type`` -> the family's package (imported on first use)."""


@cache
def family(name: str):
    """The family ``draft.type`` names (its package's ``record.FAMILY``).

    Raises:
        UserError: a name the registry does not hold.
    """
    if name not in REGISTRY:
        raise UserError(f"draft.type {name!r} is not a draft family (one of {sorted(REGISTRY)})")
    found = importlib.import_module(f"{REGISTRY[name]}.record").FAMILY
    assert found.name == name, f"{REGISTRY[name]} holds family {found.name!r}, not {name!r}"
    return found


def families() -> list:
    """Every registered family, in registry order."""
    return [family(name) for name in REGISTRY]


@cache
def option_modules() -> dict:
    """``draft.type`` -> its ``options`` module, for the families that have a config section
    of their own (importing no torch)."""
    found = {}
    for name, package in REGISTRY.items():
        if importlib.util.find_spec(f"{package}.options") is not None:
            found[name] = importlib.import_module(f"{package}.options")
    return found


def sections() -> dict[str, type]:
    """``draft.<name>`` -> the dataclass of that family's section."""
    return {name: module.Options for name, module in option_modules().items()}
