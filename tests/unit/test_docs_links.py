"""The docs point only at files in this repository: a reader of a clone, an sdist or the GitHub
page can open every link and every design or source file a page names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"`((?:\.\./|/|~)[^`\s]*\.(?:md|py))`|(/work/[^\s`);,]*)")
"""A doc or source file named by a path that leaves the repository (`../shared/design.md`), or
a path of the machine the project was built on. Values such as `../../etc/passwd` in tables of
refused inputs name no doc or source file and are not pointers."""


def _link_problem(page: Path, target: str) -> str | None:
    path = (page.parent / target.split("#")[0]).resolve()
    if not path.is_relative_to(ROOT.resolve()):
        return "outside the repository"
    return None if path.exists() else "no such file"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_named_doc_or_source_file_is_in_the_repository(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]
    problems = [
        f"link {target!r}: {why}"
        for target in links
        if (why := _link_problem(page, target)) is not None
    ]
    problems += [f"{a or b!r} is outside the repository" for a, b in OUTSIDE.findall(text)]
    assert problems == []


def test_the_scan_catches_what_it_guards_against(tmp_path: Path) -> None:
    page = ROOT / "docs" / "example.md"  # never written: only its folder is used
    assert _link_problem(page, "../../shared/design.md") == "outside the repository"
    assert _link_problem(page, "nothere.md") == "no such file"
    assert _link_problem(page, "placement.md#strategies") is None
    found = OUTSIDE.findall("see `../shared/design.md` and /work/shared/style.md; `../../x.json`")
    assert [a or b for a, b in found] == ["../shared/design.md", "/work/shared/style.md"]
