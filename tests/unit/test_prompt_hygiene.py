"""Prompt files from editors and scripts: a byte-order mark is not text, a line of control
characters is no prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wandistill.errors import UsageError
from wandistill.precompute.prompts import PromptReport, read_prompts

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("p.txt", BOM + b"a cat\na dog\n"),
        ("p.txt", BOM + b"a cat\r\na dog\r\n"),  # Notepad: BOM and CRLF
        ("p.jsonl", BOM + b'{"prompt": "a cat"}\n{"prompt": "a dog"}\n'),
    ],
)
def test_a_utf8_bom_is_not_part_of_the_first_prompt(
    tmp_path: Path, name: str, content: bytes
) -> None:
    f = tmp_path / name
    f.write_bytes(content)
    prompts, report = read_prompts(f)
    assert [p.text for p in prompts] == ["a cat", "a dog"]
    assert report.bad_json == [] and report.control == []


def test_a_bom_later_in_the_file_is_left_to_the_prompt(tmp_path: Path) -> None:
    """Only a leading BOM is an encoding mark; a U+FEFF inside the file is the user's text."""
    f = tmp_path / "p.txt"
    f.write_bytes(b"a cat\n" + BOM + b"a dog\n")
    prompts, _ = read_prompts(f)
    assert [p.text for p in prompts] == ["a cat", "\ufeffa dog"]


def test_lines_of_only_control_characters_are_reported_like_other_bad_lines(
    tmp_path: Path,
) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(b"a cat\n\x00\n\x00\x00 \x00\n\x1b[0m\x07\n\x7f\na\x00dog\n\t\x0b\x0c\n")
    prompts, report = read_prompts(f)
    # Text around control characters is still text: "a<NUL>dog", and "[0m" of an escape code.
    assert [p.text for p in prompts] == ["a cat", "\x1b[0m\x07", "a\x00dog"]
    assert report.control == [2, 3, 5] and report.empty == [7]
    summary = " ".join(report.summary())
    assert "3 lines of only control characters skipped: lines 2, 3, 5" in summary
    assert PromptReport(**json.loads(json.dumps(report.to_json()))).control == [2, 3, 5]


def test_jsonl_prompts_of_only_control_characters_are_reported(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "a cat"}, {"prompt": "\u0000"}, {"prompt": " \u0001\u0002 "}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts, report = read_prompts(f)
    assert [p.text for p in prompts] == ["a cat"] and report.control == [2, 3]


def test_a_file_of_only_control_characters_has_no_usable_prompt(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_bytes(BOM + b"\x00\n\x01\x02\n")
    with pytest.raises(UsageError, match="no usable prompt .* 2 control characters only"):
        read_prompts(f)
