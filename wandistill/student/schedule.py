"""K-step students: which recorded teacher steps each objective trains at, and the K-step scheduler.

A student trained for K steps must be *sampled* at exactly the points it was trained at, by a
stock diffusers scheduler (so the export drops into `WanPipeline`), with a first-order update
(the unroll and perflow objectives train the student's own first-order steps: a first-order step
turns an x0 estimate into the next point, DDIM-style, and nothing else). Why this scheduler:

- Wan's teachers use `UniPCMultistepScheduler(prediction_type="flow_prediction",
  use_flow_sigmas=True, flow_shift=s)`. Its `set_timesteps(N)` takes
  `linspace(1, 1/1000, N + 1)[:-1]` and shifts it, so when K divides N, `set_timesteps(K)` gives
  exactly every N/K-th sigma of the N-step schedule (16 steps, K = 4: sigmas [1, .9001, .7504,
  .501, 0] = steps 0, 4, 8, 12; equal in float32, checked by `match_steps`, not assumed).
  DPMSolver/DEIS/SA-Solver with `use_flow_sigmas` build `1 - linspace(1, 1/1000, N + 1)`, a
  different grid, so they cannot be used.
- Its default update is order 2 plus the UniC corrector. With `solver_order=1` the predictor is
  `x_t = sigma_t / sigma_s * x - alpha_t * expm1(-h) * x0`, h = lambda_t - lambda_s, lambda =
  log(alpha / sigma), alpha = 1 - sigma, which is DDIM: `alpha_t * x0 + sigma_t * eps_hat` with
  eps_hat = (x - alpha_s * x0) / sigma_s; for flow matching that equals the Euler step
  `x + (sigma_t - sigma_s) * v` (a test checks it to float32 rounding, and that sigma_t = 0
  gives x0). The corrector would still mix the next step's x0 into the previous update
  (`use_corrector` when `step_index - 1 not in disable_corrector`), so
  `disable_corrector = [0 .. K-1]` switches it off for every one of the K steps.
- A teacher with `FlowMatchEulerDiscreteScheduler` is first-order already (Euler on v = the flow
  DDIM); its `set_timesteps(K)` takes `linspace(1, sigma_min, K)` *inclusive*, so a K-step grid
  lands on the N-step one when K - 1 divides N - 1 instead. The same matching handles it.
- Any other scheduler class is refused with the list of supported ones.

The match is one mechanism for every scheduler: build the student's scheduler from the cache's
recorded scheduler config (so `sampler.flow_shift` overrides are kept), call `set_timesteps(K)`,
and find each sigma in the teacher's recorded schedule (`shared.safetensors["sigmas"]`); a K that
does not land on it is an error listing the K that do. The truncated integer timestep
(`int(sigma * 1000)`) can differ by 1 from the teacher's at a few (shift, N, K) because numpy
computes the two linspaces separately (seen at shift 1.0: N = 21, K = 3); the sigma, which is all
the update uses, is identical.

Step imitation (K unset and no unroll or perflow) keeps the teacher's own scheduler
and N: the student learned the teacher's velocity at every step, so the teacher's solver is the
one that reproduces the teacher's trajectory from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from wandistill.cache.files import SettingsBlock
from wandistill.config import LossConfig
from wandistill.errors import UsageError

SIGMA_TOLERANCE = 1e-6
"""Sigmas of the student's and the teacher's schedule that are the same point (float32)."""
SUPPORTED = ("UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler")
STEP_IMITATION = ("output", "final_latent", "feature")
"""Objectives that match the teacher at every recorded step of its N-step trajectory."""
AT_STUDENT_STEPS = ("perflow",)
"""Objectives that train a K-step student at exactly its K sigmas (the recorded slots there)."""


@dataclass(frozen=True, slots=True)
class TeacherSchedule:
    """The teacher's N-step schedule and which of its steps a cache holds points of."""

    num_inference_steps: int
    sigmas: tuple[float, ...]
    """N + 1 values; the last is the end of the trajectory (0 for Wan's flow schedules)."""
    timesteps: tuple[float, ...]
    recorded: tuple[int, ...]
    """Step indices with a cached (x_t, t, output), sorted: cache slot i holds step recorded[i]."""
    scheduler: dict[str, Any] | None
    """{"_class_name": ..., **config} of the teacher's scheduler; None for caches without it."""
    boundary_timestep: float | None = None
    """Wan 2.2: steps with t >= this ran on `transformer`, the rest on `transformer_2`."""

    @classmethod
    def from_cache(
        cls, settings: SettingsBlock, shared: dict[str, torch.Tensor]
    ) -> TeacherSchedule:
        n = settings.num_inference_steps or 0
        recorded = tuple(settings.record_steps or range(n))
        sigmas = shared.get("sigmas")
        if sigmas is None or sigmas.numel() != n + 1:
            sigmas = torch.zeros(0)  # an old cache: step imitation only (student_schedule)
        t = shared.get("timesteps")
        config = settings.scheduler_config or {}
        train_steps = float(config.get("num_train_timesteps", 1000))
        timesteps = t.flatten().tolist() if t is not None else (sigmas[:-1] * train_steps).tolist()
        spec = {"_class_name": settings.scheduler, **config} if settings.scheduler else None
        ratio = settings.boundary_ratio
        return cls(
            num_inference_steps=n,
            sigmas=tuple(float(s) for s in sigmas.flatten().tolist()),
            timesteps=tuple(float(x) for x in timesteps),
            recorded=recorded,
            scheduler=spec,
            boundary_timestep=float(ratio) * train_steps if ratio is not None else None,
        )

    @classmethod
    def from_scheduler(
        cls,
        scheduler: Any,
        num_inference_steps: int,
        recorded: list[int] | None = None,
        boundary_ratio: float | None = None,
    ) -> TeacherSchedule:
        """The schedule precompute will record with `scheduler` (a configured diffusers one)."""
        config = json.loads(json.dumps(dict(scheduler.config), default=str))  # JSON values
        spec = {"_class_name": type(scheduler).__name__, **config}
        train_steps = float(spec.get("num_train_timesteps", 1000))
        timesteps, sigmas = _set_timesteps(build_scheduler(spec), num_inference_steps)
        return cls(
            num_inference_steps=num_inference_steps,
            sigmas=sigmas,
            timesteps=timesteps,
            recorded=tuple(recorded if recorded is not None else range(num_inference_steps)),
            scheduler=spec,
            boundary_timestep=boundary_ratio * train_steps if boundary_ratio is not None else None,
        )

    def slot(self, step: int) -> int:
        return self.recorded.index(step)


