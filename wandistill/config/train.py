"""The train stage's recipe sections: student (with its LoRA and teacher init), optim, loss,
fsdp, and `[train]` itself."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from wandistill.checks.bounds import SEED, TIMEOUT_S, Range
from wandistill.config.common import _locations, _problems, section


@section("student.init_from_teacher")
class TeacherInitConfig:
    path: str = ""
    """Teacher folder (or its transformer folder, or a .safetensors file) whose tensors initialise
    the student; empty: random init. Read lazily with safetensors, never the whole teacher."""
    component: str = "transformer"
    """Which transformer of the teacher folder (Wan 2.2 A14B: transformer or transformer_2)."""
    blocks: list[Annotated[int, Range(ge=0, le=10_000)]] = field(default_factory=list)
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


@section("student.lora")
class StudentLoraConfig:
    rank: Annotated[int, Range(ge=0, le=4096)] = 0
    """LoRA rank r. 0: no LoRA, a full student. > 0: the student is the teacher's transformer
    (student.init_from_teacher.path, all blocks) frozen, plus peft LoRA adapters of rank r on
    target_modules; only the adapters are trained, checkpointed and kept in EMA."""
    alpha: Annotated[float, Range(gt=0, le=1e6)] | None = None
    """LoRA alpha (the update is scaled by alpha / rank). None: alpha = rank (scale 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names (or name suffixes at a dot, peft's rule) of the nn.Linear layers that get an
    adapter, e.g. "to_q" (every block's attn1 and attn2) or "blocks.0.attn1.to_q"."""
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
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


@section("student")
class StudentConfig:
    num_layers: Annotated[int, Range(ge=1, le=1024)] | None = None
    """Transformer blocks. None: from config_file, else the teacher's (the cache records the
    teacher's transformer config; the student starts from it)."""
    num_attention_heads: Annotated[int, Range(ge=1, le=1024)] | None = None
    attention_head_dim: Annotated[int, Range(ge=2, le=4096)] | None = None
    """Per-head width; even (Wan's 3-axis RoPE splits it). Width = heads x head_dim."""
    ffn_dim: Annotated[int, Range(ge=1, le=1 << 20)] | None = None
    config_file: str = ""
    """Optional JSON with WanTransformer3DModel config keys; the four fields above override it.
    text_dim, in_channels and out_channels must match the cache."""
    init_from_teacher: TeacherInitConfig = field(default_factory=TeacherInitConfig)
    """Optional init from teacher tensors: `init_from_teacher = {path = "...", blocks = [0, 4]}`."""
    num_inference_steps: Annotated[int, Range(ge=1, le=1000)] | None = None
    """K: the sampler steps the student is trained for (1, 2, 4, ...). None: the teacher's N,
    i.e. step imitation with the teacher's own scheduler. A K-step student samples with a
    first-order flow scheduler whose K steps land on the teacher's schedule (see docs/export.md);
    loss.perflow and loss.unroll train it at exactly those K recorded steps."""
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


@section("optim")
class OptimConfig:
    lr: Annotated[float, Range(gt=0, le=10)] = 1e-4
    """Peak learning rate of AdamW (reached after warmup, then cosine decay)."""
    weight_decay: Annotated[float, Range(ge=0, le=10)] = 0.01
    """Applied to matrices only; biases, norms and modulation tables are not decayed."""
    betas: list[Annotated[float, Range(ge=0, lt=1)]] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    warmup_steps: Annotated[int, Range(ge=0, le=10**9)] = 0
    """Linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.0
    """Cosine decay ends at lr * min_lr_ratio on the last step."""
    grad_clip: Annotated[float, Range(ge=0, le=1e6)] = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    ema_decay: Annotated[float, Range(ge=0, lt=1)] = 0.999
    """EMA of the student's weights, updated after every optimizer step; 0 keeps a plain copy."""

    def __post_init__(self) -> None:
        _problems((len(self.betas) == 2, f"optim.betas={self.betas} needs two values"))


@section("loss")
class LossConfig:
    output: Annotated[float, Range(ge=0, le=1e6)] = 1.0
    """Weight of teacher-output matching: MSE between the student's prediction at a recorded
    (x_t, t) and the teacher's guided (CFG) output there."""
    final_latent: Annotated[float, Range(ge=0, le=1e6)] = 0.0
    """Weight of final-latent matching: MSE between x0 = x_t - sigma_t * v_student and the
    teacher's final latent."""
    feature: Annotated[float, Range(ge=0, le=1e6)] = 0.0
    """Weight of feature matching through learned student-to-teacher-width projections."""
    feature_map: dict[str, str] = field(default_factory=dict)
    """Teacher feature (recorded by precompute) -> student block, e.g. {"blocks.8" = "blocks.1"}."""
    unroll: Annotated[float, Range(ge=0, le=1e6)] = 0.0
    """Weight of the unroll objective (`wandistill.student.unroll`): the student's own K-step
    sampler runs from each record's cached noise and its final latent matches the cached one,
    backpropagated through all K steps. One sample per record (at the student's first step)."""
    unroll_checkpoint: bool = True
    """Make each unrolled step an activation checkpoint: hold K latents instead of K steps'
    activations, for one more forward per step (the lever when a large K does not fit)."""
    perflow: Annotated[float, Range(ge=0, le=1e6)] = 0.0
    """Weight of piecewise reflow (PeRFlow, Yan et al. 2024; `wandistill.student.perflow`): at
    the recorded x_t of each student step k, the student's velocity matches the straight one
    across the window to the cached point at the student's next sigma (the final latent after the
    last): (x_k - x_(k+1)) / (sigma_k - sigma_(k+1)). Needs the K student steps recorded."""

    def weights(self) -> dict[str, float]:
        """Objective name -> weight, for every objective (weight 0: off)."""
        names = ("output", "final_latent", "feature", "unroll", "perflow")
        return {name: getattr(self, name) for name in names}

    @property
    def x0_terms(self) -> bool:
        """Does any weighted objective compare the student's x0 estimate with the final latent
        (and so need sigma_t and the cached final latent)."""
        return self.final_latent > 0 or self.few_step

    @property
    def at_recorded_points(self) -> bool:
        """Does any weighted objective run the student at the recorded x_t (all but unroll, which
        samples from the noise): if none does, the x_t forward is skipped."""
        return any(w > 0 for name, w in self.weights().items() if name != "unroll")

    @property
    def few_step(self) -> bool:
        """Does any weighted objective train a K-step student (first-order sampler)."""
        return self.unroll > 0 or self.perflow > 0

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


@section("fsdp")
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


@section("train")
class TrainConfig:
    cache: str | list[str] = ""
    """Cache directory written by `wandistill precompute` (the only input besides this recipe),
    or a list of caches of one teacher and settings trained on as one dataset (docs/training.md,
    "Several caches")."""
    cache_weights: list[Annotated[float, Range(gt=0, le=1e6)]] = field(default_factory=list)
    """With several caches: each cache's share of every epoch's samples, relative (mosaicml
    streaming's stream `proportion`); empty: every sample of every cache once an epoch."""
    out: str = ""
    """Run directory: checkpoints/, metrics.jsonl, student/ and student_ema/ at the end."""
    steps: Annotated[int, Range(ge=1, le=10**9)] = 100
    """Optimizer steps (each = grad_accum micro-batches on every rank)."""
    batch_size: Annotated[int, Range(ge=1, le=65_536)] = 1
    """Per-rank micro-batch of (record, recorded step) samples."""
    grad_accum: Annotated[int, Range(ge=1, le=65_536)] = 1
    """Micro-batches per optimizer step; gradients are synchronised on the last one only."""
    seed: Annotated[int, SEED] = 0
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
    checkpoint_every: Annotated[int, Range(ge=1, le=10**9)] = 50
    """Write checkpoints/checkpoint-<step>/ every this many steps (and at the last step)."""
    keep_checkpoints: Annotated[int, Range(ge=1, le=10_000)] = 2
    """Keep only the newest this many checkpoints."""
    log_every: Annotated[int, Range(ge=1, le=10**9)] = 10
    """Write a metrics.jsonl row (losses averaged over ranks) every this many steps."""
    tensorboard: bool = True
    """Also write TensorBoard events to <out>/tensorboard when tensorboard is installed."""
    data_threads: Annotated[int, Range(ge=1, le=256)] = 4
    """Reader threads per rank. Each reads one whole batch, so this many batches are read ahead
    (host memory: data_threads batches)."""
    follow_poll_interval: Annotated[float, Range(gt=0, le=3600)] = 2.0
    """--follow: seconds between looks for newly committed shards."""
    follow_timeout: Annotated[float, Range(ge=0, le=TIMEOUT_S.le)] = 3600.0
    """--follow: give up after this many seconds without a new shard; 0 waits forever."""
    dist_timeout: Annotated[float, TIMEOUT_S] | None = None
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
