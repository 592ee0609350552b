#!/usr/bin/env python
"""Train benchmark: offline distillation from the cache vs online distillation vs in-memory.

    python tests/bench/train.py [--steps 100] [--repeats 2] [--height 256] [--layers 3] [--json F]

All legs run in one invocation on the tiny teacher (`make_tiny_teacher`), with one student
config, batch size, step count, optimizer, LR schedule, EMA and loss (pipelines/tiny.toml's
[train] section with the sizes below), and every leg drives the package's own loop
(`wandistill.train.loop.setup -> fit -> export`); only where the batches come from differs:

(a) offline   `wandistill.train.run(cfg)` on a cache built once by `wandistill.precompute.run`
              (TrainingReader streaming (record, recorded step) samples). The product.
(b) online    the design it replaces: the teacher in the loop. Each step draws B training prompts
              (uniformly, with replacement) with fresh noise seeds, encodes them with the teacher's
              UMT5 text encoder (WanPipeline.tokenizer / .text_encoder), runs the teacher's sampler
              with CFG (the same scheduler, steps, guidance scale and negative-prompt embedding as
              the cache: cond + uncond transformer forwards per step, batched over the B prompts)
              through the whole trajectory, and takes from each trajectory one uniformly random
              recorded step (x_t, t, guided output) plus its final latent (the recipe's
              final-latent loss needs the end of the trajectory). Then the same student update.
(b2) online, trajectory-shared: the cheapest honest online variant. Each step samples B/S
              prompts (S = recorded steps per trajectory) and uses all S recorded steps of each
              trajectory as the batch: the same teacher work per sample as precompute, but
              batches of S correlated samples per prompt.
(c) in-memory the upper bound: the exact batches (a) trains on, in (a)'s order, read once through
              the same TrainingReader before the clock starts and held as tensors; each step only
              stacks them. (a) and (c) therefore compute the same numbers: the bench checks that
              their losses and exported students are bit-identical.

The online legs encode the (constant) negative prompt once at start-up, not per step, and run
teacher and student one after the other in one process (no overlap), as a plain online loop does.
Before (b) and (b2) start, the online generator is checked against the cache: precompute's first
batch of prompts is regenerated from its prompts and seeds, batched the same way, and compared
with the cached embeddings, x_t, teacher outputs and final latents (bit-identical so far).

Each leg runs in a fresh subprocess so its peak RSS (`ru_maxrss`) is its own. Step times come from
the leg's `metrics.jsonl` (`step_time_s`, `data_wait_frac` per log window, as `fit` measures them:
from the start of a step, including waiting for its batch, to after the EMA update; logging and
checkpointing are outside). Each run's first log window (warm-up) is dropped; the other
windows of all --repeats rounds (interleaved: a, b, b2, c, a, ...) are pooled into a mean
(total steps / total time), a median window and a fastest window. On a shared machine the
fastest window is the least disturbed figure and the median the typical one.

Threads: one torch intra-op thread per leg, and for the cache build, by default (--threads). On
a shared 2-core VM two OpenMP threads per process swing step times by 10-20x whenever another
process takes a core (a 1.8 s cache build took 35 s); with one, the reader's threads in (a) have
the second core, as they would beside a GPU.

Prints steps/s of each leg, (a)/(b), (a)/(b2), (a)/(c), the data-wait share of (a), and peak RSS
of (a) vs (c). Targets (issue 4, item 7): (a)/(c) >= 0.95, data wait of (a) <= 2%, peak RSS
(a)/(c) <= 1.1. Not a pytest test (tests/bench is excluded from collection).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from harness import (  # tests/bench, next to this script
    bootstrap_interval,
    busy_cpu_seconds,
    machine_line,
    max_rss_bytes,
    own_cpu_seconds,
    paired_ratios,
    proc_status,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "pipelines" / "tiny.toml"
LEGS = {
    "a": "offline: train.run on the cache",
    "b": "online: teacher per sample",
    "b2": "online: trajectory-shared",
    "c": "in-memory tensors",
}
MB = 1024**2


# --------------------------------------------------------------------------------- config


def prompts_for(n: int) -> list[str]:
    """The demo's prompts (the trained teacher's grammar, wandistill/demo.py), deterministic."""
    from wandistill.teacher.world import synthetic_prompts

    return synthetic_prompts(n, seed=0)


def precompute_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    return [
        f'precompute.teacher.path="{work / "teacher"}"',
        f'precompute.prompts="{work / "prompts.txt"}"',
        f'precompute.cache.path="{work / "cache"}"',
        f"precompute.sampler.height={args.height}",
        f"precompute.sampler.width={args.width}",
        f"precompute.sampler.num_inference_steps={args.sampler_steps}",
        "precompute.previews=0",
    ]


def train_overrides(args: argparse.Namespace, cache: Path, out: Path) -> list[str]:
    return [
        f'train.cache="{cache}"',
        f'train.out="{out}"',
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.log_every={args.log_every}",
        f"train.checkpoint_every={args.steps}",  # one checkpoint, at the end, in every leg
        f"train.data_threads={args.data_threads}",
        f"train.seed={args.seed}",
        'train.device="cpu"',
        f"train.student.num_layers={args.layers}",
        f"train.student.num_attention_heads={args.heads}",
        f"train.student.attention_head_dim={args.head_dim}",
        f"train.student.ffn_dim={args.ffn}",
    ]


def build_cache(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tiny teacher, prompt file and cache (precompute, timed). Returns what it measured."""
    from wandistill.config import load_recipe
    from wandistill.precompute.run import run as precompute
    from wandistill.teacher.tiny import make_tiny_teacher

    make_tiny_teacher(work / "teacher")
    (work / "prompts.txt").write_text("\n".join(prompts_for(args.prompts)) + "\n")
    cfg = load_recipe(RECIPE, precompute_overrides(args, work)).precompute
    t0 = time.perf_counter()
    summary = precompute(cfg, quiet=True)
    seconds = time.perf_counter() - t0
    from wandistill.cache.reader import CacheReader
    from wandistill.cache.training import TrainingReader

    with CacheReader(work / "cache") as store:
        train_samples = TrainingReader(store, batch_size=1).batches_per_epoch()
        records = len(store)
    return {
        "seconds": seconds,
        "records": records,
        "train_samples": train_samples,
        "bytes": summary.bytes_written,
    }


