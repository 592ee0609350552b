"""`wandistill train`: distil the cached teacher into a small student. Read top to bottom.

    run(cfg) = validate (manifest + recipe only, no device work) -> dist.init -> setup -> fit
               -> export (save_pretrained of the student and its EMA)

The helpers live by concept: `train.inputs` (validate -> `Plan`), `train.build` (student,
reader), `train.resume` (save / restore), `train.records` (run.json, sampling.json) and
`train.metrics` (the log window and its rows).

The loop needs the cache and the recipe, nothing else: it never imports `wandistill.teacher`,
never opens the teacher's folder (except `student.init_from_teacher`, which reads the chosen
tensors lazily with safetensors), and works with the teacher deleted. One step = `grad_accum`
micro-batches per rank; DDP syncs gradients on the last one only (`no_sync` on the others), so
N ranks x accumulation A trains the same as 1 rank x accumulation N*A up to float reordering.

SIGTERM / SIGINT (`failures.StopSignals`, installed in `run` only) only set a flag; at the next step
boundary the ranks agree through an all-reduce, all save a checkpoint at that same step, and the
run raises `Stopped` (exit code 143 / 130, "resume with --resume"): no rank is left in a collective.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wandistill.cache.reader import CacheReader
from wandistill.cache.training import TrainingReader, pad_to
from wandistill.checks.finite import check_step
from wandistill.config import TrainConfig, to_dict
from wandistill.errors import WandistillError
from wandistill.io import outputs
from wandistill.plots import LOSS_PNG, plot_loss
from wandistill.runtime import dist
from wandistill.runtime.failures import (
    Stopped,
    StopSignals,
    collective_error,
    is_collective_failure,
    is_oom,
)
from wandistill.runtime.faults import at
from wandistill.runtime.progress import SUMMARY_WIDTH, Progress, plural, summary_lines
from wandistill.student import experts, lora
from wandistill.student.config import describe
from wandistill.student.losses import SigmaTable, distill_losses
from wandistill.student.model import DistillModule
from wandistill.train import job, parallel
from wandistill.train.build import build_model, build_reader, objective_masks
from wandistill.train.ema import EMA
from wandistill.train.export import export_pretrained
from wandistill.train.inputs import Plan, console, run_inputs, validate
from wandistill.train.metrics import MetricsLog, Window, log_window
from wandistill.train.oom import oom_error
from wandistill.train.optim import build_optimizer, build_scheduler
from wandistill.train.records import experts_record, run_meta, sampling_record, write_run_settings
from wandistill.train.resume import restore, save


@dataclass(slots=True)
class Trainer:
    """Everything `setup` builds and `fit` uses."""

    cfg: TrainConfig
    info: dist.DistInfo
    plan: Plan
    model: DistillModule
    ddp: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: EMA
    reader: TrainingReader
    sigmas: SigmaTable
    metrics: MetricsLog
    start_step: int
    meta: dict[str, Any]
    masks: dict[str, torch.Tensor]
    """Objective -> [recorded slots] bool on the device: which samples each term covers."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    out: Path
    steps: int
    """Optimizer steps done when the run ended (== cfg.steps unless --follow ran out of data)."""
    student: Path
    student_ema: Path
    seconds: float
    corrupt: list[str] = field(default_factory=list)
    is_main: bool = True
    start_step: int = 0
    """The step this invocation started from (the checkpoint --resume restored, else 0)."""

    def lines(self, width: int = SUMMARY_WIDTH) -> list[str]:
        """The closing summary: steps this run and in all, wrapped to `width` columns."""
        return summary_lines(
            [
                f"trained {plural(self.steps, 'step')}:",
                f"{plural(self.steps - self.start_step, 'step')} this run,",
                f"{self.steps} total, in {self.seconds:.1f} s;",
                f"student: {self.student},",
                f"EMA: {self.student_ema}",
            ],
            width,
        )


# --------------------------------------------------------------------------- run


