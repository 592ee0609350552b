"""What eval reports: a column per sampler (student, teacher, baselines) with its figures, and
the result as the markdown table, the console table, notes and JSON (eval.md, eval.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from wandistill.eval import viewer

PSNR_CAP = 100.0
"""PSNR of identical latents is infinite; capped so means and JSON stay finite."""


MIN_RECORDS = 8
"""Fewer evaluated records than this and a mean MSE (and R_K) is mostly the luck of the draw:
eval warns (`few_records`)."""


@dataclass(slots=True)
class Column:
    """One way of sampling the held-out records, and how close it lands to teacher@N."""

    name: str
    role: str
    """noise | reference | teacher | student | baseline"""
    steps: int
    forwards_per_sample: int
    seconds_per_sample: float | None
    """None: nothing sampled (noise) or taken from the cache (teacher@N)."""
    latent_mse: float = 0.0
    latent_psnr: float = PSNR_CAP
    ratio: float | None = None
    """latent_mse / latent_mse of teacher@K (None without --teacher)."""
    image_psnr: float | None = None
    equivalent_steps: float | None = None
    """Where latent_mse sits on the teacher's step curve (students, baselines; --teacher)."""
    equivalent: str | None = None
    """The same in words: 'teacher@6.4', '< teacher@2', '> teacher@16'."""
    viewer: viewer.Score | None = None
    """What its samples show against their prompts (`eval/viewer.py`): shares of all four
    attributes right, each attribute, clear shapes, and the spread ratio to teacher@N. None
    unless every prompt is in the trained teacher's grammar."""