# --------------------------------------------------------------------------------- batch sources


class _Source:
    """Duck-types the part of TrainingReader that `loop.fit` / `loop.forward` / `save` use."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.epoch = 0
        self.corrupt: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "source": type(self).__name__}


def _pad_stack(rows: list[torch.Tensor]) -> torch.Tensor:
    """[L_i, D] rows -> zero-padded [B, max L_i, D], as TrainingReader(pad="batch") does."""
    out = rows[0].new_zeros((len(rows), max(r.shape[0] for r in rows), rows[0].shape[1]))
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def collate(rows: list[dict[str, torch.Tensor]], keys: list[str], slots: list[int]) -> dict:
    batch: dict[str, Any] = {}
    for name in rows[0]:
        items = [r[name] for r in rows]
        batch[name] = _pad_stack(items) if name == "prompt_embeds" else torch.stack(items)
    batch["prompt_len"] = torch.tensor([r["prompt_embeds"].shape[0] for r in rows])
    batch["key"] = keys
    batch["step_slot"] = torch.tensor(slots)
    return batch


class InMemory(_Source):
    """(c): the batches a TrainingReader yields, read before the clock starts, kept as tensors.

    Unique (record, step) samples are stored once (unpadded embeddings), so memory is at most the
    training set; each step re-stacks its batch in the reader's order."""

    def __init__(self, reader: Any, steps: int) -> None:
        super().__init__(reader.store)
        self.samples: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.order: list[tuple[list[tuple[str, int]], int]] = []
        it = iter(reader)
        try:
            for _ in range(steps):
                b = next(it)
                ids = []
                for i, (key, slot) in enumerate(
                    zip(b["key"], b["step_slot"].tolist(), strict=True)
                ):
                    if (key, slot) not in self.samples:
                        n = int(b["prompt_len"][i])
                        self.samples[(key, slot)] = {
                            name: (v[i, :n] if name == "prompt_embeds" else v[i]).clone()
                            for name, v in b.items()
                            if torch.is_tensor(v) and name not in ("prompt_len", "step_slot")
                        }
                    ids.append((key, slot))
                self.order.append((ids, reader.epoch))
        finally:
            it.close()  # shuts the reader's thread pool
        self.nbytes = sum(
            t.numel() * t.element_size() for s in self.samples.values() for t in s.values()
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for ids, epoch in self.order:
            self.epoch = epoch
            yield collate([self.samples[i] for i in ids], [k for k, _ in ids], [s for _, s in ids])


class Online(_Source):
    """(b) / (b2): training batches generated by the teacher inside the loop (see the docstring).

    mode "sample": B prompts, one random recorded step of each full trajectory.
    mode "trajectory": B / S prompts, every recorded step of each trajectory."""

    def __init__(
        self,
        store: Any,
        teacher: Path,
        fields: list[str],
        batch_size: int,
        mode: str,
        seed: int,
        precompute_batch: int,
    ) -> None:
        super().__init__(store)
        started = time.perf_counter()
        from diffusers import WanPipeline

        from wandistill.cache.contract import is_holdout
        from wandistill.teacher.encode import encode_trimmed
        from wandistill.teacher.sampler import RecordingSampler, SamplerSpec

        s = store.manifest.settings
        if s.boundary_ratio is not None:
            raise SystemExit("the online legs support one-expert (Wan 2.1) teachers only")
        self.encode_trimmed = encode_trimmed
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            s.dtype or "fp32"
        ]
        pipe = WanPipeline.from_pretrained(teacher, torch_dtype=self.dtype)
        self.tokenizer, self.encoder = pipe.tokenizer, pipe.text_encoder.eval()
        self.model = pipe.transformer.eval()
        self.msl = int(s.max_sequence_length or 512)
        self.steps = list(s.record_steps or [])
        spec = SamplerSpec(
            num_inference_steps=int(s.num_inference_steps or 0),
            guidance_scale=float(s.guidance_scale or 0.0),
            guidance_scale_2=None,
            boundary_timestep=None,
            expand_timesteps=s.expand_timesteps,
            record_steps=tuple(self.steps),
            features=(),
            latent_shape=tuple(store.manifest.dims.latent_shape),
            max_sequence_length=self.msl,
        )
        self.sampler = RecordingSampler(pipe.scheduler, spec)
        self.negative = self.encode([s.negative_prompt or ""])[0]
        self.startup_s = time.perf_counter() - started  # teacher load + negative prompt
        frac = float(s.holdout_fraction or 0.0)
        records = [store.read_record(e, i) for e, i in store.locate().values()]
        self.prompts = sorted({r.prompt for r in records if not is_holdout(r.key, frac)})
        self.fields = [f for f in fields if f != "step_slot"]
        self.mode = mode
        self.batch_size = batch_size
        if mode == "trajectory" and batch_size % len(self.steps):
            raise SystemExit(f"--batch-size must be a multiple of {len(self.steps)} for (b2)")
        self.gen = torch.Generator().manual_seed(seed)
        # precompute's first batch: the first `precompute_batch` prompts of the file, same seeds
        first = sorted(records, key=lambda r: r.seed)[:precompute_batch]
        self.check = self.verify(first)
        self.generated = 0

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        return self.encode_trimmed(
            self.tokenizer, self.encoder, prompts, max_sequence_length=self.msl, dtype=self.dtype
        ).embeds

    def trajectories(self, prompts: list[str], seeds: list[int]) -> list[Any]:
        from wandistill.teacher.sampler import Job

        embeds = self.encode(prompts)
        jobs = [
            Job(key=f"online-{i}", prompt=p, seed=s, embeds=e, negative=self.negative)
            for i, (p, s, e) in enumerate(zip(prompts, seeds, embeds, strict=True))
        ]
        state = self.sampler.start(jobs, torch.device("cpu"))
        self.sampler.advance(state, self.model, "transformer", torch.device("cpu"))
        return self.sampler.finish(state)

    def verify(self, records: list[Any]) -> dict[str, float]:
        """Regenerate cached records (one precompute batch) from their prompts and seeds, batched
        as precompute batched them; max |diff| per field (0.0: bit-identical)."""
        got = self.trajectories([r.prompt for r in records], [r.seed for r in records])
        return {
            name: max(
                float((getattr(g, name).float() - getattr(r, name).float()).abs().max())
                for g, r in zip(got, records, strict=True)
            )
            for name in ("prompt_embeds", "xt", "teacher_out", "final_latent", "timesteps")
        }

    def _row(self, rec: Any, k: int) -> dict[str, torch.Tensor]:
        full = {
            "prompt_embeds": rec.prompt_embeds,
            "xt": rec.xt[k],
            "timesteps": rec.timesteps[k],
            "teacher_out": rec.teacher_out[k],
            "final_latent": rec.final_latent,
        }
        return {f: full[f] for f in self.fields}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        n_steps = len(self.steps)
        while True:
            per = 1 if self.mode == "sample" else n_steps
            n = self.batch_size // per
            idx = torch.randint(len(self.prompts), (n,), generator=self.gen).tolist()
            seeds = torch.randint(2**31 - 1, (n,), generator=self.gen).tolist()
            recs = self.trajectories([self.prompts[i] for i in idx], seeds)
            if self.mode == "sample":
                slots = torch.randint(n_steps, (n,), generator=self.gen).tolist()
                pairs = list(zip(recs, slots, strict=True))
            else:
                pairs = [(r, k) for r in recs for k in range(n_steps)]
            rows = [self._row(r, k) for r, k in pairs]
            self.generated += len(rows)
            yield collate(rows, [f"online-{self.generated}"] * len(rows), [k for _, k in pairs])