def run(
    cfg: TrainConfig, *, resume: bool = False, follow: bool = False, skip_corrupt: bool = False
) -> TrainResult:
    """Train a student on `cfg.cache` into `cfg.out`; under torchrun, one call per rank."""
    plan = validate(cfg, resume=resume, follow=follow)  # opens the caches, once
    info = job.join(cfg, resume=resume, follow=follow, skip_corrupt=skip_corrupt)
    started = time.perf_counter()
    trainer: Trainer | None = None
    folder: outputs.OutputFolder | None = None
    ok = False
    stop = StopSignals.install()
    try:
        folder = outputs.claim(plan.out, "run", info, inputs=run_inputs(cfg))
        trainer = setup(cfg, plan, info, resume=resume, follow=follow, skip_corrupt=skip_corrupt)
        start_step = trainer.start_step
        steps = fit(trainer, stop)
        sampling = sampling_record(trainer, steps)
        student, ema = export_pretrained(
            trainer.model.student, trainer.ema, plan.out, info, sampling
        )
        views = dist.all_gather_json(info, trainer.reader.corrupt)  # reported once, by rank 0
        corrupt = [m for view in views for m in view]
        trainer.metrics.write({"event": "end", "step": steps, "corrupt": len(corrupt)})
        if info.is_main:
            plot_loss(trainer.metrics.path, plan.out / LOSS_PNG)
        ok = True
    except Exception as e:
        friendly = explain_failure(e, cfg, info, trainer)
        if friendly is None:
            raise
        raise friendly from e
    finally:
        stop.restore()
        if folder is not None:
            folder.release()
        if trainer is not None:
            trainer.metrics.close()
            # Drop DDP before the process group: a Reducer destroyed later, with the GIL held,
            # can deadlock against gloo's worker threads (seen with torch 2.13 at exit).
            trainer.ddp = trainer.model
        if ok or info.backend != "nccl":  # nccl error path: exit at once, never wait on peers
            dist.cleanup()
        plan.close()
    return TrainResult(
        out=plan.out,
        steps=steps,
        student=student,
        student_ema=ema,
        seconds=time.perf_counter() - started,
        corrupt=corrupt,
        is_main=info.is_main,
        start_step=start_step,
    )


def stopped(signum: int, step: int, info: dist.DistInfo) -> Stopped:
    """Training stopped on SIGTERM / SIGINT after saving a checkpoint at `step`."""
    return Stopped(signum, f"at step {step}", info, "resume with --resume", resume_flag="--resume")


# --------------------------------------------------------------------------- setup


def setup(
    cfg: TrainConfig,
    plan: Plan,
    info: dist.DistInfo,
    *,
    resume: bool,
    follow: bool,
    skip_corrupt: bool,
) -> Trainer:
    """Build the run in the order its parts depend on: student (LoRA, sharding) -> optimizer and
    EMA over the weights as placed -> reader -> restore -> DDP (which broadcasts rank 0's
    restored weights) -> metrics and the run's settings file."""
    plan.out.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg, plan, info)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.steps)
    ema = EMA(model.student, cfg.optim.ema_decay)
    reader = build_reader(cfg, plan, info, follow=follow, skip_corrupt=skip_corrupt)
    store = reader.store  # plan.primary
    meta = run_meta(cfg, plan, info)
    start = 0
    if resume:
        start = restore(plan, info, meta, model, ema, optimizer, scheduler, reader)
    trainer = Trainer(
        cfg=cfg,
        info=info,
        plan=plan,
        model=model,
        ddp=model,
        optimizer=optimizer,
        scheduler=scheduler,
        ema=ema,
        reader=reader,
        sigmas=SigmaTable.from_cache(store.manifest.settings, plan.shared),
        metrics=MetricsLog(plan.out, enabled=False, tensorboard=False),
        start_step=start,
        meta=meta,
        masks=objective_masks(cfg, plan.objectives, info.device),
    )
    if cfg.parallel == "ddp":  # after restore: DDP broadcasts rank 0's (restored) weights
        trainer.ddp = parallel.wrap_ddp(model, info)
    trainer.metrics = MetricsLog(plan.out, enabled=info.is_main, tensorboard=cfg.tensorboard)
    if info.is_main:
        write_run_settings(
            plan.out, {"train": to_dict(cfg), "student_config": plan.student_config, **meta}
        )
        announce(trainer, store, follow)
    return trainer


