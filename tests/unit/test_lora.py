"""LoRA students: the `[train.student.lora]` section, the adapter state-dict functions, and a
LoRA run in one process (only the adapter trained, checkpointed, averaged; bad inputs refused
before anything is written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wandistill.config import StudentLoraConfig, TrainConfig, load_recipe
from wandistill.errors import ConfigError, UsageError, WandistillError
from wandistill.student import experts, lora
from wandistill.teacher.tiny import TRANSFORMER_CONFIG
from wandistill.train import run

from cachefixtures import write_cache


def _tiny(seed: int = 0) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**TRANSFORMER_CONFIG)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- config


def test_the_lora_section_parses_with_alpha_defaulting_to_rank_and_the_wan_linears() -> None:
    cfg = load_recipe(
        None,
        ["student.lora.rank=8", 'student.init_from_teacher.path="/t"'],
        stage="train",
    ).train.student
    assert cfg.lora.enabled and cfg.lora.scale_alpha == 8.0 and cfg.lora.dropout == 0.0
    assert cfg.lora.target_modules == [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "ffn.net.0.proj",
        "ffn.net.2",
    ]
    assert not load_recipe(None, [], stage="train").train.student.lora.enabled  # rank 0: full
    sets = ["student.lora.rank=4", "student.lora.alpha=2", 'student.init_from_teacher.path="/t"']
    assert load_recipe(None, sets, stage="train").train.student.lora.scale_alpha == 2.0


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["student.lora.rank=8"], "student.init_from_teacher.path"),
        (["student.lora.rank=-1"], "student.lora.rank=-1"),
        (["student.lora.dropout=1.0"], "student.lora.dropout"),
        (["student.lora.ranks=8"], "did you mean train.student.lora.rank"),
        (
            [
                "student.lora.target_modules=[]",
                "student.lora.rank=2",
                'student.init_from_teacher.path="/t"',
            ],
            "target_modules is empty",
        ),
    ],
)
def test_bad_lora_keys_are_one_error_naming_the_key(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_recipe(None, sets, stage="train")


# --------------------------------------------------------------------------- state dicts


def test_add_lora_freezes_the_base_and_trains_only_the_adapters_which_start_at_zero() -> None:
    model = _tiny()
    x = torch.randn(1, 16, 1, 4, 4)
    t = torch.tensor([500.0])
    text = torch.randn(1, 5, TRANSFORMER_CONFIG["text_dim"])
    before = model(x, t, text, return_dict=False)[0]
    n = lora.add_lora(model, StudentLoraConfig(rank=4, alpha=8))
    assert torch.equal(model(x, t, text, return_dict=False)[0], before)  # B = 0 at init
    own = lora.trainable_state_dict(model)
    assert n == sum(v.numel() for v in own.values())
    assert n < sum(p.numel() for p in model.parameters()) / 5
    assert own and all(".lora_A.default." in k or ".lora_B.default." in k for k in own)
    # every block's 10 linears (q, k, v, out of attn1 and attn2; the FFN pair), A and B each
    assert len(own) == 2 * 10 * TRANSFORMER_CONFIG["num_layers"]
    assert lora.is_lora(model) and not lora.is_lora(_tiny())


def test_the_trainable_state_dict_round_trips_and_refuses_another_rank() -> None:
    a, b = _tiny(), _tiny()
    lora.add_lora(a, StudentLoraConfig(rank=4))
    lora.add_lora(b, StudentLoraConfig(rank=4))
    with torch.no_grad():
        for p in a.parameters():
            if p.requires_grad:
                p.normal_()
    lora.load_trainable_state_dict(b, lora.trainable_state_dict(a))
    for k, v in lora.trainable_state_dict(a).items():
        assert torch.equal(v, lora.trainable_state_dict(b)[k])
    other = _tiny()
    lora.add_lora(other, StudentLoraConfig(rank=2))
    with pytest.raises(ValueError, match="adapter is"):
        lora.load_trainable_state_dict(other, lora.trainable_state_dict(a))
    # a full student: the whole state_dict, as checkpoints always held
    full = _tiny()
    assert lora.trainable_state_dict(full).keys() == full.state_dict().keys()


def test_the_lora_file_is_diffusers_format_and_loads_back_exactly(tmp_path: Path) -> None:
    a = _tiny()
    lora.add_lora(a, StudentLoraConfig(rank=4, alpha=2, target_modules=["to_q", "to_v"]))
    with torch.no_grad():
        for p in a.parameters():
            if p.requires_grad:
                p.normal_()
    path = lora.save_lora_folder(a, tmp_path)
    assert path.name == "pytorch_lora_weights.safetensors"
    # what a sharded run passes (its gathered adapter) writes the same file
    gathered = lora.full_trainable_state_dict(a)
    assert list(gathered) == lora.trainable_names(a)
    again = lora.save_lora_folder(a, tmp_path / "again", gathered)
    first, second = load_file(path), load_file(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    keys = set(load_file(path))
    assert "transformer.blocks.0.attn2.to_v.lora_B.weight" in keys
    assert all(k.startswith("transformer.") and ".default." not in k for k in keys)
    b = _tiny()
    lora.add_lora(
        b,
        lora.config_from_record(
            lora.record(
                StudentLoraConfig(rank=4, alpha=2, target_modules=["to_q", "to_v"]),
                "transformer",
                None,
            )
        ),
    )
    lora.load_lora_file(b, path)
    for k, v in lora.trainable_state_dict(a).items():
        assert torch.equal(v, lora.trainable_state_dict(b)[k])


def test_a_target_module_that_does_not_exist_names_the_nearest_modules() -> None:
    with pytest.raises(UsageError) as e:
        lora.check_targets(_tiny(), ["to_q", "to_qv", "ffn.proj"])
    msg = e.value.message
    assert "'to_qv' (nearest: to_v, to_q" in msg
    assert "'ffn.proj' (nearest: ffn.net.0.proj" in msg
    assert "'to_q'" not in msg  # names only the bad ones
    assert "\n" not in msg


# --------------------------------------------------------------------------- a LoRA run


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny teacher's transformer folder (what cachefixtures' cache says it came from)."""
    folder = tmp_path_factory.mktemp("teacher") / "transformer"
    _tiny(seed=3).save_pretrained(folder)
    return folder