# --------------------------------------------------------------------------------- one leg


def run_loop(cfg: Any, make_source: Callable[[Any], _Source] | None) -> dict[str, Any]:
    """`wandistill.train.run(cfg)` when make_source is None; else the same validate -> setup ->
    fit -> export with the trainer's TrainingReader swapped for another batch source."""
    if make_source is None:
        from wandistill.train import run

        t0 = time.perf_counter()
        run(cfg)
        return {"leg_seconds": time.perf_counter() - t0}
    from wandistill.runtime import dist
    from wandistill.train import inputs, loop, records
    from wandistill.train.export import export_pretrained

    t0 = time.perf_counter()
    plan = inputs.validate(cfg, resume=False)
    info = dist.init(cfg.device)
    trainer = None
    try:
        trainer = loop.setup(cfg, plan, info, resume=False, follow=False, skip_corrupt=False)
        source = make_source(trainer)
        trainer.reader = source  # type: ignore[assignment]
        steps = loop.fit(trainer)
        sampling = records.sampling_record(trainer, steps)
        export_pretrained(trainer.model.student, trainer.ema, plan.out, info, sampling)
        trainer.metrics.write({"event": "end", "step": steps, "corrupt": 0})
    finally:
        if trainer is not None:
            trainer.metrics.close()
        dist.cleanup()
        plan.close()
    extra: dict[str, Any] = {"leg_seconds": time.perf_counter() - t0}
    if isinstance(source, Online):
        extra["online_check_max_abs_diff"] = source.check
        extra["online_prompts"] = len(source.prompts)
        extra["online_startup_s"] = source.startup_s
    if isinstance(source, InMemory):
        extra["preloaded_samples"] = len(source.samples)
        extra["preloaded_bytes"] = source.nbytes
    return extra


