"""The train and student rooms never import the teacher (nor diffusers pipelines)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "wandistill"
FORBIDDEN = ("wandistill.teacher", "wandistill.precompute", "diffusers.pipelines")


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.append("<relative import>")
    return names


@pytest.mark.parametrize("room", ["train", "student"])
def test_no_module_of_the_room_imports_the_teacher(room: str) -> None:
    files = sorted((PACKAGE / room).rglob("*.py"))
    assert files
    for f in files:
        bad = [n for n in _imports(f) if n.startswith(FORBIDDEN) or n == "<relative import>"]
        assert not bad, f"{f.relative_to(PACKAGE.parent)} imports {bad}"
        assert "from wandistill import teacher" not in f.read_text(encoding="utf-8")


def test_importing_train_and_building_a_student_loads_no_teacher_module() -> None:
    code = """
import json, sys
import wandistill.train
from wandistill.config import StudentConfig
from wandistill.student import build_student, resolve_student_config
cfg = resolve_student_config(
    StudentConfig(num_layers=1, num_attention_heads=2, attention_head_dim=8, ffn_dim=8),
    None, {"text_dim": 8, "latent_channels": 4})
build_student(cfg, seed=0)
print(json.dumps(sorted(sys.modules)))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "diffusers.models.transformers.transformer_wan" in loaded
    assert [m for m in loaded if m.startswith(FORBIDDEN)] == []