def _cfg(cache: Path, out: Path, base: Path, *sets: str) -> TrainConfig:
    common = [
        f'cache="{cache}"',
        f'out="{out}"',
        "steps=4",
        "batch_size=2",
        "checkpoint_every=2",
        "log_every=2",
        "data_threads=1",
        'device="cpu"',
        "tensorboard=false",
        "optim.lr=1e-2",
        "optim.warmup_steps=0",
        "optim.ema_decay=0.5",
        f'student.init_from_teacher.path="{base}"',
        "student.lora.rank=4",
        *sets,
    ]
    return load_recipe(None, common, stage="train").train


def test_a_lora_run_trains_checkpoints_and_averages_only_the_adapter(
    tmp_path: Path, base: Path
) -> None:
    write_cache(tmp_path / "c", range(4))
    # with activation checkpointing: non-reentrant, so adapters inside frozen blocks get grads
    sets = ("loss.final_latent=0.5", "gradient_checkpointing=true")
    r = run(_cfg(tmp_path / "c", tmp_path / "run", base, *sets))
    ck = tmp_path / "run" / "checkpoints" / "checkpoint-4"
    for name in ("student", "ema"):
        saved = load_file(ck / f"{name}.safetensors")
        assert saved and all(".lora_" in k for k in saved), name
    adapters = load_file(ck / "student.safetensors")
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # it trained
    for folder in (r.student, r.student_ema):
        assert [p.name for p in folder.iterdir()] == ["pytorch_lora_weights.safetensors"]
    # The EMA's file differs from the raw adapter; the base stayed the teacher's.
    raw = load_file(r.student / "pytorch_lora_weights.safetensors")
    ema = load_file(r.student_ema / "pytorch_lora_weights.safetensors")
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    import json

    sampling = json.loads((tmp_path / "run" / "sampling.json").read_text())
    assert sampling["lora"]["rank"] == 4 and sampling["lora"]["base"] == str(base.resolve())
    state = json.loads((ck / "state.json").read_text())
    assert state["meta"]["lora"]["rank"] == 4


