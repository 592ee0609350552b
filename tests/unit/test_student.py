"""The student: config from the teacher's, checked against the cache; block init; losses; x0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from wandistill.cache.files import SettingsBlock
from wandistill.config import StudentConfig, TeacherInitConfig
from wandistill.errors import UsageError
from wandistill.student import (
    DistillModule,
    SigmaTable,
    build_student,
    check_against_cache,
    distill_losses,
    flow_x0,
    resolve_student_config,
)
from wandistill.student.init import init_from_teacher, init_problems

from cachefixtures import DIMS_BLOCK as DIMS
from cachefixtures import TEACHER

SMALL = StudentConfig(num_layers=1, num_attention_heads=2, attention_head_dim=12, ffn_dim=16)


def _teacher_config() -> dict:
    return json.loads(json.dumps(TEACHER["transformer_config"]))  # as the manifest stores it


def test_student_config_starts_from_the_teachers_and_overrides_only_the_sizes() -> None:
    tconf = {**_teacher_config(), "_class_name": "WanTransformer3DModel"}
    cfg = resolve_student_config(SMALL, tconf, DIMS)
    assert (cfg["num_layers"], cfg["ffn_dim"]) == (1, 16)
    assert cfg["text_dim"] == 32 and cfg["in_channels"] == 16
    assert cfg["patch_size"] == [1, 2, 2] and cfg["qk_norm"] == "rms_norm_across_heads"
    assert "_class_name" not in cfg
    assert check_against_cache(cfg, DIMS, "c") == []


def test_a_config_file_merges_under_the_recipe_sizes(tmp_path: Path) -> None:
    f = tmp_path / "student.json"
    f.write_text(json.dumps({"num_layers": 3, "ffn_dim": 8, "_diffusers_version": "x"}))
    cfg = resolve_student_config(
        StudentConfig(config_file=str(f), ffn_dim=20), _teacher_config(), DIMS
    )
    assert (cfg["num_layers"], cfg["ffn_dim"]) == (3, 20)
    f.write_text(json.dumps({"num_layer": 3}))
    with pytest.raises(UsageError, match="num_layer"):
        resolve_student_config(StudentConfig(config_file=str(f)), _teacher_config(), DIMS)


def test_a_student_that_does_not_fit_the_cache_names_both_values() -> None:
    cfg = {**resolve_student_config(SMALL, _teacher_config(), DIMS), "text_dim": 64}
    cfg["in_channels"] = cfg["out_channels"] = 4
    problems = check_against_cache(cfg, DIMS, "cache/x")
    assert any("text_dim=64" in p and "text_dim=32" in p for p in problems)
    assert any("in_channels=4" in p and "latent_channels=16" in p for p in problems)
    assert any("out_channels=4" in p for p in problems)


def test_flow_x0_inverts_the_flow_matching_interpolation() -> None:
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 16, 1, 4, 4, generator=g), torch.randn(3, 16, 1, 4, 4, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.1])
    s = sigma.view(-1, 1, 1, 1, 1)
    xt = (1 - s) * x0 + s * noise
    torch.testing.assert_close(flow_x0(xt, noise - x0, sigma), x0)


def test_x0_and_sigma_match_the_teachers_unipc_scheduler() -> None:
    from diffusers import UniPCMultistepScheduler

    from wandistill.teacher.tiny import SCHEDULER_CONFIG

    sched = UniPCMultistepScheduler(**SCHEDULER_CONFIG)
    sched.set_timesteps(8)
    recorded = [0, 3, 7]
    table = SigmaTable.from_cache(
        SettingsBlock(record_steps=recorded),
        {"sigmas": sched.sigmas.float(), "timesteps": sched.timesteps},
    )
    ts = sched.timesteps[recorded].float()
    sigma = table(torch.arange(3), ts)
    g = torch.Generator().manual_seed(1)
    xt, v = torch.randn(3, 16, 1, 4, 4, generator=g), torch.randn(3, 16, 1, 4, 4, generator=g)
    for slot, step in enumerate(recorded):
        sched._step_index = step
        want = sched.convert_model_output(v[slot : slot + 1], sample=xt[slot : slot + 1])
        torch.testing.assert_close(flow_x0(xt, v, sigma)[slot : slot + 1], want)
    # Without a stored schedule, t / 1000 is the fallback: within 1e-3 of sigma_t.
    assert (SigmaTable(None)(torch.arange(3), ts) - sigma).abs().max() <= 1e-3


def test_losses_are_separate_terms_with_their_weighted_sum() -> None:
    from wandistill.config import LossConfig

    g = torch.Generator().manual_seed(2)
    batch = {k: torch.randn(2, 16, 1, 4, 4, generator=g) for k in ("xt", "teacher_out")}
    batch["final_latent"] = torch.randn(2, 16, 1, 4, 4, generator=g)
    batch["feature.blocks.1"] = torch.randn(2, 4, 24, generator=g)
    pred = torch.randn(2, 16, 1, 4, 4, generator=g)
    feats = {"blocks.1": torch.randn(2, 4, 24, generator=g)}
    w = LossConfig(output=1.0, final_latent=0.5, feature=0.25, feature_map={"blocks.1": "x"})
    terms = distill_losses(pred, feats, batch, w, torch.tensor([0.5, 0.2]))
    assert set(terms) == {"output", "final_latent", "feature", "loss"}
    expect = terms["output"] + 0.5 * terms["final_latent"] + 0.25 * terms["feature"]
    torch.testing.assert_close(terms["loss"], expect)


def test_feature_taps_project_block_outputs_and_survive_gradient_checkpointing() -> None:
    cfg = resolve_student_config(
        StudentConfig(num_layers=2, num_attention_heads=2, attention_head_dim=8, ffn_dim=16),
        _teacher_config(),
        DIMS,
    )
    student = build_student(cfg, seed=0)
    student.enable_gradient_checkpointing()
    model = DistillModule(student, {"blocks.1": "blocks.0"}, student_width=16, teacher_width=24)
    xt, emb = torch.randn(2, 16, 1, 4, 4), torch.randn(2, 24, 32)
    pred, feats = model(xt, torch.tensor([999.0, 500.0]), emb)
    assert pred.shape == xt.shape and feats["blocks.1"].shape == (2, 4, 24)
    (pred.square().mean() + feats["blocks.1"].square().mean()).backward()
    assert model.projections["blocks__1"].weight.grad is not None
    assert all(p.grad is not None for p in student.parameters())
    with pytest.raises(UsageError, match="blocks.5"):
        DistillModule(build_student(cfg, seed=0), {"blocks.1": "blocks.5"}, 16, 24)


def _save_teacher_transformer(path: Path, num_layers: int = 4) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(7)
    teacher = WanTransformer3DModel(**{**_teacher_config(), "num_layers": num_layers})
    teacher.save_pretrained(path / "transformer")
    return teacher


def test_block_init_copies_the_chosen_teacher_blocks_and_reads_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors

    import wandistill.student.init as init_mod

    teacher = _save_teacher_transformer(tmp_path)
    read: list[str] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *a: object, **kw: object) -> None:
            self.inner = real_open(*a, **kw)

        def __enter__(self) -> Spy:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_slice(self, name: str) -> object:
            return self.inner.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(init_mod, "safe_open", Spy)
    cfg = resolve_student_config(
        StudentConfig(num_layers=2, num_attention_heads=2, attention_head_dim=12, ffn_dim=32),
        _teacher_config(),
        DIMS,
    )
    student = build_student(cfg, seed=1)
    init_from_teacher(student, TeacherInitConfig(path=str(tmp_path), blocks=[3, 1]))
    t_sd, s_sd = teacher.state_dict(), student.state_dict()
    for name, value in s_sd.items():
        src = name.replace("blocks.0.", "blocks.3.")  # student block 1 <- teacher block 1
        torch.testing.assert_close(value, t_sd[src], rtol=0, atol=0)
    assert not any(n.startswith(("blocks.0.", "blocks.2.")) for n in read)
    assert len(read) == len(s_sd)


def test_block_init_from_a_wider_teacher_is_refused_before_copying(tmp_path: Path) -> None:
    _save_teacher_transformer(tmp_path)
    cfg = resolve_student_config(SMALL, _teacher_config(), DIMS)  # ffn 16 vs the teacher's 32
    student = build_student(cfg, seed=1)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(UsageError, match="ffn_dim"):
        init_from_teacher(student, TeacherInitConfig(path=str(tmp_path), blocks=[0]))
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())
    with pytest.raises(UsageError, match="holds no diffusion_pytorch_model"):
        init_from_teacher(student, TeacherInitConfig(path=str(tmp_path / "nope"), blocks=[0]))


def test_block_init_is_refused_by_the_same_rule_early_and_when_copying(tmp_path: Path) -> None:
    """train's validate (the cache's record of the teacher's config) and the copy itself (the
    teacher folder's config.json) refuse a block past the teacher's depth in the same words;
    a bare .safetensors file, which has no config, is refused by its tensors."""
    teacher = _save_teacher_transformer(tmp_path, num_layers=2)
    cfg = resolve_student_config(
        StudentConfig(num_layers=2, num_attention_heads=2, attention_head_dim=12, ffn_dim=32),
        _teacher_config(),
        DIMS,
    )
    init = TeacherInitConfig(path=str(tmp_path), blocks=[0, 3])
    (early,) = init_problems(init, cfg, dict(teacher.config))
    assert "names teacher block(s) [3], but the teacher has 2 (0..1)" in early
    student = build_student(cfg, seed=1)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    with pytest.raises(UsageError) as late:
        init_from_teacher(student, init)
    assert late.value.message.endswith(early)
    bare = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(UsageError, match=r"blocks\.3\..* is not in the teacher"):
        init_from_teacher(student, TeacherInitConfig(path=str(bare), blocks=[0, 3]))
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())
