"""What every config module shares: the error, the dtype names, the devices."""

from __future__ import annotations

from typing import Literal

from specforge.errors import UserError

Dtype = Literal["bfloat16", "float16", "float32"]
DtypeOrAuto = Literal["bfloat16", "float16", "float32", "auto"]
"""A dtype name, or ``auto`` (:func:`resolve_auto_dtype`)."""


class ConfigError(UserError):
    """A config file or override names an unknown key or holds a value of the wrong type."""


SUPPORTED_DEVICES = ("cpu", "cuda")
"""The device types every stage runs on."""