def test_a_killed_lora_run_resumes_exactly_and_refuses_another_rank_writing_nothing(
    tmp_path: Path, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cache(tmp_path / "c", range(4))
    run(_cfg(tmp_path / "c", tmp_path / "whole", base))
    monkeypatch.setenv(
        "WANDISTILL_FAULT", "train:step:3:0:raise"
    )  # dies after step 3; last checkpoint: 2
    with pytest.raises(WandistillError, match="injected failure"):
        run(_cfg(tmp_path / "c", tmp_path / "cut", base))
    monkeypatch.delenv("WANDISTILL_FAULT")
    before = _snapshot(tmp_path / "cut")
    for change in (["student.lora.rank=8"], ["student.lora.rank=0"]):
        with pytest.raises(UsageError, match="LoRA rank 4.*recipe asks for") as e:
            run(_cfg(tmp_path / "c", tmp_path / "cut", base, *change), resume=True)
        assert "\n" not in e.value.message
    assert _snapshot(tmp_path / "cut") == before
    r = run(_cfg(tmp_path / "c", tmp_path / "cut", base), resume=True)
    assert r.start_step == 2 and r.steps == 4
    for name in ("student", "student_ema"):  # bit-exact (the header's key order is not)
        a = load_file(tmp_path / "whole" / name / "pytorch_lora_weights.safetensors")
        b = load_file(tmp_path / "cut" / name / "pytorch_lora_weights.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_bad_lora_recipes_are_refused_before_anything_is_written(
    tmp_path: Path, base: Path
) -> None:
    write_cache(tmp_path / "c", range(2))
    out = tmp_path / "run"
    cases = [
        (['student.lora.target_modules=["to_qq"]'], "'to_qq' (nearest: to_q"),
        (["student.num_layers=1"], "changes its num_layers"),
        (["student.init_from_teacher.blocks=[1]"], "adapts every teacher block"),
    ]
    for sets, message in cases:
        with pytest.raises(UsageError, match=message.replace("(", r"\(")):
            run(_cfg(tmp_path / "c", out, base, *sets))
        assert not out.exists()


# --------------------------------------------------------------------------- per-expert


def _pair_teacher(root: Path) -> Path:
    """A folder with two different tiny experts, transformer/ and transformer_2/ (the bases)."""
    for seed, name in ((5, "transformer"), (6, "transformer_2")):
        _tiny(seed=seed).save_pretrained(root / name)
    return root


def _lora_pair(teacher: Path, cfg: StudentLoraConfig) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    from wandistill.student.experts import ExpertPair
    from wandistill.teacher.tiny import BOUNDARY_RATIO

    bases = [WanTransformer3DModel.from_pretrained(teacher / n) for n in experts.EXPERTS]
    pair = ExpertPair(*bases, BOUNDARY_RATIO, 1000)
    lora.add_lora(pair, cfg)
    return pair


def test_a_per_expert_pair_gets_one_adapter_per_expert_each_on_its_own_base(
    tmp_path: Path,
) -> None:
    pair = _lora_pair(_pair_teacher(tmp_path), StudentLoraConfig(rank=2))
    own = lora.trainable_names(pair)
    assert lora.is_lora(pair)
    per = {n: [k for k in own if k.startswith(f"{n}.")] for n in experts.EXPERTS}
    assert len(per["transformer"]) == len(per["transformer_2"]) == len(own) // 2
    assert all(".lora_" in k for k in own)  # the bases stay frozen
    bases = [getattr(pair, n).patch_embedding.weight for n in experts.EXPERTS]
    assert not torch.equal(*bases)  # each expert kept its own teacher expert
    assert "x 2 experts" in lora.describe(pair)


def test_a_per_expert_lora_run_folder_round_trips_through_finished_student_load(
    tmp_path: Path,
) -> None:
    """student/ holds one diffusers LoRA file per expert plus experts.json; `read_run(RUN).load()`
    rebuilds each expert as its base + its adapter, and samples as the trained pair did."""
    import json
    import shutil

    from diffusers import UniPCMultistepScheduler

    from wandistill.student.experts import ExpertPair
    from wandistill.student.folders import read_run, read_student
    from wandistill.student.sampler import sample_latents, student_pipeline
    from wandistill.student.schedule import TeacherSchedule, plan_objectives
    from wandistill.teacher.tiny import BOUNDARY_RATIO, SCHEDULER_CONFIG

    teacher = _pair_teacher(tmp_path / "teacher")
    cfg = StudentLoraConfig(rank=4, alpha=2, target_modules=["to_q", "to_v", "ffn.net.2"])
    pair = _lora_pair(teacher, cfg)
    with torch.no_grad():
        for p in pair.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    run_dir = tmp_path / "run"
    lora.save_lora_folder(pair, run_dir / "student")
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert files == [
        "student/experts.json",
        "student/transformer/pytorch_lora_weights.safetensors",
        "student/transformer_2/pytorch_lora_weights.safetensors",
    ]
    for name in experts.EXPERTS:  # each file in the one-transformer format, its expert's adapter
        saved = load_file(run_dir / "student" / name / "pytorch_lora_weights.safetensors")
        mine = lora.adapter_state_dict(getattr(pair, name))
        assert saved.keys() == {f"transformer.{k}" for k in mine}
        assert all(torch.equal(saved[f"transformer.{k}"], v) for k, v in mine.items())
    # what a sharded run passes (the gathered adapter, pair names) writes the same files
    lora.save_lora_folder(pair, tmp_path / "again", lora.full_trainable_state_dict(pair))
    for name in experts.EXPERTS:
        a = load_file(run_dir / "student" / name / "pytorch_lora_weights.safetensors")
        b = load_file(tmp_path / "again" / name / "pytorch_lora_weights.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    sched = UniPCMultistepScheduler(**SCHEDULER_CONFIG)
    plan = plan_objectives(
        load_recipe(None, [], stage="train").train.loss,
        2,
        TeacherSchedule.from_scheduler(sched, 4, boundary_ratio=BOUNDARY_RATIO),
    )
    entry = {**lora.record(cfg, "transformer", str(teacher)), "expert_base_files": None}
    sampling = {
        "format": "wandistill-student",
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "student_schedule": plan.student.to_json(),
        "train_steps": 1,
        "lora": entry,
    }
    (run_dir / "sampling.json").write_text(json.dumps(sampling))
    shutil.copytree(run_dir / "student", run_dir / "student_ema")  # read_student reads the run
    finished = read_run(run_dir, ema=False)
    assert finished.boundary_ratio == BOUNDARY_RATIO and finished.lora is not None
    assert read_student(run_dir / "student").boundary_ratio == BOUNDARY_RATIO
    loaded = finished.load()
    assert isinstance(loaded, ExpertPair)
    for name in experts.EXPERTS:
        want = lora.adapter_state_dict(getattr(pair, name))
        got = lora.adapter_state_dict(getattr(loaded, name))  # loaded frozen: no requires_grad
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    noise = torch.randn(1, 16, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    embeds = torch.randn(1, 8, TRANSFORMER_CONFIG["text_dim"])
    mine = sample_latents(student_pipeline(pair.eval(), plan.student), noise, embeds, 2)
    theirs = sample_latents(student_pipeline(loaded, plan.student), noise, embeds, 2)
    torch.testing.assert_close(theirs, mine, rtol=0, atol=0)
