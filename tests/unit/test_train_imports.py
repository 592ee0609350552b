"""Data flows one way (prompts -> teacher -> records -> cache -> batches -> student):
the train and student rooms never import the teacher (nor diffusers pipelines), and the cache
room never imports diffusers."""

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
    """Modules a file imports when it runs (`if TYPE_CHECKING:` blocks never run: skipped)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for stmt in node.body
        for sub in ast.walk(stmt)
    }
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.append("<relative import>")
    return names


#: Modules outside the rooms that the train / student rooms import (directly or through config).
SHARED = [
    "config",
    "placement/devices.py",
    "placement/strategies.py",
    "placement/devicemap.py",
    "placement/parse.py",
    "placement/protocol.py",
    "placement/inventory.py",
    "placement/train_size.py",
    "placement/train_plan.py",
    "placement/__init__.py",
    "runtime/workarounds.py",
    "io/modelfolder.py",
    "runtime/dist.py",
    "runtime/failures.py",
]


@pytest.mark.parametrize("room", ["train", "student", *SHARED])
def test_no_module_of_the_room_imports_the_teacher(room: str) -> None:
    files = sorted((PACKAGE / room).rglob("*.py")) if not room.endswith(".py") else [PACKAGE / room]
    assert files
    for f in files:
        bad = [n for n in _imports(f) if n.startswith(FORBIDDEN) or n == "<relative import>"]
        assert not bad, f"{f.relative_to(PACKAGE.parent)} imports {bad}"
        assert "from wandistill import teacher" not in f.read_text(encoding="utf-8")


def test_no_module_of_the_cache_room_imports_diffusers() -> None:
    files = sorted((PACKAGE / "cache").rglob("*.py"))
    assert files
    for f in files:
        bad = [n for n in _imports(f) if n.split(".")[0] in ("diffusers", "wandistill.teacher")]
        bad += [n for n in _imports(f) if n.startswith(("wandistill.teacher", "wandistill.train"))]
        assert not bad, f"{f.relative_to(PACKAGE.parent)} imports {bad}"


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_cache_room_loads_no_diffusers() -> None:
    code = """
import json, sys
import wandistill.cache, wandistill.cache.reader, wandistill.cache.writer
import wandistill.cache.training, wandistill.cache.manifest
import wandistill.cache.zarr.reader, wandistill.cache.zarr.writer
print(json.dumps(sorted(sys.modules)))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if m.split(".")[0] == "diffusers" or m.startswith(FORBIDDEN)] == []


@pytest.mark.slow  # a fresh interpreter
def test_importing_train_and_building_a_student_loads_no_teacher_module() -> None:
    code = """
import json, sys
import wandistill.train
from wandistill.config import load_recipe
load_recipe("wan2.2-a14b_4x80gb", stage="train")  # the train command parses the whole recipe
from wandistill.config import StudentConfig
from wandistill.student import build_student, resolve_student_config
from wandistill.cache.files import DimsBlock
cfg = resolve_student_config(
    StudentConfig(num_layers=1, num_attention_heads=2, attention_head_dim=8, ffn_dim=8),
    None, DimsBlock(text_dim=8, latent_channels=4))
build_student(cfg, seed=0)
print(json.dumps(sorted(sys.modules)))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "diffusers.models.transformers.transformer_wan" in loaded
    assert [m for m in loaded if m.startswith(FORBIDDEN)] == []
