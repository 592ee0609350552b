"""One test per entry of `wandistill.runtime.workarounds.WORKAROUNDS`.

Each test fails when its workaround becomes unnecessary (the library bug is fixed, or
pyproject's minimum version is past a rename) or stops applying (the private attribute, message
or behaviour it relies on is gone): then the workaround is removed, not carried.
"""

from __future__ import annotations

import ast
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.requirements import Requirement
from packaging.version import Version

from wandistill.placement.estimate import fp32_kept
from wandistill.runtime import workarounds

ROOT = Path(__file__).parents[2]
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


def _floor(package: str) -> Version:
    """The lowest version pyproject.toml allows for `package`."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(Requirement(d) for d in deps if Requirement(d).name == package)
    return min(Version(s.version) for s in req.specifier if s.operator in (">=", "=="))


def _load(cls_name: str, folder: Path, dtype: torch.dtype, **kwargs: object) -> torch.nn.Module:
    import diffusers
    import transformers

    cls = getattr(diffusers, cls_name, None) or getattr(transformers, cls_name)
    kw = workarounds.dtype_kwarg(cls, dtype)
    return cls.from_pretrained(str(folder), use_safetensors=True, **kw, **kwargs)


def _disk(cls_name: str, folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    out = tempfile.mkdtemp()
    return _load(cls_name, folder, dtype, device_map={"": "disk"}, offload_folder=out)


# --------------------------------------------------------------------------- the registry


def test_every_workaround_is_listed_exists_and_has_a_test() -> None:
    tests = {
        n.name
        for n in ast.walk(ast.parse(Path(__file__).read_text()))
        if isinstance(n, ast.FunctionDef)
    }
    for w in workarounds.WORKAROUNDS:
        assert hasattr(workarounds, w.name), w.name
        assert w.applies and (w.upstream.startswith("https://") or "none found" in w.upstream)
        assert any(t.startswith(f"test_{w.name}_") for t in tests), f"no test for {w.name}"


# --------------------------------------------------------------------------- renames


def test_ddp_no_buffer_sync_is_needed_while_torch_before_2_13_is_allowed() -> None:
    from torch.nn.parallel import DistributedDataParallel

    assert _floor("torch") < Version("2.13"), "pyproject needs torch>=2.13: use the new name"
    params = DistributedDataParallel.__init__.__code__.co_varnames
    assert set(workarounds.ddp_no_buffer_sync()) <= set(params)


def test_ddp_skip_init_sync_is_needed_while_torch_before_2_6_is_allowed() -> None:
    from torch.nn.parallel import DistributedDataParallel

    assert _floor("torch") < Version("2.6"), "pyproject needs torch>=2.6: pass init_sync=False"
    params = DistributedDataParallel.__init__.__code__.co_varnames
    assert workarounds.ddp_skip_init_sync() == {"init_sync": False}
    assert "init_sync" in params


def test_dtype_kwarg_is_needed_while_transformers_before_4_56_is_allowed() -> None:
    from diffusers import WanTransformer3DModel
    from transformers import UMT5EncoderModel

    assert _floor("transformers") < Version("4.56"), "pyproject needs >=4.56: always pass dtype"
    assert set(workarounds.dtype_kwarg(UMT5EncoderModel, torch.float16)) == {"dtype"}
    assert set(workarounds.dtype_kwarg(WanTransformer3DModel, torch.float16)) == {"torch_dtype"}


def test_t5_tokenizer_class_is_needed_while_transformers_4_is_allowed() -> None:
    assert _floor("transformers") < Version("5"), "pyproject needs transformers>=5: drop it"
    fixed = workarounds.t5_tokenizer_class({"tokenizer": ["transformers", "T5Tokenizer"]})
    assert fixed == {"tokenizer": ["transformers", "T5TokenizerFast"]}
    assert (
        workarounds.t5_tokenizer_class({"tokenizer": ["transformers", "T5TokenizerFast"]}) is None
    )


# --------------------------------------------------------------------------- accelerate


def test_incomplete_device_map_still_matches_the_librarys_message(tiny_teacher: Path) -> None:
    with pytest.raises(ValueError) as info:
        _load(
            "WanTransformer3DModel",
            tiny_teacher / "transformer",
            torch.float32,
            device_map={"blocks": "cpu"},
        )
    assert workarounds.incomplete_device_map(info.value), str(info.value)


def test_tie_meta_weights_is_needed_init_empty_weights_still_unties(tiny_teacher: Path) -> None:
    from accelerate import init_empty_weights
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config.from_pretrained(str(tiny_teacher / "text_encoder"))
    with init_empty_weights():
        model = UMT5EncoderModel(config)
    assert model.shared.weight is not model.encoder.embed_tokens.weight, "fixed: drop it"
    workarounds.tie_meta_weights(model)
    assert model.shared.weight is model.encoder.embed_tokens.weight


def test_offload_hooks_still_find_the_private_hook_attributes(tiny_teacher: Path) -> None:
    model = _disk("WanTransformer3DModel", tiny_teacher / "transformer", torch.float32)
    hooks = list(workarounds.offload_hooks(model))
    assert hooks, "accelerate's _hf_hook / weights_map layout changed"
    assert workarounds.offload_index(model)
    meta = {n for n, p in model.named_parameters() if p.device.type == "meta"}
    assert meta and meta <= workarounds.served_names(model)


def test_redispatch_disk_is_needed_an_all_disk_map_still_runs_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """accelerate picks the execution device of an all-"disk" map without looking for a GPU."""
    from accelerate import dispatch_model
    from accelerate.utils import offload_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    folder = tempfile.mkdtemp()
    offload_state_dict(folder, model.state_dict())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    dispatch_model(model, device_map={"": "disk"}, offload_dir=folder)
    hook = model._hf_hook  # type: ignore[attr-defined]
    assert str(hook.execution_device) == "cpu", "accelerate now picks the GPU: drop it"


# --------------------------------------------------------------------------- diffusers / both


def test_restore_fp32_offloaded_is_needed_placeholders_are_still_reduced(
    tiny_teacher: Path,
) -> None:
    from diffusers import WanTransformer3DModel

    wan = _disk("WanTransformer3DModel", tiny_teacher / "transformer", torch.bfloat16)
    assert wan.scale_shift_table.dtype == torch.bfloat16, "diffusers fixed it: drop the repair"
    umt5 = _disk("UMT5EncoderModel", tiny_teacher / "text_encoder", torch.float16)
    wo = dict(umt5.named_parameters())["encoder.block.0.layer.1.DenseReluDense.wo.weight"]
    assert wo.dtype == torch.float16, "transformers fixed it: drop the repair"
    kept = fp32_kept(WanTransformer3DModel, torch.bfloat16)
    workarounds.restore_fp32_offloaded(wan, torch.bfloat16, kept)
    assert wan.scale_shift_table.dtype == torch.float32


def test_mixed_map_kwargs_are_needed_offload_state_dict_still_rounds(tiny_teacher: Path) -> None:
    from diffusers import WanTransformer3DModel

    kw = {"device_map": _SPILLED, "offload_folder": tempfile.mkdtemp()}
    plain = _load("WanTransformer3DModel", tiny_teacher / "transformer", torch.bfloat16, **kw)
    assert plain.scale_shift_table.dtype == torch.bfloat16, "fixed upstream: drop the kwarg"
    kw["offload_folder"] = tempfile.mkdtemp()
    fixed = _load(
        "WanTransformer3DModel",
        tiny_teacher / "transformer",
        torch.bfloat16,
        **kw,
        **workarounds.mixed_map_kwargs(WanTransformer3DModel),
    )
    assert fixed.scale_shift_table.dtype == torch.float32


def test_never_split_is_needed_a_hooked_wan_vae_still_loses_frames(tiny_teacher: Path) -> None:
    from diffusers import AutoencoderKLWan

    assert AutoencoderKLWan._skip_keys == ["feat_cache", "feat_idx"]
    z = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    plain = _load("AutoencoderKLWan", tiny_teacher / "vae", torch.float32)
    hooked = _disk("AutoencoderKLWan", tiny_teacher / "vae", torch.float32)
    with torch.no_grad():
        assert plain.decode(z).sample.shape[2] == 5
        assert hooked.decode(z).sample.shape[2] == 2, "from_pretrained passes _skip_keys: drop it"
    assert workarounds.never_split("AutoencoderKLWan")


def _groups(model: torch.nn.Module) -> list[tuple[object, set[str]]]:
    groups: dict[int, tuple[object, set[str]]] = {}
    for name, sub in model.named_modules():
        registry = getattr(sub, "_diffusers_hook", None)
        hook = registry.get_hook("group_offloading") if registry is not None else None
        if hook is not None:
            groups.setdefault(id(hook.group), (hook.group, set()))[1].add(name)
    return list(groups.values())


def test_group_offload_level_is_needed_umt5_blocks_do_not_group(tiny_teacher: Path) -> None:
    from diffusers.hooks import apply_group_offloading

    cpu = torch.device("cpu")
    plain = _load("UMT5EncoderModel", tiny_teacher / "text_encoder", torch.float32)
    apply_group_offloading(
        plain, onload_device=cpu, offload_type="block_level", num_blocks_per_group=1
    )
    assert len(_groups(plain)) == 1, "block_level groups UMT5's nested blocks now"
    nested = _load("UMT5EncoderModel", tiny_teacher / "text_encoder", torch.float32)
    apply_group_offloading(
        nested,
        onload_device=cpu,
        offload_type="block_level",
        num_blocks_per_group=1,
        block_modules=["encoder"],
    )
    tied = nested.shared.weight
    holding = [
        g
        for g, _ in _groups(nested)
        if any(p is tied for m in g.modules for p in m.parameters())  # type: ignore[attr-defined]
        or any(p is tied for p in (g.parameters or []))  # type: ignore[attr-defined]
    ]
    assert len(holding) == 2, "the tied embedding sits in one group now: block_level may do"
    assert workarounds.group_offload_level("UMT5EncoderModel", "block_level") == "leaf_level"


def test_remove_diffusers_hooks_still_finds_the_private_registry(tiny_teacher: Path) -> None:
    from diffusers.hooks import apply_group_offloading

    model = _load("WanTransformer3DModel", tiny_teacher / "transformer", torch.float32)
    apply_group_offloading(
        model, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
    )
    registries = [m._diffusers_hook for m in model.modules() if hasattr(m, "_diffusers_hook")]
    assert registries and all(hasattr(r, "hooks") and hasattr(r, "remove_hook") for r in registries)
    workarounds.remove_diffusers_hooks(model)
    assert not any(hasattr(m, "_diffusers_hook") for m in model.modules())


# --------------------------------------------------------------------------- typer


def test_hide_flag_types_is_needed_typer_still_shows_bool_after_a_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import typer

    monkeypatch.setenv("COLUMNS", "100")
    app = typer.Typer()

    @app.command()
    def go(resume: bool = typer.Option(False, "--resume/--no-resume", help="Go on.")) -> None:
        """Go."""

    def shown(command: Any) -> str:
        with pytest.raises(SystemExit):
            command.main(["--help"], prog_name="go")
        return capsys.readouterr().out

    assert "<bool>" in shown(typer.main.get_command(app))  # still needed: the type is shown
    fixed = shown(workarounds.hide_flag_types(typer.main.get_command(app)))
    assert "<bool>" not in fixed and "--no-resume" in fixed  # and hiding it still applies


# --------------------------------------------------------------------------- safetensors

_ST_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64]
_ST_DTYPES += [torch.uint8, torch.bool, torch.float64, torch.int32, torch.int8]


@settings(max_examples=60, deadline=None)
@given(
    specs=st.dictionaries(
        st.text("abAB_.-09", min_size=1, max_size=12),
        st.tuples(st.sampled_from(_ST_DTYPES), st.lists(st.integers(0, 4), min_size=0, max_size=4)),
        min_size=1,
        max_size=6,
    ),
    meta=st.none() | st.text(max_size=20).map(lambda t: {"wandistill": t}),
)
def test_safetensors_header_is_needed_and_still_matches_save_byte_for_byte(
    specs: dict[str, tuple[torch.dtype, list[int]]], meta: dict[str, str] | None
) -> None:
    import io

    from safetensors.torch import save, save_file

    tensors = {name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in specs.items()}
    with pytest.raises(TypeError):  # still needed: no serialisation into an open file
        save_file(tensors, io.BytesIO())  # type: ignore[arg-type]
    head, order = workarounds.safetensors_header(tensors, meta)
    blob = save(tensors, metadata=meta)
    assert blob[: len(head)] == head and sorted(order) == sorted(tensors)
    data = b"".join(tensors[n].reshape(-1).view(torch.uint8).numpy().tobytes() for n in order)
    assert blob == head + data