@dataclass(slots=True)
class EvalResult:
    records: int
    num_inference_steps: int
    """K: the steps the student sampled with."""
    teacher_steps: int
    """N: the steps of the cached teacher trajectories."""
    columns: list[Column]
    step_loss: float
    """The student's output-matching loss at the recorded (x_t, t): a step-imitation
    diagnostic (a K-step student is not trained for it)."""
    r_k: float | None = None
    """MSE(student@K, teacher@N) / MSE(teacher@K, teacher@N); None without --teacher."""
    baseline_r_k: float | None = None
    teacher_curve: dict[str, float] = field(default_factory=dict)
    """Teacher steps (a string: JSON keys) -> the teacher's MSE vs teacher@N from the same noise
    (`equivalent.curve_steps`; empty without --teacher)."""
    view: str = "latents"
    per_record: list[dict[str, Any]] = field(default_factory=list)
    grid: str | None = None
    warnings: list[str] = field(default_factory=list)
    """What makes these figures less meaningful (too few records), also in the table."""

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    @property
    def student(self) -> Column:
        return next(c for c in self.columns if c.role == "student")

    @property
    def latent_mse(self) -> float:
        return self.student.latent_mse

    @property
    def latent_psnr(self) -> float:
        return self.student.latent_psnr

    @property
    def noise_mse(self) -> float:
        return self.column("noise").latent_mse

    @property
    def image_psnr(self) -> float | None:
        return self.student.image_psnr

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"latent_mse": self.latent_mse, "latent_psnr": self.latent_psnr}

    def rows(self) -> list[list[str]]:
        """The header, then one row per column (what eval.md and the terminal table show)."""
        k, n = self.num_inference_steps, self.teacher_steps
        head = [
            "column",
            "steps",
            "forwards/sample",
            "wall s/sample",
            f"latent MSE vs teacher@{n}",
            "latent PSNR (dB)",
            f"MSE / MSE(teacher@{k})",
        ]
        images = any(c.image_psnr is not None for c in self.columns)
        if images:
            head.append("image PSNR (dB)")
        if self.teacher_curve:
            head.append("~ teacher steps")
        rows = [head]
        for c in self.columns:
            row = [
                c.name,
                str(c.steps),
                str(c.forwards_per_sample),
                _seconds(c),
                f"{c.latent_mse:.5f}",
                f"{c.latent_psnr:.2f}",
                "-" if c.ratio is None else f"{c.ratio:.3f}",
            ]
            if images:
                row.append("-" if c.image_psnr is None else f"{c.image_psnr:.2f}")
            if self.teacher_curve:
                row.append(c.equivalent or "-")
            rows.append(row)
        return rows

    def notes(self) -> list[str]:
        """What the table says, in sentences: record count, R_K, the baseline, warnings."""
        k, n = self.num_inference_steps, self.teacher_steps
        lines = [f"{self.records} held-out records, each from its own cached noise."]
        if self.r_k is not None:
            verdict = "better than" if self.r_k < 1 else "no better than"
            lines.append(
                f"R_{k} = MSE(student@{k}, teacher@{n}) / MSE(teacher@{k}, teacher@{n}) = "
                f"{self.r_k:.3f}: in {k} steps the student lands {verdict} the teacher does."
            )
        if self.teacher_curve:
            lines.append(
                f"student@{k} ~ {self.student.equivalent} on the teacher's own curve (MSE vs "
                f"teacher@{n} at each step count: "
                + ", ".join(f"@{s} {m:.5f}" for s, m in self.teacher_curve.items())
                + "; interpolated in log MSE)."
            )
        elif k >= n:
            lines.append(
                f"R_{k} is not defined: at K = {k} >= N = {n} the teacher@{k} column is the "
                f"reference itself (train the student for fewer steps than the teacher's)."
            )
        if self.baseline_r_k is not None:
            lines.append(
                f"The step-imitating baseline at {k} steps: ratio {self.baseline_r_k:.3f}."
            )
        lines.append(f"Student output-matching loss at the recorded steps: {self.step_loss:.5f}.")
        lines.extend(f"Warning: {w}" for w in self.warnings)
        return lines

    def viewer_rows(self) -> list[list[str]]:
        """What a viewer sees, per column (header first); [] when no column was judged."""
        scores = [(c.name, c.viewer) for c in self.columns]
        return viewer.table_rows(scores, self.teacher_steps)

    def table(self) -> str:
        """eval.md: one row per column (a markdown table), then what R_K says, then what a
        viewer sees (a second table) where the prompts are the trained teacher's."""
        lines = _markdown(self.rows())
        if seen := self.viewer_rows():
            lines += ["", *_markdown(seen), "", viewer.LEGEND]
        return "\n".join([*lines, "", *self.notes()])

    def console_table(self) -> Any:
        """The same for a terminal: a rich table whose cells wrap to the width it is given."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        k, n = self.num_inference_steps, self.teacher_steps
        _, *rows = self.rows()
        short = ["column", "steps", "fwd", "s/sample", f"MSE vs teacher@{n}", "PSNR dB", "ratio"]
        table = Table(*short, show_lines=False)
        if any(c.image_psnr is not None for c in self.columns):
            table.add_column("image PSNR")
        if self.teacher_curve:
            table.add_column("~ teacher")
        table.columns[0].no_wrap = True  # the column names are what a reader looks for
        for row in rows:
            if self.teacher_curve:  # '@5.5' under '~ teacher': 'teacher@5.5' is cut at 80 columns
                row[-1] = row[-1].replace("teacher@", "@")
            table.add_row(*row)
        legend = (
            f"fwd: transformer forwards per sample; ratio: MSE / MSE(teacher@{k}); "
            "PSNR of latents (images where a VAE decoded them)."
        )
        parts: list[Any] = [table, Text(legend)]
        if seen := self.viewer_rows():
            head, *rows = seen
            second = Table(*head, show_lines=False)
            second.columns[0].no_wrap = True
            for row in rows:
                second.add_row(*row)
            parts += [second, Text(viewer.LEGEND)]
        return Group(*parts, *(Text(line) for line in self.notes()))


def _markdown(rows: list[list[str]]) -> list[str]:
    rows = [rows[0], ["---"] * len(rows[0]), *rows[1:]]
    return ["| " + " | ".join(r) + " |" for r in rows]


def _seconds(c: Column) -> str:
    if c.seconds_per_sample is not None:
        return f"{c.seconds_per_sample:.4f}"
    return "cached" if c.role == "reference" else "-"
