"""Placement strategies on the tiny teacher: same bits everywhere, fp32 kept, nothing shared.

Every CPU-runnable placement (cpu, disk-offload, device-map files to cpu and to cpu+disk, auto,
and the model/group offload hooks run with the CPU as their execution device) must give
bit-identical outputs. That needs `MKL_CBWR=COMPATIBLE` set before MKL starts (without it MKL
picks kernels by memory alignment, and memory-mapped offload weights are aligned differently:
~1 ulp differences), so that comparison runs in a fresh interpreter (this file, run as a script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from wandistill.errors import UsageError, WandistillError
from wandistill.placement import load as pl
from wandistill.placement.estimate import SamplerSizes
from wandistill.placement.inventory import Inventory
from wandistill.placement.oom import is_oom, oom_error, oom_guard
from wandistill.placement.parse import parse_placement
from wandistill.placement.strategies import (
    Balanced,
    Cpu,
    Cuda,
    DiskOffload,
    GroupOffload,
    ModelOffload,
)

CUDA_PLACEMENTS = [
    "cuda",
    "cuda:0",
    "gpu0",
    "balanced",
    "balanced_low_0",
    "sequential",
    "model-offload",
    "group-offload",
]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")

#: A device map as accelerate writes them, with one transformer block spilled to disk.
_SPILLED = {
    "scale_shift_table": "cpu",
    "rope": "cpu",
    "patch_embedding": "cpu",
    "condition_embedder": "cpu",
    "blocks.0": "cpu",
    "blocks.1": "disk",
    "norm_out": "cpu",
    "proj_out": "cpu",
}
MIXED_MAP = {
    "transformer": _SPILLED,
    "transformer_2": _SPILLED,
    "text_encoder": {"": "disk"},
    "vae": "cpu",
}
CPU_MAP = {
    "transformer": {"": "cpu"},
    "transformer_2": {"": "cpu"},
    "text_encoder": {"": "cpu"},
    "vae": {"": "cpu"},
}


# --------------------------------------------------------------------------- forward helpers


def _transformer_inputs(dtype: torch.dtype) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, 16, 1, 4, 4, generator=g).to(dtype),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).to(dtype),
        "return_dict": False,
    }


@torch.no_grad()
def forward(model: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One fixed-input forward of a tiny component (decode for the VAE)."""
    if name == "text_encoder":
        ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 10:] = 0
        return model(ids, mask).last_hidden_state
    if name == "vae":
        z = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2)).to(dtype)
        return model.decode(z).sample  # type: ignore[operator]
    return model(**_transformer_inputs(dtype))[0]


def _placements(
    tiny_teacher_wan22: Path, work: Path
) -> dict[str, Callable[[str, torch.dtype], object]]:
    """label -> loader(name, dtype) for every placement that runs on a CPU."""
    cpu_map = work / "cpu.json"
    cpu_map.write_text(json.dumps(CPU_MAP))
    mixed = work / "mixed.json"
    mixed.write_text(json.dumps(MIXED_MAP))

    def load(placement: str) -> Callable[[str, torch.dtype], object]:
        return lambda n, dt: pl.load_component(
            tiny_teacher_wan22,
            n,
            dtype=dt,
            placement=parse_placement(placement),
            offload_dir=work / "offload",
        )

    def hooked(placement: object) -> Callable[[str, torch.dtype], object]:
        """The offload hooks with the CPU as their execution device."""
        return lambda n, dt: pl.load_component(tiny_teacher_wan22, n, dtype=dt, placement=placement)

    return {
        "cpu": load("cpu"),
        "auto": load("auto"),
        "disk-offload": load("disk-offload"),
        "device-map-cpu": load(str(cpu_map)),
        "device-map-cpu+disk": load(str(mixed)),
        "model-offload@cpu": hooked(ModelOffload(device="cpu")),
        "group-offload@cpu": hooked(GroupOffload(device="cpu")),
        "group-offload-leaf@cpu": hooked(GroupOffload(device="cpu", level="leaf_level")),
    }


CASES = [
    ("transformer", torch.float32),
    ("transformer", torch.bfloat16),
    ("text_encoder", torch.float16),
    ("vae", torch.float32),
]


