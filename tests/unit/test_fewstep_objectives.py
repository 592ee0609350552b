"""Piecewise reflow: its target as PeRFlow defines it on hand-built batches, the cache points it
needs; and block init the teacher cannot give refused before anything is built."""

from __future__ import annotations

import pytest
import torch

from wandistill.config import LossConfig, TeacherInitConfig
from wandistill.errors import UsageError
from wandistill.student.init import init_problems
from wandistill.student.losses import SigmaTable, distill_losses, flow_x0
from wandistill.student.perflow import window_velocity
from wandistill.student.schedule import TeacherSchedule, plan_objectives
from wandistill.teacher.tiny import SCHEDULER_CONFIG

SHAPE = (3, 16, 1, 4, 4)


def _teacher(n: int = 16, recorded: list[int] | None = None) -> TeacherSchedule:
    from diffusers import UniPCMultistepScheduler

    return TeacherSchedule.from_scheduler(UniPCMultistepScheduler(**SCHEDULER_CONFIG), n, recorded)


def _randn(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- perflow


def test_one_euler_step_with_the_window_velocity_lands_on_the_windows_cached_end() -> None:
    start, end = _randn(0), _randn(1)
    sigma, sigma_end = torch.tensor([1.0, 0.75, 0.5]), torch.tensor([0.75, 0.5, 0.0])
    v = window_velocity(start, end, sigma, sigma_end)
    stepped = start + (sigma_end - sigma).view(-1, 1, 1, 1, 1) * v  # the student's sampler step
    torch.testing.assert_close(stepped, end)
    # The last window ends at sigma 0: its x0 estimate is the final latent.
    torch.testing.assert_close(flow_x0(start[2:], v[2:], sigma[2:]), end[2:])
    with pytest.raises(ValueError, match="does not go down in sigma"):
        window_velocity(start, end, sigma_end, sigma)


def test_perflow_reads_each_windows_end_at_the_students_next_step_and_the_final_latent_last():
    plan = plan_objectives(LossConfig(output=0.0, perflow=1.0), 4, _teacher(16))
    assert plan.steps["perflow"] == (0, 4, 8, 12)
    ends = plan.next_slots()
    assert ends is not None
    assert [ends[s] for s in (0, 4, 8, 12)] == [4, 8, 12, 16]  # 16 slots: 16 is the final latent
    sigmas = SigmaTable(torch.tensor(plan.teacher.sigmas[:-1]))
    got = sigmas.next(torch.tensor([0, 4, 12]), torch.zeros(3), ends)
    want = torch.tensor([plan.teacher.sigmas[4], plan.teacher.sigmas[8], 0.0])
    torch.testing.assert_close(got, want)
    # A cache of exactly the student's steps: the end is the next slot.
    only = plan_objectives(LossConfig(output=0.0, perflow=1.0), 4, _teacher(16, [0, 4, 8, 12]))
    assert only.next_slots() == [1, 2, 3, 4]


def test_the_perflow_term_is_the_mse_of_the_velocity_on_its_own_samples() -> None:
    batch = {"xt": _randn(0), "final_latent": _randn(1), "teacher_out": _randn(7)}
    pred, v = _randn(2), _randn(3)
    mask = torch.tensor([True, False, True])
    w = LossConfig(output=0.0, perflow=2.0)
    terms = distill_losses(
        pred, {}, batch, w, torch.ones(3), {"output": mask, "perflow": mask}, perflow_v=v
    )
    err = (pred - v).square().mean((1, 2, 3, 4))
    torch.testing.assert_close(terms["perflow"], err[mask].mean())
    torch.testing.assert_close(terms["loss"], 2.0 * err[mask].sum() / 3)


def test_perflow_needs_the_students_steps_recorded_and_names_the_setting() -> None:
    every_8th = _teacher(16, recorded=[0, 8])
    with pytest.raises(UsageError, match=r"perflow .* did not record \[4, 12\]") as e:
        plan_objectives(LossConfig(output=0.0, perflow=1.0), 4, every_8th)
    assert "sampler.record_for_student_steps = [4]" in (e.value.fix or "")


# --------------------------------------------------------------------------- half depth


TEACHER = {"num_layers": 2, "num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 256}


def test_a_half_depth_student_from_the_teachers_first_block_is_accepted() -> None:
    half = {**TEACHER, "num_layers": 1}
    assert init_problems(TeacherInitConfig(path="t", blocks=[0]), half, TEACHER) == []
    assert init_problems(TeacherInitConfig(path="t", blocks=[1]), half, TEACHER) == []


def test_block_init_past_the_teachers_depth_or_at_another_width_is_named() -> None:
    (beyond,) = init_problems(TeacherInitConfig(path="t", blocks=[0, 2]), TEACHER, TEACHER)
    assert "names teacher block(s) [2], but the teacher has 2 (0..1)" in beyond
    narrow = {**TEACHER, "num_layers": 1, "ffn_dim": 128}
    (width,) = init_problems(TeacherInitConfig(path="t", blocks=[0]), narrow, TEACHER)
    assert "ffn_dim=128 where the teacher has ffn_dim=256" in width
