#!/usr/bin/env python
"""Train memory: per-rank peak RSS of `wandistill train` at 1 and 2 ranks, beside the plan's.

    python tests/bench/train_memory.py                      # >= 100M-parameter student (default)
    python tests/bench/train_memory.py --layers 2 --heads 2 --head-dim 32 --ffn 128 --steps 2
                                                            # a smoke run of the harness
    python tests/bench/train_memory.py --calibrate          # re-measure the activation constants
    python tests/bench/train_memory.py --legs lora --ranks 2 --work /tmp/tm
                                                            # one leg; teacher + cache kept in
                                                            # /tmp/tm and reused next time

One teacher and a small cache (precompute at --height x --width) are built once: the tiny
teacher's components (`build_components`) with its transformer replaced by one of the sizes given
here (default 8 blocks of width 1024, ffn 4096: ~140M parameters, random weights), so the
student's state dominates the RSS. Every leg trains that transformer's config (the recipe's
student sizes are set to the teacher's, as a LoRA student demands): DDP and FSDP2 from random
weights, LoRA on the teacher's transformer itself (`init_from_teacher.path`), so all legs price
one model. Each leg runs `wandistill train` on the CPU (gloo) under `torchrun --nproc_per_node N`;
every rank writes its baseline RSS (torch, wandistill, diffusers and peft imported, before
`train` starts: `child`) and its VmHWM at exit. The figure is peak minus baseline, per rank,
beside the train plan's prediction (`wandistill.placement.train_plan.make_train_plan` for the
same student, choice, cache shape and world size: the `total` of its row; the CPU row carries
no CUDA allowance). Target: within 15%.

Legs: DDP, FSDP2 (`train.parallel = "fsdp"`) and LoRA (`[train.student.lora]`, rank
--lora-rank, DDP) at 1 and 2 ranks, one after another (never two legs at once). Steps/s of
each leg is printed too, from metrics.jsonl's times (log_every=1) between the first and the
last step, so without startup and the final save (one run; noisy on a shared box).
The final checkpoint's file sizes go to --json: the measured size of each rank's optimizer
state and of the LoRA adapter.
CUDA figures cannot be measured here (no GPU); the GPU issue owns them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import machine_line, write_json  # tests/bench, next to this script

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "pipelines" / "tiny.toml"
MiB = 1 << 20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> None:
    """One torchrun rank: `wandistill train` in-process, then baseline and peak RSS to a file.

    The baseline is the process with the libraries train runs on imported (torch, wandistill,
    diffusers' Wan transformer, peft and the transformers they pull in): the plan leaves their
    code and module state to its per-process CPU allowance (`devices.CPU_OVERHEAD`, "torch,
    diffusers, transformers imported") and prices what training allocates. wandistill imports
    diffusers lazily, so they are imported here by name; `baseline_torch` (before them) is
    recorded too, to show the libraries' share."""
    import torch  # noqa: F401

    import wandistill.cli
    import wandistill.train.loop  # noqa: F401

    base_torch = _status("VmRSS")
    import peft  # noqa: F401
    from diffusers import WanTransformer3DModel  # noqa: F401

    base = _status("VmRSS")
    code = 0
    try:
        wandistill.cli.main(json.loads(args.child))
    except SystemExit as e:
        code = int(e.code or 0)
    rank = os.environ.get("RANK", "0")
    out = Path(args.report) / f"rank{rank}.json"
    report = {"baseline": base, "baseline_torch": base_torch, "peak": _status("VmHWM")}
    out.write_text(json.dumps(report | {"exit": code}))


CALIBRATION = [  # (blocks, ffn_dim, checkpointing, bf16): width 512, 1,024 tokens
    (2, 2048, False, False),
    (4, 2048, False, False),
    (8, 2048, False, False),
    (4, 4096, False, False),
    (2, 2048, True, False),
    (8, 2048, True, False),
    (4, 2048, False, True),
    (8, 2048, False, True),
]


def activation_child(spec: str) -> None:
    """One calibration point: peak RSS over forward + backward of a random student, minus its
    gradients (the plan counts those apart), printed as JSON."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.set_num_threads(1)
    blocks, ffn, ckpt, bf16 = json.loads(spec)
    model = WanTransformer3DModel(
        num_layers=blocks, num_attention_heads=8, attention_head_dim=64, ffn_dim=ffn,
        text_dim=256, in_channels=16, out_channels=16, freq_dim=64,
    )  # fmt: skip
    if ckpt:
        model.enable_gradient_checkpointing()
    model.train()
    t, text = torch.tensor([500.0]), torch.randn(1, 64, 256)

    def step(x: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x, t, text, return_dict=False)[0]
        out.float().pow(2).mean().backward()

    step(torch.randn(1, 16, 1, 2, 2))  # kernels and lazy state, outside the measurement
    model.zero_grad(set_to_none=True)
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    step(torch.randn(1, 16, 4, 32, 32))  # 4 x 16 x 16 = 1,024 tokens
    grads = sum(p.numel() * 4 for p in model.parameters())
    print(json.dumps({"measured": _status("VmHWM") - base - grads}))


def calibrate() -> None:
    """Measured activation peaks beside `train_size.activation_bytes` (its docstring's table)."""
    from wandistill.placement.train_size import StudentSize, TrainShape, activation_bytes

    shape = TrainShape(4, 32, 32)
    print(f"{'blocks':>6}{'ffn':>6}{'ckpt':>6}{'bf16':>6}{'measured MiB':>14}{'formula MiB':>13}")
    for blocks, ffn, ckpt, bf16 in CALIBRATION:
        spec = json.dumps([blocks, ffn, ckpt, bf16])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, __file__, "--activation-child", spec],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        measured = json.loads(proc.stdout.strip().splitlines()[-1])["measured"]
        config = {"num_layers": blocks, "num_attention_heads": 8, "attention_head_dim": 64,
                  "ffn_dim": ffn, "text_dim": 256, "in_channels": 16, "freq_dim": 64}  # fmt: skip
        size = StudentSize.from_config(config)
        formula = activation_bytes(size, shape, bf16=bf16, checkpointing=ckpt)
        if bf16:  # autocast's bf16 weight copies, counted beside the activations by the plan
            formula += 2 * size.params
        print(f"{blocks:>6}{ffn:>6}{ckpt!s:>6}{bf16!s:>6}{measured / MiB:>14.1f}"
              f"{formula / MiB:>13.1f}")  # fmt: skip


def student_sizes(args: argparse.Namespace) -> dict[str, int]:
    return {
        "num_layers": args.layers,
        "num_attention_heads": args.heads,
        "attention_head_dim": args.head_dim,
        "ffn_dim": args.ffn,
    }


def make_teacher(args: argparse.Namespace, path: Path) -> None:
    """The tiny teacher with a transformer of the bench's sizes (the base a LoRA student adapts)."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    from wandistill.teacher import tiny

    parts = tiny.build_components(0, False)
    torch.manual_seed(0)
    big = WanTransformer3DModel(**{**tiny.TRANSFORMER_CONFIG, **student_sizes(args)})
    tiny._variance_preserving_(big)  # finite, O(1) teacher outputs, as the tiny teacher's
    parts["transformer"] = big.eval()
    tiny.write_teacher(path, WanPipeline(**parts), overwrite=False)


def build_cache(args: argparse.Namespace, work: Path) -> Path:
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute

    make_teacher(args, work / "teacher")
    words = "a red fox runs over the snowy hill at dusk".split()
    lines = [" ".join(words[i % 5 :] + [str(i)]) for i in range(args.prompts)]
    (work / "prompts.txt").write_text("\n".join(lines) + "\n")
    sets = [
        f'precompute.teacher.path="{work / "teacher"}"',
        f'precompute.prompts="{work / "prompts.txt"}"',
        f'precompute.cache.path="{work / "cache"}"',
        f"precompute.sampler.height={args.height}",
        f"precompute.sampler.width={args.width}",
        f"precompute.sampler.num_frames={args.frames}",
        "precompute.sampler.num_inference_steps=2",
        "precompute.previews=0",
    ]
    precompute(load_recipe(RECIPE, sets).precompute, quiet=True)
    return work / "cache"


def leg_sets(args: argparse.Namespace, leg: str, teacher: Path) -> list[str]:
    sets = [
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.checkpoint_every={args.steps}",
        "train.log_every=1",
        "train.tensorboard=false",
        'train.device="cpu"',
        *(f"train.student.{k}={v}" for k, v in student_sizes(args).items()),  # = the teacher's
    ]
    if leg == "fsdp":
        sets.append('train.parallel="fsdp"')
    if leg == "lora":
        sets.append(f"train.student.lora.rank={args.lora_rank}")
        sets.append(f'train.student.init_from_teacher.path="{teacher}"')
    return sets


def predicted(cache: Path, sets: list[str], world: int) -> dict[str, int]:
    """The train plan's row for this leg (bytes per rank)."""
    from wandistill.config import load_recipe
    from wandistill.placement.inventory import Inventory
    from wandistill.placement.train_inputs import train_inputs
    from wandistill.placement.train_plan import choice_of, make_train_plan

    recipe = load_recipe(RECIPE, [f'train.cache="{cache}"', *sets])
    inputs = train_inputs(recipe, None, "cache")
    cpu = Inventory((), 1 << 50, 0, "bench")  # the figure, not the fit, is compared
    plan = make_train_plan(
        inputs.student_config, choice_of(recipe.train), inputs.shape, cpu, world_size=world
    )
    r = plan.requested
    return {
        "params": plan.size.params,
        "trained": plan.size.trainable,
        "weights": r.weights,
        "gradients": r.gradients,
        "optimizer": r.optimizer,
        "ema": r.ema,
        "activations": r.activations,
        "checkpoint": r.checkpoint,
        "total": r.total,
    }


def run_leg(
    args: argparse.Namespace, cache: Path, work: Path, leg: str, world: int
) -> dict[str, Any]:
    sets = leg_sets(args, leg, cache.parent / "teacher")  # built beside the cache
    report = work / f"report-{leg}-{world}"
    report.mkdir()
    out = work / f"run-{leg}-{world}"
    argv = ["train", str(RECIPE), "--cache", str(cache), "--out", str(out)]
    argv += [x for s in sets for x in ("--set", s)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={world}", __file__, "--child", json.dumps(argv),
        "--report", str(report),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    ranks = [json.loads(p.read_text()) for p in sorted(report.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != world or any(r["exit"] for r in ranks):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"leg {leg} x{world} failed ({proc.returncode}): {' | '.join(tail)}")
    measured = max(r["peak"] - r["baseline"] for r in ranks)
    libraries = max(r["baseline"] - r["baseline_torch"] for r in ranks)
    times = [json.loads(x)["time"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    stepping = times[-1] - times[0] if len(times) > 1 else float("nan")
    latest = max((out / "checkpoints").glob("checkpoint-*"))
    files = {str(f.relative_to(latest)): f.stat().st_size for f in latest.rglob("*") if f.is_file()}
    plan = predicted(cache, sets, world)
    return {
        "leg": leg,
        "ranks": world,
        "measured_peak_minus_baseline": measured,
        "baseline": max(r["baseline"] for r in ranks),
        "libraries": libraries,
        "measured_peak_minus_torch_baseline": max(r["peak"] - r["baseline_torch"] for r in ranks),
        "plan": plan,
        "plan_over_measured": plan["total"] / measured,
        "seconds": seconds,
        "steps_per_s": (len(times) - 1) / stepping,  # between logged steps: no startup, no save
        "checkpoint_files": files,
    }


def _work(args: argparse.Namespace, tmp: Path) -> tuple[Path, Path]:
    """(where the teacher and cache live, where this invocation's runs go): --work keeps the
    first (built once, same sizes assumed), the runs always go to a fresh temporary folder."""
    if args.work is None:
        return tmp, tmp
    args.work.mkdir(parents=True, exist_ok=True)
    return args.work, tmp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--legs", nargs="+", default=["ddp", "fsdp", "lora"],
                   choices=["ddp", "fsdp", "lora"])  # fmt: skip
    p.add_argument("--work", type=Path, help="keep the teacher and cache here (reused if there)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--calibrate", action="store_true", help="re-measure the activation constants")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--activation-child", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.activation_child:
        return activation_child(args.activation_child)
    sys.path.insert(0, str(REPO))
    if args.calibrate:
        return calibrate()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"# {' '.join(sys.argv)}\n# {machine_line()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="train-memory-") as tmp:
        work, runs = _work(args, Path(tmp))
        cache = work / "cache"
        if not (cache / "manifest.json").exists():
            build_cache(args, work)
        results = []
        print(f"{'leg':<6}{'ranks':>6}{'measured MiB':>14}{'plan MiB':>10}{'plan/meas':>10}"
              f"{'params':>12}{'steps/s':>9}{'libs MiB':>10}")  # fmt: skip
        for leg in args.legs:
            for world in args.ranks:
                r = run_leg(args, cache, runs, leg, world)
                results.append(r)
                print(
                    f"{leg:<6}{world:>6}{r['measured_peak_minus_baseline'] / MiB:>14.1f}"
                    f"{r['plan']['total'] / MiB:>10.1f}{r['plan_over_measured']:>10.2f}"
                    f"{r['plan']['params'] / 1e6:>11.1f}M{r['steps_per_s']:>9.2f}"
                    f"{r['libraries'] / MiB:>10.1f}"
                )
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "args": vars(args), "legs": results})


if __name__ == "__main__":
    main()
