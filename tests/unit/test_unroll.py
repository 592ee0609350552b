"""The unroll objective: the student's K-step sampler from cached noise, differentiated through
every step (activation-checkpointed), and the refusal of a K whose activations do not fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wandistill.config import LossConfig
from wandistill.placement.train_size import StudentSize, TrainShape
from wandistill.student.losses import distill_losses
from wandistill.student.schedule import TeacherSchedule, plan_objectives
from wandistill.student.unroll import unroll_bytes, unroll_final, unroll_memory_problem
from wandistill.teacher.tiny import SCHEDULER_CONFIG


class _Scale(nn.Module):
    """v = a * x: the K-step final latent is noise * prod_k (1 + a * d_k), d_k = sigma_{k+1} -
    sigma_k, so d final / d a has one term per step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.3))
        self.calls = 0

    def forward(self, x: torch.Tensor, t: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.a * x


@pytest.mark.parametrize("checkpointed", [True, False])
def test_the_unroll_gradient_flows_through_every_one_of_the_k_steps(checkpointed: bool) -> None:
    sigmas, timesteps = [1.0, 0.75, 0.4, 0.1, 0.0], [999.0, 750.0, 400.0, 100.0]
    model, noise = _Scale(), torch.randn(2, 4, 1, 4, 4)
    final = unroll_final(
        model, noise, torch.zeros(2, 3, 8), sigmas, timesteps, checkpointed=checkpointed
    )
    final.sum().backward()
    a, d = 0.3, [sigmas[k + 1] - sigmas[k] for k in range(4)]
    factors = [1 + a * dk for dk in d]
    prod = torch.tensor(factors).prod().item()
    torch.testing.assert_close(final, noise * prod)
    # the gradient of every step's factor: with any one step cut off it would miss its term
    want = noise.sum().item() * sum(dk * prod / f for dk, f in zip(d, factors, strict=True))
    assert model.a.grad.item() == pytest.approx(want, rel=1e-5)
    only_last = noise.sum().item() * d[-1] * prod / factors[-1]
    assert abs(model.a.grad.item() - only_last) > 0.1 * abs(want)
    # a checkpointed step is run again in backward (its activations were not kept)
    assert model.calls == (8 if checkpointed else 4)


def test_the_unroll_term_matches_the_k_step_final_latent_to_the_cached_one_on_its_samples():
    final = torch.randn(3, 4, 1, 4, 4)
    unrolled = final.clone()
    unrolled[1] += 1.0  # sample 1 is off by 1 everywhere
    batch = {"xt": torch.zeros_like(final), "final_latent": final}
    mask = torch.tensor([True, True, False])
    terms = distill_losses(
        torch.zeros(0, 4, 1, 4, 4),
        {},
        batch,
        LossConfig(output=0.0, unroll=2.0),
        None,
        {"unroll": mask},
        unrolled=unrolled,
    )
    assert terms["unroll"].item() == pytest.approx(0.5)  # mean over the 2 covered samples
    assert terms["loss"].item() == pytest.approx(2.0 * 1.0 / 3)  # weight x sum / batch size


def test_unroll_trains_once_per_record_at_the_students_first_step() -> None:
    from diffusers import UniPCMultistepScheduler

    teacher = TeacherSchedule.from_scheduler(UniPCMultistepScheduler(**SCHEDULER_CONFIG), 16, None)
    plan = plan_objectives(LossConfig(output=0.0, unroll=1.0), 4, teacher)
    assert plan.steps == {"unroll": (0,)} and plan.student.num_inference_steps == 4
    cfg = LossConfig(output=0.0, unroll=1.0)
    assert cfg.few_step and not cfg.at_recorded_points


def test_a_k_whose_unrolled_activations_do_not_fit_is_refused_naming_the_checkpoint_lever():
    size = StudentSize.from_config(
        {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30}
        | {"in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256}
        | {"patch_size": [1, 2, 2]}
    )
    shape = TrainShape(21, 60, 104, 512, batch_size=1)
    kw = dict(blocks=False, bf16=True)
    plain = unroll_bytes(8, size, shape, checkpointed=False, **kw)
    ckpt = unroll_bytes(8, size, shape, checkpointed=True, **kw)
    assert ckpt < plain / 4  # K latents + one step, against K steps' activations
    between = (ckpt + plain) // 2
    problem = unroll_memory_problem(8, size, shape, between, checkpointed=False, **kw)
    assert problem is not None and "set loss.unroll_checkpoint = true" in problem
    assert "K = 8" in problem and "\n" not in problem
    assert unroll_memory_problem(8, size, shape, between, checkpointed=True, **kw) is None
    tight = unroll_memory_problem(8, size, shape, ckpt // 2, checkpointed=True, **kw)
    assert tight is not None and "train.gradient_checkpointing = true" in tight
