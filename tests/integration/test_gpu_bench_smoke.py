"""`tests/bench/gpu.py --smoke`: the GPU bench's code paths at toy sizes on the CPU (issue 30).

The GPU command is run by whoever is lent a device, once, with minutes to spare; this test is
what makes it known to work before then. No timing is asserted (the runner is shared).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zygote import Zygote

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "tests" / "bench" / "gpu.py"
SECTIONS = ("setup", "placements", "speed", "oom", "train", "storage")


def _gpu_module() -> Any:
    """tests/bench/gpu.py as a module (it imports no torch at the top)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_gpu_run_isolates_each_section_and_the_smoke_shares_one_process() -> None:
    gpu = _gpu_module()
    names = ["setup", *gpu.SECTIONS]
    assert gpu.groups(names, "section") == [[n] for n in names]
    assert gpu.groups(names, "run") == [names]
    assert sum(gpu.BUDGETS_S.values()) <= 8 * 60  # the 8 minutes on one H100


def test_a_section_gets_its_budget_or_the_run_budget_line_when_too_little_is_left() -> None:
    gpu = _gpu_module()
    want = gpu.BUDGETS_S["train"]
    assert gpu.section_budget("train", False, 1000.0) == (want, None)
    assert gpu.section_budget("train", False, want * 0.7) == (want * 0.7, None)
    budget, why = gpu.section_budget("train", False, want * 0.5)
    assert budget == 0 and why.startswith("run budget: ") and f"needs {want} s" in why
    smoke, _ = gpu.section_budget("train", True, 1e6)
    assert smoke == want * gpu.SMOKE_SLACK


def _bench(zygote: Zygote, out: Path, *args: str, timeout: float) -> tuple[dict[str, Any], str]:
    """The bench as a fork of the session's zygote (tests/zygote.py); so are the processes it
    starts with `sys.executable`."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CUDA_VISIBLE_DEVICES": "",  # the CPU paths, even on a runner with a GPU
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [zygote.python, str(BENCH), "--out", str(out), "--smoke", *args],
        cwd=ROOT,
        env=zygote.env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    return data, (out / "results.md").read_text()


def _figures(row: dict[str, Any]) -> list[float]:
    return [v for v in row.values() if isinstance(v, int | float) and not isinstance(v, bool)]


def _rows(data: dict[str, Any], section: str, key: str) -> dict[str, dict[str, Any]]:
    return {r[key]: r for r in data["sections"][section]["rows"] if key in r}


@pytest.mark.slow
def test_smoke_run_writes_every_section_with_figures_or_the_reason_it_skipped(
    zygote: Zygote, tmp_path: Path
) -> None:
    # --budget 300 is 1200 s in smoke mode (x4): the run ends by itself before the timeout
    data, md = _bench(zygote, tmp_path, "--budget", "300", timeout=1500)
    assert data["mode"] == "smoke" and data["environment"]["gpus"] == []
    for name in SECTIONS:
        section = data["sections"][name]
        assert section["status"] in ("done", "skipped"), (name, section)
        with_figures = [r for r in section["rows"] if _figures(r) and "error" not in r]
        assert with_figures or section["skipped"], (name, section)
        assert all(isinstance(why, str) and len(why) > 10 for why in section["skipped"])
        assert f"## {name}" in md

    assert len({data["sections"][name]["pid"] for name in SECTIONS}) == 1  # one child in all

    placed = _rows(data, "placements", "placement")
    assert {"cpu", "disk-offload", "device-map.json", "auto"} <= set(placed)
    for row in placed.values():  # one device, one dtype: placements must agree bit for bit
        assert row["records"] == 4 and row["records_per_s"] > 0
        assert row["max_abs_diff"] == 0.0 and row["diff_vs"] == "cpu"
    skipped = " ".join(data["sections"]["placements"]["skipped"])
    assert "model-offload: needs CUDA" in skipped and "group-offload" in skipped

    speed = _rows(data, "speed", "leg")
    assert speed["naive"]["prompts_per_s"] > 0 and speed["precompute batch 2"]["seconds"] > 0
    assert data["sections"]["speed"]["summary"]["precompute_vs_naive"] > 0
    assert any(k.startswith("torch.compile") for k in speed)
    assert any("pinned" in why for why in data["sections"]["speed"]["skipped"])

    oom = " ".join(data["sections"]["oom"]["skipped"])
    assert "needs CUDA" in oom and "--dry-run: exit 0" in oom

    trained = _rows(data, "train", "leg")
    for label in ("fp32", "bf16 autocast + checkpointing"):
        assert trained[label]["exit"] == 0 and trained[label]["steps_per_s"] > 0
        assert 0 <= trained[label]["data_wait"] <= 1
        assert trained[label]["host_rss_above_start_GiB"] >= 0  # sampled around the leg
        assert "peak_rss_GiB" not in trained[label]  # the process's lifetime peak: not the leg's
    for label in ("FSDP2, bf16 + checkpointing", "LoRA rank 16 on the teacher, bf16"):
        said = [why for why in data["sections"]["train"]["skipped"] if why.startswith(label)]
        assert label in trained or said, label  # run where the config takes the key

    benches = _rows(data, "storage", "bench")
    storage_skips = data["sections"]["storage"]["skipped"]
    for name in ("cache_io", "precompute_write"):
        assert name in benches or any(why.startswith(name) for why in storage_skips)
        if name in benches:
            assert benches[name]["exit"] == 0, benches[name]
    if "cache_io" in benches:
        assert math.isfinite(benches["cache_io"]["webdataset.read_vs_raw"])
    if "precompute_write" in benches:  # its verdict, read from its --json
        assert "overhead_vs_null_sink" in benches["precompute_write"]


@pytest.mark.slow
def test_a_run_budget_too_small_for_a_section_skips_it_with_the_reason(
    zygote: Zygote, tmp_path: Path
) -> None:
    data, md = _bench(zygote, tmp_path, "--sections", "oom,storage", "--budget", "1", timeout=300)
    for name in ("setup", "oom", "storage"):
        section = data["sections"][name]
        assert section["status"] == "skipped"
        assert section["skipped"][0].startswith("run budget:"), section
        assert "skipped: run budget:" in md
    assert "placements" not in data["sections"]


@pytest.mark.slow
def test_isolated_sections_each_run_in_a_process_of_their_own(
    zygote: Zygote, tmp_path: Path
) -> None:
    # the GPU run's default, at smoke sizes: setup then oom, each in its own child
    data, md = _bench(zygote, tmp_path, "--sections", "oom", "--isolate", "section", timeout=900)
    setup, oom = data["sections"]["setup"], data["sections"]["oom"]
    assert setup["status"] == "done" and setup["rows"][0]["safetensors_GiB"] > 0
    assert "--dry-run: exit 0" in " ".join(oom["skipped"])
    assert setup["pid"] != oom["pid"]
    assert "placements" not in data["sections"] and "## oom" in md
