"""`wandistill eval`: run the student's sampler from cached noise and embeddings, compare.

For each held-out record (by the cache's `holdout_fraction`, or every record of a separate cache)
the student denoises the record's own initial noise with the cache's scheduler, one forward per
step (it learned the guided output, so no CFG pass), and its final latent is compared with the
teacher's cached final latent: MSE and PSNR. It also scores the student on every recorded
(x_t, t) of those records (output-matching loss). Given the teacher folder, both final latents
are decoded with the VAE for an image PSNR and a teacher | student PNG grid. Deterministic: no
randomness is drawn anywhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wandistill import outputs
from wandistill.cache.reader import CacheStore
from wandistill.cache.schema import Record, is_holdout, pad_embeds
from wandistill.errors import UsageError
from wandistill.eval.metrics import image_psnr, mse, psnr
from wandistill.fsutil import atomic_write_bytes, atomic_write_json
from wandistill.modelfolder import load_pretrained, refuse_custom_code, require_safetensors
from wandistill.placements import Auto, Cpu, Cuda, Placement
from wandistill.teacher.folder import TeacherFolder


@dataclass(slots=True)
class EvalResult:
    records: int
    steps: int
    latent_mse: float
    latent_psnr: float
    noise_mse: float
    """MSE of the initial noise against the teacher's final latent: the do-nothing baseline."""
    step_loss: float
    image_psnr: float | None = None
    per_record: list[dict[str, Any]] = field(default_factory=list)
    grid: str | None = None

    def table(self) -> str:
        rows = [
            ("held-out records", f"{self.records}"),
            ("student steps", f"{self.steps}"),
            ("latent MSE vs teacher", f"{self.latent_mse:.5f}"),
            ("latent PSNR vs teacher (dB)", f"{self.latent_psnr:.2f}"),
            ("baseline: noise MSE vs teacher", f"{self.noise_mse:.5f}"),
            ("output-matching loss (recorded steps)", f"{self.step_loss:.5f}"),
        ]
        if self.image_psnr is not None:
            rows.append(("decoded image PSNR vs teacher (dB)", f"{self.image_psnr:.2f}"))
        width = max(len(r[0]) for r in rows)
        lines = [f"| {'metric':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
        return "\n".join(lines)


def make_scheduler(settings: dict[str, Any]) -> Any:
    """The teacher's scheduler, rebuilt from the cache manifest (no teacher folder needed)."""
    import diffusers

    cls = getattr(diffusers, settings["scheduler"], None)
    if cls is None:
        raise UsageError(f"cache names an unknown scheduler {settings['scheduler']!r}")
    return cls.from_config(settings["scheduler_config"])


@torch.no_grad()
def student_sample(
    student: torch.nn.Module,
    scheduler: Any,
    noise_BCFHW: torch.Tensor,
    embeds_BLD: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """The student's sampler: one forward per step, its output used as the guided prediction."""
    device = next(student.parameters()).device
    dtype = next(student.parameters()).dtype
    scheduler.set_timesteps(steps, device=device)
    scheduler.set_begin_index(0)
    latents = noise_BCFHW.to(device=device, dtype=torch.float32)
    cond = embeds_BLD.to(device=device, dtype=dtype)
    for t in scheduler.timesteps:
        pred = student(
            hidden_states=latents.to(dtype),
            timestep=t.expand(latents.shape[0]),
            encoder_hidden_states=cond,
            return_dict=False,
        )[0]
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    return latents.cpu()


def _held_out(store: CacheStore, split: str, limit: int | None) -> list[Record]:
    frac = float(store.manifest.settings.get("holdout_fraction", 0.0))
    located = sorted(store.locate().items())  # by key: deterministic
    if split == "holdout":
        if frac <= 0:
            raise UsageError(
                f"cache {str(store.path)!r} has no held-out records (holdout_fraction = 0)",
                fix="pass --split all with a separate eval cache, or precompute with "
                "--set cache.holdout_fraction=0.1",
            )
        located = [(k, v) for k, v in located if is_holdout(k, frac)]
    if limit is not None:
        located = located[:limit]
    if not located:
        raise UsageError(f"cache {str(store.path)!r} has no records in split {split!r}")
    return [store.read_record(*v) for _, v in located]


def load_student(path: str | Path) -> torch.nn.Module:
    """The student folder as a WanTransformer3DModel; an unloadable folder is a usage error."""
    from diffusers import WanTransformer3DModel

    from wandistill.student.config import check_saved_config

    require_safetensors(path, "student")
    check_saved_config(path)
    try:
        return load_pretrained(WanTransformer3DModel, path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"student {str(path)!r} cannot be loaded as a WanTransformer3DModel ({first})",
            fix="pass the student folder written by `wandistill train` (<out>/student)",
        ) from None


def evaluate(
    cache: str | Path,
    student_path: str | Path,
    out_dir: str | Path,
    *,
    teacher: str | Path | None = None,
    steps: int | None = None,
    split: str = "holdout",
    max_records: int | None = None,
    grid_records: int = 8,
    device: Placement | None = None,
) -> EvalResult:
    """`device` (`--device`, parsed by `placements.parse_device`): where the student and the
    teacher's VAE run, through the same placement objects precompute uses; default the CPU."""
    if not Path(student_path).is_dir():
        raise UsageError(
            f"student {str(student_path)!r} does not exist",
            fix="pass the student folder written by `wandistill train` (<out>/student)",
        )
    refuse_custom_code(student_path, "student")
    folder = TeacherFolder.open(teacher) if teacher is not None else None
    placement = _device_placement(device or Cpu(), folder)
    device = placement.execution_device()
    torch.manual_seed(0)
    student = load_student(student_path).to(device).eval().requires_grad_(False)
    with CacheStore(cache) as store:
        settings = store.manifest.settings
        _check_fit(student, store.manifest.dims, cache)
        records = _held_out(store, split, max_records)
    inputs = {"--cache": cache, "--student": student_path, "--teacher": teacher}
    with outputs.claim(out_dir, "eval", inputs=inputs) as out:  # every input checked out
        return _evaluate(
            student, records, settings, out.path, folder, steps, grid_records, placement
        )


def _evaluate(
    student: torch.nn.Module,
    records: list[Record],
    settings: dict[str, Any],
    out: Path,
    folder: TeacherFolder | None,
    steps: int | None,
    grid_records: int,
    placement: Placement,
) -> EvalResult:
    """Sample, score and write eval.json / eval.md / grid.png into the claimed folder."""
    device = placement.execution_device()
    msl = int(settings["max_sequence_length"])
    n_steps = steps or int(settings["num_inference_steps"])
    scheduler = make_scheduler(settings)
    finals, per_record, step_losses = [], [], []
    for rec in records:
        emb = pad_embeds(rec.prompt_embeds, msl).unsqueeze(0)
        final = student_sample(student, scheduler, rec.noise.unsqueeze(0), emb, n_steps)[0]
        finals.append(final)
        with torch.no_grad():
            dtype = next(student.parameters()).dtype
            pred = student(
                hidden_states=rec.xt.to(device=device, dtype=dtype),
                timestep=rec.timesteps.to(device),
                encoder_hidden_states=emb.expand(rec.xt.shape[0], -1, -1).to(device, dtype),
                return_dict=False,
            )[0].cpu()
        step_losses.append(mse(pred, rec.teacher_out))
        per_record.append(
            {
                "key": rec.key,
                "prompt": rec.prompt,
                "latent_mse": mse(final, rec.final_latent),
                "latent_psnr": min(psnr(final, rec.final_latent), 100.0),
                "step_loss": step_losses[-1],
            }
        )
    result = EvalResult(
        records=len(records),
        steps=n_steps,
        latent_mse=float(np.mean([r["latent_mse"] for r in per_record])),
        latent_psnr=float(np.mean([r["latent_psnr"] for r in per_record])),
        noise_mse=float(np.mean([mse(r.noise, r.final_latent) for r in records])),
        step_loss=float(np.mean(step_losses)),
        per_record=per_record,
    )
    decoded = _decode(folder, records, finals, result, placement) if folder else None
    write_grid(records, finals, decoded, out / "grid.png", grid_records)
    result.grid = str(out / "grid.png")
    atomic_write_json(out / "eval.json", asdict(result))
    atomic_write_bytes(out / "eval.md", (result.table() + "\n").encode())
    return result


def _check_fit(student: torch.nn.Module, dims: dict[str, Any], cache: str | Path) -> None:
    cfg = student.config
    if dims and (cfg.text_dim != dims["text_dim"] or cfg.in_channels != dims["latent_channels"]):
        raise UsageError(
            f"student (text_dim {cfg.text_dim}, in_channels {cfg.in_channels}) does not fit cache "
            f"{str(cache)!r} (text_dim {dims['text_dim']}, latent channels "
            f"{dims['latent_channels']})",
            fix="evaluate the student on a cache of the teacher it was distilled from",
        )


def latent_rgb(latent_CFHW: torch.Tensor, ref_CFHW: torch.Tensor) -> np.ndarray:
    """First three channels of frame 0 as RGB, scaled by the reference's range (shared scale)."""
    ref = ref_CFHW[:3, 0].float()
    lo, hi = float(ref.min()), float(ref.max())
    x = (latent_CFHW[:3, 0].float() - lo) / max(hi - lo, 1e-6)
    return (x.clamp(0, 1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def _upscale(img: np.ndarray, height: int) -> np.ndarray:
    from PIL import Image

    h, w = img.shape[:2]
    scale = max(1, height // h)
    return np.asarray(Image.fromarray(img).resize((w * scale, h * scale), Image.Resampling.NEAREST))


def _stretch(teacher_u8: np.ndarray, student_u8: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Contrast-stretch both images by the teacher's range so small differences show (a random
    tiny VAE decodes to nearly flat colour); the metrics use the raw pixels."""
    axes = tuple(range(teacher_u8.ndim - 1))  # per colour channel
    lo = teacher_u8.min(axis=axes).astype(np.float64)
    scale = 255.0 / np.maximum(teacher_u8.max(axis=axes) - lo, 1.0)

    def f(x: np.ndarray) -> np.ndarray:
        return np.clip((x.astype(np.float64) - lo) * scale, 0, 255).round().astype(np.uint8)

    return f(teacher_u8), f(student_u8)


def write_grid(
    records: list[Record],
    finals: list[torch.Tensor],
    decoded: tuple[np.ndarray, np.ndarray] | None,
    path: Path,
    rows: int,
    cell: int = 96,
) -> None:
    """One row per record: teacher | student latents (channels 0-2), then decoded frames."""
    from PIL import Image

    from wandistill.teacher.decode import frames_strip, save_png

    lines = []
    for i, (rec, fin) in enumerate(list(zip(records, finals, strict=True))[:rows]):
        cells = [latent_rgb(rec.final_latent, rec.final_latent), latent_rgb(fin, rec.final_latent)]
        if decoded is not None:
            t_img, s_img = _stretch(decoded[0][i], decoded[1][i])
            cells += [np.asarray(frames_strip(t_img)), np.asarray(frames_strip(s_img))]
        cells = [_upscale(c, cell) for c in cells]
        height = max(c.shape[0] for c in cells)
        gap = np.full((height, 6, 3), 255, np.uint8)
        padded = [
            np.pad(c, ((0, height - c.shape[0]), (0, 0), (0, 0)), constant_values=255)
            for c in cells
        ]
        lines.append(np.concatenate([x for c in padded for x in (c, gap)][:-1], axis=1))
    width = max(line.shape[1] for line in lines)
    lines = [
        np.pad(line, ((0, 6), (0, width - line.shape[1]), (0, 0)), constant_values=255)
        for line in lines
    ]
    save_png(Image.fromarray(np.concatenate(lines, axis=0)), path)


def _device_placement(device: Placement, folder: TeacherFolder | None) -> Placement:
    """`device` made concrete: auto is a GPU if the VAE fits one (the first GPU if there is no
    teacher to plan), else the CPU."""
    from wandistill.teacher import placement as pl
    from wandistill.teacher.plan import SamplerSizes

    if folder is not None:
        sizes = SamplerSizes(previews=True)  # Wan 480p decode: what a real teacher's eval does
        return pl.resolve_placement(
            device,
            folder=folder,
            dtype=torch.float32,
            sizes=sizes,
            components=("vae",),
            only=(Cuda, Cpu),
        )
    if isinstance(device, Auto):
        device = Cuda() if torch.cuda.is_available() else Cpu()
    return pl.resolve_placement(device, folder={}, dtype=torch.float32)


def _decode(
    teacher: TeacherFolder,
    records: list[Record],
    finals: list[torch.Tensor],
    result: EvalResult,
    placement: Placement,
) -> tuple[np.ndarray, np.ndarray]:
    from wandistill.teacher import placement as pl
    from wandistill.teacher.decode import decode_latents

    vae = pl.load_component(teacher, "vae", dtype=torch.float32, placement=placement)
    t_img = decode_latents(vae, torch.stack([r.final_latent for r in records]))
    s_img = decode_latents(vae, torch.stack(finals))
    scores = [min(image_psnr(s, t), 100.0) for s, t in zip(s_img, t_img, strict=True)]
    result.image_psnr = float(np.mean(scores))
    for row, x in zip(result.per_record, scores, strict=True):
        row["image_psnr"] = x
    return t_img, s_img
