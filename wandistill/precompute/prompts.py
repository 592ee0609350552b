"""Prompt files: `.txt` (one prompt per line) or `.jsonl` ({"prompt", "seed"?, "negative_prompt"?}).

Bad lines never stop a 100k-prompt run: empty lines, duplicates (same prompt and seed), invalid
UTF-8, malformed JSON and prompts of nothing but control characters (NUL, escapes) are skipped and
counted in a report that names their line numbers. A UTF-8 byte-order mark (editors on Windows
write one) is not part of the first prompt. Only a missing file, or a file with no usable prompt
at all, is an error.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wandistill.checks.bounds import PROMPT_SEED
from wandistill.errors import UsageError


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    seed: int
    line: int
    """1-based line number in the prompt file (stable identity for reports)."""
    negative_prompt: str | None = None
    """This prompt's own negative prompt; None uses the recipe's."""


@dataclass(slots=True)
class PromptReport:
    path: str
    lines: int = 0
    kept: int = 0
    empty: list[int] = field(default_factory=list)
    duplicate: list[int] = field(default_factory=list)
    bad_utf8: list[int] = field(default_factory=list)
    bad_json: list[int] = field(default_factory=list)
    control: list[int] = field(default_factory=list)
    """Lines whose prompt is empty once control characters (NUL included) are removed."""
    truncated: list[int] = field(default_factory=list)
    """Filled by the encode phase: prompts longer than max_sequence_length tokens."""
    truncated_keys: list[str] = field(default_factory=list)
    """Their record keys: a later run of the same cache (its embeddings gone) keeps them."""

    def summary(self) -> list[str]:
        """Human lines for everything that was not used as written."""
        out = [f"{self.kept} prompts from {self.lines} lines of {self.path}"]
        for label, items in (
            ("empty lines skipped", self.empty),
            ("duplicates (same prompt and seed) skipped", self.duplicate),
            ("lines with invalid UTF-8 skipped", self.bad_utf8),
            ("malformed JSON lines skipped", self.bad_json),
            ("lines of only control characters skipped", self.control),
            ("prompts truncated to max_sequence_length tokens", self.truncated),
        ):
            if items:
                shown = ", ".join(map(str, items[:8]))
                more = f", ... ({len(items)} in all)" if len(items) > 8 else ""
                out.append(f"{len(items)} {label}: lines {shown}{more}")
        return out

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def only_control(text: str) -> bool:
    """True if nothing but control characters and whitespace is left (a NUL-only line)."""
    return not "".join(c for c in text if unicodedata.category(c) != "Cc").strip()


def _parse_jsonl(line: str, lineno: int, base_seed: int) -> Prompt | None:
    obj = json.loads(line)
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        raise ValueError("needs a string 'prompt'")
    seed = obj.get("seed", base_seed + lineno - 1)
    neg = obj.get("negative_prompt")
    if type(seed) is not int or not isinstance(neg, str | None):  # (a bool is not a seed)
        raise ValueError("'seed' must be an integer and 'negative_prompt' a string")
    if problem := PROMPT_SEED.problem("seed", seed):  # negative or beyond 64 bits: torch would
        raise ValueError(problem)  # alias or overflow; a bad line
    text = obj["prompt"].strip()
    return Prompt(text, seed, lineno, neg) if text else None


def _parse_line(
    raw: bytes, lineno: int, jsonl: bool, base_seed: int, report: PromptReport
) -> Prompt | list[int]:
    """One line as a prompt, or the report's list (empty, bad UTF-8, bad JSON, control
    characters only) it belongs to."""
    try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
    except UnicodeDecodeError:
        return report.bad_utf8
    if not line:
        return report.empty
    if only_control(line):
        return report.control
    if not jsonl:
        return Prompt(line, base_seed + lineno - 1, lineno)
    try:
        prompt = _parse_jsonl(line, lineno, base_seed)
    except (json.JSONDecodeError, ValueError):
        return report.bad_json
    if prompt is None:
        return report.empty
    return report.control if only_control(prompt.text) else prompt


def read_prompts(
    path: str | Path, *, base_seed: int = 0, into: Any = None
) -> tuple[list[Prompt], PromptReport]:
    """Parse a prompt file; a prompt without a seed gets `base_seed + (line - 1)`.

    `into`: where the prompts go (anything with `append` and `len`; default a new list), e.g.
    precompute's compact `PromptTable`, so 100k prompts are never 100k objects at once."""
    p, fix = Path(path), "pass --prompts FILE (.txt or .jsonl)"
    if not str(path):
        raise UsageError("no prompt file given", fix=fix)
    if p.is_dir():
        raise UsageError(f"prompt file {str(p)!r} is a directory", fix=fix)
    if not p.is_file():
        raise UsageError(f"prompt file {str(p)!r} does not exist", fix=fix)
    if p.suffix not in (".txt", ".jsonl"):
        raise UsageError(
            f"prompt file {str(p)!r} must end in .txt or .jsonl",
            fix="one prompt per line (.txt) or one JSON object per line (.jsonl)",
        )
    report, jsonl = PromptReport(path=str(p)), p.suffix == ".jsonl"
    prompts = [] if into is None else into
    seen: set[tuple[str, int, str | None] | str] = set()
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as e:
        raise UsageError(
            f"prompt file {str(p)!r} cannot be read ({e.strerror})",
            fix="check its permissions, or pass another --prompts FILE",
        ) from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            report.lines = lineno
            prompt = _parse_line(raw, lineno, jsonl, base_seed, report)
            if isinstance(prompt, list):  # the report's list for this bad line
                prompt.append(lineno)
                continue
            # A .txt seed is implicit (its line), so a repeated line is a duplicate; a .jsonl line
            # with the same prompt and an explicit other seed is another sample.
            # (A .txt line's identity is its text: the string itself, no tuple per line.)
            ident = (prompt.text, prompt.seed, prompt.negative_prompt) if jsonl else prompt.text
            if ident in seen:
                report.duplicate.append(lineno)
                continue
            seen.add(ident)
            prompts.append(prompt)
    report.kept = len(prompts)
    if not prompts:
        raise UsageError(
            f"prompt file {str(p)!r} has no usable prompt ({report.lines} lines: "
            f"{len(report.empty)} empty, {len(report.bad_utf8)} invalid UTF-8, "
            f"{len(report.bad_json)} malformed JSON, {len(report.control)} control characters "
            "only)",
            fix='put one prompt per line (.txt) or {"prompt": ...} per line (.jsonl)',
        )
    return prompts, report
