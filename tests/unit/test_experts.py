"""One student per Wan 2.2 expert: routing by timestep, the K-step split, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

from wandistill.cache.files import DimsBlock, SettingsBlock
from wandistill.config import TrainConfig, load_recipe
from wandistill.errors import ConfigError
from wandistill.student import experts
from wandistill.student.experts import ExpertPair
from wandistill.student.sampler import sample_latents, student_pipeline
from wandistill.student.schedule import TeacherSchedule, plan_objectives
from wandistill.teacher.tiny import BOUNDARY_RATIO, SCHEDULER_CONFIG, TRANSFORMER_CONFIG

TINY = Path(__file__).parents[2] / "pipelines" / "tiny.toml"
BOUNDARY = BOUNDARY_RATIO * 1000  # 875: the tiny Wan 2.2 teacher's, as Wan2.2-T2V-A14B's


def _train(*sets: str) -> TrainConfig:
    return load_recipe(TINY, list(sets), stage="train").train


def _expert(seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**TRANSFORMER_CONFIG)


def _pair() -> ExpertPair:
    return ExpertPair(_expert(1), _expert(2), BOUNDARY_RATIO, 1000)


def _inputs(timesteps: list[float]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b = len(timesteps)
    return {
        "hidden_states": torch.randn(b, 16, 1, 4, 4, generator=g),
        "timestep": torch.tensor(timesteps),
        "encoder_hidden_states": torch.randn(b, 8, TRANSFORMER_CONFIG["text_dim"], generator=g),
    }


def _run(model: torch.nn.Module, x: dict[str, torch.Tensor], rows: list[int]) -> torch.Tensor:
    return model(**{k: v[rows] for k, v in x.items()}, return_dict=False)[0]


def _teacher(n: int = 4, ratio: float | None = BOUNDARY_RATIO) -> TeacherSchedule:
    sched = UniPCMultistepScheduler(**SCHEDULER_CONFIG)
    return TeacherSchedule.from_scheduler(sched, n, boundary_ratio=ratio)


def _settings(teacher: TeacherSchedule) -> SettingsBlock:
    ratio = teacher.boundary_timestep / 1000 if teacher.boundary_timestep is not None else None
    return SettingsBlock(boundary_ratio=ratio)


# --------------------------------------------------------------------------- routing


def test_each_sample_goes_to_the_expert_of_its_timestep_with_t_at_the_boundary_going_high() -> None:
    pair = _pair()
    x = _inputs([999.0, 875.0, 874.0, 100.0])
    with torch.no_grad():
        (out,) = pair(**x)
        high = _run(pair.transformer, x, [0, 1])
        low = _run(pair.transformer_2, x, [2, 3])
    torch.testing.assert_close(out[:2], high, rtol=0, atol=1e-6)
    torch.testing.assert_close(out[2:], low, rtol=0, atol=1e-6)
    assert not torch.allclose(out[2:], _run(pair.transformer, x, [2, 3]).detach())


def test_a_one_sided_batch_still_gives_the_other_expert_a_zero_gradient() -> None:
    """DDP's reducer and FSDP's reduce-scatter need every parameter in every backward; the
    output is the active expert's alone."""
    pair = _pair()
    x = _inputs([999.0, 950.0])
    (out,) = pair(**x)
    out.square().mean().backward()
    high = [p.grad for p in pair.transformer.parameters()]
    low = [p.grad for p in pair.transformer_2.parameters()]
    assert all(g is not None for g in high + low)
    assert any(float(g.abs().sum()) > 0 for g in high)
    assert all(float(g.abs().sum()) == 0 for g in low)
    with torch.no_grad():
        torch.testing.assert_close(out, _run(pair.transformer, x, [0, 1]), rtol=0, atol=1e-6)


def test_without_gradients_an_idle_expert_is_not_run() -> None:
    pair = _pair()
    calls: list[str] = []
    for name in experts.EXPERTS:
        getattr(pair, name).register_forward_hook(lambda *_, n=name: calls.append(n))
    with torch.no_grad():
        pair(**_inputs([10.0, 20.0]))
    assert calls == ["transformer_2"]


def test_the_projects_sampler_switches_experts_where_the_split_says() -> None:
    """The K-step split (student timesteps >= boundary -> transformer) is WanPipeline's rule:
    each expert sees exactly the timesteps `split_steps` gives it."""
    teacher = _teacher()
    plan = plan_objectives(_train("student.num_inference_steps=2").loss, 2, teacher)
    high, low = experts.split_steps(plan.student.timesteps, BOUNDARY)
    assert high == (0,) and low == (1,)
    pair = _pair()
    seen: dict[str, list[float]] = {n: [] for n in experts.EXPERTS}
    for name in experts.EXPERTS:
        getattr(pair, name).register_forward_pre_hook(
            lambda _m, _a, kw, n=name: seen[n].append(float(kw["timestep"][0])), with_kwargs=True
        )
    noise = torch.randn(1, 16, 1, 4, 4)
    embeds = torch.randn(1, 8, TRANSFORMER_CONFIG["text_dim"])
    sample_latents(student_pipeline(pair, plan.student), noise, embeds, 2)
    assert seen["transformer"] == [plan.student.timesteps[i] for i in high]
    assert seen["transformer_2"] == [plan.student.timesteps[i] for i in low]