def child(spec_path: Path) -> None:
    """One leg, in its own process: spec JSON in, result JSON out (spec['result'])."""
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    from diffusers import WanTransformer3DModel  # noqa: F401  (same baseline in every leg)

    from wandistill.config import load_recipe
    from wandistill.train import loop  # noqa: F401

    rss0 = proc_status().get("VmRSS", 0)
    recipe = load_recipe(RECIPE, spec["overrides"])
    cfg, pre_batch = recipe.train, recipe.precompute.sampler.batch_size
    leg, teacher, seed = spec["leg"], Path(spec["teacher"]), spec["online_seed"]

    def online(mode: str) -> Callable[[Any], _Source]:
        def make(t: Any) -> _Source:
            return Online(
                t.reader.store, teacher, t.plan.fields, cfg.batch_size, mode, seed, pre_batch
            )

        return make

    makers: dict[str, Callable[[Any], _Source] | None] = {
        "a": None,
        "b": online("sample"),
        "b2": online("trajectory"),
        "c": lambda t: InMemory(t.reader, cfg.steps),
    }
    extra = run_loop(cfg, makers[leg])
    from wandistill.train.metrics import read_metrics

    result = {
        "leg": leg,
        "rows": read_metrics(cfg.out),
        "rss_baseline": rss0,
        "rss_peak": max_rss_bytes(),
        "threads": torch.get_num_threads(),
        **extra,
    }
    Path(spec["result"]).write_text(json.dumps(result))


