#!/usr/bin/env python
"""Every figure only a GPU can give, from one command (issue 30).

    python tests/bench/gpu.py --out DIR [--work SCRATCH]   # a GPU box: <= 8 minutes, one H100
    python tests/bench/gpu.py --out DIR --smoke            # the same code paths, toy sizes, CPU

No network, no downloads: the teacher is built here, with random weights, from the shipped
configs (wandistill/teacher/configs/wan2.1-1.3b: the 1.42B-parameter transformer and the
real-shape UMT5-xxl encoder, bf16; tokenizer, VAE and scheduler from `make_tiny_teacher`).
`--smoke` builds it from the same configs shrunk to the tiny teacher's sizes.

Every section has its own time budget (printed at the start with the run's, 475 s in all on
a GPU); a section that cannot run on this device, or whose budget is spent, says so in a
`skipped:` line, and one killed at its budget keeps the rows it finished.

Processes. The parent imports no torch; it starts the children and kills one (with its session)
past its budget. On a GPU each section runs in a child of its own: `gpu_used` is the device's
used memory (total - free), which no in-process reset clears, so a section must not inherit an
earlier one's CUDA context, cached blocks or loaded teacher; and a hung kernel or a long
compile is cut off at that section's budget. With `--smoke` all sections run, one after the
other, in a single child: a CPU has no such state to isolate, and each interpreter with torch
and diffusers costs seconds (`--isolate section|run` overrides either default; the CI test runs
both). Inside a section the legs run in-process in both modes, through the same functions:
precompute (`wandistill.precompute.run`), `wandistill train` (`cli.main`, one call per leg) and
the storage benches (`main(argv)`). A train leg's figures stay its own:
`torch.cuda.reset_peak_memory_stats()` before it makes metrics.jsonl's CUDA peak the leg's, and
host and device-wide memory are sampled around it (`Peak`) rather than read from the process's
lifetime `ru_maxrss`. The one leg still in a process of its own is the forced OOM through the
CLI on a GPU: its memory cap is per process.

  setup       the machine and versions; build the teacher (kept in SCRATCH, default DIR/work,
              and reused by a rerun with the same SCRATCH)
  placements  precompute at 480x832 (few frames and steps) under each placement: records/s,
              peak GPU and host memory beside `wandistill plan`'s estimate, max difference of
              the outputs from the first placement's
  speed       precompute vs the naive loop (WanPipeline per prompt, step callback, torch.save);
              batched prompts; the transformer's forward under each SDPA backend, cond+uncond
              in one batch, torch.compile of its blocks, achieved TFLOP/s vs the bf16 peak;
              pinned vs pageable host-to-device copies
  oom         a forced CUDA out-of-memory (the CLI at load, a forward in-process): the
              project's one-line message with its figures and the next placement
  train       `wandistill train` (FSDP2 on its 1-rank process group) on the cache the first
              placement made on this device: fp32, bf16 autocast +
              activation checkpointing, FSDP2 and LoRA where the installed config has
              train.parallel / train.student.lora.rank: steps/s, data-wait share, peak memory,
              and the train plan where `train --dry-run` prints one
  storage     tests/bench/cache_io.py (81-frame records, cold reads) and
              tests/bench/precompute_write.py (the background writer), bounded

DIR/results.json and DIR/results.md are rewritten after every row; each section also records
its wall and CPU seconds (its finished subprocesses included).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # harness, precompute: benches beside this one
from harness import ROOT, GiB, MiB, Peak, Report, environment  # noqa: E402

SECTIONS = ("placements", "speed", "oom", "train", "storage")
CONFIGS = ROOT / "wandistill/teacher/configs/wan2.1-1.3b"

#: Seconds per section on one H100, each child's start-up included: 475 in all (the default
#: --budget), under the 8 minutes the issue allows; the parent imports no torch and adds ~1 s.
#: setup is generous because without a teacher every other section is skipped. Smoke mode
#: multiplies them by SMOKE_SLACK: it checks code paths, and a shared CI runner must not turn
#: them into skips.
BUDGETS_S = {
    "setup": 90,
    "placements": 110,
    "speed": 95,
    "oom": 25,
    "train": 85,
    "storage": 70,
}
SMOKE_SLACK = 4.0
#: A section starts only with at least this share of its budget left in the run's.
MIN_SHARE = 0.6
#: Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by device name.
BF16_PEAK_TFLOPS = {
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
}


@dataclass(frozen=True, slots=True)
class Mode:
    """Sizes for one run: the GPU's (real shapes) or the smoke test's (toy shapes)."""

    name: str
    shrink: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per component, config keys replacing the shipped ones (smoke: the tiny teacher's)."""
    height: int = 480
    width: int = 832
    num_frames: int = 5
    steps: int = 4
    prompts: int = 4
    batch: int = 2
    max_sequence_length: int = 512
    oom_frames: int = 81
    train_steps: int = 40
    log_every: int = 10
    student: tuple[str, ...] = ("train.student.num_layers=10",)
    cache_io: tuple[str, ...] = ()
    precompute_write: tuple[str, ...] = ()


def _tiny_shrink() -> dict[str, dict[str, Any]]:
    from wandistill.teacher.tiny import TEXT_ENCODER_CONFIG, TRANSFORMER_CONFIG

    keys = ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "text_dim")
    return {
        "transformer": {k: TRANSFORMER_CONFIG[k] for k in keys},
        "text_encoder": {
            **dict(TEXT_ENCODER_CONFIG),
            "dropout_rate": 0.1,  # the shipped config's value; inference ignores it
        },
    }


GPU_MODE = Mode(
    name="gpu",
    cache_io=(
        "--records", "16", "--shard-records", "4", "--repeats", "2", "--latent-frames", "21",
        "--backends", "webdataset",
    ),
    precompute_write=(
        "--prompts", "160", "--frames", "1", "--steps", "1", "--batch-size", "8",
        "--shard-records", "2", "--store-dtype", "fp8", "--repeats", "4",
        "--legs", "null_sink,background", "--threads", "8",
    ),
)  # fmt: skip


