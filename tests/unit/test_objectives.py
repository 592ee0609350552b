"""K-step students: the schedule matching, the first-order scheduler, the step plan, the losses."""

from __future__ import annotations

import pytest
import torch

from wandistill.config import LossConfig, SamplerConfig
from wandistill.errors import ConfigError, UsageError
from wandistill.student.losses import SigmaTable, distill_losses, flow_x0
from wandistill.student.schedule import (
    TeacherSchedule,
    build_scheduler,
    plan_objectives,
    student_schedule,
    student_steps_for,
)
from wandistill.teacher.tiny import SCHEDULER_CONFIG


def _unipc(**kw: object):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**{**SCHEDULER_CONFIG, **kw})


def _teacher(n: int = 16, recorded: list[int] | None = None, sched=None) -> TeacherSchedule:
    return TeacherSchedule.from_scheduler(sched or _unipc(), n, recorded)


@pytest.mark.parametrize(("n", "k", "shift"), [(16, 4, 3.0), (50, 2, 5.0), (40, 8, 12.0)])
def test_k_step_unipc_lands_on_every_n_over_k_th_teacher_sigma(n: int, k: int, shift: float):
    teacher = _teacher(n, sched=_unipc(flow_shift=shift))
    s = student_schedule(teacher, k, few_step=True, key="K")
    assert s.steps == tuple(range(0, n, n // k))
    sched = s.make_scheduler()
    sched.set_timesteps(k)
    want = torch.tensor([teacher.sigmas[i] for i in s.steps] + [0.0])
    assert torch.equal(sched.sigmas, want), "the same float32 sigmas, not merely close"
    assert sched.config.solver_order == 1 and list(sched.config.disable_corrector) == list(range(k))


def test_the_16_step_wan_schedule_at_4_steps_is_the_documented_one() -> None:
    s = student_schedule(_teacher(16), 4, few_step=True, key="K")
    assert s.steps == (0, 4, 8, 12)
    assert [round(x, 4) for x in s.sigmas] == [1.0, 0.9001, 0.7504, 0.501, 0.0]


def test_the_student_scheduler_takes_first_order_ddim_euler_steps_ending_at_x0() -> None:
    s = student_schedule(_teacher(16), 4, few_step=True, key="K")
    sched = s.make_scheduler()
    sched.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 1, 4, 4, generator=g)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(x.shape, generator=g)
        sigma, nxt = sched.sigmas[i], sched.sigmas[i + 1]
        x0 = flow_x0(x, v, sigma.expand(2))
        eps = (x - (1 - sigma) * x0) / sigma  # DDIM: re-noise x0 with the implied noise
        ddim = (1 - nxt) * x0 + nxt * eps
        stepped = sched.step(v, t, x, return_dict=False)[0]
        torch.testing.assert_close(stepped, x + (nxt - sigma) * v, atol=1e-6, rtol=0)  # Euler
        torch.testing.assert_close(stepped, ddim, atol=1e-5, rtol=0)
        x = stepped
    torch.testing.assert_close(x, x0, atol=1e-6, rtol=0)  # sigma = 0: the last step returns x0


def test_a_flow_match_euler_teacher_uses_its_own_euler_on_its_own_grid() -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    teacher = _teacher(16, sched=FlowMatchEulerDiscreteScheduler(shift=3.0))
    s = student_schedule(teacher, 4, few_step=True, key="K")
    assert s.scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert s.steps == (0, 5, 10, 15)  # linspace inclusive: (K - 1) divides (N - 1)
    with pytest.raises(UsageError, match=r"choose K from \[1, 2, 4, 6, 16\]"):
        student_schedule(teacher, 8, few_step=True, key="K")


def test_k_off_the_teachers_grid_or_above_n_or_an_unknown_scheduler_is_refused() -> None:
    teacher = _teacher(16)
    with pytest.raises(UsageError, match=r"K=3: .* does not land") as e:
        student_schedule(teacher, 3, few_step=True, key="K")
    assert "[1, 2, 4, 8, 16]" in (e.value.fix or "")
    with pytest.raises(UsageError, match="K=32 exceeds the teacher's 16 steps"):
        student_schedule(teacher, 32, few_step=True, key="K")
    from diffusers import DPMSolverMultistepScheduler

    dpm = DPMSolverMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    with pytest.raises(UsageError, match="DPMSolverMultistepScheduler' has no first-order"):
        student_schedule(_teacher(8, sched=dpm), 4, few_step=True, key="K")


def test_step_imitation_keeps_the_teachers_scheduler_and_n() -> None:
    s = student_schedule(_teacher(8), None, few_step=False, key="K")
    assert s.num_inference_steps == 8 and not s.first_order
    assert build_scheduler(s.scheduler).config.solver_order == 2


def test_each_objective_trains_at_its_own_recorded_steps() -> None:
    loss = LossConfig(output=1.0, perflow=1.0)
    plan = plan_objectives(loss, 4, _teacher(8))
    assert plan.steps["perflow"] == (0, 2, 4, 6)
    assert plan.steps["output"] == tuple(range(8))
    assert plan.slots == list(range(8)) and plan.next_slots() is not None
    assert plan.slot_mask("perflow").tolist() == [i % 2 == 0 for i in range(8)]
    alone = plan_objectives(LossConfig(output=0.0, perflow=1.0), 2, _teacher(8))
    assert alone.slots == [0, 4]
    assert any("perflow" in line for line in alone.describe())
    step_imitation = plan_objectives(LossConfig(output=1.0), None, _teacher(8))
    assert step_imitation.slots == list(range(8)) and step_imitation.next_slots() is None


def test_perflow_trains_at_the_student_steps_and_names_the_ones_the_cache_lacks() -> None:
    plan = plan_objectives(LossConfig(output=0.0, perflow=1.0), 4, _teacher(8))
    assert plan.steps == {"perflow": (0, 2, 4, 6)}
    assert any(line.rstrip().endswith("perflow") for line in plan.describe())
    every_4th = _teacher(16, recorded=[0, 4, 8, 12])
    with pytest.raises(UsageError, match=r"loss.perflow trains .* did not record \[2, 6, 10"):
        plan_objectives(LossConfig(output=0.0, perflow=1.0), 8, every_4th)
    assert not LossConfig(output=1.0).few_step and LossConfig(perflow=1.0).x0_terms


def test_a_wan22_student_trains_over_both_experts_regions() -> None:
    teacher = TeacherSchedule.from_scheduler(_unipc(), 8, boundary_ratio=0.875)
    assert teacher.boundary_timestep == 875.0
    plan = plan_objectives(LossConfig(output=0.0, perflow=1.0), 4, teacher)
    experts = {r["expert"] for r in plan.rows() if "perflow" in r["objectives"]}
    assert experts == {"transformer", "transformer_2"}


def test_objectives_that_need_unrecorded_points_are_refused_with_the_fix() -> None:
    every_4th = _teacher(16, recorded=[0, 4, 8, 12])
    with pytest.raises(UsageError, match=r"did not record \[2, 6, 10, 14\]") as e:
        plan_objectives(LossConfig(output=0.0, perflow=1.0), 8, every_4th)
    assert "record_for_student_steps = [8]" in (e.value.fix or "")
    assert "more than the 4 steps the cache recorded" in e.value.message
    # Perflow at 4 steps is exactly what this cache holds.
    assert plan_objectives(LossConfig(perflow=1.0), 4, every_4th).steps["perflow"] == (
        0,
        4,
        8,
        12,
    )


def test_recorded_steps_unite_record_steps_every_nth_and_student_steps() -> None:
    cfg = SamplerConfig(num_inference_steps=16, record_steps=[15], record_every=8)
    assert cfg.recorded_steps() == [0, 8, 15]
    cfg = SamplerConfig(num_inference_steps=16, record_for_student_steps=[1, 4])
    assert cfg.recorded_steps(student_steps_for(_unipc(), 16)) == [0, 4, 8, 12]
    assert SamplerConfig(num_inference_steps=4).recorded_steps() == [0, 1, 2, 3]
    with pytest.raises(UsageError, match=r"record_for_student_steps=3: .* does not land"):
        SamplerConfig(num_inference_steps=16, record_for_student_steps=[3]).recorded_steps(
            student_steps_for(_unipc(), 16)
        )
    with pytest.raises(ConfigError, match="record_for_student_steps"):
        SamplerConfig(num_inference_steps=16, record_for_student_steps=[32])


def _batch(b: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shape = (b, 16, 1, 4, 4)
    return {
        "xt": torch.randn(shape, generator=g),
        "teacher_out": torch.randn(shape, generator=g),
        "final_latent": torch.randn(shape, generator=g),
        "xt_next": torch.randn(shape, generator=g),
        "timesteps_next": torch.tensor([900.0, 750.0, 500.0, 0.0]),
    }


def test_an_x0_term_matches_x0_to_the_final_latent_on_its_own_samples_only() -> None:
    batch, pred = _batch(), torch.randn(4, 16, 1, 4, 4)
    sigma = torch.tensor([1.0, 0.9, 0.75, 0.5])
    mask = torch.tensor([True, False, True, False])
    w = LossConfig(output=0.0, final_latent=2.0)
    terms = distill_losses(pred, {}, batch, w, sigma, {"output": ~mask, "final_latent": mask})
    err = (flow_x0(batch["xt"], pred, sigma) - batch["final_latent"]).square().mean((1, 2, 3, 4))
    torch.testing.assert_close(terms["final_latent"], err[mask].mean())
    torch.testing.assert_close(terms["loss"], 2.0 * err[mask].sum() / 4)  # sum / batch size


def test_sigma_table_gives_the_next_points_sigma_and_zero_past_the_last_slot() -> None:
    table = SigmaTable(torch.tensor([1.0, 0.8, 0.5]))
    slots = torch.tensor([0, 1, 2])
    got = table.next(slots, torch.zeros(3), [1, 2, 3])
    torch.testing.assert_close(got, torch.tensor([0.8, 0.5, 0.0]))
