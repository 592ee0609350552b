"""Loading a recipe: strict TOML into the typed sections, `--set` overrides, shipped recipes.

Loading is strict: an unknown key is an error naming the closest valid key, and a value of the
wrong type is an error naming the key, the value and the type it needs. Overrides are applied to
the raw TOML before validation, so they are checked the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from wandistill.checks.validate import MiB, read_capped
from wandistill.config.precompute import PrecomputeConfig
from wandistill.config.train import TrainConfig
from wandistill.errors import ConfigError
from wandistill.placement.strategies import Placement

if typing.TYPE_CHECKING:
    from importlib.resources.abc import Traversable

T = TypeVar("T")

MAX_RECIPE_BYTES = MiB
"""A recipe picks values; a bigger file is not a recipe."""


@dataclass(kw_only=True, slots=True)
class Recipe:
    name: str = ""
    description: str = ""
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------- strict loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against annotation `tp`; ints widen to float, nothing else is converted."""
    origin = typing.get_origin(tp)
    if tp is Placement:  # parsed (with its sibling keys) in TeacherConfig.__post_init__
        if not isinstance(value, str):
            raise ConfigError(f'{where}={value!r} must be a string, e.g. "auto"')
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table ([{where}]), got {value!r}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={value!r} must be {_type_name(tp)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r} must be a list")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} must be a table")
        return {str(k): _coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp in (int, float) and isinstance(value, int) and not isinstance(value, bool):
        # Widen to float only where it cannot overflow; every numeric field declares its range
        # (checks/bounds.py), which refuses a huge int or a NaN / inf with the range named.
        return float(value) if tp is float and -(1 << 63) <= value < 1 << 63 else value
    if tp is Any:
        return value
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}={value!r} must be {tp.__name__}, not a boolean")
    if not isinstance(value, tp):
        raise ConfigError(f"{where}={value!r} must be {_type_name(tp)}, got {type(value).__name__}")
    return value


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    name = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    prefix = where + "." if where else ""
    if close:
        return ConfigError(
            f"unknown key {name!r}: did you mean {prefix}{close[0]}?",
            fix=f"spell it {prefix}{close[0]}",
        )
    return ConfigError(
        f"unknown key {name!r}: valid keys here: {', '.join(valid)}",
        fix=f"use one of the keys of [{where or 'the recipe'}] listed above",
    )


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a TOML table, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(key, fields, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    """A config as plain JSON-able data: recipe values back in the form a recipe writes them
    (a placement as its --placement text)."""
    if hasattr(cfg, "to_recipe"):
        return cfg.to_recipe()
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def _parse_value(text: str) -> Any:
    """`--set` values are TOML literals (4, 1e-4, true, [0, 2], "x"); bare words are strings.
    Exactly one value: a document that parses to more than `v` (a second `key = value` smuggled
    in after a newline or a `;`-less trick) is refused, not silently dropped."""
    try:
        doc = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"--set value {text[:40]!r}... nests too deeply") from None
    except ValueError:  # Python's int limit (4,300 digits) is a ValueError inside tomllib
        raise ConfigError(
            f"--set value {text[:40]!r}... is a number of {len(text)} characters; no recipe "
            "key takes one that large"
        ) from None
    if set(doc) != {"v"}:
        raise ConfigError(f"--set value {text[:60]!r} holds more than one value")
    return doc["v"]


def apply_override(data: dict[str, Any], assignment: str, stage: str | None = None) -> None:
    """Apply one `key.path=value` to the raw recipe dict, resolving keys relative to `stage`."""
    if any(c in assignment for c in "\n\r\x00"):
        raise ConfigError(
            f"--set {assignment[:80]!r} holds a line break; --set takes exactly one "
            "section.key=value",
            fix="pass one --set per key",
        )
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r} must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = [p.strip() for p in dotted.strip().split(".") if p.strip()]
    if not parts:
        raise ConfigError(f"--set {assignment!r} has an empty key")
    root_fields = [f.name for f in dataclasses.fields(Recipe)]
    if stage is not None and parts[0] not in root_fields:
        parts = [stage, *parts]
    # Walk the dataclass tree alongside the dict so a typo is reported with a suggestion.
    cls: Any = Recipe
    node = data
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise _unknown_key(part, names, ".".join(parts[:i]))
        tp = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            node[part] = _parse_value(text.strip())
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[: i + 1])} is not a section")
        node = node.setdefault(part, {})
        cls = tp


# --------------------------------------------------------------------------- shipped recipes

RECIPES_PACKAGE = "wandistill.recipes"
"""The repository's pipelines/*.toml, mapped into the package at build time (pyproject.toml)."""


