"""Typed recipes: strict TOML loading into dataclasses, with `--set` overrides.

One recipe drives both stages (`[precompute.*]` and `[train.*]` sections), the way torchtitan's job
config does. Loading is strict: an unknown key is an error naming the closest valid key, and a
value of the wrong type is an error naming the key, the value and the type it needs. Overrides
(`--set precompute.sampler.num_inference_steps=4`, or `sampler.num_inference_steps=4` inside a
stage command) are applied to the raw TOML before validation, so they are checked the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from wandistill.checks.bounds import SEED, TIMEOUT_S, checked, num
from wandistill.checks.validate import MiB, read_capped
from wandistill.errors import ConfigError, UsageError
from wandistill.placement.parse import GROUP_LEVELS, parse_placement
from wandistill.placement.strategies import Cpu, Placement

if typing.TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    from wandistill.cache.encoding import Encoding

T = TypeVar("T")

MAX_RECIPE_BYTES = MiB
"""A recipe picks values; a bigger file is not a recipe."""
DTYPES = ("fp32", "fp16", "bf16")
BACKENDS = ("webdataset", "zarr")


def _locations(**given: tuple[str, bool]) -> tuple[bool, str]:
    """The recipe's locations (key -> (value, URL supported)) through the CLI's one parser
    (`wandistill.io.location`): a URL only where the stage reads or writes it end to end, never
    a local path named like a URL. A (passed, message) check for `_problems`."""
    from wandistill.io.location import problem

    bad = [p for k, (v, url) in given.items() if (p := problem(v, k, url=url))]
    return not bad, "; ".join(bad)


def _problems(*checks: tuple[bool, str]) -> None:
    """Raise once with every failed check, so a user fixes a recipe in one pass."""
    bad = [msg for ok, msg in checks if not ok]
    if bad:
        raise ConfigError("; ".join(bad))


@dataclass(kw_only=True, slots=True)
class TeacherConfig:
    path: str = ""
    """Local diffusers Wan folder (Wan 2.1: `transformer`; Wan 2.2 A14B: also `transformer_2`)."""
    placement: Placement = field(default_factory=Cpu)
    """cpu, cuda, cuda:N, gpu0, balanced, balanced_low_0, sequential, auto, a device-map .json,
    model-offload, group-offload or disk-offload. Written as text, parsed here once into its
    typed strategy (`wandistill.placement`), with group_offload_level and max_memory folded
    in; everything downstream takes the object."""
    dtype: str = "fp32"
    """Compute dtype of the teacher; layers Wan keeps in fp32 stay fp32."""
    offload_folder: str = ""
    """Where disk-offload spills weights; each component/rank/run gets its own subfolder."""
    group_offload_level: str = "block_level"
    """group-offload granularity: block_level or leaf_level."""
    max_memory: dict[str, str] = field(default_factory=dict)
    """Per-device caps for accelerate device maps, e.g. {"0": "70GiB", "cpu": "200GiB"}."""

    def __post_init__(self) -> None:
        _problems(
            _locations(
                **{
                    "teacher.path": (self.path, False),
                    "teacher.offload_folder": (self.offload_folder, False),
                }
            ),
            (self.dtype in DTYPES, f"teacher.dtype={self.dtype!r} must be one of {DTYPES}"),
            (
                self.group_offload_level in GROUP_LEVELS,
                "teacher.group_offload_level must be block_level or leaf_level",
            ),
        )
        try:
            self.placement = parse_placement(
                self.placement,
                group_offload_level=self.group_offload_level,
                max_memory=self.max_memory,
            )
        except UsageError as e:
            raise ConfigError(f"teacher.{e.message}", fix=e.fix) from None


@dataclass(kw_only=True, slots=True)
@checked("sampler")
class SamplerConfig:
    height: int = num(480, ge=16, le=8192)
    """Pixel height; divisible by 16 (VAE factor 8 x patch 2)."""
    width: int = num(832, ge=16, le=8192)
    """Pixel width; divisible by 16."""
    num_frames: int = num(81, ge=1, le=4097)
    """Frames; 4k+1 (the Wan VAE compresses time by 4)."""
    num_inference_steps: int = num(50, ge=1, le=1000)
    """Teacher sampler steps (at most the scheduler's 1000 training timesteps)."""
    guidance_scale: float = num(5.0, ge=0, le=100)
    """CFG scale g in uncond + g * (cond - uncond); 1.0 disables the uncond pass."""
    guidance_scale_2: float | None = num(None, ge=0, le=100)
    """Wan 2.2 A14B: scale for the low-noise expert (transformer_2); defaults to guidance_scale."""
    flow_shift: float | None = num(None, gt=0, le=100)
    """Override of the scheduler's flow shift; None keeps the teacher folder's value."""
    negative_prompt: str = ""
    max_sequence_length: int = num(512, ge=1, le=8192)
    """Text length the pipeline pads to; embeddings are stored trimmed and re-padded on read."""
    record_steps: list[int] = num(list_of=(), ge=0, le=999)
    """Step indices whose (x_t, t, teacher output) are recorded. With record_every and
    record_for_student_steps also empty, every step is recorded; otherwise the recorded steps are
    the union of the three (see `recorded_steps`)."""
    record_every: int = num(0, ge=0, le=1000)
    """Also record every n-th step (0, n, 2n, ...); 0: off. `record_every = 4` of 16 steps
    records what a 4-step student needs (the steps its schedule visits) when 4 divides 16."""
    record_for_student_steps: list[int] = num(list_of=(), ge=1, le=1000)
    """Also record the teacher steps a K-step student is trained at (trajectory objective), for
    each K listed, e.g. [1, 2, 4]: the steps where the student's K-step schedule meets the
    teacher's N-step one (every N/K-th step for Wan's UniPC flow schedule; K must land on it)."""
    features: list[str] = field(default_factory=list)
    """Named teacher blocks whose outputs are recorded, e.g. ["blocks.3", "blocks.7"]."""
    seed: int = num(0, ge=SEED.ge, le=SEED.le)
    """Base seed; a prompt without its own seed gets seed + its line index."""
    batch_size: int = num(1, ge=1, le=4096)
    """Prompts denoised together."""
    expert_group_batches: int = num(16, ge=1, le=100_000)
    """Wan 2.2: batches that run their high-noise steps before the swap to transformer_2
    (bigger groups mean fewer expert loads, more latents held in memory)."""

    def __post_init__(self) -> None:
        _problems(
            (
                self.height % 16 == 0,
                f"sampler.height={self.height} must be a positive multiple of 16",
            ),
            (
                self.width % 16 == 0,
                f"sampler.width={self.width} must be a positive multiple of 16",
            ),
            (
                self.num_frames % 4 == 1,
                f"sampler.num_frames={self.num_frames} must be 4k+1 (1, 5, 9, ... 81)",
            ),
            (
                all(0 <= s < self.num_inference_steps for s in self.record_steps),
                f"sampler.record_steps={self.record_steps} must lie in "
                f"[0, {self.num_inference_steps})",
            ),
            (
                len(set(self.record_steps)) == len(self.record_steps),
                f"sampler.record_steps={self.record_steps} has duplicates",
            ),
            (
                self.record_every >= 0,
                f"sampler.record_every={self.record_every} must be >= 0 (0: off)",
            ),
            (
                all(0 < k <= self.num_inference_steps for k in self.record_for_student_steps),
                f"sampler.record_for_student_steps={self.record_for_student_steps}: each K must "
                f"lie in [1, num_inference_steps={self.num_inference_steps}] (a student takes at "
                "most as many steps as the teacher)",
            ),
        )

    def recorded_steps(self, student_steps: Callable[[int], list[int]] | None = None) -> list[int]:
        """The step indices precompute records, sorted: the union of `record_steps`, every
        `record_every`-th step and, for each K of `record_for_student_steps`, the steps
        `student_steps(K)` names (the teacher's scheduler decides them, so callers that know it
        pass `wandistill.student.schedule.student_steps_for(scheduler, N)`); all steps when the
        three are empty."""
        if not (self.record_steps or self.record_every or self.record_for_student_steps):
            return list(range(self.num_inference_steps))
        chosen = set(self.record_steps)
        if self.record_every:
            chosen.update(range(0, self.num_inference_steps, self.record_every))
        if self.record_for_student_steps:
            if student_steps is None:
                raise ValueError("sampler.record_for_student_steps needs the teacher's scheduler")
            for k in self.record_for_student_steps:
                chosen.update(student_steps(k))
        return sorted(chosen)


@dataclass(kw_only=True, slots=True)
@checked("cache")
class CacheConfig:
    path: str = "cache/default"
    """Cache directory, or an fsspec URL (s3://bucket/prefix)."""
    backend: str = "webdataset"
    """webdataset (tar shards) or zarr (v3 group)."""
    shard_records: int = num(64, ge=1, le=1_000_000)
    """Records per shard: the unit of atomic publication, resume and follow mode."""
    holdout_fraction: float = num(0.0, ge=0, lt=1)
    """Share of prompts marked held-out (by key hash) for eval; train skips them."""
    store_dtype: str = "model"
    """Stored dtype of x_t, teacher output, final latent and features: model (as computed: the
    teacher's dtype, fp32 for the final latent), fp32, bf16, fp16 or fp8 (e4m3 with a float32
    scale per recorded step). Readers hand out the computed dtype (docs/cache-format.md)."""
    store_dtypes: dict[str, str] = field(default_factory=dict)
    """Per-field overrides of store_dtype: keys xt, teacher_out, final_latent, features."""
    compression: str = "none"
    """none or zstd (zarr backend: each inner chunk, before its crc32c)."""
    compression_level: int = num(3, ge=1, le=22)

    def __post_init__(self) -> None:
        from wandistill.cache.choices import COMPRESSIONS, STORE_DTYPES, TRAJECTORY, ZARR_ONLY

        names = tuple(STORE_DTYPES)
        keys = f"keys are {', '.join(TRAJECTORY)}, values one of {', '.join(names)}"
        _problems(
            _locations(**{"cache.path": (self.path, True)}),
            (self.backend in BACKENDS, f"cache.backend={self.backend!r} must be one of {BACKENDS}"),
            (self.store_dtype in names, f"cache.store_dtype={self.store_dtype!r}: one of {names}"),
            *(
                (k in TRAJECTORY and v in names, f"cache.store_dtypes.{k}={v!r}: {keys}")
                for k, v in self.store_dtypes.items()
            ),
            (
                self.compression in COMPRESSIONS,
                f"cache.compression={self.compression!r} must be one of {COMPRESSIONS}",
            ),
            (
                self.compression == "none" or self.backend == "zarr",
                f"cache.compression={self.compression!r} {ZARR_ONLY}",
            ),
        )

    def encoding(self) -> Encoding:
        from wandistill.cache.encoding import Encoding

        return Encoding(
            dtype=self.store_dtype,
            dtypes=tuple(sorted(self.store_dtypes.items())),
            compression=self.compression,
            level=self.compression_level,
        )


@dataclass(kw_only=True, slots=True)
@checked("precompute")
class PrecomputeConfig:
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    prompts: str = ""
    """Prompt file: .txt (one per line) or .jsonl ({"prompt", "seed"?, "negative_prompt"?})."""
    previews: int = num(0, ge=0, le=100_000)
    """VAE-decode this many teacher samples to PNG for eval."""
    dist_timeout: float | None = num(None, gt=TIMEOUT_S.gt, le=TIMEOUT_S.le)
    """Seconds a rank waits for the others (rendezvous, collectives) before it exits naming the
    missing rank. None: WANDISTILL_DIST_TIMEOUT, else 300."""


@dataclass(kw_only=True, slots=True)
@checked("student.init_from_teacher")
class TeacherInitConfig:
    path: str = ""
    """Teacher folder (or its transformer folder, or a .safetensors file) whose tensors initialise
    the student; empty: random init. Read lazily with safetensors, never the whole teacher."""
    component: str = "transformer"
    """Which transformer of the teacher folder (Wan 2.2 A14B: transformer or transformer_2)."""
    blocks: list[int] = num(list_of=(), ge=0, le=10_000)
    """Teacher block indices copied into student blocks 0..k-1 (k <= student.num_layers); the
    embedders and output head are copied too. Empty: only those non-block tensors."""

    def __post_init__(self) -> None:
        _problems(
            (
                not self.blocks or bool(self.path),
                "student.init_from_teacher.blocks is set but init_from_teacher.path is empty",
            ),
        )


LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
"""The linears of every Wan block: self- and cross-attention q/k/v/out and the FFN pair (what
DiffSynth's Wan LoRAs target as q,k,v,o,ffn.0,ffn.2; diffusers names them as here)."""


@dataclass(kw_only=True, slots=True)
@checked("student.lora")
class StudentLoraConfig:
    rank: int = num(0, ge=0, le=4096)
    """LoRA rank r. 0: no LoRA, a full student. > 0: the student is the teacher's transformer
    (student.init_from_teacher.path, all blocks) frozen, plus peft LoRA adapters of rank r on
    target_modules; only the adapters are trained, checkpointed and kept in EMA."""
    alpha: float | None = num(None, gt=0, le=1e6)
    """LoRA alpha (the update is scaled by alpha / rank). None: alpha = rank (scale 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names (or name suffixes at a dot, peft's rule) of the nn.Linear layers that get an
    adapter, e.g. "to_q" (every block's attn1 and attn2) or "blocks.0.attn1.to_q"."""
    dropout: float = num(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (peft lora_dropout)."""

    def __post_init__(self) -> None:
        _problems(
            (
                self.rank == 0 or bool(self.target_modules),
                "student.lora.target_modules is empty; name the linears to adapt, e.g. "
                f"{list(LORA_TARGETS)}",
            ),
            (
                all(isinstance(t, str) and t.strip() for t in self.target_modules),
                "student.lora.target_modules holds an empty name",
            ),
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """alpha as peft receives it (rank when unset)."""
        return float(self.rank) if self.alpha is None else float(self.alpha)


@dataclass(kw_only=True, slots=True)
@checked("student")
class StudentConfig:
    num_layers: int | None = num(None, ge=1, le=1024)
    """Transformer blocks. None: from config_file, else the teacher's (the cache records the
    teacher's transformer config; the student starts from it)."""
    num_attention_heads: int | None = num(None, ge=1, le=1024)
    attention_head_dim: int | None = num(None, ge=2, le=4096)
    """Per-head width; even (Wan's 3-axis RoPE splits it). Width = heads x head_dim."""
    ffn_dim: int | None = num(None, ge=1, le=1 << 20)
    config_file: str = ""
    """Optional JSON with WanTransformer3DModel config keys; the four fields above override it.
    text_dim, in_channels and out_channels must match the cache."""
    init_from_teacher: TeacherInitConfig = field(default_factory=TeacherInitConfig)
    """Optional init from teacher tensors: `init_from_teacher = {path = "...", blocks = [0, 4]}`."""
    num_inference_steps: int | None = num(None, ge=1, le=1000)
    """K: the sampler steps the student is trained for (1, 2, 4, ...). None: the teacher's N,
    i.e. step imitation with the teacher's own scheduler. A K-step student samples with a
    first-order flow scheduler whose K steps land on the teacher's schedule (see docs/export.md);
    the trajectory objective trains it at exactly those K recorded steps."""
    experts: str = "one"
    """Wan 2.2 A14B: "one" student replaces both experts; "per-expert" trains a high-noise
    (`transformer`) and a low-noise (`transformer_2`) student, each on the recorded points of
    its side of boundary_ratio, exported with both and the boundary (docs/training.md)."""
    lora: StudentLoraConfig = field(default_factory=StudentLoraConfig)
    """`[train.student.lora]`: rank > 0 trains peft LoRA adapters on the teacher's transformer
    instead of a full student (see docs/training.md, LoRA students)."""

    def __post_init__(self) -> None:
        _problems(
            (
                self.experts in ("one", "per-expert"),
                f"student.experts={self.experts!r} must be 'one' or 'per-expert'",
            ),
            (
                self.attention_head_dim is None or self.attention_head_dim % 2 == 0,
                f"student.attention_head_dim={self.attention_head_dim} must be even "
                "(Wan's RoPE splits each head over frames, height and width)",
            ),
            (
                self.num_inference_steps is None or self.num_inference_steps > 0,
                f"student.num_inference_steps={self.num_inference_steps} must be positive",
            ),
            (
                self.num_layers is None or len(self.init_from_teacher.blocks) <= self.num_layers,
                f"student.init_from_teacher.blocks lists {len(self.init_from_teacher.blocks)} "
                f"blocks but the student has num_layers={self.num_layers}",
            ),
            (
                not self.lora.enabled or bool(self.init_from_teacher.path),
                "student.lora.rank > 0 needs the base it adapts: set "
                "student.init_from_teacher.path to the teacher folder",
            ),
        )


@dataclass(kw_only=True, slots=True)
@checked("optim")
class OptimConfig:
    lr: float = num(1e-4, gt=0, le=10)
    """Peak learning rate of AdamW (reached after warmup, then cosine decay)."""
    weight_decay: float = num(0.01, ge=0, le=10)
    """Applied to matrices only; biases, norms and modulation tables are not decayed."""
    betas: list[float] = num(list_of=(0.9, 0.999), ge=0, lt=1)
    """AdamW (beta1, beta2)."""
    warmup_steps: int = num(0, ge=0, le=10**9)
    """Linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: float = num(0.0, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio on the last step."""
    grad_clip: float = num(1.0, ge=0, le=1e6)
    """Clip the global gradient norm to this; 0 disables clipping."""
    ema_decay: float = num(0.999, ge=0, lt=1)
    """EMA of the student's weights, updated after every optimizer step; 0 keeps a plain copy."""

    def __post_init__(self) -> None:
        _problems((len(self.betas) == 2, f"optim.betas={self.betas} needs two values"))


@dataclass(kw_only=True, slots=True)
@checked("loss")
class LossConfig:
    output: float = num(1.0, ge=0, le=1e6)
    """Weight of teacher-output matching: MSE between the student's prediction at a recorded
    (x_t, t) and the teacher's guided (CFG) output there."""
    final_latent: float = num(0.0, ge=0, le=1e6)
    """Weight of final-latent matching: MSE between x0 = x_t - sigma_t * v_student and the
    teacher's final latent."""
    feature: float = num(0.0, ge=0, le=1e6)
    """Weight of feature matching through learned student-to-teacher-width projections."""
    feature_map: dict[str, str] = field(default_factory=dict)
    """Teacher feature (recorded by precompute) -> student block, e.g. {"blocks.8" = "blocks.1"}."""
    trajectory: float = num(0.0, ge=0, le=1e6)
    """Weight of trajectory regression (ODE / knowledge distillation for a K-step student): at
    the recorded points the K-step student is sampled at, x0 = x_t - sigma_t * v_student matches
    the final latent of that teacher trajectory. Needs those K steps recorded."""
    consistency: float = num(0.0, ge=0, le=1e6)
    """Weight of consistency distillation: x0 of the student at a recorded point x_{t_n} matches
    x0 of a stop-gradient EMA copy of the student at the cached next point x_{t_(n+1)} (the
    teacher's ODE step, read from the cache); at the last step the target is the final latent.
    Needs every teacher step recorded."""
    reflow: float = num(0.0, ge=0, le=1e6)
    """Weight of reflow (rectified-flow distillation, Liu et al. 2023 / InstaFlow): at the K-step
    student's sigmas, the input is the straight-line point sigma * noise + (1 - sigma) * x_0
    between the trajectory's cached noise and its final latent, and x0 = x - sigma * v_student
    matches that final latent. These are the very points the K-step first-order sampler visits
    when its earlier estimates were right (the recorded x_t of the teacher's curved trajectory
    are not), so it trains the student where it samples. Needs the noise and final latent only
    (and the K steps recorded, which are its samples' slots)."""
    unroll: float = num(0.0, ge=0, le=1e6)
    """Weight of the unroll objective (`wandistill.student.unroll`): the student's own K-step
    sampler runs from each record's cached noise and its final latent matches the cached one,
    backpropagated through all K steps. One sample per record (at the student's first step)."""
    unroll_checkpoint: bool = True
    """Make each unrolled step an activation checkpoint: hold K latents instead of K steps'
    activations, for one more forward per step (the lever when a large K does not fit)."""
    perflow: float = num(0.0, ge=0, le=1e6)
    """Weight of piecewise reflow (PeRFlow, Yan et al. 2024; `wandistill.student.perflow`): at
    the recorded x_t of each student step k, the student's velocity matches the straight one
    across the window to the cached point at the student's next sigma (the final latent after the
    last): (x_k - x_(k+1)) / (sigma_k - sigma_(k+1)). Needs the K student steps recorded."""
    consistency_target_decay: float = num(0.95, ge=0, lt=1)
    """EMA decay of the consistency target network (updated after every optimizer step; 0 makes
    the target a stop-gradient copy of the current student). 0.95 as in Song et al. 2023 (CD)."""

    def weights(self) -> dict[str, float]:
        """Objective name -> weight, for every objective (weight 0: off)."""
        return {
            "output": self.output,
            "final_latent": self.final_latent,
            "feature": self.feature,
            "trajectory": self.trajectory,
            "consistency": self.consistency,
            "reflow": self.reflow,
            "unroll": self.unroll,
            "perflow": self.perflow,
        }

    @property
    def x0_terms(self) -> bool:
        """Does any weighted objective compare the student's x0 estimate with the final latent
        (and so need sigma_t and the cached final latent)."""
        return self.final_latent > 0 or self.few_step

    @property
    def at_recorded_points(self) -> bool:
        """Does any weighted objective run the student at the recorded x_t (all but reflow, which
        builds its own inputs): if none does, the x_t forward is skipped."""
        own = ("reflow", "unroll")
        return any(w > 0 for name, w in self.weights().items() if name not in own)

    @property
    def few_step(self) -> bool:
        """Does any weighted objective train a K-step student (first-order sampler)."""
        few = ("trajectory", "consistency", "reflow", "unroll", "perflow")
        return any(self.weights()[name] > 0 for name in few)

    def __post_init__(self) -> None:
        _problems(
            (
                sum(self.weights().values()) > 0,
                "loss: every weight is 0, so nothing would be trained; set loss.output = 1.0",
            ),
            (
                self.feature == 0 or bool(self.feature_map),
                f"loss.feature={self.feature} needs loss.feature_map "
                '(e.g. feature_map = {"blocks.8" = "blocks.1"})',
            ),
        )


@dataclass(kw_only=True, slots=True)
class FsdpConfig:
    """`[train.fsdp]`: how `train.parallel = "fsdp"` shards the student (torch FSDP2)."""

    param_dtype: str = "fp32"
    """fp32 or bf16: the dtype of the gathered parameters in forward/backward (FSDP2's
    MixedPrecisionPolicy); the sharded weights, the gradient reduce, the optimizer state and the
    EMA stay fp32."""
    cpu_offload: bool = False
    """Keep the sharded parameters, their gradients and the optimizer state in host memory
    (FSDP2's CPUOffloadPolicy); the optimizer step runs on the CPU."""

    def __post_init__(self) -> None:
        _problems(
            (
                self.param_dtype in ("fp32", "bf16"),
                f"train.fsdp.param_dtype={self.param_dtype!r} must be 'fp32' or 'bf16'",
            ),
        )


PARALLEL = ("ddp", "fsdp")


@dataclass(kw_only=True, slots=True)
@checked("train")
class TrainConfig:
    cache: str | list[str] = ""
    """Cache directory written by `wandistill precompute` (the only input besides this recipe),
    or a list of caches of one teacher and settings trained on as one dataset (docs/training.md,
    "Several caches")."""
    cache_weights: list[float] = num(list_of=(), gt=0, le=1e6)
    """With several caches: each cache's share of every epoch's samples, relative (mosaicml
    streaming's stream `proportion`); empty: every sample of every cache once an epoch."""
    out: str = ""
    """Run directory: checkpoints/, metrics.jsonl, student/ and student_ema/ at the end."""
    steps: int = num(100, ge=1, le=10**9)
    """Optimizer steps (each = grad_accum micro-batches on every rank)."""
    batch_size: int = num(1, ge=1, le=65_536)
    """Per-rank micro-batch of (record, recorded step) samples."""
    grad_accum: int = num(1, ge=1, le=65_536)
    """Micro-batches per optimizer step; gradients are synchronised on the last one only."""
    seed: int = num(0, ge=SEED.ge, le=SEED.le)
    """Student init and data order."""
    device: str = "auto"
    """auto (cuda:LOCAL_RANK when there is a GPU, else cpu), cpu or cuda."""
    mixed_precision: str = "no"
    """no or bf16 (autocast; weights, optimizer state and EMA stay fp32)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block in backward: less activation memory, ~30% slower."""
    parallel: str = "ddp"
    """ddp (every rank holds the whole student) or fsdp (FSDP2: each transformer block, then
    the root, sharded over the ranks; sharded checkpoints). See [train.fsdp]."""
    checkpoint_every: int = num(50, ge=1, le=10**9)
    """Write checkpoints/checkpoint-<step>/ every this many steps (and at the last step)."""
    keep_checkpoints: int = num(2, ge=1, le=10_000)
    """Keep only the newest this many checkpoints."""
    log_every: int = num(10, ge=1, le=10**9)
    """Write a metrics.jsonl row (losses averaged over ranks) every this many steps."""
    tensorboard: bool = True
    """Also write TensorBoard events to <out>/tensorboard when tensorboard is installed."""
    data_threads: int = num(4, ge=1, le=256)
    """Reader threads per rank. Each reads one whole batch, so this many batches are read ahead
    (host memory: data_threads batches)."""
    follow_poll_interval: float = num(2.0, gt=0, le=3600)
    """--follow: seconds between looks for newly committed shards."""
    follow_timeout: float = num(3600.0, ge=0, le=TIMEOUT_S.le)
    """--follow: give up after this many seconds without a new shard; 0 waits forever."""
    dist_timeout: float | None = num(None, gt=TIMEOUT_S.gt, le=TIMEOUT_S.le)
    """Seconds a rank waits for the others (rendezvous, collectives, a checkpoint being saved)
    before it exits naming the missing rank. None: WANDISTILL_DIST_TIMEOUT, else 300."""
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    """[train.fsdp]: mixed precision and CPU offload of `parallel = "fsdp"`."""
    student: StudentConfig = field(default_factory=StudentConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)

    @property
    def caches(self) -> list[str]:
        """`cache` as a list (one entry for a single cache, none when unset)."""
        return [c for c in ([self.cache] if isinstance(self.cache, str) else self.cache) if c]

    def __post_init__(self) -> None:
        if self.cache_weights:
            from wandistill.cache.choices import check_weights

            check_weights(self.cache_weights, len(self.caches))
        _problems(
            _locations(
                **{
                    "train.cache" + (f"[{i}]" if len(self.caches) > 1 else ""): (c, True)
                    for i, c in enumerate(self.caches)
                },
                **{"train.out": (self.out, False)},
            ),
            (
                self.parallel in PARALLEL,
                f"train.parallel={self.parallel!r} must be 'ddp' or 'fsdp'",
            ),
            (
                self.device in ("auto", "cpu", "cuda"),
                f"train.device={self.device!r} must be auto, cpu or cuda",
            ),
            (
                self.mixed_precision in ("no", "bf16"),
                f"train.mixed_precision={self.mixed_precision!r} must be 'no' or 'bf16'",
            ),
        )


@dataclass(kw_only=True, slots=True)
class Recipe:
    name: str = ""
    description: str = ""
    precompute: PrecomputeConfig = field(default_factory=PrecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------- strict loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against annotation `tp`; ints widen to float, nothing else is converted."""
    origin = typing.get_origin(tp)
    if tp is Placement:  # parsed (with its sibling keys) in TeacherConfig.__post_init__
        if not isinstance(value, str):
            raise ConfigError(f'{where}={value!r} must be a string, e.g. "auto"')
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table ([{where}]), got {value!r}")
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}={value!r} must be {_type_name(tp)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where}={value!r} must be a list")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}={value!r} must be a table")
        return {str(k): _coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if tp in (int, float) and isinstance(value, int) and not isinstance(value, bool):
        # Widen to float only where it cannot overflow; every numeric field declares its range
        # (checks/bounds.py), which refuses a huge int or a NaN / inf with the range named.
        return float(value) if tp is float and -(1 << 63) <= value < 1 << 63 else value
    if tp is Any:
        return value
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}={value!r} must be {tp.__name__}, not a boolean")
    if not isinstance(value, tp):
        raise ConfigError(f"{where}={value!r} must be {_type_name(tp)}, got {type(value).__name__}")
    return value


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    name = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    prefix = where + "." if where else ""
    if close:
        return ConfigError(
            f"unknown key {name!r}: did you mean {prefix}{close[0]}?",
            fix=f"spell it {prefix}{close[0]}",
        )
    return ConfigError(
        f"unknown key {name!r}: valid keys here: {', '.join(valid)}",
        fix=f"use one of the keys of [{where or 'the recipe'}] listed above",
    )


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a TOML table, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(key, fields, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
    """A config as plain JSON-able data: recipe values back in the form a recipe writes them
    (a placement as its --placement text)."""
    if hasattr(cfg, "to_recipe"):
        return cfg.to_recipe()
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def _parse_value(text: str) -> Any:
    """`--set` values are TOML literals (4, 1e-4, true, [0, 2], "x"); bare words are strings.
    Exactly one value: a document that parses to more than `v` (a second `key = value` smuggled
    in after a newline or a `;`-less trick) is refused, not silently dropped."""
    try:
        doc = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:
        raise ConfigError(f"--set value {text[:40]!r}... nests too deeply") from None
    except ValueError:  # Python's int limit (4,300 digits) is a ValueError inside tomllib
        raise ConfigError(
            f"--set value {text[:40]!r}... is a number of {len(text)} characters; no recipe "
            "key takes one that large"
        ) from None
    if set(doc) != {"v"}:
        raise ConfigError(f"--set value {text[:60]!r} holds more than one value")
    return doc["v"]


def apply_override(data: dict[str, Any], assignment: str, stage: str | None = None) -> None:
    """Apply one `key.path=value` to the raw recipe dict, resolving keys relative to `stage`."""
    if any(c in assignment for c in "\n\r\x00"):
        raise ConfigError(
            f"--set {assignment[:80]!r} holds a line break; --set takes exactly one "
            "section.key=value",
            fix="pass one --set per key",
        )
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r} must look like section.key=value")
    dotted, text = assignment.split("=", 1)
    parts = [p.strip() for p in dotted.strip().split(".") if p.strip()]
    if not parts:
        raise ConfigError(f"--set {assignment!r} has an empty key")
    root_fields = [f.name for f in dataclasses.fields(Recipe)]
    if stage is not None and parts[0] not in root_fields:
        parts = [stage, *parts]
    # Walk the dataclass tree alongside the dict so a typo is reported with a suggestion.
    cls: Any = Recipe
    node = data
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise _unknown_key(part, names, ".".join(parts[:i]))
        tp = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            node[part] = _parse_value(text.strip())
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[: i + 1])} is not a section")
        node = node.setdefault(part, {})
        cls = tp


# --------------------------------------------------------------------------- shipped recipes

RECIPES_PACKAGE = "wandistill.recipes"
"""The repository's pipelines/*.toml, mapped into the package at build time (pyproject.toml)."""


def shipped_recipes_dir() -> Traversable:
    """The folder of recipes that ship with the package, read through importlib.resources so a
    wheel, an editable install and a zip all work. A source tree put on sys.path without being
    installed has no `wandistill.recipes` (the build makes it): read its pipelines/ instead; so
    does a source tree run through PYTHONPATH while another tree is installed editable (whose
    `wandistill.recipes` would be the other tree's recipes, not this code's)."""
    tree = Path(__file__).resolve().parents[1]
    if (tree / "pyproject.toml").is_file() and (tree / "pipelines").is_dir():
        return tree / "pipelines"
    try:
        return importlib.resources.files(RECIPES_PACKAGE)
    except ModuleNotFoundError:
        return tree / "pipelines"


def shipped_recipe_names() -> list[str]:
    return sorted(
        f.name.removesuffix(".toml")
        for f in shipped_recipes_dir().iterdir()
        if f.name.endswith(".toml") and f.is_file()
    )


def _no_such_recipe(arg: str, message: str, expected: str) -> ConfigError:
    """One line naming `arg`, the nearest shipped names, and how to list them all."""
    names = shipped_recipe_names()
    stem = os.path.basename(arg).removesuffix(".toml")
    near = difflib.get_close_matches(stem, names, n=3, cutoff=0.5)
    hint = f" (nearest shipped: {', '.join(near)})" if near else ""
    return ConfigError(
        f"{message}{hint}", fix=f"pass {expected}; `wandistill recipes` lists the shipped ones"
    )


def shipped_recipe(name: str) -> Traversable:
    """The shipped recipe called `name` (a file stem in pipelines/, e.g. `tiny`)."""
    if name in shipped_recipe_names():
        return shipped_recipes_dir() / f"{name}.toml"
    raise _no_such_recipe(
        name, f"unknown recipe {name!r}: not a shipped recipe name", "a shipped recipe name"
    )


def is_recipe_path(text: str) -> bool:
    """How a RECIPE argument is read (stated in --help): a path has a slash or ends in .toml,
    a name has neither and is a shipped recipe. By its spelling alone, so a file or folder that
    shares a shipped recipe's name (a teacher folder called `tiny`) never hides it."""
    return text.endswith(".toml") or "/" in text or os.sep in text


def resolve_recipe(arg: str | Path) -> Traversable:
    """What every command's RECIPE argument means (is_recipe_path): a path is a TOML file, a
    name is a shipped recipe; the filesystem is never asked which it is."""
    text = str(arg)
    if not is_recipe_path(text):
        if text in shipped_recipe_names():
            return shipped_recipe(text)
        local = f" (for the file {text!r} here, pass ./{text})" if Path(text).exists() else ""
        raise _no_such_recipe(
            text, f"recipe {text!r} is not a shipped recipe name{local}", "a shipped name"
        )
    p = Path(text)
    if p.is_file():
        return p
    if p.is_dir():
        raise ConfigError(f"recipe {text!r} is a directory", fix="pass a TOML file inside it")
    raise _no_such_recipe(text, f"recipe {text!r} does not exist", "a TOML file")


def load_recipe(
    path: str | Path | None = None, overrides: list[str] | None = None, stage: str | None = None
) -> Recipe:
    """Read a TOML recipe (a file or a shipped name, see `resolve_recipe`; None: start from
    defaults), apply overrides, then validate once."""
    data: dict[str, Any] = {}
    if path is not None:
        source = resolve_recipe(path)
        fix = "fix the recipe, or start from a shipped one (`wandistill recipes copy NAME`)"
        raw = (
            read_capped(
                source, max_bytes=MAX_RECIPE_BYTES, what="recipe", fix=fix, error=ConfigError
            )
            if isinstance(source, Path)
            else source.read_bytes()  # a shipped recipe: package data
        )
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid TOML: {e}") from None
        except ValueError:  # Python's int limit (4,300 digits) is a ValueError inside tomllib
            raise ConfigError(
                f"recipe {str(path)!r} holds an integer of more than 4,300 digits", fix=fix
            ) from None
        except RecursionError:  # tomllib recurses per nesting level
            raise ConfigError(f"recipe {str(path)!r} nests too deeply", fix=fix) from None
    for assignment in overrides or []:
        apply_override(data, assignment, stage)
    try:
        return from_dict(Recipe, data)
    except TypeError as e:  # a missing kw-only field would land here; keep it one line
        raise ConfigError(f"recipe {path}: {e}") from None
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(  # name the file: the key may come from it or from a --set
            f"recipe {str(path)!r}: {e.message}",
            fix=e.fix or "fix that key in the recipe (or in the --set override)",
        ) from None
