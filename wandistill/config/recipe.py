"""Loading a recipe: strict TOML into the typed sections, `--set` overrides, shipped recipes.

Loading is strict (pydantic, `config.common.section`): an unknown key is an error naming the
closest valid key, and a value of the wrong type is an error naming the key, the value and the
type it needs. Overrides are applied to the raw TOML before validation, so they are checked the
same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import tomllib
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

from wandistill.checks.validate import MiB, read_capped
from wandistill.config.common import build, section, unknown_key
from wandistill.config.precompute import PrecomputeConfig
from wandistill.config.train import TrainConfig
from wandistill.errors import ConfigError

if typing.TYPE_CHECKING:
    from importlib.resources.abc import Traversable

T = TypeVar("T")

MAX_RECIPE_BYTES = MiB
"""A recipe picks values; a bigger file is not a recipe."""


@section("")
class Recipe:
    name: str = ""
    description: str = ""
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------- strict loading


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build config class `cls` from a TOML table: its sub-tables first (strict pydantic takes a
    section only as an instance of its class), then `cls` itself, which refuses unknown keys
    ("did you mean"), wrong types and out-of-range numbers with the key's path `where`."""
    hints = typing.get_type_hints(cls)
    values = dict(data)
    for key, value in data.items():
        if not hasattr(tp := hints.get(key), "section_name"):
            continue
        name = f"{where}.{key}" if where else key
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a table ([{name}]), got {value!r}")
        values[key] = from_dict(tp, value, name)
    return build(cls, values, where)


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
            message, fix = unknown_key(part, names, ".".join(parts[:i]))
            raise ConfigError(message, fix=fix)
        tp = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            node[part] = _parse_value(text.strip())
            return
        if not hasattr(tp, "section_name"):
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
