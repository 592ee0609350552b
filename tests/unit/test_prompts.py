"""Prompt files: bad lines are skipped and reported by line number; only no prompt at all fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wandistill.errors import UsageError
from wandistill.precompute.prompts import read_prompts


def test_txt_prompts_skip_empty_duplicate_and_invalid_utf8_lines(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(b"a cat\n\n  \na dog\nbad \xff\xfe bytes\na cat\n  a fox  \n")
    prompts, report = read_prompts(f, base_seed=10)
    # A .txt prompt's seed is base_seed + its 0-based line; a repeated line is a duplicate.
    assert [(p.text, p.seed, p.line) for p in prompts] == [
        ("a cat", 10, 1),
        ("a dog", 13, 4),
        ("a fox", 16, 7),
    ]
    assert report.empty == [2, 3] and report.bad_utf8 == [5] and report.duplicate == [6]
    assert any("invalid UTF-8" in line and "5" in line for line in report.summary())


def test_jsonl_prompts_carry_seed_and_negative_prompt_and_drop_duplicates(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a cat", "seed": 7},
        {"prompt": "a cat", "seed": 7},
        {"prompt": "a dog", "negative_prompt": "blurry"},
        {"text": "no prompt key"},
        {"prompt": "x", "seed": "seven"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    prompts, report = read_prompts(f)
    assert [(p.text, p.seed, p.negative_prompt) for p in prompts] == [
        ("a cat", 7, None),
        ("a dog", 2, "blurry"),
    ]
    assert report.duplicate == [2] and report.bad_json == [4, 5, 6]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.txt", None, "does not exist"),
        ("empty.txt", b"", "no usable prompt"),
        ("blank.txt", b"\n \n\n", "no usable prompt"),
        ("prompts.csv", b"a,b\n", "must end in .txt or .jsonl"),
    ],
)
def test_unusable_prompt_files_are_one_clear_error(
    tmp_path: Path, name: str, content: bytes | None, message: str
) -> None:
    f = tmp_path / name
    if content is not None:
        f.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        read_prompts(f)