@dataclass(frozen=True, slots=True)
class StudentSchedule:
    """How the student samples: K steps at teacher steps `steps`, with `scheduler`."""

    num_inference_steps: int
    steps: tuple[int, ...]
    """The teacher step index of each of the K student steps."""
    sigmas: tuple[float, ...]
    timesteps: tuple[float, ...]
    scheduler: dict[str, Any] | None
    """{"_class_name": ..., **config} for `from_config`; None: the teacher folder's own."""
    first_order: bool

    def make_scheduler(self) -> Any:
        if self.scheduler is None:
            raise UsageError(
                "this run recorded no scheduler (its cache predates scheduler recording)",
                fix="re-run precompute and train with this wandistill",
            )
        return build_scheduler(self.scheduler)

    def to_json(self) -> dict[str, Any]:
        return {
            "num_inference_steps": self.num_inference_steps,
            "teacher_steps": list(self.steps),
            "sigmas": list(self.sigmas),
            "timesteps": list(self.timesteps),
            "scheduler": self.scheduler,
            "first_order": self.first_order,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StudentSchedule:
        return cls(
            num_inference_steps=int(data["num_inference_steps"]),
            steps=tuple(int(s) for s in data["teacher_steps"]),
            sigmas=tuple(float(s) for s in data["sigmas"]),
            timesteps=tuple(float(t) for t in data["timesteps"]),
            scheduler=data.get("scheduler"),
            first_order=bool(data["first_order"]),
        )


# --------------------------------------------------------------------------- schedulers


def build_scheduler(spec: dict[str, Any]) -> Any:
    """A stock diffusers scheduler from {"_class_name": ..., **config} (scheduler classes only)."""
    import diffusers

    name = spec.get("_class_name", "")
    cls = getattr(diffusers, name, None) if name.endswith("Scheduler") else None
    if cls is None:
        raise UsageError(f"unknown scheduler class {name!r}", fix=f"use one of {SUPPORTED}")
    config = {k: v for k, v in spec.items() if not k.startswith("_")}
    return cls.from_config(config)


def _set_timesteps(sched: Any, k: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    sched.set_timesteps(k, device="cpu")
    sigmas = getattr(sched, "sigmas", None)
    if not isinstance(sigmas, torch.Tensor):
        raise UsageError(
            f"scheduler {type(sched).__name__} has no sigma schedule; wandistill distils "
            "flow-matching Wan teachers",
            fix=f"use a teacher whose scheduler is one of {', '.join(SUPPORTED)}",
        )
    return (
        tuple(float(t) for t in sched.timesteps.float().tolist()),
        tuple(float(s) for s in sigmas.float().tolist()),
    )


def first_order_spec(teacher: dict[str, Any], k: int) -> dict[str, Any]:
    """The teacher's scheduler config turned first-order for a K-step student (see module doc)."""
    name = teacher.get("_class_name")
    if name == "UniPCMultistepScheduler":
        flow = teacher.get("prediction_type") == "flow_prediction" and teacher.get(
            "use_flow_sigmas"
        )
        if not flow:
            raise UsageError(
                "the teacher's UniPCMultistepScheduler is not a flow schedule "
                "(prediction_type='flow_prediction', use_flow_sigmas=True), which x0 = x_t - "
                "sigma * v and the K-step student need",
                fix="distil a Wan teacher with its stock flow scheduler",
            )
        return {**teacher, "solver_order": 1, "disable_corrector": list(range(k))}
    if name == "FlowMatchEulerDiscreteScheduler":
        if teacher.get("stochastic_sampling") or teacher.get("invert_sigmas"):
            raise UsageError(
                "the teacher's FlowMatchEulerDiscreteScheduler samples stochastically or with "
                "inverted sigmas; a K-step student needs the deterministic Euler (DDIM) update",
                fix="set stochastic_sampling and invert_sigmas to false in its scheduler config",
            )
        return dict(teacher)
    raise UsageError(
        f"the teacher's scheduler {name!r} has no first-order K-step form wandistill knows",
        fix=f"use a teacher whose scheduler is one of {', '.join(SUPPORTED)}",
    )


def match_steps(teacher: TeacherSchedule, k: int) -> StudentSchedule | None:
    """The first-order K-step schedule, if each of its sigmas is one of the teacher's steps."""
    assert teacher.scheduler is not None
    spec = first_order_spec(teacher.scheduler, k)
    try:
        timesteps, sigmas = _set_timesteps(build_scheduler(spec), k)
    except (ValueError, RuntimeError, TypeError):  # e.g. dynamic shifting without mu
        return None
    if len(sigmas) != k + 1 or abs(sigmas[-1] - teacher.sigmas[-1]) > SIGMA_TOLERANCE:
        return None
    steps: list[int] = []
    for s in sigmas[:-1]:
        hit = [
            i
            for i, t in enumerate(teacher.sigmas[:-1])
            if abs(t - s) <= SIGMA_TOLERANCE and (not steps or i > steps[-1])
        ]
        if not hit:
            return None
        steps.append(hit[0])
    return StudentSchedule(k, tuple(steps), sigmas, timesteps, spec, first_order=True)


def student_schedule(
    teacher: TeacherSchedule, k: int | None, *, few_step: bool, key: str
) -> StudentSchedule:
    """Resolve the student's sampler: the teacher's own (step imitation) or a first-order K-step
    one whose steps land on the teacher's schedule. `key` names the setting in messages."""
    n = teacher.num_inference_steps
    if not few_step:
        own = (teacher.sigmas, teacher.timesteps, teacher.scheduler)
        return StudentSchedule(n, tuple(range(n)), *own, first_order=False)
    k = n if k is None else k
    if teacher.scheduler is None or len(teacher.sigmas) != n + 1:
        raise UsageError(
            "the cache records no teacher scheduler and sigma schedule, which a K-step student "
            "(train.student.num_inference_steps, loss.unroll, loss.perflow) needs",
            fix="re-run `wandistill precompute` into a new cache with this wandistill",
        )
    if k > n:
        raise UsageError(
            f"{key}={k} exceeds the teacher's {n} steps; a student takes at most as many steps "
            "as the teacher's schedule has",
            fix=f"choose K <= {n}",
        )
    found = match_steps(teacher, k)
    if found is None:
        valid = [j for j in range(1, n + 1) if match_steps(teacher, j)]
        raise UsageError(
            f"{key}={k}: the {teacher.scheduler['_class_name']} {k}-step schedule does not land "
            f"on the teacher's {n}-step one (for UniPC, K must divide N)",
            fix=f"choose K from {valid}",
        )
    return found


def student_steps_for(scheduler: Any, num_inference_steps: int) -> Any:
    """For `SamplerConfig.recorded_steps`: K -> the teacher steps a K-step student visits."""
    teacher = TeacherSchedule.from_scheduler(scheduler, num_inference_steps)

    def steps(k: int) -> list[int]:
        key = "sampler.record_for_student_steps"
        return list(student_schedule(teacher, k, few_step=True, key=key).steps)

    return steps


# --------------------------------------------------------------------------- objectives


@dataclass(frozen=True, slots=True)
class ObjectivePlan:
    """Which recorded teacher steps each weighted objective trains at (validated)."""

    teacher: TeacherSchedule
    student: StudentSchedule
    steps: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Objective -> teacher step indices; only objectives with a weight > 0."""

    @property
    def slots(self) -> list[int]:
        """The cache slots the training sample space covers: every step any objective uses."""
        used = {s for steps in self.steps.values() for s in steps}
        return sorted(self.teacher.slot(s) for s in used)

    def next_slots(self) -> list[int] | None:
        """Slot -> the slot whose x_t is each sample's next point (`len(recorded)`: the final
        latent): perflow's window end, the slot of the student's next step (None without it)."""
        if "perflow" not in self.steps:
            return None
        recorded = self.teacher.recorded
        nxt = list(range(1, len(recorded) + 1))
        ends = [*self.student.steps[1:], None]
        for start, end in zip(self.student.steps, ends, strict=True):
            nxt[self.teacher.slot(start)] = len(recorded) if end is None else self.teacher.slot(end)
        return nxt

    def slot_mask(self, name: str) -> torch.Tensor:
        """Bool per cache slot: does objective `name` train at that slot's step."""
        mask = torch.zeros(len(self.teacher.recorded), dtype=torch.bool)
        for s in self.steps.get(name, ()):
            mask[self.teacher.slot(s)] = True
        return mask

    def rows(self) -> list[dict[str, Any]]:
        """One row per used step: index, timestep, sigma, expert, and the objectives using it."""
        t = self.teacher
        rows = []
        for step in sorted({s for v in self.steps.values() for s in v}):
            expert = ""
            if t.boundary_timestep is not None and step < len(t.timesteps):
                expert = (
                    "transformer" if t.timesteps[step] >= t.boundary_timestep else "transformer_2"
                )
            rows.append(
                {
                    "index": step,
                    "timestep": t.timesteps[step] if step < len(t.timesteps) else float("nan"),
                    "sigma": t.sigmas[step] if step < len(t.sigmas) else float("nan"),
                    "expert": expert,
                    "objectives": [n for n, v in self.steps.items() if step in v],
                }
            )
        return rows

    def describe(self) -> list[str]:
        """Text lines for --dry-run and plan: the schedules, then one line per used step."""
        t, s = self.teacher, self.student
        sched = (s.scheduler or {}).get("_class_name", "the teacher folder's scheduler")
        kind = "first-order" if s.first_order else "the teacher's own"
        lines = [
            f"teacher: {t.num_inference_steps} steps, {len(t.recorded)} recorded; student: "
            f"K = {s.num_inference_steps} steps with {kind} {sched} at teacher steps "
            f"{list(s.steps)}",
            "objective steps (index: timestep, sigma[, expert]):",
        ]
        for r in self.rows():
            expert = f", {r['expert']}" if r["expert"] else ""
            lines.append(
                f"  {r['index']:>4}: t={r['timestep']:7.2f}  sigma={r['sigma']:.4f}{expert}  "
                f"{' '.join(r['objectives'])}"
            )
        return lines


def plan_objectives(loss: LossConfig, k: int | None, teacher: TeacherSchedule) -> ObjectivePlan:
    """Resolve K and the steps of every weighted objective; every gap in the cache is named."""
    few_step = k is not None or loss.few_step
    key = "train.student.num_inference_steps"
    student = student_schedule(teacher, k, few_step=few_step, key=key)
    recorded = set(teacher.recorded)
    problems: list[tuple[str, list[str]]] = []  # (what is wrong, its fixes)
    fix_k = f"sampler.record_for_student_steps = [{student.num_inference_steps}]"
    if k is not None and k > len(recorded):
        problems.append(
            (
                f"{key}={k} is more than the {len(recorded)} steps the cache recorded "
                f"({sorted(recorded)})",
                [f"choose K <= {len(recorded)}", f"re-run precompute with {fix_k}"],
            )
        )
    steps: dict[str, tuple[int, ...]] = {}
    weights = loss.weights()
    for name in STEP_IMITATION:
        if weights[name] > 0:
            steps[name] = tuple(teacher.recorded)
    for name in AT_STUDENT_STEPS:
        if weights[name] == 0:
            continue
        steps[name] = student.steps
        missing = sorted(set(student.steps) - recorded)
        if missing:
            problems.append(
                (
                    f"loss.{name} trains the {student.num_inference_steps}-step student at "
                    f"teacher steps {list(student.steps)}, but the cache did not record {missing}",
                    [f"re-run precompute with {fix_k}"],
                )
            )
    if loss.unroll > 0:  # one sample per record: its slot at the student's first step
        steps["unroll"] = student.steps[:1]
        if student.steps[0] not in recorded:
            problems.append(
                (
                    f"loss.unroll samples each record once, at the student's first step "
                    f"{student.steps[0]}, which the cache did not record",
                    [f"re-run precompute with {fix_k}"],
                )
            )
    if problems:
        fixes = dict.fromkeys(f for _, some in problems for f in some)  # once each, in order
        raise UsageError("; ".join(m for m, _ in problems), fix=", or ".join(fixes))
    return ObjectivePlan(teacher=teacher, student=student, steps=steps)
