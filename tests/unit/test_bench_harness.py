"""tests/bench/harness.py: the pieces benches share (results on disk, memory peaks, ratios)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from harness import Peak, Report, bootstrap_interval, markdown_table, paired_ratios  # noqa: E402


def test_report_keeps_sections_written_by_another_writer_and_renders_skip_lines(
    tmp_path: Path,
) -> None:
    Report(tmp_path).update({"command": "bench --out x"}, a={"status": "done", "rows": [{"x": 1}]})
    Report(tmp_path).update(b={"status": "skipped", "skipped": ["needs CUDA (none visible)"]})
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["command"] == "bench --out x"
    assert data["sections"]["a"]["rows"] == [{"x": 1}]
    assert data["sections"]["b"]["status"] == "skipped"
    md = (tmp_path / "results.md").read_text()
    assert "## a" in md and "| x |" in md and "| 1 |" in md
    assert "## b" in md and "- skipped: needs CUDA (none visible)" in md
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic writes left no temp file


def test_markdown_table_takes_the_union_of_the_rows_keys() -> None:
    lines = markdown_table([{"leg": "a", "s": 1.23456}, {"leg": "b", "error": "x|y"}])
    assert lines[0] == "| leg | s | error |"
    assert lines[2] == "| a | 1.235 | - |"
    assert lines[3] == "| b | - | x\\|y |"


def test_peak_sees_memory_held_when_the_block_ends() -> None:
    with Peak() as peak:
        held = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, every page touched
    assert peak.above()["RssAnon"] >= 48 << 20
    assert held[-1] == 1


def test_paired_ratios_and_their_interval() -> None:
    assert paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    assert bootstrap_interval([1.1, 1.1, 1.1]) == (1.1, 1.1)
    lo, hi = bootstrap_interval([1.0, 1.1, 1.2, 1.3])
    assert 1.0 <= lo <= hi <= 1.3


def test_write_json_puts_the_environment_and_the_peak_rss_beside_the_figures(
    tmp_path: Path,
) -> None:
    from harness import max_rss_bytes, write_json

    write_json(tmp_path / "r.json", {"ratios": {"a/b": 1.5}})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ratios"] == {"a/b": 1.5}
    env = data["environment"]
    assert env["cpus"] >= 1 and env["torch"] and env["cpu_model"]
    assert 0 < data["max_rss_bytes"] <= max_rss_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left


def test_own_cpu_seconds_counts_this_process_and_children_only_the_children() -> None:
    from harness import busy_cpu_seconds, own_cpu_seconds

    own, kids, busy = own_cpu_seconds(), own_cpu_seconds(children_only=True), busy_cpu_seconds()
    x = np.random.default_rng(0).random((400, 400))
    for _ in range(20):
        x = x @ x / 400
    assert own_cpu_seconds() > own
    assert own_cpu_seconds(children_only=True) == kids  # no child ran
    assert busy_cpu_seconds() >= busy


def test_machine_line_names_the_cpu_torch_and_the_commit() -> None:
    from harness import environment, machine_line

    line, env = machine_line(), environment()
    assert line.startswith("machine: ")
    assert env["cpu_model"] in line and f"torch {env['torch']}" in line
    assert f"commit {env['commit']}" in line


def test_every_bench_script_writes_its_figures_as_json() -> None:
    """Each bench takes `--json FILE` (through `write_json`) or `--out DIR` (through `Report`),
    so no bench's figures exist only as printed text (issue 26, item 8)."""
    bench = Path(__file__).parents[1] / "bench"
    scripts = [p for p in sorted(bench.glob("*.py")) if "__main__" in p.read_text()]
    assert {"precompute.py", "precompute_write.py", "placement_memory.py"} <= {
        p.name for p in scripts
    }
    for script in scripts:
        text = script.read_text()
        to_json = "--json" in text and "write_json(" in text
        to_report = '"--out"' in text and "Report(" in text
        assert to_json or to_report, f"{script.name} writes no JSON"