def test_the_cache_side_records_which_expert_made_each_slot() -> None:
    teacher = _teacher()
    made = experts.recorded_experts(teacher.timesteps, teacher.recorded, BOUNDARY)
    assert made == ["transformer", "transformer", "transformer_2", "transformer_2"]
    assert experts.recorded_experts(teacher.timesteps, teacher.recorded, None) is None


# --------------------------------------------------------------------------- refusals


def _problems(teacher: TeacherSchedule, *sets: str, dims: dict | None = None) -> list[str]:
    cfg = _train('student.experts="per-expert"', *sets)
    plan = plan_objectives(cfg.loss, cfg.student.num_inference_steps, teacher)
    return experts.check(
        cfg.student, cfg.loss, _settings(teacher), DimsBlock(**(dims or {})), plan, "CACHE"
    )


def test_a_k_that_leaves_one_expert_without_a_step_is_refused_naming_the_smallest_k() -> None:
    (problem,) = _problems(_teacher(), "student.num_inference_steps=1")
    assert "train.student.num_inference_steps=1" in problem
    assert "leaving transformer_2 without a step" in problem
    assert "set train.student.num_inference_steps = 2" in problem
    assert _problems(_teacher(), "student.num_inference_steps=2") == []


def test_per_expert_on_a_wan21_cache_is_refused_with_the_fix() -> None:
    (problem,) = _problems(_teacher(ratio=None))
    assert "'per-expert' needs a cache of a Wan 2.2 A14B teacher" in problem
    assert "set train.student.experts = 'one'" in problem
    cfg = _train()  # the default, "one", needs no boundary
    assert experts.check(cfg.student, cfg.loss, SettingsBlock(), DimsBlock(), None, "CACHE") == []


def test_a_cache_whose_recorded_experts_disagree_with_its_timesteps_is_refused() -> None:
    wrong = {"recorded_experts": ["transformer"] * 4}
    (problem,) = _problems(_teacher(), "student.num_inference_steps=2", dims=wrong)
    assert "dims.recorded_experts" in problem


def test_feature_loss_and_a_single_expert_init_are_refused_with_per_expert(tmp_path: Path) -> None:
    problems = _problems(
        _teacher(),
        "loss.feature=1.0",
        'loss.feature_map={"blocks.1" = "blocks.0"}',
        f'student.init_from_teacher.path="{tmp_path}"',
        'student.init_from_teacher.component="transformer_2"',
    )
    assert any("loss.feature" in p for p in problems)
    assert any("init_from_teacher.component" in p for p in problems)
    (tmp_path / "transformer").mkdir()
    (problem,) = _problems(_teacher(), f'student.init_from_teacher.path="{tmp_path}"')
    assert "has no transformer_2/ folder" in problem


def test_a_resume_that_changes_experts_names_both_settings() -> None:
    cfg = _train('student.experts="per-expert"')
    msg = experts.resume_problem(cfg.student, {}, Path("/r/checkpoints/checkpoint-4"))
    assert "train.student.experts = 'one'" in msg and "'per-expert'" in msg
    assert experts.resume_problem(cfg.student, {"experts": "per-expert"}, Path("/x")) == ""


def test_experts_must_be_one_or_per_expert() -> None:
    with pytest.raises(ConfigError, match="student.experts='both' must be 'one' or 'per-expert'"):
        _train('student.experts="both"')


def test_a_cache_recording_only_one_experts_points_is_refused() -> None:
    sched = UniPCMultistepScheduler(**SCHEDULER_CONFIG)
    high_only = TeacherSchedule.from_scheduler(sched, 4, [0, 1], boundary_ratio=BOUNDARY_RATIO)
    (problem,) = _problems(high_only)  # step imitation: every recorded step
    assert "train at no recorded point of transformer_2" in problem


def test_per_expert_lora_students_pass_the_checks_with_a_two_expert_base(tmp_path: Path) -> None:
    for name in experts.EXPERTS:
        (tmp_path / name).mkdir()
    init = f'student.init_from_teacher.path="{tmp_path}"'
    assert _problems(_teacher(), "student.num_inference_steps=2", init, "student.lora.rank=4") == []