def smoke_mode() -> Mode:
    return Mode(
        name="smoke",
        shrink=_tiny_shrink(),
        height=32,
        width=32,
        num_frames=1,
        steps=2,
        prompts=4,
        batch=2,
        max_sequence_length=32,
        oom_frames=81,
        train_steps=4,
        log_every=2,
        student=("train.student.num_layers=1",),
        cache_io=(
            "--records", "4", "--shard-records", "2", "--repeats", "1", "--latent-frames", "1",
            "--backends", "webdataset", "--no-prefault", "--threads", "1", "--workers", "0",
        ),
        precompute_write=(
            "--prompts", "4", "--frames", "1", "--steps", "1", "--batch-size", "2",
            "--height", "64", "--width", "64",
            "--shard-records", "2", "--repeats", "1", "--legs", "null_sink,background",
            "--no-prefault", "--threads", "1",
        ),
    )  # fmt: skip


# ------------------------------------------------------------------------- sections' frame


class Section:
    """One section's results, written through `Report` after every row."""

    def __init__(self, name: str, report: Report, budget_s: float, deadline: float) -> None:
        self.name, self.report, self.deadline = name, report, deadline
        self.t0 = time.time()
        self.cpu0 = _cpu_s()
        self.data: dict[str, Any] = {
            "status": "running",
            "budget_s": round(budget_s),
            "rows": [],
            "notes": [],
            "skipped": [],
            "summary": {},
        }

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        self.data["seconds"] = round(time.time() - self.t0, 2)
        self.data["cpu_s"] = round(_cpu_s() - self.cpu0, 1)  # with its finished subprocesses
        self.report.update(**{self.name: self.data})

    def row(self, **values: Any) -> None:
        values = {k: _rounded(v) for k, v in values.items()}
        self.data["rows"].append(values)
        print(f"[{self.name}] " + ", ".join(f"{k}={v}" for k, v in values.items()), flush=True)
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        print(f"[{self.name}] {text}", flush=True)
        self.save()

    def skip(self, text: str) -> None:
        self.data["skipped"].append(text)
        print(f"[{self.name}] skipped: {text}", flush=True)
        self.save()

    def summary(self, **values: Any) -> None:
        self.data["summary"].update({k: _rounded(v) for k, v in values.items()})
        self.save()

    def fits(self, what: str, need_s: float) -> bool:
        """Whether `need_s` more seconds fit the budget; if not, a skip line says so."""
        if self.left() >= need_s:
            return True
        self.skip(f"{what}: budget ({self.left():.0f} s left, needs ~{need_s:.0f} s)")
        return False

    def finish(self) -> None:
        rows, skipped = self.data["rows"], self.data["skipped"]
        self.data["status"] = "done" if rows or not skipped else "skipped"
        self.save()


def _cpu_s() -> float:
    """CPU seconds of this process and its finished subprocesses so far."""
    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))


