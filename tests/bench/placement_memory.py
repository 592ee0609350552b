"""Peak CPU memory of each placement that runs on a CPU, against `wandistill plan`'s estimate.

    python tests/bench/placement_memory.py --teacher tiny
    python tests/bench/placement_memory.py --teacher wan1.3b [--work DIR] [--json FILE]

`wan1.3b` is a Wan2.1-1.3B-shaped teacher: the real transformer config
(wandistill/teacher/configs/wan2.1-1.3b), random bf16 weights built on the meta device and
materialised here (1.42B parameters, 2.8 GB of safetensors), plus the tiny text encoder and VAE;
only the denoise phase (the transformer) is measured. Each placement runs in a fresh process:
load the transformer, one forward at the sizes below, unload. A sampler thread reads
/proc/self/status every 5 ms; reported are the peaks above the process's RSS after imports,
split into anonymous memory (RssAnon: what the process allocated) and all of it (VmRSS: also the
memory-mapped weight files it touched, page cache the kernel may drop under pressure). The
library modules a load imports are imported before the baseline; the whole process's peak is
shown too, against which the plan adds a fixed 2 GiB allowance.

The plan's estimate is the strategy's `cpu` need for the denoise phase minus the fixed 2 GiB
process allowance (weights + activations), and for disk-offload also the execution device's
share. model-offload and group-offload are measured with the CPU as execution device (their
hooks only); the plan does not offer them without a GPU, so they have no estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from harness import machine_line, write_json  # tests/bench, next to this script

ROOT = Path(__file__).parents[2]
GiB = 1 << 30
SIZES = {"height": 128, "width": 128, "num_frames": 5}  # 2 latent frames x 8 x 8 = 128 tokens;
# --size 256x256x9: 3 x 16 x 16 = 768 tokens
PLACEMENTS = [
    "cpu",
    "disk-offload",
    "device-map-cpu",
    "model-offload@cpu",
    "group-offload@cpu",
    "group-offload-leaf@cpu",
]


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class Peak(threading.Thread):
    """Samples /proc/self/status until stopped; keeps the maxima."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _status()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            for k, v in _status().items():
                self.peak[k] = max(self.peak[k], v)


def _placement(label: str, work: Path):  # noqa: ANN202
    from wandistill.placement.parse import parse_placement
    from wandistill.placement.strategies import GroupOffload, ModelOffload

    if label == "device-map-cpu":
        path = work / "cpu-map.json"
        path.write_text(json.dumps({"transformer": {"": "cpu"}}))
        return parse_placement(str(path))
    return {
        "model-offload@cpu": ModelOffload(device="cpu"),
        "group-offload@cpu": GroupOffload(device="cpu"),
        "group-offload-leaf@cpu": GroupOffload(device="cpu", level="leaf_level"),
    }.get(label) or parse_placement(label)