def _bit_identity_main(tiny_teacher_wan22: Path, out: Path) -> None:
    """Child process: every placement x case -> out/<case>.safetensors ({label: output})."""
    from safetensors.torch import save_file

    for name, dtype in CASES:
        results: dict[str, torch.Tensor] = {}
        for label, loader in _placements(tiny_teacher_wan22, out).items():
            model = loader(name, dtype)
            results[label] = forward(model, name, dtype).contiguous()  # type: ignore[arg-type]
            pl.unload(model)  # type: ignore[arg-type]
        save_file(results, str(out / f"{name}-{str(dtype)[6:]}.safetensors"))


# --------------------------------------------------------------------------- bit identity


@pytest.mark.slow  # a fresh interpreter
def test_every_cpu_placement_gives_bit_identical_outputs(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    env = {**os.environ, "MKL_CBWR": "COMPATIBLE", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, __file__, "bit-identity", str(tiny_teacher_wan22), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, dtype in CASES:
        outputs = load_file(str(tmp_path / f"{name}-{str(dtype)[6:]}.safetensors"))
        ref = outputs.pop("cpu")
        assert ref.dtype == dtype and ref.isfinite().all()
        for label, out in outputs.items():
            assert torch.equal(out, ref), f"{name} {dtype}: {label} differs from cpu"


# --------------------------------------------------------------------------- fp32-kept layers


def _input_dtypes(model: torch.nn.Module, modules: list[str]) -> tuple[dict, Callable]:
    """Record the dtype of the first input each named module receives during a forward."""
    seen: dict[str, torch.dtype] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            seen.setdefault(name, args[0].dtype)

        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(record(n)) for n in modules]
    return seen, lambda: [h.remove() for h in handles]


def _kept_placeholders(model: torch.nn.Module, names: list[str]) -> dict[str, torch.dtype]:
    params = dict(model.named_parameters())
    return {n: params[n].dtype for n in names}


@pytest.mark.filterwarnings("ignore:The following device_map keys do not match")
@pytest.mark.parametrize("placement", ["cpu", "disk-offload", "mixed-map"])
def test_wan_fp32_layers_compute_in_fp32_in_bf16(
    tiny_teacher_wan22: Path, tmp_path: Path, placement: str
) -> None:
    if placement == "mixed-map":
        (tmp_path / "m.json").write_text(json.dumps(MIXED_MAP))
        placement = str(tmp_path / "m.json")
    model = pl.load_component(
        tiny_teacher_wan22,
        "transformer",
        dtype=torch.bfloat16,
        placement=parse_placement(placement),
        offload_dir=tmp_path,
    )
    # Wan casts activations to these layers' weight dtype; offloaded weights are loaded in their
    # placeholder's dtype. So what reaches the fp32 layers, and what they hold, must be fp32.
    time_in = "condition_embedder.time_embedder.linear_1"
    table: dict[str, torch.dtype] = {}
    block = model.blocks[1]
    grab = block.norm1.register_forward_pre_hook(
        lambda m, a: table.update(sst=block.scale_shift_table.dtype)  # loaded by block's hook
    )
    seen, remove = _input_dtypes(model, [time_in, "blocks.1.ffn.net.0.proj"])
    forward(model, "transformer", torch.bfloat16)
    remove()
    grab.remove()
    assert seen == {time_in: torch.float32, "blocks.1.ffn.net.0.proj": torch.bfloat16}
    assert table == {"sst": torch.float32}
    kept = ["scale_shift_table", "blocks.1.scale_shift_table", "blocks.1.norm2.weight"]
    assert set(_kept_placeholders(model, kept).values()) == {torch.float32}
    pl.unload(model)


@pytest.mark.parametrize("placement", ["cpu", "disk-offload"])
def test_umt5_wo_stays_fp32_under_fp16(
    tiny_teacher_wan22: Path, tmp_path: Path, placement: str
) -> None:
    model = pl.load_component(
        tiny_teacher_wan22,
        "text_encoder",
        dtype=torch.float16,
        placement=parse_placement(placement),
        offload_dir=tmp_path,
    )
    wo = "encoder.block.0.layer.1.DenseReluDense.wo"
    q = "encoder.block.0.layer.0.SelfAttention.q"
    seen, remove = _input_dtypes(model, [wo, q])
    forward(model, "text_encoder", torch.float16)
    remove()
    assert seen == {wo: torch.float32, q: torch.float16}
    assert _kept_placeholders(model, [f"{wo}.weight"]) == {f"{wo}.weight": torch.float32}
    pl.unload(model)


def test_umt5_has_no_fp32_layers_under_bf16(tiny_teacher_wan22: Path) -> None:
    """transformers keeps UMT5's `wo` in fp32 only for fp16 (bf16 has fp32's range)."""
    model = pl.load_component(
        tiny_teacher_wan22, "text_encoder", dtype=torch.bfloat16, placement=Cpu()
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# --------------------------------------------------------------------------- offload folders


def test_two_experts_sharing_an_offload_dir_keep_their_own_weights(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    expected = {}
    for name in ("transformer", "transformer_2"):
        ref = pl.load_component(tiny_teacher_wan22, name, dtype=torch.float32, placement=Cpu())
        expected[name] = forward(ref, name, torch.float32)
    experts = {
        name: pl.load_component(
            tiny_teacher_wan22,
            name,
            dtype=torch.float32,
            placement=DiskOffload(),
            offload_dir=tmp_path,
        )
        for name in ("transformer", "transformer_2")
    }
    folders = {pl.placement_of(m).offload_dir for m in experts.values()}  # type: ignore[union-attr]
    assert len(folders) == 2 and all(f is not None and f.parent == tmp_path for f in folders)
    for name, model in experts.items():
        torch.testing.assert_close(forward(model, name, torch.float32), expected[name])
    assert not torch.allclose(expected["transformer"], expected["transformer_2"])
    for model in experts.values():
        pl.unload(model)
    assert not any(f.exists() for f in folders)  # type: ignore[union-attr]


def test_unload_frees_weights_hooks_and_offload_folder(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    root = tmp_path / "cache" / ".offload" / "rank0"
    model = pl.load_component(
        tiny_teacher_wan22,
        "transformer",
        dtype=torch.float32,
        placement=DiskOffload(),
        offload_dir=root,
    )
    folder = pl.placement_of(model).offload_dir  # type: ignore[union-attr]
    assert folder is not None and folder.parent == root and any(folder.iterdir())
    pl.unload(model)
    assert not folder.exists() and not (tmp_path / "cache").exists()  # made here, removed here
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())


def test_group_offload_unload_removes_diffusers_hooks(tiny_teacher_wan22: Path) -> None:
    model = pl.load_component(
        tiny_teacher_wan22, "transformer", dtype=torch.float32, placement=GroupOffload(device="cpu")
    )
    assert any(hasattr(m, "_diffusers_hook") for m in model.modules())
    pl.unload(model)
    assert not any(hasattr(m, "_diffusers_hook") for m in model.modules())


# --------------------------------------------------------------------------- what load returns


def test_loaded_component_is_eval_frozen_and_reports_its_device(tiny_teacher_wan22: Path) -> None:
    model = pl.load_component(tiny_teacher_wan22, "vae", dtype=torch.float32, placement=Cpu())
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert pl.execution_device(model) == torch.device("cpu")
    placed = pl.placement_of(model)
    assert placed is not None and placed.placement == Cpu() and placed.component == "vae"


def test_vae_runs_whole_under_disk_and_group_offload(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    for placement in (DiskOffload(device="cpu"), GroupOffload(device="cpu")):
        model = pl.load_component(
            tiny_teacher_wan22,
            "vae",
            dtype=torch.float32,
            placement=placement,
            offload_dir=tmp_path,
        )
        assert pl.placement_of(model).placement == Cpu()  # type: ignore[union-attr]
        assert not any(p.device.type == "meta" for p in model.parameters())


def test_a_weight_left_on_meta_is_an_error(tiny_teacher_wan22: Path) -> None:
    model = pl.load_component(
        tiny_teacher_wan22, "transformer", dtype=torch.float32, placement=Cpu()
    )
    block = model.blocks[0].ffn.net[0].proj
    block.weight = torch.nn.Parameter(torch.empty_like(block.weight, device="meta"))
    with pytest.raises(WandistillError, match="never loaded.*blocks.0.ffn"):
        pl._check_placed(model, "transformer", Balanced(), None)


# --------------------------------------------------------------------------- usage errors


@no_cuda
@pytest.mark.parametrize("placement", CUDA_PLACEMENTS)
def test_cuda_placements_on_a_cpu_only_machine_are_usage_errors(
    tiny_teacher_wan22: Path, placement: str
) -> None:
    with pytest.raises(UsageError) as info:
        pl.load_component(
            tiny_teacher_wan22,
            "transformer",
            dtype=torch.float32,
            placement=parse_placement(placement),
        )
    message = str(info.value).splitlines()[0]
    assert f"placement {placement!r} needs CUDA" in message and "disk-offload" in message
    assert info.value.exit_code == 2


@pytest.mark.parametrize("placement", CUDA_PLACEMENTS)
def test_resolving_cuda_placements_without_gpus_is_a_usage_error(placement: str) -> None:
    with pytest.raises(UsageError, match="needs CUDA GPUs but none is visible"):
        pl.resolve_placement(
            parse_placement(placement),
            folder="wan2.1-1.3b",
            dtype=torch.bfloat16,
            inventory=Inventory.cpu_only(),
        )


def test_unknown_placement_suggests_the_nearest() -> None:
    with pytest.raises(UsageError) as info:
        parse_placement("balance")
    assert "did you mean balanced" in (info.value.fix or "")


def test_cuda_index_beyond_the_visible_gpus_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cuda:3.*1 visible"):
        parse_placement("cuda:3").check(gpus=1)


def test_missing_component_folder_is_a_usage_error_naming_it(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    import shutil

    broken = shutil.copytree(tiny_teacher_wan22, tmp_path / "teacher")
    shutil.rmtree(broken / "transformer")
    with pytest.raises(UsageError, match=str(broken / "transformer")):
        pl.load_component(broken, "transformer", dtype=torch.float32, placement=Cpu())


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"transfomer": "cpu"}', "unknown component 'transfomer'"),
        ('{"transformer": {"blocks.0": "gpu"}}', "is not a device"),
        ('{"transformer": {"": 0}}', "puts transformer on GPU 0 but 0 GPU"),
        ('{"vae": {"decoder": "cpu", "encoder": "disk"}}', "splits or disk-offloads the vae"),
    ],
)
def test_bad_device_map_files_are_usage_errors(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=match):
        parse_placement(str(path)).check(gpus=0)


def test_device_map_without_the_component_is_a_usage_error(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    path = tmp_path / "map.json"
    path.write_text('{"transformer": "cpu"}')
    with pytest.raises(UsageError, match="no entry for 'vae'"):
        pl.load_component(
            tiny_teacher_wan22, "vae", dtype=torch.float32, placement=parse_placement(str(path))
        )


def test_device_map_missing_modules_is_a_usage_error(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    path = tmp_path / "map.json"
    path.write_text('{"transformer": {"blocks": "cpu"}}')
    with pytest.raises(UsageError, match="does not cover every weight"):
        pl.load_component(
            tiny_teacher_wan22,
            "transformer",
            dtype=torch.float32,
            placement=parse_placement(str(path)),
        )


# --------------------------------------------------------------------------- resolve


def test_resolve_turns_gpu0_into_cuda0_and_auto_into_the_plans_choice() -> None:
    one_gpu = Inventory.fake(1, 80)
    kw = {"folder": "wan2.1-14b", "dtype": torch.bfloat16, "sizes": SamplerSizes()}
    auto = parse_placement("auto")
    assert pl.resolve_placement(parse_placement("gpu0"), inventory=one_gpu, **kw) == Cuda(0)
    assert pl.resolve_placement(auto, inventory=one_gpu, **kw) == Cuda(0)
    small = Inventory.fake(1, 24, cpu_gib=64)
    assert pl.resolve_placement(auto, inventory=small, **kw) == GroupOffload(device="cuda:0")
    cpu24 = Inventory.cpu_only(24)
    assert pl.resolve_placement(auto, inventory=cpu24, **kw) == DiskOffload(device="cpu")


def test_resolve_auto_under_torchrun_plans_for_the_ranks_own_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    inv = Inventory.fake(4, 80)
    got = pl.resolve_placement(
        parse_placement("auto"),
        folder="wan2.1-14b",
        dtype=torch.bfloat16,
        inventory=inv,
        world_size=4,
        local_rank=2,
    )
    assert got == Cuda(2)


def test_resolve_auto_when_nothing_fits_is_a_runtime_error() -> None:
    tiny_machine = Inventory.cpu_only(cpu_gib=4, disk_gib=5)
    with pytest.raises(WandistillError, match="does not fit this machine") as info:
        pl.resolve_placement(
            parse_placement("auto"),
            folder="wan2.1-14b",
            dtype=torch.bfloat16,
            inventory=tiny_machine,
        )
    assert info.value.exit_code == 1


def test_auto_on_this_cpu_machine_loads_the_tiny_teacher_on_cpu(tiny_teacher_wan22: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks a CPU-only machine")
    got = pl.resolve_placement(
        parse_placement("auto"),
        folder=tiny_teacher_wan22,
        dtype=torch.float32,
        sizes=SamplerSizes(32, 32, 1, 1, 32),
    )
    assert got == Cpu()


# --------------------------------------------------------------------------- out of memory


def test_cuda_oom_names_device_figures_strategy_and_next_flags() -> None:
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")
    with pytest.raises(WandistillError) as info, oom_guard("cuda:0", Cuda(0), component="x"):
        raise exc
    err = info.value
    assert err.exit_code == 1 and isinstance(err.__cause__, torch.OutOfMemoryError)
    assert "out of memory on cuda:0 running x with placement 'cuda:0'" in err.message
    assert err.fix is not None
    flags = ["--placement model-offload", "--placement group-offload", "--placement disk-offload"]
    assert all(f in err.fix for f in flags)
    assert err.fix.index(flags[0]) < err.fix.index(flags[1]) < err.fix.index(flags[2])


def test_a_real_cpu_allocation_failure_becomes_a_one_line_error() -> None:
    with pytest.raises(WandistillError) as info, oom_guard("cpu", Cpu()):
        torch.empty(1 << 60, dtype=torch.uint8)  # 1 EiB: the allocator refuses at once
    err = info.value
    assert err.message.startswith("out of memory on cpu with placement 'cpu':")
    assert "available" in err.message and "GiB" in err.message and "\n" not in err.message
    assert "--placement disk-offload" in (err.fix or "")


def test_group_offload_oom_suggests_leaf_level_then_disk() -> None:
    err = oom_error(torch.OutOfMemoryError("GPU 1"), device="cuda:1", placement=GroupOffload())
    assert "cuda:1" in err.message
    assert "group_offload_level=leaf_level" in (err.fix or "")
    assert (err.fix or "").index("leaf_level") < (err.fix or "").index("disk-offload")


def test_a_loaded_component_guards_its_own_forward(tiny_teacher_wan22: Path) -> None:
    model = pl.load_component(
        tiny_teacher_wan22, "transformer", dtype=torch.float32, placement=Cpu()
    )
    with pytest.raises(WandistillError) as info, pl.oom_guard_for(model):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 9 GB")
    assert "on cpu running transformer with placement 'cpu'" in info.value.message


def test_non_memory_errors_pass_through_the_guard() -> None:
    assert is_oom(RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate"))
    assert not is_oom(RuntimeError("shape mismatch"))
    with pytest.raises(RuntimeError, match="shape mismatch"), oom_guard("cpu", Cpu()):
        raise RuntimeError("shape mismatch")


if __name__ == "__main__":  # the bit-identity child process (see the module docstring)
    if sys.argv[1] == "bit-identity":
        _bit_identity_main(Path(sys.argv[2]), Path(sys.argv[3]))