# --------------------------------------------------------------------------------- parent


def spawn_leg(
    leg: str, overrides: list[str], work: Path, tag: str, args: argparse.Namespace
) -> dict[str, Any]:
    spec = {
        "leg": leg,
        "overrides": overrides,
        "teacher": str(work / "teacher"),
        "threads": args.threads,
        "online_seed": args.seed + 1,
        "result": str(work / f"result-{tag}.json"),
    }
    spec_path = work / f"spec-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"log-{tag}.txt"
    b0, c0, t0 = busy_cpu_seconds(), own_cpu_seconds(children_only=True), time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    wall = time.perf_counter() - t0
    cpu = own_cpu_seconds(children_only=True) - c0
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"leg {leg} failed (exit {proc.returncode}); log: {log}")
    res = json.loads(Path(spec["result"]).read_text())
    res["cpu_seconds"] = cpu
    res["others_cores"] = max(0.0, (busy_cpu_seconds() - b0) - cpu) / wall
    res["process_seconds"] = wall
    return summarize(res)


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per-window step times and data-wait shares from the metrics rows; the first window
    (warm-up) is kept apart."""
    windows, prev = [], 0
    for row in res["rows"]:
        if "step_time_s" in row:
            n = row["step"] - prev
            prev = row["step"]
            secs = row["step_time_s"] * n
            windows.append({"steps": n, "seconds": secs, "wait": row["data_wait_frac"] * secs})
    res["first_window"] = windows[0]
    res["windows"] = windows[1:] if len(windows) > 1 else windows
    res["losses"] = [row["loss"] for row in res["rows"] if "step_time_s" in row]
    res["steady"] = pooled([res])
    res.pop("rows")
    return res


def pooled(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Steady windows of every round of a leg: mean (total steps / total time), median window and
    fastest window steps/s, and the data-wait share of all of them."""
    ws = [w for r in runs for w in r["windows"]]
    n = sum(w["steps"] for w in ws)
    secs = sum(w["seconds"] for w in ws)
    rates = sorted(w["steps"] / w["seconds"] for w in ws)
    return {
        "windows": len(ws),
        "steps": n,
        "seconds": secs,
        "steps_per_s": n / secs,
        "median_window": statistics.median(rates),
        "best_window": rates[-1],
        "step_ms": 1e3 * secs / n,
        "wait_frac": sum(w["wait"] for w in ws) / secs,
    }


def paired_rounds(xs: list[dict[str, Any]], ys: list[dict[str, Any]]) -> list[float]:
    """[median, low, high] of round r's (x) steady steps/s over round r's (y), with the 95%
    interval: the legs of a round ran back to back, so load that drifts between rounds cancels."""
    ratios = paired_ratios(
        [r["steady"]["steps_per_s"] for r in xs], [r["steady"]["steps_per_s"] for r in ys]
    )
    return [statistics.median(ratios), *bootstrap_interval(ratios)]


