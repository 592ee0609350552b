"""Every number a user can set is finite and in range before any work, through one mechanism.

The cases are generated from the config tree itself: every int / float field (plain, optional
or a list) must declare a range, and every declared range refuses NaN, +-inf, a value past each
bound and a 70-bit integer, naming the key, the value and the allowed range.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path

import pytest

from wandistill.checks.bounds import Range, range_of
from wandistill.cli import main
from wandistill.config import Recipe, load_recipe
from wandistill.errors import ConfigError
from wandistill.precompute.prompts import read_prompts


def _numeric(tp: typing.Any) -> type | None:
    """int or float if the annotation is a number, an optional number or a list of numbers."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType, list):
        found = {_numeric(a) for a in typing.get_args(tp)} - {None}
        return found.pop() if found else None
    return tp if tp in (int, float) else None


def _numeric_fields(cls: type = Recipe, path: str = "") -> list[tuple[str, type, Range | None]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{path}.{f.name}" if path else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(_numeric_fields(tp, name))
        elif (kind := _numeric(tp)) is not None:
            is_list = typing.get_origin(tp) is list
            out.append((name + ("[]" if is_list else ""), kind, range_of(cls, f.name)))
    return out


FIELDS = _numeric_fields()


def test_every_numeric_setting_declares_a_range() -> None:
    assert len(FIELDS) > 30
    missing = [name for name, _, rng in FIELDS if rng is None]
    assert missing == [], f"numeric settings without a declared range: {missing}"


def _bad_values(kind: type, rng: Range) -> list[str]:
    """TOML literals that break `rng` (as `--set` sees them)."""
    bad = ["nan", "inf", "-inf"] if kind is float else ["99999999999999999999999"]
    for bound, step in ((rng.ge, -1), (rng.gt, 0), (rng.le, +1), (rng.lt, 0)):
        if bound is None:
            continue
        v = bound + step
        if kind is int:
            bad.append(str(int(v)))
        else:
            bad.append(repr(float(v)))
    return bad


CASES = [
    (name, value)
    for name, kind, rng in FIELDS
    if rng is not None
    for value in _bad_values(kind, rng)
]


@pytest.mark.parametrize(("key", "value"), CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_an_out_of_range_or_non_finite_value_is_refused_naming_key_value_and_range(
    key: str, value: str
) -> None:
    is_list = key.endswith("[]")
    key = key.removesuffix("[]")
    literal = f"[{value}]" if is_list and not key.endswith("betas") else value
    if key.endswith("betas"):
        literal = f"[0.9, {value}]"
    with pytest.raises(ConfigError) as info:
        load_recipe(None, [f"{key}={literal}"])
    short = key.split(".", 1)[1]  # messages name keys relative to the stage, as --set takes them
    message = info.value.message
    shown = value if value in ("nan", "inf", "-inf") or "." not in value else repr(float(value))
    assert re.search(rf"{re.escape(short)}(\[\d+\])?={re.escape(shown)} ", message), message
    assert "finite" in message or "allowed" in message, message
    assert "[" in message or "(" in message, f"no allowed range in {message!r}"


def test_every_problem_of_a_recipe_is_reported_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(None, ["train.optim.lr=nan", "train.optim.ema_decay=1.5"])
    assert "optim.lr=nan" in info.value.message and "optim.ema_decay=1.5" in info.value.message


def test_values_inside_their_ranges_load() -> None:
    r = load_recipe(
        None,
        [
            "precompute.sampler.seed=9223372036854775807",
            "precompute.sampler.guidance_scale=0.0",
            "precompute.sampler.flow_shift=12.0",
            "train.optim.betas=[0.0, 0.99]",
            "train.dist_timeout=30",
        ],
    )
    assert r.precompute.sampler.seed == 2**63 - 1 and r.train.dist_timeout == 30.0
    assert math.isfinite(r.train.optim.lr)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--guidance-scale", "nan"], "--guidance-scale=nan must be a finite number in [0, 100]"),
        (["--guidance-scale", "inf"], "--guidance-scale=inf must be a finite number"),
        (["--seed", "-1"], "--seed=-1 must be >= 0"),
        (["--seed", str(2**64)], f"--seed={2**64} is too large"),
        (["--steps", "100000"], "--steps=100000 is too large (allowed: [1, 1000])"),
        (["--max-sequence-length", "0"], "--max-sequence-length=0 must be positive"),
    ],
)
def test_sample_flags_get_the_same_ranges(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sample", "--teacher", str(tmp_path), "--prompts", str(tmp_path / "p.txt")]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path / "out"), *flags])
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["teacher", "make-tiny", "{}", "--seed", str(2**70)],
        ["eval", "--cache", "{}", "--student", "{}", "--out", "{}/o", "--steps", "5000"],
    ],
)
def test_other_numeric_flags_are_checked_before_any_work(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([a.format(tmp_path / "t") for a in argv])
    assert info.value.code == 2
    assert "is too large (allowed:" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_prompt_seeds_beyond_64_bits_or_negative_are_bad_lines(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "ok", "seed": 2**64 - 1},
        {"prompt": "too big", "seed": 2**64},
        {"prompt": "negative", "seed": -5},
        {"prompt": "fine"},
    ]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    prompts, report = read_prompts(p)
    assert [x.text for x in prompts] == ["ok", "fine"]
    assert report.bad_json == [2, 3]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "1000000", "--gpu-mem", "80GiB"], "--gpus 1000000 must lie in 0..4096"),
        (["--gpus", "2", "--gpu-mem", "1e30GiB"], "--gpu-mem '1e30GiB' is larger than the 16TiB"),
        (["--disk", "1e30GiB"], "--disk '1e30GiB' is larger than"),
    ],
)
def test_plan_what_if_numbers_have_the_upper_bounds_its_help_names(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    from wandistill.cli import MAX_GPUS, MAX_SIZES

    from clirun import run_cli

    code, out, err = run_cli(
        capsys, "plan", "--config", "wan2.1-14b", "--cpu-mem", "512GiB", *flags
    )
    assert code == 2 and message in err and err.count("error:") == 1, err
    code, out, _ = run_cli(capsys, "plan", "--help")
    flat = " ".join(out.replace("│", " ").split())  # rich's help box, unwrapped
    assert f"0..{MAX_GPUS}" in flat and all(f"at most {v}" in flat for v in MAX_SIZES.values())