def child(label: str, teacher: Path, work: Path) -> None:
    """One placement in this fresh process: load, one forward, report peaks as JSON."""
    import torch

    from wandistill.placement import load as pl
    from wandistill.teacher.folder import TeacherFolder

    folder = TeacherFolder.open(teacher)
    cfg = folder.raw_config("transformer")
    g = torch.Generator().manual_seed(0)
    frames = (SIZES["num_frames"] - 1) // 4 + 1
    x = torch.randn(1, 16, frames, SIZES["height"] // 8, SIZES["width"] // 8, generator=g)
    text = torch.randn(1, 512, cfg["text_dim"], generator=g)
    import accelerate.hooks  # noqa: F401  the libraries' code is not the placement's memory
    import diffusers.hooks  # noqa: F401
    from diffusers import WanTransformer3DModel  # noqa: F401

    base = _status()
    peak = Peak()
    peak.start()
    t0 = time.perf_counter()
    model = pl.load_component(
        folder,
        "transformer",
        dtype=torch.bfloat16,
        placement=_placement(label, work),
        offload_dir=work / "offload",
    )
    t1 = time.perf_counter()
    device = pl.execution_device(model)
    with torch.no_grad():
        model(
            hidden_states=x.to(device, torch.bfloat16),
            timestep=torch.tensor([500.0], device=device),
            encoder_hidden_states=text.to(device, torch.bfloat16),
            return_dict=False,
        )
    t2 = time.perf_counter()
    peak.done.set()
    peak.join()
    pl.unload(model)
    print(
        json.dumps(
            {
                "total": peak.peak["VmRSS"],
                "anon": peak.peak["RssAnon"] - base["RssAnon"],
                "rss": peak.peak["VmRSS"] - base["VmRSS"],
                "load_s": t1 - t0,
                "forward_s": t2 - t1,
            }
        )
    )


def build_teacher(kind: str, work: Path) -> Path:
    """The tiny teacher, or one with a Wan2.1-1.3B-shaped random transformer (bf16)."""
    from wandistill.teacher.tiny import make_tiny_teacher

    path = work / kind
    if (path / "model_index.json").exists():
        return path
    make_tiny_teacher(path)
    if kind == "tiny":
        return path
    import shutil

    import torch
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    config = json.loads(
        (ROOT / "wandistill/teacher/configs/wan2.1-1.3b/transformer/config.json").read_text()
    )
    with init_empty_weights():
        model = WanTransformer3DModel.from_config(config)
    model.to(torch.bfloat16).to_empty(device="cpu")  # 2.8 GB, never a float32 copy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.bfloat16) * 0.02)
    # the RoPE tables are computed buffers (not saved): rebuild them as the constructor does
    model.rope = type(model.rope)(
        model.config.attention_head_dim, model.config.patch_size, model.config.rope_max_seq_len
    )
    shutil.rmtree(path / "transformer")
    model.save_pretrained(path / "transformer", safe_serialization=True)
    return path


def plan_estimates(teacher: Path) -> dict[str, int]:
    """Plan's CPU need (minus the process allowance) for the denoise phase, per strategy."""
    import torch

    from wandistill.placement.devices import CPU_OVERHEAD
    from wandistill.placement.estimate import SamplerSizes
    from wandistill.placement.inventory import Inventory
    from wandistill.placement.plan import make_plan

    sizes = SamplerSizes(**SIZES, batch_size=1, max_sequence_length=512)
    plan = make_plan(
        teacher,
        dtype=torch.bfloat16,
        sizes=sizes,
        inventory=Inventory.cpu_only(cpu_gib=20, disk_gib=100),
        components=("transformer",),
    )
    out = {}
    for s in plan.strategies:
        need = s.needs["denoise"]
        out[s.strategy] = need["cpu"] - CPU_OVERHEAD
    out["device-map-cpu"] = out["cpu"]  # the whole component mapped to "cpu"
    out["activations"] = plan.phases[0].activation_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", choices=["tiny", "wan1.3b"], default="tiny")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--size", default="128x128x5", help="HEIGHTxWIDTHxFRAMES")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    h, w, f = (int(x) for x in args.size.split("x"))
    SIZES.update(height=h, width=w, num_frames=f)
    work = args.work or Path(tempfile.mkdtemp(prefix="placement-memory-"))
    if args.child:
        child(args.child, work / args.teacher, work)
        return
    teacher = build_teacher(args.teacher, work)
    estimates = plan_estimates(teacher)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    act = _size(estimates["activations"])
    print(f"# {' '.join(sys.argv)}\n# {machine_line()}")
    print(f"teacher {args.teacher}, bf16, {SIZES}, plan's activation estimate {act}, work {work}\n")
    print(
        "| placement | plan: weights + act. | peak anon | /plan | peak RSS | /plan "
        "| process peak RSS (plan: +2 GiB) | load s | fwd s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for label in PLACEMENTS:
        cmd = [sys.executable, __file__, "--teacher", args.teacher, "--work", str(work)]
        cmd += ["--size", args.size]
        done = subprocess.run(
            [*cmd, "--child", label], env=env, capture_output=True, text=True, check=True
        )
        r = json.loads(done.stdout.strip().splitlines()[-1])
        est = estimates.get(label)
        print(
            f"| {label} | {_size(est)} | {_size(r['anon'])} | {_ratio(r['anon'], est)} | "
            f"{_size(r['rss'])} | {_ratio(r['rss'], est)} | {_size(r['total'])} | "
            f"{r['load_s']:.1f} | "
            f"{r['forward_s']:.2f} |"
        )
        rows[label] = {**r, "plan_estimate": est}  # bytes; the estimate None: the plan has none
    if args.json:
        figures = {"teacher": args.teacher, "sizes": SIZES, "estimates": estimates}
        write_json(args.json, {"command": " ".join(sys.argv), **figures, "placements": rows})


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.3f} GiB" if n >= GiB // 100 else f"{n / (1 << 20):.1f} MiB"


def _ratio(measured: int, estimate: int | None) -> str:
    return f"{measured / estimate:.2f}" if estimate else "-"


if __name__ == "__main__":
    main()
