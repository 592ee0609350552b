"""The precompute stage's recipe sections: teacher, sampler, cache, and `[precompute]` itself."""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import field
from typing import Annotated, Any

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from wandistill.checks.bounds import SEED, TIMEOUT_S, Range
from wandistill.config.common import BACKENDS, DTYPES, _locations, _problems, section
from wandistill.errors import ConfigError, UsageError
from wandistill.placement.parse import GROUP_LEVELS, parse_placement
from wandistill.placement.strategies import Cpu, Placement

if typing.TYPE_CHECKING:
    from wandistill.cache.encoding import Encoding


def _placement_text(value: Any) -> Any:
    """A placement is written as text and parsed in `TeacherConfig.__post_init__` (with its
    sibling keys); a parsed one (a config copied with `dataclasses.replace`) passes as it is."""
    if isinstance(value, str | Placement):
        return value
    raise PydanticCustomError("placement_type", 'must be a string, e.g. "auto"')


@section("teacher")
class TeacherConfig:
    path: str = ""
    """Local diffusers Wan folder (Wan 2.1: `transformer`; Wan 2.2 A14B: also `transformer_2`)."""
    placement: Annotated[Placement, PlainValidator(_placement_text)] = field(default_factory=Cpu)
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


@section("sampler")
class SamplerConfig:
    height: Annotated[int, Range(ge=16, le=8192)] = 480
    """Pixel height; divisible by 16 (VAE factor 8 x patch 2)."""
    width: Annotated[int, Range(ge=16, le=8192)] = 832
    """Pixel width; divisible by 16."""
    num_frames: Annotated[int, Range(ge=1, le=4097)] = 81
    """Frames; 4k+1 (the Wan VAE compresses time by 4)."""
    num_inference_steps: Annotated[int, Range(ge=1, le=1000)] = 50
    """Teacher sampler steps (at most the scheduler's 1000 training timesteps)."""
    guidance_scale: Annotated[float, Range(ge=0, le=100)] = 5.0
    """CFG scale g in uncond + g * (cond - uncond); 1.0 disables the uncond pass."""
    guidance_scale_2: Annotated[float, Range(ge=0, le=100)] | None = None
    """Wan 2.2 A14B: scale for the low-noise expert (transformer_2); defaults to guidance_scale."""
    flow_shift: Annotated[float, Range(gt=0, le=100)] | None = None
    """Override of the scheduler's flow shift; None keeps the teacher folder's value."""
    negative_prompt: str = ""
    max_sequence_length: Annotated[int, Range(ge=1, le=8192)] = 512
    """Text length the pipeline pads to; embeddings are stored trimmed and re-padded on read."""
    record_steps: list[Annotated[int, Range(ge=0, le=999)]] = field(default_factory=list)
    """Step indices whose (x_t, t, teacher output) are recorded. With record_every and
    record_for_student_steps also empty, every step is recorded; otherwise the recorded steps are
    the union of the three (see `recorded_steps`)."""
    record_every: Annotated[int, Range(ge=0, le=1000)] = 0
    """Also record every n-th step (0, n, 2n, ...); 0: off. `record_every = 4` of 16 steps
    records what a 4-step student needs (the steps its schedule visits) when 4 divides 16."""
    record_for_student_steps: list[Annotated[int, Range(ge=1, le=1000)]] = field(
        default_factory=list
    )
    """Also record the teacher steps a K-step student is trained at (perflow, unroll), for
    each K listed, e.g. [1, 2, 4]: the steps where the student's K-step schedule meets the
    teacher's N-step one (every N/K-th step for Wan's UniPC flow schedule; K must land on it)."""
    features: list[str] = field(default_factory=list)
    """Named teacher blocks whose outputs are recorded, e.g. ["blocks.3", "blocks.7"]."""
    seed: Annotated[int, SEED] = 0
    """Base seed; a prompt without its own seed gets seed + its line index."""
    batch_size: Annotated[int, Range(ge=1, le=4096)] = 1
    """Prompts denoised together."""
    expert_group_batches: Annotated[int, Range(ge=1, le=100_000)] = 16
    """Wan 2.2: batches that run their high-noise steps before the swap to transformer_2
    (bigger groups mean fewer expert loads, more latents held in memory)."""

    def __post_init__(self) -> None:
        _problems(
            *(
                (v % 16 == 0, f"sampler.{k}={v} must be a positive multiple of 16")
                for k, v in (("height", self.height), ("width", self.width))
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


@section("cache")
class CacheConfig:
    path: str = "cache/default"
    """Cache directory, or an fsspec URL (s3://bucket/prefix)."""
    backend: str = "webdataset"
    """webdataset (tar shards) or zarr (v3 group)."""
    shard_records: Annotated[int, Range(ge=1, le=1_000_000)] = 64
    """Records per shard: the unit of atomic publication, resume and follow mode."""
    holdout_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.0
    """Share of prompts marked held-out (by key hash) for eval; train skips them."""
    store_dtype: str = "model"
    """Stored dtype of x_t, teacher output, final latent and features: model (as computed: the
    teacher's dtype, fp32 for the final latent), fp32, bf16, fp16 or fp8 (e4m3 with a float32
    scale per recorded step). Readers hand out the computed dtype (docs/cache-format.md)."""
    store_dtypes: dict[str, str] = field(default_factory=dict)
    """Per-field overrides of store_dtype: keys xt, teacher_out, final_latent, features."""
    compression: str = "none"
    """none or zstd (zarr backend: each inner chunk, before its crc32c)."""
    compression_level: Annotated[int, Range(ge=1, le=22)] = 3

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


@section("precompute")
class PrecomputeConfig:
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    prompts: str = ""
    """Prompt file: .txt (one per line) or .jsonl ({"prompt", "seed"?, "negative_prompt"?})."""
    previews: Annotated[int, Range(ge=0, le=100_000)] = 0
    """VAE-decode this many teacher samples to PNG for eval."""
    dist_timeout: Annotated[float, TIMEOUT_S] | None = None
    """Seconds a rank waits for the others (rendezvous, collectives) before it exits naming the
    missing rank. None: WANDISTILL_DIST_TIMEOUT, else 300."""