def _rounded(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


@dataclass(slots=True)
class Ctx:
    """What every section needs: the mode, the folders, the device."""

    mode: Mode
    out: Path
    work: Path
    """Scratch: the teacher (14 GB on a GPU box), caches, offload folders, bench data."""
    cuda: bool

    @property
    def teacher(self) -> Path:
        return self.work / f"teacher-{self.mode.name}"

    @property
    def prompts(self) -> Path:
        return self.work / "prompts.txt"

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def gpu(self) -> int | None:
        return 0 if self.cuda else None


def _gib(n: float | None) -> float | None:
    return None if n is None else n / GiB


def _sync(ctx: Ctx) -> None:
    if ctx.cuda:
        import torch

        torch.cuda.synchronize()


# ------------------------------------------------------------------------------- setup


def random_model(component: str, config: dict[str, Any], seed: int) -> Any:
    """A component from its config with random bf16 weights, never a float32 copy.

    Weights are slices of one shared pool of normal draws (16M values), scaled per tensor to
    N(0, 1/fan_in) (norm weights 1, biases 0): the 7.1B parameters (UMT5 5.7B, transformer
    1.4B) fill at memory speed instead of minutes of `randn`, and activations stay O(1) through
    30 blocks (checked on a CPU: the full transformer and a 4-layer real-width UMT5 give finite
    outputs of std ~1)."""
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights():
        if component == "transformer":
            from diffusers import WanTransformer3DModel

            model = WanTransformer3DModel.from_config(config)
        else:
            from transformers import UMT5Config, UMT5EncoderModel

            model = UMT5EncoderModel(UMT5Config(**config))
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    if component == "text_encoder":
        model.tie_weights()  # to_empty gave `shared` and `embed_tokens` a tensor each
    pool = torch.randn(1 << 24, generator=torch.Generator().manual_seed(seed)).bfloat16()
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if p.ndim >= 2:
                std = p[0].numel() ** -0.5  # fan_in, for Linear, Conv3d and Embedding alike
                _fill_(p.view(-1), pool, offset=(i * 7919) % pool.numel(), scale=std)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    if component == "transformer":  # RoPE tables are computed buffers (not saved): rebuild
        c = model.config
        model.rope = type(model.rope)(c.attention_head_dim, c.patch_size, c.rope_max_seq_len)
    return model.eval()


def _fill_(flat: Any, pool: Any, offset: int, scale: float) -> None:
    """`flat` = `pool` (from `offset`, wrapping) x `scale`, in one pass over the memory."""
    import torch

    pos = 0
    while pos < flat.numel():
        take = min(flat.numel() - pos, pool.numel() - offset)
        torch.mul(pool[offset : offset + take], scale, out=flat[pos : pos + take])
        pos, offset = pos + take, 0


def build_teacher(ctx: Ctx) -> Path:
    """Tiny tokenizer/VAE/scheduler, then the shipped transformer and text encoder configs
    (shrunk in smoke mode) with random weights; built aside and renamed into place."""
    from wandistill.teacher.tiny import make_tiny_teacher

    if (ctx.teacher / "model_index.json").exists():
        return ctx.teacher
    tmp = ctx.work / f".{ctx.teacher.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_teacher(tmp)
    for seed, component in enumerate(("transformer", "text_encoder")):
        config = json.loads((CONFIGS / component / "config.json").read_text())
        config.update(ctx.mode.shrink.get(component, {}))
        model = random_model(component, config, seed)
        shutil.rmtree(tmp / component)
        model.save_pretrained(tmp / component, safe_serialization=True)
        del model
        gc.collect()
    os.replace(tmp, ctx.teacher)
    return ctx.teacher


def setup(sec: Section, ctx: Ctx) -> None:
    sec.report.update({"environment": environment()})  # here: the parent never imports torch
    ctx.work.mkdir(parents=True, exist_ok=True)
    lines = [f"prompt {i}: a cat and a dog walking in a park" for i in range(ctx.mode.prompts)]
    ctx.prompts.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    reused = (ctx.teacher / "model_index.json").exists()
    build_teacher(ctx)
    size = sum(f.stat().st_size for f in ctx.teacher.rglob("*.safetensors"))
    sec.row(
        teacher=str(ctx.teacher),
        reused=reused,
        safetensors_GiB=size / GiB,
        build_s=time.perf_counter() - t0,
    )


# ---------------------------------------------------------------------------- placements


def precompute_overrides(
    ctx: Ctx, cache: Path, placement: str, batch: int | None = None
) -> list[str]:
    m = ctx.mode
    return [
        f'teacher.path="{ctx.teacher}"',
        f'prompts="{ctx.prompts}"',
        f'cache.path="{cache}"',
        f'teacher.placement="{placement}"',
        'teacher.dtype="bf16"',
        f'teacher.offload_folder="{ctx.work / "offload"}"',
        f"sampler.height={m.height}",
        f"sampler.width={m.width}",
        f"sampler.num_frames={m.num_frames}",
        f"sampler.num_inference_steps={m.steps}",
        f"sampler.batch_size={batch or m.batch}",
        f"sampler.max_sequence_length={m.max_sequence_length}",
    ]


def precompute_config(ctx: Ctx, cache: Path, placement: str, extra: tuple[str, ...] = ()) -> Any:
    from wandistill.config import load_recipe

    overrides = [*precompute_overrides(ctx, cache, placement), *extra]
    return load_recipe(None, overrides, stage="precompute").precompute


def placement_list(ctx: Ctx) -> list[tuple[str, str, tuple[str, ...], bool]]:
    """(label, teacher.placement, extra overrides, needs CUDA) in the order they run."""
    leaf = ('teacher.group_offload_level="leaf_level"',)
    first = "cuda" if ctx.cuda else "cpu"
    return [
        (first, first, (), False),
        ("model-offload", "model-offload", (), True),
        ("group-offload (block, streams)", "group-offload", (), True),
        ("group-offload (leaf, streams)", "group-offload", leaf, True),
        ("device-map.json", str(ctx.work / "device-map.json"), (), False),
        ("auto", "auto", (), False),
        ("disk-offload", "disk-offload", (), False),  # the slowest: last
    ]


def write_device_map(ctx: Ctx) -> Path:
    """Half the transformer's blocks on the GPU and half on the CPU (on a CPU box: half on the
    CPU, half on disk); the text encoder on the GPU (CPU); the VAE on the CPU."""
    from safetensors import safe_open

    names: set[str] = {"rope"}  # RoPE tables: buffers only, absent from the weight files
    for path in sorted((ctx.teacher / "transformer").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no iterator
                parts = key.split(".")
                names.add(".".join(parts[:2]) if parts[0] == "blocks" else parts[0])
    blocks = sum(1 for n in names if n.startswith("blocks."))
    near, far = (0, "cpu") if ctx.cuda else ("cpu", "disk")
    mapping = {
        n: (far if n.startswith("blocks.") and int(n.split(".")[1]) >= blocks // 2 else near)
        for n in sorted(names)
    }
    data = {"text_encoder": "cuda:0" if ctx.cuda else "cpu", "transformer": mapping, "vae": "cpu"}
    path = ctx.work / "device-map.json"
    path.write_text(json.dumps(data, indent=1))
    return path


def placement_api() -> SimpleNamespace:
    """The package's placement functions (wandistill/placement/), in one namespace."""
    from wandistill.placement import devices, estimate, inventory, load, parse, plan, strategies

    return SimpleNamespace(
        CPU_OVERHEAD=devices.CPU_OVERHEAD,
        Auto=parse.Auto,
        Cpu=strategies.Cpu,
        Cuda=strategies.Cuda,
        Inventory=inventory.Inventory,
        SamplerSizes=estimate.SamplerSizes,
        make_plan=plan.make_plan,
        load=load,
    )


def plan_estimate(ctx: Ctx, cfg: Any) -> tuple[str, dict[str, int]]:
    """The strategy `wandistill plan` would use for this config and its peak bytes per device."""
    from wandistill.placement.estimate import dtype_from_name

    api = placement_api()
    placement = cfg.teacher.placement
    plan = api.make_plan(
        ctx.teacher,
        dtype=dtype_from_name(cfg.teacher.dtype),
        sizes=api.SamplerSizes.from_config(cfg),
        inventory=api.Inventory.detect(ctx.work),
        placement=placement,
    )
    which = plan.auto.strategy if isinstance(placement, api.Auto) else placement
    s = plan.strategy(which)
    return s.strategy, dict(s.peak)


def first_record(cache: Path) -> dict[str, Any]:
    """The floating-point tensors of the cache's first record (by key)."""
    from wandistill.cache.reader import CacheReader

    with CacheReader(cache) as store:
        where = store.locate()
        record = store.read_record(*where[sorted(where)[0]])
    return {k: v.float() for k, v in record.tensors().items() if v.is_floating_point()}


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a if k in b and a[k].shape == b[k].shape)


def measured_precompute(ctx: Ctx, cfg: Any) -> tuple[Any, float, Peak, dict[str, int]]:
    """Run precompute with memory sampled: (summary, seconds, sampler, CUDA allocator peaks)."""
    import torch

    from wandistill.precompute.run import run

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with Peak(ctx.gpu) as peak:
        t0 = time.perf_counter()
        summary = run(cfg, quiet=True)
        seconds = time.perf_counter() - t0
    alloc = {}
    if ctx.cuda:
        alloc = {
            "allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
        }
    return summary, seconds, peak, alloc


def placements(sec: Section, ctx: Ctx) -> None:
    overhead = placement_api().CPU_OVERHEAD
    write_device_map(ctx)
    ref: tuple[str, dict[str, Any]] | None = None
    sec.note(
        "gpu_used: device-wide used memory (total - free, CUDA context included) at its peak; "
        "plan_gpu: `wandistill plan`'s peak for the GPU (+1 GiB context allowance); host: "
        "peak RSS above the run's start vs the plan's CPU figure less its 2 GiB process "
        "allowance; target: measured within +-15% of the plan"
    )
    for label, placement, extra, needs_cuda in placement_list(ctx):
        if needs_cuda and not ctx.cuda:
            sec.skip(f"{label}: needs CUDA (none visible)")
            continue
        if not sec.fits(label, 8.0 if ctx.mode.name == "smoke" else 15.0):
            continue
        cache = ctx.work / "placements" / re.sub(r"[^a-z0-9]+", "-", label).strip("-")
        shutil.rmtree(cache, ignore_errors=True)
        cfg = precompute_config(ctx, cache, placement, extra)
        try:
            strategy, plan = plan_estimate(ctx, cfg)
        except Exception as e:  # the plan's failure is a finding, not the section's end
            strategy, plan = f"plan failed: {type(e).__name__}: {e}", {}
        try:
            summary, seconds, peak, alloc = measured_precompute(ctx, cfg)
        except Exception as e:
            sec.row(placement=label, error=f"{type(e).__name__}: {e}"[:300])
            continue
        record = first_record(cache)
        if ref is None:
            ref = (label, record)
        gpu_plan = sum(v for k, v in plan.items() if k.startswith("cuda")) or None
        host_plan = plan["cpu"] - overhead if "cpu" in plan else None
        gpu_used = peak.peak.get("gpu_used")
        host = peak.above()
        sec.row(
            placement=label,
            plan_strategy=strategy,
            records=summary.records_written,
            seconds=seconds,
            records_per_s=summary.records_written / seconds,
            gpu_used_GiB=_gib(gpu_used),
            plan_gpu_GiB=_gib(gpu_plan),
            gpu_vs_plan=gpu_used / gpu_plan if gpu_used and gpu_plan else None,
            gpu_allocated_GiB=_gib(alloc.get("allocated")),
            host_rss_GiB=_gib(host.get("VmRSS")),
            host_anon_GiB=_gib(host.get("RssAnon")),
            plan_host_GiB=_gib(host_plan),
            host_vs_plan=host["VmRSS"] / host_plan if host_plan and "VmRSS" in host else None,
            max_abs_diff=max_abs_diff(record, ref[1]),
            diff_vs=ref[0],
        )


# --------------------------------------------------------------------------------- speed


def _timed(fn: Callable[[], Any], ctx: Ctx, min_s: float = 0.5, max_iters: int = 10) -> float:
    """Median seconds of `fn` after one warm-up call: at least 2 calls, up to `min_s` total."""
    fn()
    _sync(ctx)
    times: list[float] = []
    while len(times) < 2 or (sum(times) < min_s and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        _sync(ctx)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed_pipeline(
    sec: Section, ctx: Ctx, batches: tuple[int | None, ...], legs: dict[str, float]
) -> None:
    """The naive loop (batch None) or precompute at each batch size, on the same prompts,
    steps, seeds and sizes, on this device in bf16; seconds into `legs` by name."""
    import precompute as bench  # tests/bench/precompute.py
    import torch

    m = ctx.mode
    ns = argparse.Namespace(height=m.height, width=m.width, steps=m.steps, batch_size=m.batch)
    prompts = ctx.prompts.read_text().splitlines()
    ours_extra = tuple(precompute_overrides(ctx, Path("unused"), ctx.device)[3:])
    for batch in batches:
        name = "naive" if batch is None else f"precompute batch {batch}"
        if not sec.fits(f"pipeline leg {name!r}", 6.0 if m.name == "smoke" else 20.0):
            continue
        target = ctx.work / "speed" / name.replace(" ", "-")
        shutil.rmtree(target, ignore_errors=True)
        if batch is None:
            seconds = bench.naive(
                ctx.teacher, prompts, ns, target, dtype=torch.bfloat16, device=ctx.device,
                num_frames=m.num_frames, max_sequence_length=m.max_sequence_length,
            )  # fmt: skip
        else:
            extra = (*ours_extra, f"sampler.batch_size={batch}")
            seconds = bench.ours(ctx.teacher, ctx.prompts, ns, target, False, extra)
        legs[name] = seconds
        per_s = len(prompts) / seconds
        sec.row(leg=name, prompts=len(prompts), seconds=seconds, prompts_per_s=per_s)
        shutil.rmtree(target, ignore_errors=True)
        gc.collect()  # the naive leg's pipeline: its GPU memory back before the next leg
        if ctx.cuda:
            torch.cuda.empty_cache()


def transformer_inputs(ctx: Ctx, batch: int, frames: int) -> dict[str, Any]:
    import torch

    from wandistill.teacher.folder import TeacherFolder

    cfg = TeacherFolder.open(ctx.teacher).raw_config("transformer")
    m = ctx.mode
    g = torch.Generator().manual_seed(0)
    shape = (batch, cfg["in_channels"], (frames - 1) // 4 + 1, m.height // 8, m.width // 8)
    text = (batch, m.max_sequence_length, cfg["text_dim"])
    return {
        "hidden_states": torch.randn(shape, generator=g).to(ctx.device, torch.bfloat16),
        "timestep": torch.full((batch,), 500.0, device=ctx.device),
        "encoder_hidden_states": torch.randn(text, generator=g).to(ctx.device, torch.bfloat16),
        "return_dict": False,
    }


def load_transformer(ctx: Ctx) -> Any:
    import torch

    api = placement_api()
    from wandistill.teacher.folder import TeacherFolder

    return api.load.load_component(
        TeacherFolder.open(ctx.teacher),
        "transformer",
        dtype=torch.bfloat16,
        placement=api.Cuda(0) if ctx.cuda else api.Cpu(),
        offload_dir=ctx.work / "offload",
    )


def bf16_peak(ctx: Ctx) -> float | None:
    if not ctx.cuda:
        return None
    import torch

    name = torch.cuda.get_device_name(0)
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


def speed_forward(sec: Section, ctx: Ctx) -> None:
    """The transformer alone: achieved TFLOP/s under each lever, one process, one model."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = load_transformer(ctx)
    b = ctx.mode.batch
    one = transformer_inputs(ctx, b, ctx.mode.num_frames)
    two = transformer_inputs(ctx, 2 * b, ctx.mode.num_frames)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**one)
    flops = counter.get_total_flops()
    peak = bf16_peak(ctx)
    sec.summary(forward_tflop=flops / 1e12, bf16_peak_tflops=peak, device=ctx.device)

    def leg(name: str, fn: Callable[[], Any], work: float = 1.0) -> None:
        if not sec.fits(f"forward {name!r}", 3.0 if ctx.mode.name == "smoke" else 8.0):
            return
        try:
            with torch.no_grad():
                seconds = _timed(fn, ctx)
        except Exception as e:  # a backend this device or build lacks
            sec.row(leg=name, error=f"{type(e).__name__}: {str(e).splitlines()[0]}"[:200])
            return
        tflops = work * flops / seconds / 1e12
        sec.row(leg=name, seconds=seconds, tflops=tflops, of_peak=tflops / peak if peak else None)

    leg(f"eager, batch {b}, default SDPA", lambda: model(**one))
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):

        def run(backend: str = backend) -> Any:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return model(**one)

        leg(f"SDPA {backend}", run)
    leg(f"cond+uncond in one forward (batch {2 * b})", lambda: model(**two), work=2.0)
    leg(f"cond, uncond apart (2 x batch {b})", lambda: (model(**one), model(**one)), work=2.0)
    compile_leg(sec, ctx, model, one, leg)


def compile_leg(sec: Section, ctx: Ctx, model: Any, inputs: dict[str, Any], leg: Callable) -> None:
    """`compile_repeated_blocks` (one block compiled, reused 30 times) where diffusers has it;
    inductor on a GPU, the eager backend in smoke mode (tracing only: no C++ build on a CPU)."""
    need = 10.0 if ctx.mode.name == "smoke" else 45.0
    if not hasattr(model, "compile_repeated_blocks"):
        sec.skip("torch.compile: this diffusers has no compile_repeated_blocks")
        return
    if not sec.fits("torch.compile (compile time)", need):
        return
    import torch

    backend = "inductor" if ctx.cuda else "eager"
    t0 = time.perf_counter()
    try:
        model.compile_repeated_blocks(backend=backend)
        with torch.no_grad():
            model(**inputs)  # the compile itself
        _sync(ctx)
    except Exception as e:  # no triton, no compiler: a finding, not the section's end
        sec.row(leg=f"torch.compile ({backend})", error=f"{type(e).__name__}: {e}"[:300])
        return
    sec.note(f"torch.compile ({backend}) of the repeated blocks: {time.perf_counter() - t0:.1f} s")
    leg(f"torch.compile ({backend}) blocks", lambda: model(**inputs))


def speed_transfers(sec: Section, ctx: Ctx) -> None:
    """Host-to-device copies of 256 MiB, pageable vs pinned (what offloading moves)."""
    if not ctx.cuda:
        sec.skip("pinned vs pageable transfers: needs CUDA (none visible)")
        return
    import torch

    host = torch.randn(64 * MiB, dtype=torch.float32)  # 256 MiB
    pinned = host.pin_memory()
    for name, src in (("pageable", host), ("pinned", pinned)):
        seconds = _timed(lambda src=src: src.to("cuda", non_blocking=True), ctx)
        sec.row(leg=f"H2D 256 MiB {name}", seconds=seconds, GB_per_s=host.nbytes / seconds / 1e9)


def speed(sec: Section, ctx: Ctx) -> None:
    """Cheap and essential first (transfers, the >= 1.3x target), torch.compile's minute of
    compiling late, the batch-1 precompute leg last."""
    legs: dict[str, float] = {}
    speed_transfers(sec, ctx)
    speed_pipeline(sec, ctx, (None, ctx.mode.batch), legs)
    ours = legs.get(f"precompute batch {ctx.mode.batch}")
    if ours and "naive" in legs:
        sec.summary(precompute_vs_naive=legs["naive"] / ours, target=">= 1.3x")
    sec.skip(
        "cond+uncond in one forward as a precompute mode: not built (the sampler runs them "
        "apart, bit-equal to WanPipeline); the forward rows show what it would gain"
    )
    speed_forward(sec, ctx)
    speed_pipeline(sec, ctx, (1,), legs)
    if ours and "precompute batch 1" in legs:
        sec.summary(batched_prompts_vs_batch_1=legs["precompute batch 1"] / ours)


# ----------------------------------------------------------------------------------- oom

_CAPPED_CLI = (
    "import sys, torch; torch.cuda.set_per_process_memory_fraction(float(sys.argv[1])); "
    "from wandistill.cli import main; main(sys.argv[2:])"
)


def oom_cli(sec: Section, ctx: Ctx) -> None:
    """`wandistill precompute --placement cuda` in a process capped to 0.5 GiB of the GPU."""
    cache = ctx.work / "oom-cache"
    shutil.rmtree(cache, ignore_errors=True)
    args = ["precompute", "--teacher", str(ctx.teacher), "--prompts", str(ctx.prompts)]
    args += ["--out", str(cache), "--placement", ctx.device, "--dtype", "bf16"]
    args += ["--set", f"precompute.sampler.height={ctx.mode.height}"]
    args += ["--set", f"precompute.sampler.width={ctx.mode.width}"]
    args += ["--set", f"precompute.sampler.num_frames={ctx.mode.num_frames}"]
    args += ["--set", f"precompute.sampler.max_sequence_length={ctx.mode.max_sequence_length}"]
    if not ctx.cuda:  # the same command line, checked by the CLI without a GPU
        code, text = cli_in_process([*args, "--dry-run"])
        sec.skip(
            "forced CUDA OOM: needs CUDA (none visible); its command line checked with "
            f"--dry-run: exit {code}"
        )
        if code:
            sec.note(f"dry-run output: {' '.join(text.split())[-300:]}")
        return
    import torch

    cap = 0.5 * GiB / torch.cuda.get_device_properties(0).total_memory
    done = _run([sys.executable, "-c", _CAPPED_CLI, f"{cap:.6f}", *args], max(10, sec.left()))
    _oom_row(sec, "precompute CLI, GPU capped at 0.5 GiB", done.returncode, done.stderr)


def _oom_row(sec: Section, leg: str, code: int | None, text: str) -> None:
    error = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("error:")), "")
    fix = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("fix:")), "")
    whole = " ".join(text.split())
    sec.row(
        leg=leg,
        exit=code,
        says_out_of_memory="out of memory" in whole,
        has_figures=bool(re.search(r"total [\d.]+ GiB", whole)),
        names_next_placement="--placement" in whole,
        traceback="Traceback" in text,
        error=error[:300] or whole[-300:],
        fix=fix[:300],
    )


def oom_forward(sec: Section, ctx: Ctx) -> None:
    """A transformer forward at `oom_frames` frames with the GPU capped just above its weights."""
    if not ctx.cuda:
        sec.skip("forced CUDA OOM in a forward: needs CUDA (none visible)")
        return
    import torch

    from wandistill.errors import WandistillError

    pl = placement_api().load

    model = load_transformer(ctx)
    inputs = transformer_inputs(ctx, 1, ctx.mode.oom_frames)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * MiB) / total)
    text, code = "no error: the forward fit", 0
    try:
        with torch.no_grad(), pl.oom_guard_for(model):
            model(**inputs)
    except WandistillError as e:
        text, code = f"error: {e.message}\nfix: {e.fix}", e.exit_code
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        pl.unload(model)
    _oom_row(sec, f"forward at {ctx.mode.oom_frames} frames, cap weights + 256 MiB", code, text)


def oom(sec: Section, ctx: Ctx) -> None:
    oom_cli(sec, ctx)
    oom_forward(sec, ctx)


# --------------------------------------------------------------------------------- train


def accepted(overrides: tuple[str, ...]) -> str | None:
    """None if the installed config takes these `train.KEY=VALUE`s together (a key another
    branch adds, with what it needs beside it); else the config's own message."""
    from wandistill.config import load_recipe
    from wandistill.errors import WandistillError

    try:
        load_recipe(None, list(overrides), stage="train")
    except WandistillError as e:
        return e.message
    return None


def train_legs(ctx: Ctx) -> list[tuple[str, tuple[str, ...]]]:
    """(label, --set overrides). A full student gets the mode's student sizes; a LoRA student
    is the teacher's whole transformer (frozen) plus adapters, so it gets none."""
    bf16 = ('train.mixed_precision="bf16"', "train.gradient_checkpointing=true")
    full = ctx.mode.student
    lora = ("train.student.lora.rank=16", f'train.student.init_from_teacher.path="{ctx.teacher}"')
    return [  # the shipped recipes' setting first, fp32 (the reference) last: a tight budget
        ("bf16 autocast + checkpointing", (*bf16, *full)),  # skips the least needed leg
        ("FSDP2, bf16 + checkpointing", (*bf16, *full, 'train.parallel="fsdp"')),
        ("LoRA rank 16 on the teacher, bf16", (*bf16, *lora)),
        ("fp32", ('train.mixed_precision="no"', *full)),  # one process: no DDP wrapper
    ]


def train_cache(ctx: Ctx) -> Path:
    """The first placement's cache (made on this device); made here if that section did not."""
    cache = ctx.work / "placements" / ctx.device
    if not (cache / "manifest.json").exists():
        from wandistill.precompute.run import run

        shutil.rmtree(cache, ignore_errors=True)
        run(precompute_config(ctx, cache, ctx.device), quiet=True)
    return cache


def cli_in_process(args: list[str]) -> tuple[int, str]:
    """`wandistill ARGS` in this process: (exit code, stdout + stderr)."""
    from wandistill.cli import main

    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main(args)
        except SystemExit as e:
            code = int(e.code or 0)
    return code, out.getvalue()


def train_dry_run(args: list[str]) -> list[str]:
    """`wandistill train ... --dry-run` in-process: the lines that carry a memory plan."""
    _, text = cli_in_process([*args, "--dry-run"])
    return [ln.strip() for ln in text.splitlines() if "GiB" in ln or "GB" in ln]


def metrics_figures(run: Path) -> dict[str, Any]:
    """steps/s, data-wait share and peak memory from metrics.jsonl, the first window dropped."""
    from wandistill.train.metrics import read_metrics

    rows = [r for r in read_metrics(run) if "step_time_s" in r]
    windows = rows[1:] or rows
    if not windows:
        return {}
    return {
        "steps_per_s": 1 / statistics.mean(r["step_time_s"] for r in windows),
        "data_wait": statistics.mean(r["data_wait_frac"] for r in windows),
        "peak_gpu_GiB": max(r.get("peak_mem_bytes", 0) for r in rows) / GiB,
        "peak_rss_GiB": max(r.get("peak_rss_bytes", 0) for r in rows) / GiB,
    }


def train(sec: Section, ctx: Ctx) -> None:
    """Each leg is `wandistill train` called in this process (see the module docstring): the
    CUDA allocator's peak is reset before it and the host's sampled around it, so each leg's
    figures are its own; FSDP2 on one process takes the 1-rank group the package makes."""
    m = ctx.mode
    cache = train_cache(ctx)
    common = [
        f"train.log_every={m.log_every}",
        f"train.checkpoint_every={m.train_steps}",
        "train.tensorboard=false",
    ]
    for label, overrides in train_legs(ctx):
        why = accepted(overrides)
        if why is not None:
            sec.skip(f"{label}: the installed config does not take it ({why})")
            continue
        if not sec.fits(label, 4.0 if m.name == "smoke" else 20.0):
            continue
        out = ctx.work / "train" / re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
        shutil.rmtree(out, ignore_errors=True)
        sets = [a for o in (*common, *overrides) for a in ("--set", o)]
        args = ["train", "--cache", str(cache), "--out", str(out), "--steps", str(m.train_steps)]
        plan = train_dry_run([*args, *sets])
        row: dict[str, Any] = {"leg": label, **train_leg(ctx, [*args, *sets], out)}
        row["plan"] = "; ".join(plan) or "train --dry-run prints no memory plan in this version"
        sec.row(**row)


def train_leg(ctx: Ctx, args: list[str], out: Path) -> dict[str, Any]:
    """One `wandistill train ARGS` in-process: exit code, seconds and its figures."""
    import torch

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # metrics.jsonl's peak is this leg's alone
    with Peak(ctx.gpu) as peak:
        t0 = time.perf_counter()
        try:
            code, text = cli_in_process(args)
        except Exception as e:  # not the CLI's one-line error: a finding, next leg still runs
            code, text = 1, f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
    row: dict[str, Any] = {"exit": code, "seconds": seconds}
    if code:
        return {**row, "error": _last_error(text)}
    figures = metrics_figures(out)
    figures.pop("peak_rss_GiB", None)  # ru_maxrss: this process's lifetime, not the leg's
    host = peak.above()
    return {
        **row,
        **figures,
        "gpu_used_GiB": _gib(peak.peak.get("gpu_used")),
        "host_rss_above_start_GiB": _gib(host.get("VmRSS")),
    }


# ------------------------------------------------------------------------------- storage


def storage(sec: Section, ctx: Ctx) -> None:
    """The two storage benches (cache_io.py, precompute_write.py), at bounded sizes, each called
    through its `main(argv)` in this process (its output captured): what they measure is the
    disk and the writer thread, which a process of their own would not change."""
    cio_json, pw_json = ctx.work / "cache_io.json", ctx.work / "precompute_write.json"
    cio_out = ctx.work / "cache-io"
    shutil.rmtree(cio_out, ignore_errors=True)
    legs = [
        ("cache_io", [*ctx.mode.cache_io, "--out", str(cio_out), "--json", str(cio_json)]),
        (
            "precompute_write",
            [*ctx.mode.precompute_write, "--work", str(ctx.work), "--json", str(pw_json)],
        ),
    ]
    for name, args in legs:
        if not sec.fits(name, 3.0 if ctx.mode.name == "smoke" else 20.0):
            continue
        t0 = time.perf_counter()
        code, text = bench_in_process(name, args)
        row: dict[str, Any] = {"bench": name, "exit": code}
        row["seconds"] = time.perf_counter() - t0
        row["command"] = " ".join(["python", f"tests/bench/{name}.py", *args])
        if code == 0 and name == "cache_io":
            row.update(json.loads(cio_json.read_text())["ratios"])
        elif code == 0:
            row.update(json.loads(pw_json.read_text())["verdict"])
        else:
            row["error"] = _last_error(text)
        sec.row(**row)
    shutil.rmtree(cio_out, ignore_errors=True)


def bench_in_process(name: str, args: list[str]) -> tuple[int, str]:
    """`python tests/bench/NAME.py ARGS` as `NAME.main(ARGS)` here: (exit code, its output).
    torch's thread count, which precompute_write sets, is put back for whatever runs next."""
    import importlib
    import signal

    import torch

    threads, sigterm = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    out = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = importlib.import_module(name).main(args) or 0
    except SystemExit as e:  # argparse's p.error, or cache_io's SIGTERM handler
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:
        code = 1
        out.write(f"\n{type(e).__name__}: {e}")
    finally:
        torch.set_num_threads(threads)
        signal.signal(signal.SIGTERM, sigterm)  # cache_io installs its own
    return code, out.getvalue()


# ------------------------------------------------------------------------------ processes


@dataclass(slots=True)
class Done:
    returncode: int | None
    stdout: str
    stderr: str


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Done:
    """A child in its own session; past `timeout` the whole session is killed (exit None)."""
    import signal

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        return Done(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Done(None, out, err + f"\nkilled after {timeout:.0f} s")


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    picked = [ln for ln in lines if ln.startswith(("error:", "fix:"))] or lines[-2:]
    return " / ".join(picked)[-400:]


RUNNERS: dict[str, Callable[[Section, Ctx], None]] = {
    "setup": setup,
    "placements": placements,
    "speed": speed,
    "oom": oom,
    "train": train,
    "storage": storage,
}


def section_budget(name: str, smoke: bool, run_left: float) -> tuple[float, str | None]:
    """(seconds, None) for a section starting with `run_left` seconds of the run's budget
    left, or (0, the skip line) when less than MIN_SHARE of its budget is left. The parent and
    a child decide with this one rule; since `run_left` only shrinks, a section the parent
    finds skipped now would be skipped by the child too."""
    want = BUDGETS_S[name] * (SMOKE_SLACK if smoke else 1.0)
    budget = min(want, run_left)
    if budget < MIN_SHARE * want:
        return 0.0, f"run budget: {max(0, run_left):.0f} s left, the section needs {want:.0f} s"
    return budget, None


def groups(names: list[str], isolate: str) -> list[list[str]]:
    """The sections each child runs: `section`, one each (the GPU's default); `run`, all in
    one (the smoke's default). See the module docstring for why."""
    return [names] if isolate == "run" else [[n] for n in names]


def child(args: argparse.Namespace) -> None:
    """The sections of `--child` in this process (started by `parent`), in order, each up to
    its own deadline; the first one's budget counts from the moment the parent launched this
    process, as the parent's kill does. A section that raises is recorded as partial and the
    next one still runs."""
    import torch

    mode = smoke_mode() if args.smoke else GPU_MODE
    ctx = Ctx(mode, args.out, args.work, torch.cuda.is_available())
    report = Report(args.out, "GPU bench")
    run_end = args.run_start + args.budget * (SMOKE_SLACK if args.smoke else 1.0)
    t_start = args.launched
    for name in args.child.split(","):
        budget, why = section_budget(name, args.smoke, run_end - t_start)
        if why is not None:
            report.update(**{name: {"status": "skipped", "skipped": [why], "budget_s": 0}})
            print(f"[{name}] skipped: {why}", flush=True)
            continue
        print(f"[{name}] start, budget {budget:.0f} s", flush=True)
        sec = Section(name, report, budget, t_start + budget)
        sec.data["pid"] = os.getpid()  # which sections shared a process
        sec.save()
        try:
            if name != "setup" and not (ctx.teacher / "model_index.json").exists():
                sec.skip("no teacher: the setup section did not finish")
            else:
                RUNNERS[name](sec, ctx)
            sec.finish()
        except Exception as e:
            traceback.print_exc()
            sec.note(f"stopped by {type(e).__name__}: {str(e)[:300]}")
            sec.data["status"] = f"partial: {type(e).__name__}"
            sec.save()
        print(f"[{name}] {sec.data['status']}", flush=True)
        t_start = time.time()


def parent(args: argparse.Namespace) -> int:
    """Each group of sections in a child, killed at the group's budget; the report records
    how each section ended."""
    report = Report(args.out, "GPU bench")
    cmd = " ".join(["python", "tests/bench/gpu.py", *sys.argv[1:]])
    report.update(
        {"command": cmd, "mode": "smoke" if args.smoke else "gpu", "budget_s": args.budget}
    )
    slack = SMOKE_SLACK if args.smoke else 1.0
    names = ["setup", *args.sections]
    each = ", ".join(f"{n} {BUDGETS_S[n] * slack:.0f}" for n in names)
    total = sum(BUDGETS_S[n] for n in names) * slack
    print(f"budget: run {args.budget * slack:.0f} s; sections {total:.0f} s ({each})", flush=True)
    start = time.time()
    for group in groups(names, args.isolate):
        run_left = args.budget * slack - (time.time() - start)
        runs = []
        for name in group:
            _, why = section_budget(name, args.smoke, run_left)
            if why is None:
                runs.append(name)
                continue
            report.update(**{name: {"status": "skipped", "skipped": [why], "budget_s": 0}})
            print(f"[{name}] skipped: {why}", flush=True)
        if not runs:
            continue
        want = sum(BUDGETS_S[n] for n in runs) * slack
        code = run_child(args, runs, start, min(want, run_left))
        sections = report.load()["sections"]
        for name in runs:
            section = sections.get(name)
            if section is None:
                why = f"not started: its child {_ended(code)} before it"
                section = {"status": "skipped", "skipped": [why], "budget_s": 0}
            elif section.get("status") == "running":
                section["status"] = f"partial: {_ended(code)}"
            else:
                continue
            report.update(**{name: section})
            print(f"[{name}] {section['status']}", flush=True)
    total = time.time() - start
    report.update({"seconds": round(total, 1)})
    print(f"wrote {report.json_path} and {report.md_path} in {total:.0f} s", flush=True)
    return 0


def _ended(code: int | None) -> str:
    return "was killed at its budget" if code is None else f"exited {code}"


def run_child(
    args: argparse.Namespace, names: list[str], start: float, budget: float
) -> int | None:
    """The child running `names`, its output passed through; killed (with its session) when
    `budget` seconds from now are spent (it checks its sections' deadlines between legs)."""
    import signal

    launched = time.time()
    cmd = [sys.executable, __file__, "--out", str(args.out), "--work", str(args.work)]
    cmd += ["--child", ",".join(names), "--budget", str(args.budget)]
    cmd += ["--run-start", f"{start:.3f}", "--launched", f"{launched:.3f}"]
    cmd += ["--smoke"] if args.smoke else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=budget + 5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="results and scratch folder")
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch folder, kept for a rerun (default OUT/work; ~25 GB on a GPU box)",
    )
    p.add_argument("--smoke", action="store_true", help="toy sizes: the CI check, on a CPU")
    p.add_argument(
        "--isolate",
        choices=("section", "run"),
        default=None,
        help="a process per section (default on a GPU) or one for the run (default with --smoke)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=float(sum(BUDGETS_S.values())),
        help="seconds for the whole run (default the sections' budgets, 475; x4 with --smoke)",
    )
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # sections, comma-separated
    p.add_argument("--run-start", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    args.isolate = args.isolate or ("run" if args.smoke else "section")
    args.out = args.out.absolute()
    args.work = (args.work or args.out / "work").absolute()
    if args.child:
        child(args)
        # Every result is on disk (Report writes atomically after each change): skip the
        # interpreter's teardown of torch, diffusers and transformers, which took ~7 s of a
        # loaded 2-core box (measured: exit after those imports, 7.0 s vs 0.1 s) and checks
        # nothing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
