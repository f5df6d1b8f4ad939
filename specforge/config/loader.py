"""Loading: YAML (a repeated key refused), dotted command-line overrides, the type check that
names the offending key, and the field docs ``--help`` shows."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from specforge.config.base import ConfigError
from specforge.config.recipe import SpecForgeConfig


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (by default the last one
    wins silently, so a config could hold two values for one setting)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}): keep one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None):
    """Build a :class:`SpecForgeConfig` from a YAML file plus dotted overrides.

    Args:
        path: YAML file, or ``None`` for the defaults.
        overrides: ``key.sub=value`` strings; values are parsed as YAML scalars/lists.

    Returns:
        The validated config.

    Raises:
        ConfigError: unknown key, wrong type, bad value, or an unreadable file.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = recipe_path(path)
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(
                f"{path}: not UTF-8 text ({err.reason} at byte {err.start})"
            ) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping, got {type(loaded).__name__}"
            )
        raw = loaded or {}
    for item in overrides or []:
        apply_override(raw, item)
    return from_dict(SpecForgeConfig, raw)


SHIPPED_RECIPES = "specforge.configs"
"""The package that holds the shipped recipes (``configs/`` in a checkout links to it)."""
DEFAULT_RECIPE = "smollm2-135m-eagle3"
"""The embedded default recipe, which ``specforge quickstart`` runs."""


def recipe_path(path: str | Path) -> Path:
    """A config file: an existing path, else the name of a shipped recipe (``smollm2-135m-eagle3``
    or ``smollm2-135m-eagle3.yaml``), read from the installed package.

    Raises:
        ConfigError: neither exists.
    """
    path = Path(path)
    if path.is_file():
        return path
    name = path.name if path.suffix == ".yaml" else f"{path.name}.yaml"
    shipped = Path(str(resources.files(SHIPPED_RECIPES).joinpath(name)))
    if len(path.parts) == 1 and shipped.is_file():
        return shipped
    raise ConfigError(f"config file not found: {path}")


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict (creating sections as needed)."""
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override must look like section.key=value, got {item!r}")
    try:
        value = yaml.load(text, Loader=UniqueKeyLoader) if text.strip() else None
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({reason})") from None
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def from_dict(cls: type, raw: Any, prefix: str = ""):
    """Build dataclass ``cls`` from a dict, checking keys and types recursively."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}"
            f" (known keys of {where}: {', '.join(sorted(names))})"
        )
    kwargs = {name: _check(hints[name], value, f"{prefix}{name}") for name, value in raw.items()}
    return cls(**kwargs)


YAML_BOOLEAN_WORDS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}
"""The words YAML reads as booleans: a choice field that offers one of them (``decode_kernel:
on``) takes the boolean back as that word."""


def _check(tp: Any, value: Any, key: str) -> Any:
    """Return ``value`` converted to type ``tp`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} must not be null")
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check(arg, value, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads on/off, yes/no as booleans
            spellings = YAML_BOOLEAN_WORDS[value]
            value = next((word for word in spellings if word in choices), value)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_check(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        # PyYAML reads "3e-4" as a string (YAML 1.1); accept numeric strings for float fields.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")  # a bug in this module


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain data (for saving next to checkpoints and outputs)."""
    return dataclasses.asdict(cfg)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (for ``--help``), its
    bases' included (a class composed at import, ``DraftConfig``, has no source of its own)."""
    docs = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # composed at import (``DraftConfig``): its bases hold it
            continue
        body = ast.parse(textwrap.dedent(source)).body[0].body
        for node, after in zip(body, body[1:] + [None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs
