"""Mutated real files never crash wandistill: one error line naming the file, nothing written.

Property-based (hypothesis, derandomized): the manifests (webdataset, zarr), a running cache's
journal, a checkpoint's state.json / optimizer.json / `latest`, a student config file and every
recipe in pipelines/, all produced by a tiny run (`realfiles.py`), are mutated (type swaps,
deletions, huge/negative/NaN/inf numbers, deep nesting, long strings, path traversal, truncation,
byte flips, wrong top-level types), then fed to `wandistill.cli.main` in process. Every case
must exit non-zero with exactly one `error:` line that names the mutated file, print no
traceback (nor an internal-error line), and leave every other file byte-identical.

Each mutation is invalid by construction for its file: sealed files (manifest, journal,
checkpoint state, optimizer.json through state.json's crc32c) refuse any change of content;
for the files a user writes (student config, recipes) only changes that break a type, a range or
the syntax are drawn (e.g. no digit flips, which can make another valid config).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import shutil
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pydantic_core import from_json

from wandistill.cli import main

from realfiles import RealFiles, real_files, tree_digest

CASES = {  # examples per test; 2,150 in all
    "manifest-wds": 400,
    "manifest-zarr": 250,
    "journal": 250,
    "state": 300,
    "optimizer": 150,
    "latest": 50,
    "student-config": 300,
    "recipe": 450,
}


SEALED_CLASSES = {
    "swap",
    "number",
    "nest",
    "long",
    "truncate",
    "flip",
    "top",
    "delete",
    "traversal",
}
USER_CLASSES = SEALED_CLASSES - {"delete"}
RECIPE_CLASSES = {"swap", "unknown", "nest", "long", "truncate", "flip", "top"}
SEEN: dict[str, Counter[str]] = {}
"""Examples run per test and mutation class (printed with -s; every class must occur)."""


def _seen(name: str, op: str) -> None:
    event(op)
    SEEN.setdefault(name, Counter())[op] += 1


def _report(name: str, classes: set[str]) -> None:
    counts = SEEN.get(name, Counter())
    print(f"\n{name}: {sum(counts.values())} examples, by class {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= CASES[name] and classes <= set(counts), counts


def _settings(name: str) -> Any:
    return settings(
        max_examples=CASES[name],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealFiles:
    return real_files(tmp_path_factory.mktemp("real"))


# ----------------------------------------------------------------------------- running a case


def _run(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = int(e.code or 0) if not isinstance(e.code, str) else 1
    return code, out.getvalue() + err.getvalue()


@dataclass
class Target:
    """One file under test, restored after every example."""

    path: Path
    watched: list[Path]
    """Folders whose other files must not change."""
    args: list[str]
    named: str
    """What the error line must contain (the file's name, or its path)."""
    fresh: Path | None = None
    """An output folder the failing command must not create."""
    pristine: dict[Path, Path] | None = None
    """Watched copies -> what they were copied from: restored after an example that changed
    them, before its verdict, so the next example (and hypothesis's replay of a failing one)
    starts from the same files. Without it, a command wrongly accepted once (say a resume that
    trains and moves `latest`) changes the folder, the replay sees another folder and passes,
    and hypothesis reports "Flaky" instead of a reproducible failure."""

    def check(self, data: bytes) -> None:
        original = self.path.read_bytes()
        before = [tree_digest(w, skip=self.path) for w in self.watched]
        self.path.write_bytes(data)
        try:
            code, text = _run(self.args)
        finally:
            self.path.write_bytes(original)
        after = [tree_digest(w, skip=self.path) for w in self.watched]
        created = self.fresh is not None and self.fresh.exists()
        self._restore(before, after)
        flat = " ".join(text.split())
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert code != 0, f"exit 0 for a mutated {self.path.name}: {data[:300]!r}\n{text}"
        assert "Traceback" not in text and "internal error" not in text, text
        assert len(errors) == 1, text
        assert self.named in flat, (self.named, text)
        assert after == before
        assert not created

    def _restore(self, before: list[dict[str, str]], after: list[dict[str, str]]) -> None:
        for w, b, a in zip(self.watched, before, after, strict=True):
            if a != b and self.pristine and w in self.pristine:
                shutil.rmtree(w)
                shutil.copytree(self.pristine[w], w)
        if self.fresh is not None and self.fresh.exists():
            shutil.rmtree(self.fresh)


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------- JSON mutations

RAW = "__raw_{}__"
TRAVERSAL = ("../../etc/x", "/etc/passwd", "..", "a/../../b", "..\\..\\x", "shards/../../../x.tar")
SAMPLES: dict[str, Any] = {
    "str": "x",
    "number": 7,
    "fraction": 0.5,
    "bool": True,
    "null": None,
    "list": [1],
    "dict": {"a": 1},
}
NUMBERS = (10**30, -(10**30), -1, 2**70, -(2**70), "nan", "inf", "-inf", "1e999", "-1e999")


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    return {str: "str", type(None): "null", list: "list", dict: "dict"}[type(v)]


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


def _set(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _delete(obj: Any, path: tuple[Any, ...]) -> None:
    for k in path[:-1]:
        obj = obj[k]
    del obj[path[-1]]


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def _dump(obj: Any) -> bytes:
    """JSON with raw tokens spliced in: NaN/Infinity/1e999 literals and deep nesting."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    for token in ("nan", "inf", "-inf", "1e999", "-1e999"):
        literal = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}.get(token, token)
        text = text.replace(json.dumps(RAW.format(token)), literal)
    while (i := text.find('"__deep_')) >= 0:
        j = text.index('__"', i)
        depth = int(text[i + 8 : j])
        text = text[:i] + "[" * depth + "]" * depth + text[j + 3 :]
    return (text + "\n").encode()


def _number(token: Any) -> Any:
    return RAW.format(token) if isinstance(token, str) else token


def _same(data: bytes, obj: Any) -> bool:
    try:
        return from_json(data, allow_inf_nan=True) == obj
    except ValueError:
        return False


@st.composite
def json_mutation(
    draw: st.DrawFn, raw: bytes, *, sealed: bool, keys: Callable[[tuple[Any, ...]], bool]
) -> tuple[str, bytes]:
    """(mutation class, bytes of the mutated JSON document). `sealed`: any change must be
    refused; otherwise only type-, range- and syntax-breaking ones are drawn, at paths `keys`
    accepts."""
    obj = json.loads(raw)
    paths = [p for p in _paths(obj) if keys(p)]
    ops = ["swap", "number", "nest", "long", "truncate", "flip", "top"]
    ops += ["delete", "traversal"] if sealed else ["traversal"]
    op = draw(st.sampled_from(ops))
    if op == "truncate":
        end = raw.rstrip().rfind(raw.rstrip()[-1:])
        return op, raw[: draw(st.integers(0, end))]
    if op == "flip":
        spots = [i for i, b in enumerate(raw) if not chr(b).isspace()]
        i = draw(st.sampled_from(spots))
        if sealed:
            out = bytearray(raw)
            out[i] ^= draw(st.integers(1, 255))
        else:  # a high-bit byte amid ASCII: never valid UTF-8
            out = bytearray(raw)
            out[i] |= 0x80
        data = bytes(out)
        assume(not _same(data, obj))
        return op, data
    if op == "top":
        return op, _dump(draw(st.sampled_from([[], "x", 5, None, True, [obj]])))
    mutated = copy.deepcopy(obj)
    if op == "delete":
        path = draw(st.sampled_from([p for p in paths if isinstance(_get(obj, p[:-1]), dict)]))
        _delete(mutated, path)
    else:
        path = draw(st.sampled_from(paths))
        current = _get(obj, path)
        if op == "swap":
            kinds = [k for k in SAMPLES if k != _kind(current) and (sealed or k != "null")]
            if _kind(current) == "number":
                kinds.remove("fraction")
            value = SAMPLES[draw(st.sampled_from(kinds))]
        elif op == "number":
            value = _number(draw(st.sampled_from(NUMBERS)))
        elif op == "nest":
            value = f"__deep_{draw(st.integers(40, 400))}__"
        elif op == "long":
            value = "x" * draw(st.integers(1000, 100_000))
        else:
            value = draw(st.sampled_from(TRAVERSAL))
        _set(mutated, path, value)
    data = _dump(mutated)
    assume(not _same(data, obj))
    return op, data


def _any(path: tuple[Any, ...]) -> bool:
    return True


# ----------------------------------------------------------------------------- caches


@pytest.fixture(scope="module")
def work(real: RealFiles, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("work")


def _manifest_target(cache: Path, work: Path, command: str, source: Path) -> Target:
    path = cache / "manifest.json"
    fresh = work / "never"
    args = {
        "info": ["cache", "info", str(cache)],
        "train": ["train", "--cache", str(cache), "--out", str(fresh), "--steps", "1"],
    }[command]
    return Target(path, [cache], args, str(path), fresh=fresh, pristine={cache: source})


@pytest.mark.parametrize("backend", ["wds", "zarr"])
def test_a_mutated_manifest_is_one_error_line_and_changes_nothing(
    real: RealFiles, work: Path, backend: str
) -> None:
    cache = _copy(getattr(real, backend), work / f"m-{backend}")
    raw = (cache / "manifest.json").read_bytes()
    source = getattr(real, backend)
    targets = {c: _manifest_target(cache, work, c, source) for c in ("info", "train")}

    @_settings(f"manifest-{backend}")
    @given(
        data=json_mutation(raw, sealed=True, keys=_any), command=st.sampled_from(["info", "train"])
    )
    def case(data: tuple[str, bytes], command: str) -> None:
        _seen(f"manifest-{backend}", data[0])
        targets[command].check(data[1])

    case()
    _report(f"manifest-{backend}", SEALED_CLASSES)


def test_a_mutated_journal_is_one_error_line_and_changes_nothing(
    real: RealFiles, work: Path
) -> None:
    cache = _copy(real.running, work / "journal")
    path = cache / "journal" / "rank-00000.json"
    target = Target(
        path, [cache], ["cache", "info", str(cache)], str(path), pristine={cache: real.running}
    )

    @_settings("journal")
    @given(data=json_mutation(path.read_bytes(), sealed=True, keys=_any))
    def case(data: tuple[str, bytes]) -> None:
        _seen("journal", data[0])
        target.check(data[1])

    case()
    _report("journal", SEALED_CLASSES)


# ----------------------------------------------------------------------------- checkpoints


def _resume_target(real: RealFiles, run: Path, path: Path) -> Target:
    args = real.train_args(real.wds, run, "--resume", "--steps", "3")  # trains on: reads it
    return Target(path, [run, real.wds], args, str(path), pristine={run: real.run})


@pytest.mark.parametrize("name", ["state", "optimizer"])
def test_a_mutated_checkpoint_file_is_one_error_line_and_changes_nothing(
    real: RealFiles, work: Path, name: str
) -> None:
    run = _copy(real.run, work / f"run-{name}")
    path = run / "checkpoints" / "checkpoint-2" / f"{name}.json"
    target = _resume_target(real, run, path)

    @_settings(name)
    @given(data=json_mutation(path.read_bytes(), sealed=True, keys=_any))
    def case(data: tuple[str, bytes]) -> None:
        _seen(name, data[0])
        target.check(data[1])

    case()
    _report(name, SEALED_CLASSES)


LATEST = st.one_of(
    st.sampled_from(
        [f"{t}/checkpoint-2" for t in TRAVERSAL] + ["", "{}", "checkpoint-", "checkpoint-x"]
    ),
    st.integers(2000, 50_000).map(lambda n: "checkpoint-" + "2" * n),
    st.binary(min_size=1, max_size=64).map(lambda b: "\x80" + b.decode("latin-1")),
    st.sampled_from(["checkpoint-2/../checkpoint-1", "./checkpoint-2", "checkpoint-2\x00"]),
)


def test_a_mutated_latest_pointer_is_one_error_line_and_changes_nothing(
    real: RealFiles, work: Path
) -> None:
    run = _copy(real.run, work / "run-latest")
    path = run / "checkpoints" / "latest"
    target = _resume_target(real, run, path)

    @_settings("latest")
    @given(text=LATEST)
    def case(text: str) -> None:
        _seen("latest", "latest")
        target.check(text.encode("utf-8", errors="surrogateescape"))

    case()
    _report("latest", {"latest"})


# ----------------------------------------------------------------------------- student config


def test_a_mutated_student_config_file_is_one_error_line_and_changes_nothing(
    real: RealFiles, work: Path
) -> None:
    folder = _copy(real.run / "student", work / "student")
    path = folder / "config.json"
    fresh = work / "never-student"
    args = real.train_args(real.wds, fresh, "--set", f'student.config_file="{path}"')
    target = Target(path, [folder, real.wds], args, str(path), fresh=fresh)
    raw = path.read_bytes()
    obj = json.loads(raw)

    def keys(p: tuple[Any, ...]) -> bool:  # what the file sets; `_` keys are metadata
        return not str(p[0]).startswith("_") and obj[p[0]] is not None

    @_settings("student-config")
    @given(data=json_mutation(raw, sealed=False, keys=keys))
    def case(data: tuple[str, bytes]) -> None:
        _seen("student-config", data[0])
        target.check(data[1])

    case()
    _report("student-config", USER_CLASSES)


# ----------------------------------------------------------------------------- recipes


def _toml_value(v: Any) -> str:
    if isinstance(v, str) and v.startswith("__deep_"):
        depth = int(v[7:-2])
        return "[" * depth + "]" * depth
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"


def _toml(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> str:
    """A small TOML writer for recipes: scalars first, then one [table] per nested table."""
    lines = [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in data.items() if not _table(v)]
    for k, v in data.items():
        if _table(v):
            name = ".".join(json.dumps(p) for p in (*prefix, k))
            lines.append(f"\n[{name}]\n{_toml(v, (*prefix, k))}")
    return "\n".join(lines)


def _table(v: Any) -> bool:
    return isinstance(v, dict)


@functools.cache
def _field_type(path: tuple[str, ...]) -> Any:
    """The recipe field's annotation (None for keys the dataclasses do not declare)."""
    import dataclasses
    import typing

    from wandistill.config import Recipe

    tp: Any = Recipe
    for part in path:
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


BAD_FOR = {  # values no field of that annotation accepts
    int: ["x", True, [1], {"a": 1}, 1.5, 2**70, -(2**70)],
    float: ["x", True, [1.0], {"a": 1}, float("nan"), float("inf"), float("-inf")],
    str: [7, True, ["x"], {"a": 1}, 1.5],
    bool: [1, "true", [True], {"a": 1}],
}


def _bad_values(tp: Any) -> list[Any]:
    import dataclasses
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return [v for v in _bad_values(inner[0]) if all(v in _bad_values(a) for a in inner)]
    if origin is list:
        return ["x", 7, {"a": 1}, [*BAD_FOR[args[0]][:1], *BAD_FOR[args[0]][:1]]]
    if origin is dict:
        return ["x", 7, [1], {"k": [1]}]
    if dataclasses.is_dataclass(tp):
        return ["x", 7, [1]]
    return BAD_FOR[tp]


def _opening_quotes(raw: bytes) -> list[int]:
    """Offsets of the first quote of each `key = "..."` line (not in a comment)."""
    out, start = [], 0
    for line in raw.split(b"\n"):
        q, hash_ = line.find(b'"'), line.find(b"#")
        if q >= 0 and (hash_ < 0 or q < hash_) and not line.lstrip().startswith(b"["):
            out.append(start + q)
        start += len(line) + 1
    return out


@st.composite
def recipe_mutation(draw: st.DrawFn, raw: bytes) -> tuple[str, bytes]:
    data = tomllib.loads(raw.decode())
    leaves = [p for p in _paths(data) if _field_type(p) is not None]
    leaves = [p for p in leaves if not isinstance(_get(data, p), dict) or p[-1] == "max_memory"]
    op = draw(st.sampled_from(["swap", "unknown", "nest", "long", "truncate", "flip", "top"]))
    if op == "truncate":  # inside a string literal: never valid TOML
        i = draw(st.sampled_from(_opening_quotes(raw)))
        close = raw.index(b'"', i + 1)
        return op, raw[: draw(st.integers(i + 1, close))]
    if op == "flip":  # a high-bit byte amid ASCII: never valid UTF-8
        i = draw(st.sampled_from([i for i, b in enumerate(raw) if b < 0x80]))
        return op, raw[:i] + bytes([raw[i] | 0x80]) + raw[i + 1 :]
    mutated = copy.deepcopy(data)
    if op == "top":
        mutated[draw(st.sampled_from(["precompute", "train"]))] = draw(st.sampled_from([5, "x"]))
    elif op == "unknown":
        path = draw(st.sampled_from(leaves))
        _set(mutated, (*path[:-1], path[-1] + draw(st.sampled_from(["_x", "s", "2"]))), 1)
    else:
        path = draw(st.sampled_from(leaves))
        tp = _field_type(path)
        if op == "swap":
            value = draw(st.sampled_from(_bad_values(tp)))
        elif op == "nest":
            value = f"__deep_{draw(st.integers(40, 3000))}__"
        else:
            assume(tp is not str)
            value = "x" * draw(st.integers(1000, 100_000))
        _set(mutated, path, value)
    return op, _toml(mutated).encode()


def test_a_mutated_recipe_is_one_error_line_and_changes_nothing(work: Path) -> None:
    folder = work / "recipes"
    folder.mkdir(exist_ok=True)
    recipes = sorted(Path("pipelines").glob("*.toml"))
    targets = []
    for src in recipes:
        path = folder / src.name
        shutil.copy(src, path)
        args = ["train", str(path), "--dry-run"]
        targets.append((Target(path, [folder], args, f"recipe {str(path)!r}"), path))

    @_settings("recipe")
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        target, path = data.draw(st.sampled_from(targets))
        op, mutated = data.draw(recipe_mutation(path.read_bytes()))
        _seen("recipe", op)
        target.check(mutated)

    case()
    _report("recipe", RECIPE_CLASSES)