def student_digest(out: Path) -> str:
    f = out / "student" / "diffusion_pytorch_model.safetensors"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else "-"


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=64, help="prompts in the cache (1/8 held out)")
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--sampler-steps", type=int, default=8, help="teacher steps (all recorded)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=3, help="student blocks")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=12)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--data-threads", type=int, default=2, help="TrainingReader threads (a)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per leg")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, help="scratch folder (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    p.add_argument("--json", type=Path, help="write every figure here")


def describe_setup(args: argparse.Namespace, cache: dict[str, Any]) -> list[str]:
    width = args.heads * args.head_dim
    lat = (args.height // 8, args.width // 8)
    return [
        f"# {' '.join(sys.argv)}",
        f"# {machine_line()}",
        f"# teacher: tiny Wan 2.1 (2 blocks, width 24, ffn 32), {args.height}x{args.width}x1 "
        f"(latent 16x1x{lat[0]}x{lat[1]}, {lat[0] * lat[1] // 4} tokens), "
        f"{args.sampler_steps} steps, CFG 5.0, fp32",
        f"# cache: {cache['records']} records ({cache['train_samples']} training samples), "
        f"{cache['bytes'] / MB:.1f} MiB, built in {cache['seconds']:.1f} s",
        f"# student: {args.layers} blocks x width {width} ({args.heads}x{args.head_dim}), "
        f"ffn {args.ffn}; batch {args.batch_size}; loss output 1.0 + final_latent 0.1; "
        f"AdamW lr 3e-3 (tiny.toml); {args.threads} torch thread(s) per leg",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    add_common(p)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per leg")
    p.add_argument("--legs", default="a,b,b2,c")
    p.add_argument(
        "--repeats", type=int, default=2, help="interleaved rounds (a, b, b2, c, a, ...)"
    )
    args = p.parse_args()
    if args.child is not None:
        child(args.child)
        return
    legs = [x.strip() for x in args.legs.split(",") if x.strip()]
    if unknown := [x for x in legs if x not in LEGS]:
        raise SystemExit(f"unknown legs {unknown}; choose from {list(LEGS)}")
    torch.set_num_threads(args.threads)  # the cache build too (see "Threads" above)
    work = args.work or Path(tempfile.mkdtemp(prefix="wandistill-bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        cache = build_cache(args, work)
        runs: dict[str, list[dict[str, Any]]] = {leg: [] for leg in legs}
        for r in range(args.repeats):
            for leg in legs:
                out = work / f"run-{leg}-{r}"
                res = spawn_leg(
                    leg, train_overrides(args, work / "cache", out), work, f"{leg}-{r}", args
                )
                res["student_sha"] = student_digest(out)
                runs[leg].append(res)
                print(
                    f"  round {r} {leg:>2}: {res['steady']['steps_per_s']:.2f} steps/s steady, "
                    f"wait {100 * res['steady']['wait_frac']:.1f}%, peak RSS "
                    f"{res['rss_peak'] / MB:.0f} MiB, others {res['others_cores']:.2f} cores",
                    flush=True,
                )
                shutil.rmtree(out, ignore_errors=True)
        report(args, cache, runs, time.perf_counter() - t0)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(
    args: argparse.Namespace,
    cache: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    total: float,
) -> None:
    for line in describe_setup(args, cache):
        print(line)
    print(
        f"# {args.steps} steps per leg, log window {args.log_every}, {args.repeats} interleaved "
        f"round(s); steady windows (all but each run's first) pooled over rounds; "
        f"bench wall {total:.0f} s"
    )
    legs = {leg: pooled(rs) for leg, rs in runs.items()}
    print(
        f"{'leg':<36}{'steps/s':>8}{'median':>8}{'best':>7}{'ms/step':>9}{'wait':>7}"
        f"{'peak RSS':>10}{'+RSS':>8}{'others':>8}"
    )
    for leg, s in legs.items():
        rss = max(r["rss_peak"] for r in runs[leg])
        inc = max(r["rss_peak"] - r["rss_baseline"] for r in runs[leg])
        others = statistics.mean(r["others_cores"] for r in runs[leg])
        print(
            f"({leg}) {LEGS[leg]:<31}{s['steps_per_s']:>8.2f}{s['median_window']:>8.2f}"
            f"{s['best_window']:>7.2f}{s['step_ms']:>9.1f}{100 * s['wait_frac']:>6.1f}%"
            f"{rss / MB:>7.0f}MiB{inc / MB:>5.0f}MiB{others:>8.2f}"
        )
        s |= {"rss_peak": rss, "rss_increment": inc, "others_cores": others}
    print(
        "steps/s: total steady steps / their time; median / best: of the 10-step windows; wait: "
        "share of step time\nspent getting the batch (the reader in (a), the teacher in (b)/(b2), "
        "re-stacking in (c)); +RSS: peak\nminus RSS after imports; others: cores other processes "
        "kept busy during the leg (mean of rounds)"
    )
    for leg, rs in runs.items():
        first = rs[0]["first_window"]
        print(
            f"  ({leg}) per round steps/s: "
            + ", ".join(f"{r['steady']['steps_per_s']:.2f}" for r in rs)
            + f"; first window {1e3 * first['seconds'] / first['steps']:.0f} ms/step"
        )
    figures: dict[str, Any] = {"cache": cache, "legs": legs, "rounds": runs}
    for x, y, note in (("a", "b", ""), ("a", "b2", ""), ("a", "c", "   (target >= 0.95)")):
        if x in legs and y in legs:
            r = {
                k: legs[x][k] / legs[y][k] for k in ("steps_per_s", "median_window", "best_window")
            }
            figures[f"{x}/{y}"] = r
            print(
                f"steps/s ({x})/({y}): {r['steps_per_s']:.2f}x (median window "
                f"{r['median_window']:.2f}x, best window {r['best_window']:.2f}x){note}"
            )
            if args.repeats > 1:
                r["paired_rounds"] = paired_rounds(runs[x], runs[y])
                med, lo, hi = r["paired_rounds"]
                print(f"  paired rounds ({x})/({y}): {med:.2f}x, 95% {lo:.2f}-{hi:.2f}x")
    if "a" in legs:
        w = legs["a"]["wait_frac"]
        figures["a_wait"] = w
        print(f"data wait of (a): {100 * w:.2f}% of step time (target <= 2%)")
    if "a" in legs and "c" in legs:
        a, c = legs["a"], legs["c"]
        m, inc = a["rss_peak"] / c["rss_peak"], a["rss_increment"] / max(1, c["rss_increment"])
        figures["rss_a/c"], figures["rss_increment_a/c"] = m, inc
        print(f"peak RSS (a)/(c): {m:.2f} (target <= 1.1); above the import baseline: {inc:.2f}")
        c0 = runs["c"][0]
        print(
            f"(c) holds {c0.get('preloaded_samples')} unique samples in memory, "
            f"{c0.get('preloaded_bytes', 0) / MB:.1f} MiB"
        )
        same_loss = all(r["losses"] == runs["a"][0]["losses"] for r in runs["a"] + runs["c"])
        shas = {r["student_sha"] for r in runs["a"] + runs["c"]}
        figures["a_equals_c"] = same_loss and len(shas) == 1
        print(
            f"(a) and (c) bit-identical: losses {'yes' if same_loss else 'NO'}, exported student "
            f"{'yes' if len(shas) == 1 else 'NO'} ({', '.join(sorted(shas))})"
        )
    for leg in ("b", "b2"):
        if leg in runs:
            chk = runs[leg][0].get("online_check_max_abs_diff", {})
            print(
                f"({leg}) online generator vs cache (one precompute batch regenerated), "
                "max |diff|: " + ", ".join(f"{k} {v:.1e}" for k, v in chk.items())
            )
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "args": vars(args), **figures})


if __name__ == "__main__":
    main()