def announce(t: Trainer, store: CacheReader, follow: bool) -> None:
    cfg, info = t.cfg, t.info
    n_params = sum(p.numel() for p in t.model.student.parameters())
    global_batch = cfg.batch_size * cfg.grad_accum * info.world_size
    state = "complete" if store.complete else "still being written"
    phrases = [
        f"train: student {describe(t.plan.student_config)},",
        f"{n_params / 1e6:.2f}M params;",
        *([f"{lora.describe(t.model.student)};"] if lora.is_lora(t.model.student) else []),
        f"{info.world_size} rank(s) on {info.device.type} x batch {cfg.batch_size} x accum "
        f"{cfg.grad_accum} = {global_batch} samples/step;",
        f"cache {store.path} ({len(store)} records, {state})",
        *(
            f"+ cache {s.path} ({len(s)} records, "
            f"{'complete' if s.complete else 'still being written'})"
            for s in t.reader.stores[1:]
        ),
        *([f"weights {t.reader.weights}"] if t.reader.weights else []),
    ]
    groups = [phrases, parallel.describe(cfg, info) if cfg.parallel == "fsdp" else []]
    groups.append(f"train: {t.plan.objectives.describe()[0]}".split(" "))
    for line in (line for g in groups for line in summary_lines(g)):  # short lines: 80 columns
        console.print(line)
    split = experts_record(t)
    if split is not None:
        high, low = (list(split[f"{n}_steps"]) for n in experts.EXPERTS)
        console.print(
            f"train: per-expert students split at t = {split['boundary_timestep']:g}: K-step "
            f"steps {high} -> transformer, {low} -> transformer_2"
        )
    if not store.complete and not follow:
        console.print(
            "[yellow]train: the cache is not complete; training on the records committed so "
            "far (pass --follow to wait for more)[/yellow]"
        )


# --------------------------------------------------------------------------- fit


def fit(t: Trainer, stop: StopSignals | None = None) -> int:
    """The loop: accumulate, clip, step, EMA, log, checkpoint. Returns the steps done."""
    cfg, info = t.cfg, t.info
    samples_per_step = cfg.batch_size * cfg.grad_accum * info.world_size
    batches = iter(t.reader)
    step = saved = t.start_step
    window = Window()
    shown: dict[str, float] = {}
    t.metrics.write({"event": "start", "step": step, "world_size": info.world_size})
    with Progress(
        total=cfg.steps, description="train", enabled=info.is_main, unit="step", initial=step
    ) as bar:
        while step < cfg.steps:
            signum = stop.agreed(info) if stop is not None else 0
            if signum:  # every rank stops here, at the same step, after the same checkpoint
                if step != saved:
                    _last_save(t, step, window, samples_per_step)
                raise stopped(signum, step, info)
            t0 = time.perf_counter()
            wait = 0.0
            terms: dict[str, torch.Tensor] = {}  # this step's terms, for the finiteness check
            batch: dict[str, Any] | None = None
            for micro in range(cfg.grad_accum):
                w0 = time.perf_counter()
                batch = next(batches, None)
                wait += time.perf_counter() - w0
                if batch is None:
                    break
                no_sync = info.distributed and micro < cfg.grad_accum - 1  # not the last
                with parallel.no_sync(t.ddp) if no_sync else contextlib.nullcontext():
                    losses, counts = forward(t, batch)
                    if at("train", "loss", step + 1, info.rank):  # test-only NaN
                        losses = {k: v * float("nan") for k, v in losses.items()}
                    (losses["loss"] / cfg.grad_accum).backward()
                window.add_micro(losses, counts, cfg.grad_accum)
                for k, v in losses.items():
                    terms[k] = terms.get(k, 0.0) + v.detach()
            if batch is None:  # --follow: the cache is complete and every batch is used
                t.optimizer.zero_grad(set_to_none=True)
                if info.is_main:
                    console.print(f"train: the cache is complete and exhausted at step {step}")
                break
            lr = t.optimizer.param_groups[0]["lr"]
            grad_norm = parallel.full(  # FSDP: a DTensor, the same on every rank
                torch.nn.utils.clip_grad_norm_(
                    t.model.parameters(), cfg.optim.grad_clip or float("inf")
                )
            )
            check_step(info, step + 1, terms, grad_norm, saved)  # every rank, before the update
            t.optimizer.step()
            t.scheduler.step()
            t.optimizer.zero_grad(set_to_none=True)
            t.ema.update(t.model.student)
            step += 1
            at("train", "step", step, info.rank)

            window.add(grad_norm, lr, time.perf_counter() - t0, wait)
            if step % cfg.log_every == 0 or step == cfg.steps:
                shown = log_window(t, step, window, samples_per_step)
            bar.advance(1, **shown)
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save(t, step)
                saved = step
                at("train", "saved", step, info.rank)
    if step != saved:
        _last_save(t, step, window, samples_per_step)
    return step


