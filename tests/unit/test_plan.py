"""Memory plans on made-up machines for the real Wan configs (meta device, no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from wandistill.config import load_recipe
from wandistill.errors import UsageError
from wandistill.placement.devices import GiB
from wandistill.placement.estimate import SamplerSizes, activation_bytes, fp32_kept
from wandistill.placement.inventory import Inventory, read_meminfo
from wandistill.placement.parse import parse_placement
from wandistill.placement.plan import make_plan
from wandistill.placement.render import render_plan
from wandistill.teacher.folder import CONFIG_NAMES, config_folder

from clirun import run_cli as _run

BF16, FP32 = torch.bfloat16, torch.float32
MACHINES = {
    "1x24GB": Inventory.fake(1, 24, cpu_gib=64),
    "1x80GB": Inventory.fake(1, 80),
    "4x80GB": Inventory.fake(4, 80, cpu_gib=512),
    "cpu64": Inventory.cpu_only(64),
    "cpu24": Inventory.cpu_only(24),
}


def plan(config: str, dtype: torch.dtype, machine: str, **kw: object):  # noqa: ANN201
    return make_plan(config, dtype=dtype, sizes=SamplerSizes(), inventory=MACHINES[machine], **kw)


# --------------------------------------------------------------------------- auto's choices


BATCHED = SamplerSizes(cfg_batched=True)  # cond + uncond as one doubled batch


@pytest.mark.parametrize(
    ("config", "dtype", "machine", "sizes", "auto"),
    [
        ("wan2.1-14b", BF16, "1x24GB", SamplerSizes(), "group-offload"),
        ("wan2.1-14b", BF16, "1x80GB", SamplerSizes(), "cuda:0"),
        ("wan2.1-14b", BF16, "4x80GB", SamplerSizes(), "cuda:0"),
        ("wan2.1-14b", BF16, "cpu64", SamplerSizes(), "cpu"),
        ("wan2.1-14b", BF16, "cpu24", SamplerSizes(), "disk-offload"),
        ("wan2.1-14b", FP32, "1x80GB", SamplerSizes(), "cuda:0"),
        ("wan2.1-14b", FP32, "cpu64", SamplerSizes(), "disk-offload"),
        ("wan2.1-14b", FP32, "1x80GB", BATCHED, "group-offload"),
        ("wan2.1-14b", FP32, "4x80GB", BATCHED, "balanced"),
        ("wan2.1-14b", FP32, "1x24GB", BATCHED, None),
        ("wan2.1-1.3b", BF16, "1x24GB", SamplerSizes(), "cuda:0"),
        ("wan2.1-1.3b", BF16, "cpu24", SamplerSizes(), "cpu"),
        ("wan2.2-a14b", BF16, "1x24GB", SamplerSizes(), "group-offload"),
        ("wan2.2-a14b", BF16, "1x80GB", SamplerSizes(), "cuda:0"),
        ("wan2.2-a14b", FP32, "4x80GB", BATCHED, "balanced"),
    ],
)
def test_auto_picks_the_fastest_strategy_that_fits(
    config: str, dtype: torch.dtype, machine: str, sizes: SamplerSizes, auto: str | None
) -> None:
    p = make_plan(config, dtype=dtype, sizes=sizes, inventory=MACHINES[machine])
    assert p.auto.strategy == auto, p.auto.reason
    fitting = [s for s in p.strategies if s.fits]
    if auto is not None:
        assert fitting[0].strategy == auto
        assert all(s.speed_rank > p.strategy(auto).speed_rank for s in fitting[1:])
    else:
        assert not fitting and p.auto.reason.startswith("nothing fits")


def test_auto_explains_what_was_too_big() -> None:
    p = plan("wan2.1-14b", BF16, "1x24GB")
    assert "faster but too big: cuda:0 (cuda:0 needs" in p.auto.reason


def test_a_max_memory_cap_is_honoured() -> None:
    p = plan(
        "wan2.1-14b", BF16, "1x80GB", placement=parse_placement("auto", max_memory={"0": "30GiB"})
    )
    assert not p.strategy("cuda").fits and p.auto.strategy == "group-offload"


# --------------------------------------------------------------------------- phases


def test_peak_is_the_max_over_phases_not_the_sum() -> None:
    p = plan("wan2.1-1.3b", BF16, "1x80GB")
    cuda = p.strategy("cuda")
    per_phase = [need["cuda:0"] for need in cuda.needs.values()]
    assert [ph.name for ph in p.phases] == ["encode", "denoise"]
    assert cuda.peak["cuda:0"] == max(per_phase) < sum(per_phase)
    # UMT5-xxl (10.6 GiB in bf16) outweighs the 1.3B transformer: the encode phase is the peak
    assert cuda.needs["encode"]["cuda:0"] > cuda.needs["denoise"]["cuda:0"]


def test_wan22_keeps_one_expert_resident_unless_told_otherwise() -> None:
    one = plan("wan2.2-a14b", BF16, "1x80GB")
    two = plan("wan2.2-a14b", BF16, "1x80GB", experts_resident=2)
    assert [ph.name for ph in one.phases] == [
        "encode",
        "denoise (transformer)",
        "denoise (transformer_2)",
    ]
    assert [ph.name for ph in two.phases] == ["encode", "denoise"]
    expert = one.component("transformer_2").weight_bytes
    gap = two.strategy("cuda").peak["cuda:0"] - one.strategy("cuda").peak["cuda:0"]
    assert gap == expert


def test_the_vae_phase_appears_only_with_previews() -> None:
    inv = MACHINES["1x80GB"]
    with_previews = make_plan(
        "wan2.1-14b", dtype=BF16, sizes=SamplerSizes(previews=True), inventory=inv
    )
    assert [ph.name for ph in with_previews.phases][-1] == "decode"
    assert "decode" not in [ph.name for ph in plan("wan2.1-14b", BF16, "1x80GB").phases]


# --------------------------------------------------------------------------- sizes


def test_published_configs_have_the_published_parameter_counts() -> None:
    counts = {
        name: {c.name: c.params for c in plan(name, BF16, "cpu64").components}
        for name in CONFIG_NAMES
    }
    assert counts["wan2.1-14b"] == {
        "text_encoder": 5_680_910_336,  # UMT5-xxl encoder, embedding tied as in from_pretrained
        "transformer": 14_288_491_584,
        "vae": 126_892_531,
    }
    assert counts["wan2.1-1.3b"]["transformer"] == 1_418_996_800
    assert counts["wan2.2-a14b"]["transformer_2"] == counts["wan2.2-a14b"]["transformer"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_header_sizes_equal_the_loaded_components_bytes(
    tiny_teacher: Path, dtype: torch.dtype
) -> None:
    from wandistill.placement.load import load_component

    p = make_plan(
        tiny_teacher, dtype=dtype, sizes=SamplerSizes(32, 32, 1), inventory=MACHINES["cpu24"]
    )
    for comp in p.components:
        model = load_component(
            tiny_teacher, comp.name, dtype=dtype, placement=parse_placement("cpu")
        )
        loaded = sum(t.numel() * t.element_size() for t in model.parameters())
        assert comp.source == "safetensors headers"
        assert comp.weight_bytes == loaded, comp.name


def test_fp32_kept_rules_follow_each_library() -> None:
    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    wan = fp32_kept(WanTransformer3DModel, BF16)
    assert wan("blocks.3.scale_shift_table") and wan("blocks.3.norm2.weight")
    assert wan("condition_embedder.time_embedder.linear_1.weight")
    assert not wan("blocks.3.ffn.net.0.proj.weight") and not wan("blocks.3.norm_q.weight")
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    assert fp32_kept(UMT5EncoderModel, torch.float16)(wo)
    assert not fp32_kept(UMT5EncoderModel, BF16)(wo)  # transformers: fp16 only
    assert not fp32_kept(WanTransformer3DModel, FP32)("scale_shift_table")


def test_latent_tokens_and_cfg_doubling() -> None:
    sizes = SamplerSizes(height=480, width=832, num_frames=81)
    assert sizes.latent_frames == 21 and sizes.tokens() == 21 * 30 * 52 == 32_760
    cfg = json.loads((config_folder("wan2.1-14b") / "transformer" / "config.json").read_text())
    two_passes = activation_bytes("transformer", cfg, sizes, BF16)
    batched = activation_bytes("transformer", cfg, BATCHED, BF16)
    assert two_passes == activation_bytes("transformer", cfg, SamplerSizes(cfg=False), BF16)
    assert 1.99 < batched / two_passes <= 2.0
    assert 5 * GiB < two_passes < 10 * GiB  # ~7.6 GiB estimated for 14B at 480p, 81 frames


# --------------------------------------------------------------------------- device maps


def test_balanced_uses_every_gpu_within_its_free_memory() -> None:
    p = make_plan("wan2.1-14b", dtype=FP32, sizes=BATCHED, inventory=MACHINES["4x80GB"])
    free = MACHINES["4x80GB"].gpus[0].free_bytes
    for name in ("balanced", "balanced_low_0"):
        s = p.strategy(name)
        assert s.fits and all(s.peak.get(f"cuda:{i}", 0) <= free for i in range(4))
    assert all(f"cuda:{i}" in p.strategy("balanced").peak for i in range(4))
    low0 = p.strategy("balanced_low_0").needs["denoise"]
    assert low0.get("cuda:0", 0) < low0["cuda:1"]


def test_device_maps_that_spill_off_the_gpus_do_not_fit() -> None:
    small = Inventory.fake(2, 16, cpu_gib=128)
    p = make_plan("wan2.1-14b", dtype=BF16, sizes=SamplerSizes(), inventory=small)
    s = p.strategy("balanced")
    assert not s.fits and "do not fit on the GPUs" in s.note


def test_a_cpu_only_machine_offers_only_cpu_and_disk_offload() -> None:
    p = plan("wan2.1-14b", BF16, "cpu64")
    assert [s.strategy for s in p.strategies] == ["cpu", "disk-offload"]
    assert "no GPU visible" in p.auto.reason


# --------------------------------------------------------------------------- output


def test_render_shows_every_phase_every_device_and_auto() -> None:
    p = plan("wan2.2-a14b", BF16, "4x80GB")
    console = Console(record=True, width=240)
    for r in render_plan(p):
        console.print(r)
    text = console.export_text()
    for needle in (
        "denoise (transformer_2)",
        "phase denoise (transformer) (GiB)",
        "auto -> cuda:0",
    ):
        assert needle in text
    assert "┃ cuda:3 ┃" in text and "┃ disk ┃" in text


def test_plan_json_is_plain_json() -> None:
    data = json.loads(json.dumps(plan("wan2.1-14b", BF16, "1x24GB").to_json()))
    assert data["auto"]["strategy"] == "group-offload" and data["tokens"] == 32_760
    assert {s["strategy"] for s in data["strategies"]} >= {"cuda:0", "disk-offload"}


def test_unknown_config_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="wan2.1-15b"):
        config_folder("wan2.1-15b")


# --------------------------------------------------------------------------- inventory


def test_detect_sees_this_machines_ram_and_disk(tmp_path: Path) -> None:
    inv = Inventory.detect(tmp_path / "not" / "yet")
    assert inv.cpu_bytes > 0 and inv.disk_bytes > 0
    assert len(inv.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_meminfo_is_read_in_bytes(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemAvailable:   1024 kB\nHugePages_Total: 0\n")
    assert read_meminfo(str(f)) == {
        "MemTotal": 24576000 * 1024,
        "MemAvailable": 1024 * 1024,
        "HugePages_Total": 0,
    }


# --------------------------------------------------------------------------- command


def test_plan_command_for_a_committed_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "plan", "--config", "wan2.2-a14b", "--dtype", "bf16", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["teacher"] == "wan2.2-a14b" and data["dtype"] == "bf16"
    assert data["auto"]["strategy"] is not None


def test_plan_command_reads_the_recipe_and_the_tiny_teacher(
    tiny_teacher: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = Path(__file__).parents[2] / "pipelines" / "tiny.toml"
    code, out, err = _run(capsys, "plan", str(recipe), "--teacher", str(tiny_teacher), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert {c["source"] for c in data["components"]} == {"safetensors headers"}
    want = load_recipe(recipe, stage="precompute").precompute
    assert data["sizes"]["height"] == want.sampler.height
    assert data["requested"] == str(want.teacher.placement)
    assert data["auto"]["strategy"] is not None


def test_plan_command_without_a_teacher_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(capsys, "plan")
    assert code == 2 and "--config" in err and "Traceback" not in err
