"""What every bench needs around its legs: the machine, memory peaks, and results on disk.

Why one module: each bench printed its own machine line and sampled memory its own way, so
figures from two benches could not be put side by side (issue 26, item 8). Every bench under
tests/bench prints `machine_line()` (gpu.py and scale.py write `environment()` through
`Report`) and writes its `--json` through `write_json`.

* `environment()`: host, CPU model, cores, RAM, load, versions, git commit, and each visible
  GPU; `machine_line()`: the same as the one line a bench prints above its table;
* `busy_cpu_seconds()` / `own_cpu_seconds()`: the whole machine's CPU time and this process's
  (with its reaped children), so a leg can say how many cores other processes took meanwhile;
* `Peak`: a thread sampling this process's RSS (anonymous and file-backed) and, on CUDA, the
  device's used memory (total - free, which counts the CUDA context the allocator's figures
  leave out), every 5 ms; the maxima above the figures at the start;
* `max_rss_bytes()`: the process's lifetime peak RSS (`ru_maxrss`);
* `paired_ratios` / `bootstrap_interval`: leg / baseline of the same round, so drift between
  rounds cancels, and a 95% interval of their median;
* `Report`: sections of results rewritten as JSON and Markdown (atomically) after every change,
  so a run killed half-way leaves everything it finished; `write_json()`: one bench's figures as
  one JSON file, with the environment and the peak RSS beside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
GiB = 1 << 30
MiB = 1 << 20


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _ram_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    return None


def environment() -> dict[str, Any]:
    """The machine and software a result came from (GPUs only where torch sees CUDA)."""
    import torch

    env: dict[str, Any] = {
        "host": platform.node(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": _ram_bytes(),
        "os": f"{platform.system()} {platform.release()}",
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "commit": _git_commit(),
        "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    for name in ("diffusers", "transformers", "accelerate", "peft"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "total_bytes": torch.cuda.get_device_properties(i).total_memory,
            }
            for i in range(torch.cuda.device_count())
        ]
    else:
        env["gpus"] = []
    return env


def machine_line() -> str:
    """`environment()` as the one `machine:` line a bench prints above its table."""
    env = environment()
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "no GPU"
    ram = "?" if env["ram_bytes"] is None else f"{env['ram_bytes'] / GiB:.1f} GiB"
    return (
        f"machine: {env['host']}, {env['cpu_model']}, {env['cpus']} cpus, {ram}, "
        f"load {env['load_average'][0]}, python {env['python']}, torch {env['torch']} "
        f"({env['torch_threads']} threads), diffusers {env['diffusers']}, "
        f"commit {env['commit']}, {gpus}"
    )


def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has used so far (/proc/stat; nan elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def own_cpu_seconds(children_only: bool = False) -> float:
    """CPU seconds of this process (all threads) and its reaped children; the children alone
    where the work ran in subprocesses. Subtracted from `busy_cpu_seconds()` over a leg, it
    leaves what other processes took meanwhile."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = kids.ru_utime + kids.ru_stime
    if not children_only:
        me = resource.getrusage(resource.RUSAGE_SELF)
        total += me.ru_utime + me.ru_stime
    return total


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process in bytes (empty where /proc is missing)."""
    out: dict[str, int] = {}
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def max_rss_bytes() -> int:
    """Peak RSS of this process over its life (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


class Peak(threading.Thread):
    """`with Peak(gpu) as p: ...`; then `p.above()` gives the peaks above the start.

    `gpu` is a CUDA device index or None. The sampler's own cost is one small read of /proc
    (and one cudaMemGetInfo) every 5 ms, on a thread that holds the GIL only while reading.
    """

    def __init__(self, gpu: int | None = None, every_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.gpu = gpu
        self.every_s = every_s
        self.start_values = self._sample()
        self.peak = dict(self.start_values)
        self.done = threading.Event()

    def _sample(self) -> dict[str, int]:
        values = proc_status()
        if self.gpu is not None:
            import torch

            free, total = torch.cuda.mem_get_info(self.gpu)
            values["gpu_used"] = total - free
        return values

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            for key, value in self._sample().items():
                self.peak[key] = max(self.peak.get(key, 0), value)

    def __enter__(self) -> Peak:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()
        for key, value in self._sample().items():  # a last sample: a short leg may end first
            self.peak[key] = max(self.peak.get(key, 0), value)

    def above(self) -> dict[str, int]:
        """Each figure's peak minus its value when the sampler was created."""
        return {k: v - self.start_values.get(k, 0) for k, v in self.peak.items()}


def paired_ratios(legs: Sequence[float], baselines: Sequence[float]) -> list[float]:
    """Each round's leg / the baseline of the same round (the rounds ran back to back)."""
    return [a / b for a, b in zip(legs, baselines, strict=True)]


def bootstrap_interval(ratios: Sequence[float], n: int = 10_000) -> tuple[float, float]:
    """95% bootstrap interval of the median of `ratios`."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = np.asarray(ratios)
    medians = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    return float(np.quantile(medians, 0.025)), float(np.quantile(medians, 0.975))


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp sibling, fsync, rename: a reader sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A Markdown table over the union of the rows' keys, in first-seen order."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row.get(k)) for k in keys) + " |" for row in rows]
    return lines


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """`data` with `environment` (unless it has one) and this process's `max_rss_bytes`, written
    atomically: a bench's `--json FILE`."""
    out = {"environment": environment(), **data, "max_rss_bytes": max_rss_bytes()}
    atomic_write_text(Path(path), json.dumps(out, indent=1, default=str) + "\n")


class Report:
    """`results.json` + `results.md` under `out`, rewritten whole after every update.

    Several processes may update it one after another (a parent and the child it waits for):
    each update re-reads the JSON first, so nothing another process wrote is lost.
    """

    def __init__(self, out: Path, title: str = "Results") -> None:
        self.out = out
        self.title = title
        self.json_path = out / "results.json"
        self.md_path = out / "results.md"

    def load(self) -> dict[str, Any]:
        if self.json_path.is_file():
            return json.loads(self.json_path.read_text(encoding="utf-8"))
        return {"sections": {}}

    def update(self, top: Mapping[str, Any] | None = None, **sections: Mapping[str, Any]) -> None:
        """Merge top-level keys and whole sections (by name), then write both files."""
        data = self.load()
        data.update(top or {})
        for name, section in sections.items():
            data["sections"][name] = dict(section)
        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.json_path, json.dumps(data, indent=1, default=str) + "\n")
        atomic_write_text(self.md_path, "\n".join(self.markdown(data)) + "\n")

    def markdown(self, data: Mapping[str, Any]) -> list[str]:
        lines = [f"# {self.title}", ""]
        if "command" in data:
            lines += [f"`{data['command']}`", ""]
        env = data.get("environment")
        if env:
            lines += ["Machine: " + "; ".join(f"{k} {_cell(v)}" for k, v in env.items()), ""]
        for name, s in data["sections"].items():
            lines += [f"## {name}", "", f"status: **{s.get('status', '?')}**"]
            if s.get("seconds") is not None:
                lines[-1] += f", {s['seconds']:.1f} s of a {s.get('budget_s', '?')} s budget"
                if s.get("cpu_s") is not None:
                    lines[-1] += f" ({s['cpu_s']:.1f} CPU s)"
            lines.append("")
            lines += [f"- {note}" for note in s.get("notes", [])]
            lines += [f"- skipped: {why}" for why in s.get("skipped", [])]
            if s.get("notes") or s.get("skipped"):
                lines.append("")
            if s.get("rows"):
                lines += [*markdown_table(s["rows"]), ""]
            for key, value in (s.get("summary") or {}).items():
                lines.append(f"- {key}: {_cell(value)}")
            if s.get("summary"):
                lines.append("")
        return lines