def shipped_recipes_dir() -> Traversable:
    """The folder of recipes that ship with the package, read through importlib.resources so a
    wheel, an editable install and a zip all work. A source tree put on sys.path without being
    installed has no `wandistill.recipes` (the build makes it): read its pipelines/ instead; so
    does a source tree run through PYTHONPATH while another tree is installed editable (whose
    `wandistill.recipes` would be the other tree's recipes, not this code's)."""
    tree = Path(__file__).resolve().parents[2]
    if (tree / "pyproject.toml").is_file() and (tree / "pipelines").is_dir():
        return tree / "pipelines"
    try:
        return importlib.resources.files(RECIPES_PACKAGE)
    except ModuleNotFoundError:
        return tree / "pipelines"


def shipped_recipe_names() -> list[str]:
    return sorted(
        f.name.removesuffix(".toml")
        for f in shipped_recipes_dir().iterdir()
        if f.name.endswith(".toml") and f.is_file()
    )


def _no_such_recipe(arg: str, message: str, expected: str) -> ConfigError:
    """One line naming `arg`, the nearest shipped names, and how to list them all."""
    names = shipped_recipe_names()
    stem = os.path.basename(arg).removesuffix(".toml")
    near = difflib.get_close_matches(stem, names, n=3, cutoff=0.5)
    hint = f" (nearest shipped: {', '.join(near)})" if near else ""
    return ConfigError(
        f"{message}{hint}", fix=f"pass {expected}; `wandistill recipes` lists the shipped ones"
    )


def shipped_recipe(name: str) -> Traversable:
    """The shipped recipe called `name` (a file stem in pipelines/, e.g. `tiny`)."""
    if name in shipped_recipe_names():
        return shipped_recipes_dir() / f"{name}.toml"
    raise _no_such_recipe(
        name, f"unknown recipe {name!r}: not a shipped recipe name", "a shipped recipe name"
    )


def is_recipe_path(text: str) -> bool:
    """How a RECIPE argument is read (stated in --help): a path has a slash or ends in .toml,
    a name has neither and is a shipped recipe. By its spelling alone, so a file or folder that
    shares a shipped recipe's name (a teacher folder called `tiny`) never hides it."""
    return text.endswith(".toml") or "/" in text or os.sep in text


def resolve_recipe(arg: str | Path) -> Traversable:
    """What every command's RECIPE argument means (is_recipe_path): a path is a TOML file, a
    name is a shipped recipe; the filesystem is never asked which it is."""
    text = str(arg)
    if not is_recipe_path(text):
        if text in shipped_recipe_names():
            return shipped_recipe(text)
        local = f" (for the file {text!r} here, pass ./{text})" if Path(text).exists() else ""
        raise _no_such_recipe(
            text, f"recipe {text!r} is not a shipped recipe name{local}", "a shipped name"
        )
    p = Path(text)
    if p.is_file():
        return p
    if p.is_dir():
        raise ConfigError(f"recipe {text!r} is a directory", fix="pass a TOML file inside it")
    raise _no_such_recipe(text, f"recipe {text!r} does not exist", "a TOML file")


def load_recipe(
    path: str | Path | None = None, overrides: list[str] | None = None, stage: str | None = None
) -> Recipe:
    """Read a TOML recipe (a file or a shipped name, see `resolve_recipe`; None: start from
    defaults), apply overrides, then validate once."""
    data: dict[str, Any] = {}
    if path is not None:
        source = resolve_recipe(path)
        fix = "fix the recipe, or start from a shipped one (`wandistill recipes copy NAME`)"
        raw = (
            read_capped(
                source, max_bytes=MAX_RECIPE_BYTES, what="recipe", fix=fix, error=ConfigError
            )
            if isinstance(source, Path)
            else source.read_bytes()  # a shipped recipe: package data
        )
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid TOML: {e}") from None
        except ValueError:  # Python's int limit (4,300 digits) is a ValueError inside tomllib
            raise ConfigError(
                f"recipe {str(path)!r} holds an integer of more than 4,300 digits", fix=fix
            ) from None
        except RecursionError:  # tomllib recurses per nesting level
            raise ConfigError(f"recipe {str(path)!r} nests too deeply", fix=fix) from None
    for assignment in overrides or []:
        apply_override(data, assignment, stage)
    try:
        return from_dict(Recipe, data)
    except TypeError as e:  # a missing kw-only field would land here; keep it one line
        raise ConfigError(f"recipe {path}: {e}") from None
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(  # name the file: the key may come from it or from a --set
            f"recipe {str(path)!r}: {e.message}",
            fix=e.fix or "fix that key in the recipe (or in the --set override)",
        ) from None
