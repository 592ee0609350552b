"""Recipes load strictly: typos name the closest key, types are checked, overrides apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from wandistill.config import Recipe, load_recipe
from wandistill.errors import ConfigError

PIPELINES = sorted((Path(__file__).parents[2] / "pipelines").glob("*.toml"))


def test_the_tiny_recipe_exists() -> None:
    assert any(p.name == "tiny.toml" for p in PIPELINES)


@pytest.mark.parametrize("recipe", PIPELINES, ids=lambda p: p.name)
def test_every_recipe_in_pipelines_parses(recipe: Path) -> None:
    r = load_recipe(recipe)
    assert isinstance(r, Recipe) and r.name


def test_set_overrides_apply_relative_to_the_stage_and_from_the_root(tmp_path: Path) -> None:
    r = load_recipe(
        PIPELINES[0].parent / "tiny.toml",
        ["sampler.num_inference_steps=4", "train.optim.lr=3e-4", 'cache.backend="zarr"'],
        stage="precompute",
    )
    assert r.precompute.sampler.num_inference_steps == 4
    assert r.precompute.cache.backend == "zarr"
    assert r.train.optim.lr == pytest.approx(3e-4)
    r = load_recipe(None, ["sampler.record_steps=[0, 3]", "teacher.dtype=bf16"], stage="precompute")
    assert r.precompute.sampler.record_steps == [0, 3] and r.precompute.teacher.dtype == "bf16"


def test_an_unknown_key_names_the_closest_valid_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[precompute.sampler]\nnum_inferance_steps = 4\n")
    with pytest.raises(
        ConfigError,
        match=r"precompute.sampler.num_inferance_steps.*did you mean "
        r"precompute.sampler.num_inference_steps",
    ):
        load_recipe(bad)
    with pytest.raises(ConfigError, match="did you mean precompute.teacher.placement"):
        load_recipe(None, ["teacher.placment=cpu"], stage="precompute")
    with pytest.raises(ConfigError, match="unknown key 'trian'"):
        load_recipe(None, ["trian.steps=3"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("precompute.sampler.height=33", "multiple of 16"),
        ("precompute.sampler.num_frames=4", "4k\\+1"),
        ("precompute.sampler.num_inference_steps=0", "must be positive"),
        ("precompute.sampler.height=true", "must be int"),
        ('train.optim.lr="fast"', "must be float"),
        ("precompute.teacher.placement=everywhere", "placement"),
        ("precompute.cache.backend=lmdb", "backend"),
        ("precompute.sampler.record_steps=[0, 99]", "record_steps"),
        ("train.steps=-1", "must be positive"),
        ("precompute.sampler=3", "is not a section|must be a table"),
        ("precompute.sampler.height", "section.key=value"),
    ],
)
def test_bad_values_are_one_clear_error(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(None, [override])


def test_a_missing_or_broken_recipe_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[precompute\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(broken)


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("train.steps=5\ntrain.bogus=1", "holds a line break; --set takes exactly one"),
        ("train.steps=5\rx=1", "holds a line break"),
        ("train.steps=5\x00", "holds a line break"),
        ("train.steps=" + "9" * 5000, "is a number of 5000 characters"),
        ('train.out="a"\nx', "holds a line break"),
    ],
    ids=["newline-smuggles-a-key", "carriage-return", "nul", "5000-digit-int", "newline-in-str"],
)
def test_set_takes_exactly_one_key_value(assignment: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(None, [assignment])


def test_a_recipe_with_an_integer_over_python_s_digit_limit_is_one_line(tmp_path: Path) -> None:
    recipe = tmp_path / "big.toml"
    recipe.write_text("[train]\nsteps = " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match="holds an integer of more than 4,300 digits"):
        load_recipe(recipe)


def test_environment_integers_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from wandistill.errors import UsageError
    from wandistill.runtime import dist

    for value in ("9" * 5000, "two", "-1"):
        monkeypatch.setenv("WORLD_SIZE", value)
        with pytest.raises(UsageError, match="environment variable WORLD_SIZE="):
            dist.init("cpu")


def test_a_section_built_in_code_or_copied_with_replace_is_checked_like_a_recipe() -> None:
    import dataclasses

    from wandistill.config import LossConfig, OptimConfig

    with pytest.raises(ConfigError, match=r"optim\.lr=nan must be a finite number in \(0, 10\]"):
        OptimConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match="did you mean loss.output"):
        LossConfig(outptu=1.0)
    train = load_recipe("tiny").train
    with pytest.raises(ConfigError, match=r"train\.steps=0 must be positive \(allowed: \[1, "):
        dataclasses.replace(train, steps=0)
    copied = dataclasses.replace(train, steps=5)
    assert copied.steps == 5 and copied.optim == train.optim
    assert dataclasses.asdict(copied)["optim"]["betas"] == train.optim.betas


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.cache=3", "train.cache=3 must be str | list[str]"),
        ("train.steps=true", "train.steps=True must be int, not a boolean"),
        ("train.steps=2.0", "train.steps=2.0 must be int, got float"),
        ("train.loss.feature_map={a = 1}", "train.loss.feature_map.a=1 must be str, got int"),
        (
            "precompute.teacher.placement=3",
            'precompute.teacher.placement=3 must be a string, e.g. "auto"',
        ),
    ],
)
def test_wrong_types_are_refused_without_conversion_naming_the_key_path(
    override: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(None, [override])
    assert info.value.message == message


def test_an_int_fills_a_float_key() -> None:
    r = load_recipe(None, ["train.optim.lr=1", "train.optim.betas=[0, 0.5]"])
    assert r.train.optim.lr == 1.0 and type(r.train.optim.lr) is float
    assert r.train.optim.betas == [0.0, 0.5] and type(r.train.optim.betas[0]) is float