def _last_save(t: Trainer, step: int, window: Window, samples_per_step: int) -> None:
    """A checkpoint at an unsaved last step (the run's end, or a stop), its metrics row first."""
    if window.steps:
        log_window(t, step, window, samples_per_step)
    save(t, step)


def forward(
    t: Trainer, batch: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One micro-batch through the student; every loss term in fp32, and how many samples each
    term covered."""
    dev = t.info.device
    on = {k: v.to(dev, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
    masks = {n: m[on["step_slot"]] for n, m in t.masks.items()}
    loss = t.cfg.loss
    sigma = t.sigmas(on["step_slot"], on["timesteps"]) if loss.x0_terms else None
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=t.cfg.mixed_precision == "bf16"):
        embeds = pad_to(on["prompt_embeds"], t.reader.store.max_sequence_length).float()
        # One forward at the recorded x_t of each sample if a weighted objective uses them
        if loss.at_recorded_points:
            pred, feats = t.ddp(on["xt"].float(), on["timesteps"].float(), embeds)
        else:  # unroll alone: no forward at single points
            pred, feats = on["xt"].new_zeros((0, *on["xt"].shape[1:])).float(), {}
        unrolled = _unroll(t, on, embeds, masks["unroll"]) if loss.unroll > 0 else None
        perflow_v = _perflow(t, on, sigma) if loss.perflow > 0 else None
    terms = distill_losses(pred, feats, on, loss, sigma, masks, unrolled, perflow_v)
    return terms, {n: m.sum() for n, m in masks.items()}


def _perflow(t: Trainer, on: dict[str, Any], sigma: torch.Tensor | None) -> torch.Tensor:
    """[B, ...] the straight velocity across each sample's window (`student.perflow`), from
    each sample's own sigma (`forward` has it: perflow is an x0 term) to its window end's."""
    from wandistill.student.perflow import window_velocity

    assert sigma is not None
    ends = t.plan.objectives.next_slots()
    assert ends is not None
    sigma_end = t.sigmas.next(on["step_slot"], on["timesteps_next"], ends)
    return window_velocity(on["xt"], on["xt_next"], sigma, sigma_end)


def _unroll(
    t: Trainer, on: dict[str, Any], embeds: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[B, ...] the student's K-step final latent from each covered sample's noise (rows outside
    `mask` are the cached final latent, ignored by the loss)."""
    from wandistill.student.unroll import unroll_final

    out = on["final_latent"].float().clone()
    rows = mask.nonzero().flatten()
    if rows.numel():
        s = t.plan.objectives.student

        def step(x: torch.Tensor, ts: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
            return t.ddp(x, ts, cond)[0]

        final = unroll_final(
            step,
            on["noise"][rows],
            embeds[rows],
            s.sigmas,
            s.timesteps,
            checkpointed=t.cfg.loss.unroll_checkpoint,
        )
        out = out.index_put((rows,), final.float())
    return out


# --------------------------------------------------------------------------- failures


def explain_failure(
    e: Exception, cfg: TrainConfig, info: dist.DistInfo, t: Trainer | None
) -> WandistillError | None:
    """OOM and lost peers become one clear error; anything else keeps its traceback."""
    if isinstance(e, WandistillError):
        return None
    if is_oom(e):
        n = sum(p.numel() for p in t.model.student.parameters()) if t is not None else 0
        known = {} if t is None else {"student_config": t.plan.student_config}
        return oom_error(cfg, info, n, e, **known, dims=t.plan.manifest.dims if t else None)
    if info.distributed and is_collective_failure(e):
        return collective_error(info, e)
    return None
