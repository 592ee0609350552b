"""tests/bench/steps.py: a run folder is reused only for the very settings that made it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from cachefixtures import write_cache

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
import steps as bench  # noqa: E402


def test_a_rerun_with_other_train_steps_trains_a_new_student_and_the_same_settings_reuse_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug: a rerun with more --train-steps reported the old finished student."""
    import wandistill.train as train_pkg

    write_cache(tmp_path / "cache-train", range(4))
    (tmp_path / "train.jsonl").write_text('{"prompt": "a red cat", "seed": 0}\n')
    trained: list[dict[str, Any]] = []

    def fake_train(cfg: Any, resume: bool = False) -> None:  # a finished run, as train leaves it
        trained.append({"out": Path(cfg.out), "steps": cfg.steps})
        Path(cfg.out).mkdir()  # train claims its --out: nothing of the bench's may be in it
        (Path(cfg.out) / "sampling.json").write_text("{}")

    monkeypatch.setattr(train_pkg, "run", fake_train)
    teacher = tmp_path / "teacher"
    extra = ["student.num_inference_steps=4", *bench.OBJECTIVES["unroll"]]
    short = bench.train_one(tmp_path, "k4-unroll", teacher, extra, ["train.steps=400"])
    again = bench.train_one(tmp_path, "k4-unroll", teacher, extra, ["train.steps=400"])
    longer = bench.train_one(tmp_path, "k4-unroll", teacher, extra, ["train.steps=2000"])
    assert again == short != longer
    assert [(t["out"], t["steps"]) for t in trained] == [(short, 400), (longer, 2000)]
    kept = json.loads(longer.with_name(longer.name + ".json").read_text())
    assert kept["train"]["steps"] == 2000 and "out" not in kept["train"]
    # another training cache (more trajectories per prompt) is another run too
    (tmp_path / "train.jsonl").write_text('{"prompt": "a red cat", "seed": 1}\n')
    other = bench.train_one(tmp_path, "k4-unroll", teacher, extra, ["train.steps=400"])
    assert other not in (short, longer) and len(trained) == 3


def test_the_table_reports_equivalent_steps_viewer_accuracy_and_spread() -> None:
    def col(name: str, role: str, mse: float, acc: float | None, **more: Any) -> dict[str, Any]:
        view = None if acc is None else {"all": acc, "spread_ratio": 0.9}
        return {"name": name, "role": role, "latent_mse": mse, "viewer": view, **more}

    result = {
        "num_inference_steps": 4,
        "teacher_steps": 16,
        "r_k": 0.4,
        "baseline_r_k": 1.2,
        "columns": [
            col("teacher@16", "reference", 0.0, 0.93),
            col("teacher@4", "teacher", 0.03, 0.8),
            col("student@4", "student", 0.012, 0.85, equivalent="teacher@6"),
        ],
    }
    (row,) = bench.table({"k4-perflow": result})[2:]
    assert row == (
        "| 4 | perflow | 0.400 | 1.200 | 0.0120 | 0.0300 | teacher@6 | 0.85 / 0.80 / 0.93 | 0.90 |"
    )


def test_the_gap_table_compares_each_students_error_on_trained_and_held_out_pairs() -> None:
    def result(k: int, student_mse: float) -> dict[str, Any]:
        columns = [{"name": f"student@{k}", "role": "student", "latent_mse": student_mse}]
        return {"num_inference_steps": k, "columns": columns}

    held_out = {"k4-perflow": result(4, 0.006), "k2-unroll": result(2, 0.009)}
    seen = {"k4-perflow": result(4, 0.002)}  # k2-unroll was not scored on trained pairs
    assert bench.gap_table(held_out, seen)[2:] == ["| 4 | perflow | 0.0020 | 0.0060 | 3.00 |"]


def test_a_half_depth_student_takes_every_other_teacher_block() -> None:
    assert bench.depth_sets("full", 4) == []
    assert bench.depth_sets("half", 2) == [
        "student.num_layers=1",
        "student.init_from_teacher.blocks=[0]",
    ]
    assert bench.depth_sets("half", 4) == [
        "student.num_layers=2",
        "student.init_from_teacher.blocks=[0, 2]",
    ]


def test_every_objective_sets_every_few_step_weight_so_the_recipes_own_stays_out() -> None:
    for name, sets in bench.OBJECTIVES.items():
        assert [s.split("=")[0] for s in sets] == [f"loss.{w}" for w in bench.WEIGHTS], name
    assert "loss.perflow=0.0" in bench.OBJECTIVES["unroll"]
    assert "loss.unroll=0.0" in bench.OBJECTIVES["perflow"]
