"""Shipped recipes: a RECIPE is a file or a shipped name, from any directory; list and copy them."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from wandistill.config import load_recipe, resolve_recipe, shipped_recipe_names, to_dict
from wandistill.errors import ConfigError

from clirun import run_cli as _run

REPO = Path(__file__).parents[2]
PIPELINES = sorted((REPO / "pipelines").glob("*.toml"))


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_every_recipe_in_pipelines_ships_under_the_name_it_declares() -> None:
    assert shipped_recipe_names() == sorted(p.stem for p in PIPELINES)
    for p in PIPELINES:
        assert load_recipe(p.stem).name == p.stem, f"{p.name}: `name` must equal the file stem"


def test_a_name_loads_the_same_recipe_as_its_path_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_path = to_dict(load_recipe(REPO / "pipelines" / "wan2.1-14b_1x24gb.toml"))
    monkeypatch.chdir(tmp_path)
    assert to_dict(load_recipe("wan2.1-14b_1x24gb")) == by_path
    assert resolve_recipe("tiny").read_bytes() == (REPO / "pipelines" / "tiny.toml").read_bytes()


def test_a_local_file_named_like_a_shipped_recipe_is_read_by_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("tiny").write_text('name = "mine"\n')
    assert load_recipe("./tiny").name == "mine"
    assert load_recipe("tiny").name == "tiny"


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("tinyy", "recipe 'tinyy' is not a shipped recipe name (nearest shipped: tiny)"),
        (
            "pipelines/tiny.toml",
            "recipe 'pipelines/tiny.toml' does not exist (nearest shipped: tiny, tiny-fewstep)",
        ),
        ("tiny.toml", "recipe 'tiny.toml' does not exist (nearest shipped: tiny, tiny-fewstep)"),
        ("zzz", "recipe 'zzz' is not a shipped recipe name"),
    ],
)
def test_an_unknown_recipe_is_one_line_naming_the_nearest_shipped_names(
    arg: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # outside the repository: pipelines/ is not here
    with pytest.raises(ConfigError) as e:
        load_recipe(arg)
    assert e.value.message == message and "wandistill recipes" in (e.value.fix or "")
    for command in ("precompute", "train", "plan"):
        code, _, err = _run(capsys, command, arg)
        assert code == 2 and "Traceback" not in err, err
        assert _error_lines(err) == [f"error: {message}"], err
    code, _, err = _run(capsys, "demo", "--recipe", arg, "--root", str(tmp_path / "demo"))
    assert code == 2 and _error_lines(err) == [f"error: {message}"], err
    assert not (tmp_path / "demo").exists()


def test_a_directory_is_not_a_recipe(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_recipe(tmp_path)


def test_recipes_lists_every_shipped_recipe_with_teacher_and_placement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(capsys, "recipes")
    assert code == 0
    for name in shipped_recipe_names():
        teacher = load_recipe(name).precompute.teacher
        row = next(line for line in out.splitlines() if f" {name} " in line)
        assert str(teacher.placement) in row, row
        assert Path(teacher.path).name[:8] in out  # long paths may fold onto the next line


def test_copy_writes_the_shipped_bytes_and_never_overwrites_without_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    shipped = (REPO / "pipelines" / "tiny.toml").read_bytes()
    assert _run(capsys, "recipes", "copy", "tiny")[0] == 0
    assert Path("tiny.toml").read_bytes() == shipped  # comments kept: it is for editing
    assert load_recipe("tiny.toml").name == "tiny"  # the copy (a file) is what loads now

    mine = b'name = "edited"\n'
    Path("tiny.toml").write_bytes(mine)
    code, _, err = _run(capsys, "recipes", "copy", "tiny")
    assert code == 2 and len(_error_lines(err)) == 1 and "--force" in err, err
    assert Path("tiny.toml").read_bytes() == mine
    assert _run(capsys, "recipes", "copy", "tiny", "--force")[0] == 0
    assert Path("tiny.toml").read_bytes() == shipped

    Path("into").mkdir()
    assert _run(capsys, "recipes", "copy", "wan2.1-14b_1x24gb", "into")[0] == 0
    assert tomllib.loads(Path("into/wan2.1-14b_1x24gb.toml").read_text())["name"] == (
        "wan2.1-14b_1x24gb"
    )
    assert _run(capsys, "recipes", "copy", "tiny", "new/dir/r.toml")[0] == 0
    assert Path("new/dir/r.toml").read_bytes() == shipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["into", "new", "tiny.toml"]  # no temps


def test_copy_of_an_unknown_name_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "recipes", "copy", "wan2.1-14b", "out.toml")
    assert code == 2 and "Traceback" not in err
    assert _error_lines(err) == [
        "error: unknown recipe 'wan2.1-14b': not a shipped recipe name (nearest shipped: "
        "wan2.1-14b_4x80gb, wan2.1-14b_1x80gb, wan2.1-14b_1x24gb)"
    ], err
    assert list(tmp_path.iterdir()) == []


def test_every_package_folder_is_in_the_wheel_package_list() -> None:
    """pyproject lists packages (find cannot add the pipelines/ mapping): keep the list whole."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = [REPO / "wandistill", *(REPO / "wandistill").rglob("*")]
    dotted = [d.relative_to(REPO).parts for d in folders if d.is_dir()]
    on_disk = {  # what Python can import as a package (folders named like identifiers)
        ".".join(parts)
        for parts in dotted
        if all(p.isidentifier() for p in parts) and "__pycache__" not in parts
    }
    assert set(setuptools["packages"]) == on_disk | {"wandistill.recipes"}
    assert setuptools["package-dir"] == {"wandistill.recipes": "pipelines"}
    assert setuptools["package-data"]["wandistill.recipes"] == ["*.toml"]


def test_a_name_is_never_shadowed_by_a_file_or_folder_of_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path has a slash or ends in .toml, a name has neither: the README's teacher folder
    `tiny` in the working directory does not hide the shipped recipe `tiny`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "mine").write_text('name = "mine"\n')
    shipped = (REPO / "pipelines" / "tiny.toml").read_bytes()
    assert resolve_recipe("tiny").read_bytes() == shipped
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_recipe("./tiny")
    with pytest.raises(ConfigError, match=r"pass \./mine"):
        resolve_recipe("mine")
    assert Path(str(resolve_recipe("./mine"))).name == "mine"
