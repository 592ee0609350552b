"""TeacherFolder: a Wan folder read once into typed objects, and every bad teacher file refused.

Each class of bad input is tried in several files and forms; each must be one UsageError line
naming the file (and the field where there is one) with a fix, before anything is loaded.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from wandistill.cli import main
from wandistill.errors import UsageError
from wandistill.teacher.folder import CONFIG_NAMES, TeacherFolder
from wandistill.teacher.tiny import BOUNDARY_RATIO

PACKAGE = Path(__file__).parents[2] / "wandistill"
Edit = Callable[[Path], None]


# --------------------------------------------------------------------------- editing copies


def _copy(src: Path, tmp: Path, edit: Edit) -> Path:
    dst = Path(shutil.copytree(src, tmp / "teacher"))
    edit(dst)
    return dst


def _set(rel: str, key: str, value: Any = None, *, raw: str | None = None) -> Edit:
    """Set `key` in a JSON file to `value`, or to `raw` JSON text (NaN, 1e400, huge ints)."""

    def edit(t: Path) -> None:
        data = json.loads((t / rel).read_text())
        data[key] = "@@RAW@@" if raw is not None else value
        text = json.dumps(data)
        (t / rel).write_text(text.replace('"@@RAW@@"', raw) if raw is not None else text)

    return edit


def _drop(rel: str, key: str | None = None) -> Edit:
    def edit(t: Path) -> None:
        if key is not None:
            data = json.loads((t / rel).read_text())
            del data[key]
            (t / rel).write_text(json.dumps(data))
        elif (t / rel).is_dir():
            shutil.rmtree(t / rel)
        else:
            (t / rel).unlink()

    return edit


def _write(rel: str, content: str | bytes) -> Edit:
    def edit(t: Path) -> None:
        (t / rel).parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        (t / rel).write_bytes(data)

    return edit


def refused(folder: Path, *needles: str, complete: bool = True) -> UsageError:
    """open() refuses with one line holding every needle ({t}: the folder) and a fix."""
    with pytest.raises(UsageError) as info:
        TeacherFolder.open(folder, complete=complete)
    e = info.value
    assert "\n" not in e.message and e.fix, e
    for needle in needles:
        assert needle.format(t=folder) in e.message, e.message
    return e


# --------------------------------------------------------------------------- good folders


def _reference_fingerprint(root: Path) -> dict[str, Any]:
    """The fingerprint as wandistill 0.1 computed it (teacher/fingerprint.py): caches written
    then must still match a folder opened now."""

    def digest(p: Path) -> str:
        h = hashlib.sha256()
        if p.suffix != ".safetensors":
            h.update(p.read_bytes())
            return h.hexdigest()
        size = p.stat().st_size
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(n))
            h.update(size.to_bytes(8, "little"))
            h.update(f.read(65536))
            f.seek(max(8 + n, size - 65536))
            h.update(f.read(65536))
        return h.hexdigest()

    index = json.loads((root / "model_index.json").read_text())
    comps = {"model_index": {"model_index.json": digest(root / "model_index.json")}}
    for name, spec in sorted(index.items()):
        sub = root / name
        if name.startswith("_") or not isinstance(spec, list) or not sub.is_dir():
            continue
        files = sorted(
            p
            for p in sub.rglob("*")
            if p.is_file() and p.suffix in (".safetensors", ".json", ".txt", ".model")
        )
        comps[name] = {str(p.relative_to(sub)): digest(p) for p in files}
    blob = json.dumps(comps, sort_keys=True).encode()
    return {
        "fingerprint": hashlib.sha256(blob).hexdigest(),
        "components": comps,
        "path": str(root.resolve()),
    }


def test_a_wan21_folder_opens_into_typed_configs_one_expert_and_its_scheduler(
    tiny_teacher: Path,
) -> None:
    from safetensors import safe_open

    f = TeacherFolder.open(tiny_teacher)
    assert f.experts == ("transformer",) and f.boundary_ratio is None
    assert not f.expand_timesteps and set(f.components) == {"text_encoder", "transformer", "vae"}
    assert f.config("transformer").text_dim == 32 and f.config("vae").z_dim == 16
    assert f.transformer_config == json.loads(
        (tiny_teacher / "transformer/config.json").read_text()
    )
    assert f.latent_shape(num_frames=5, height=32, width=32) == (16, 2, 4, 4)
    assert type(f.scheduler).__name__ == "UniPCMultistepScheduler"
    assert f.scheduler.config.flow_shift == 3.0
    shifted = TeacherFolder.open(tiny_teacher, flow_shift=5.0).scheduler
    assert shifted.config.flow_shift == 5.0 and f.make_scheduler() is not f.make_scheduler()
    with safe_open(
        str(tiny_teacher / "transformer/diffusion_pytorch_model.safetensors"), "pt"
    ) as sf:
        want = {k: sf.get_slice(k).get_shape() for k in sf.keys()}  # noqa: SIM118
    assert {k: n for k, (n, _) in f.numels("transformer").items()} == {
        k: int(torch.Size(s).numel()) for k, s in want.items()
    }
    assert f.fingerprint == _reference_fingerprint(tiny_teacher)


def test_a_wan22_folder_has_two_experts_the_boundary_and_a_different_fingerprint(
    tiny_teacher: Path, tiny_teacher_wan22: Path
) -> None:
    f = TeacherFolder.open(tiny_teacher_wan22)
    assert f.experts == ("transformer", "transformer_2")
    assert f.boundary_ratio == BOUNDARY_RATIO
    assert f.config("transformer_2").num_layers == f.config("transformer").num_layers
    assert "transformer_2" in f.fingerprint["components"] and f.numels("transformer_2")
    assert f.fingerprint == _reference_fingerprint(tiny_teacher_wan22)
    assert (
        f.fingerprint["fingerprint"] != TeacherFolder.open(tiny_teacher).fingerprint["fingerprint"]
    )


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_published_configs_open_through_the_same_checks_without_weights(name: str) -> None:
    f = TeacherFolder.published(name)
    assert f.label == name and f.scheduler_config is None and f.tokenizer_path is None
    assert all(f.numels(c) is None for c in f.components)
    assert f.experts == (
        ("transformer", "transformer_2") if name == "wan2.2-a14b" else ("transformer",)
    )
    assert f.config("text_encoder").d_model == 4096
    with pytest.raises(UsageError, match="has no scheduler"):
        f.make_scheduler()


def test_a_configs_only_folder_plans_but_precompute_needs_its_weights(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    t = _copy(tiny_teacher, tmp_path, lambda t: [p.unlink() for p in t.rglob("*.safetensors")])
    assert TeacherFolder.open(t, complete=False).numels("transformer") is None
    refused(t, "'{t}/text_encoder' has no model.safetensors")


def test_safetensors_next_to_a_pickle_load_and_the_pickle_is_ignored(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    t = _copy(
        tiny_teacher, tmp_path, _write("transformer/diffusion_pytorch_model.bin", b"\x80junk")
    )
    weights = TeacherFolder.open(t).component("transformer").weights
    assert weights is not None
    assert [p.path.name for p in weights.files] == ["diffusion_pytorch_model.safetensors"]


@pytest.mark.parametrize("shift", [0.0, -1.0, float("nan"), float("inf")])
def test_a_flow_shift_override_must_be_a_positive_number(tiny_teacher: Path, shift: float) -> None:
    with pytest.raises(UsageError, match="flow_shift"):
        TeacherFolder.open(tiny_teacher, flow_shift=shift)


# --------------------------------------------------------------------------- bad JSON

FILES = [
    "model_index.json",
    "transformer/config.json",
    "vae/config.json",
    "text_encoder/config.json",
    "scheduler/scheduler_config.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/tokenizer.json",
]


def _damage(kind: str, rel: str) -> Edit:
    def edit(t: Path) -> None:
        text = (t / rel).read_text()
        data = {
            "truncated": text[: len(text) // 2].encode(),
            "garbage": b"{oops",
            "empty": b"",
            "not-utf8": b'{"a": "\xff\xfe"}',
            "duplicate-key": text.replace("{", '{"_dup": 1, "_dup": 2, ', 1).encode(),
        }[kind]
        (t / rel).write_bytes(data)

    return edit


@pytest.mark.parametrize("kind", ["truncated", "garbage", "empty", "not-utf8", "duplicate-key"])
@pytest.mark.parametrize("rel", FILES)
def test_invalid_json_in_any_teacher_file_is_refused_naming_the_file(
    tiny_teacher: Path, tmp_path: Path, rel: str, kind: str
) -> None:
    t = _copy(tiny_teacher, tmp_path, _damage(kind, rel))
    e = refused(t, f"'{{t}}/{rel}'")
    assert "not valid JSON" in e.message
    if kind == "not-utf8":
        assert "not UTF-8 text at byte" in e.message
    if kind == "duplicate-key":
        assert "duplicate key '_dup'" in e.message


@pytest.mark.parametrize(
    ("rel", "key", "value"),
    [
        ("transformer/config.json", "in_channels", "16"),
        ("transformer/config.json", "patch_size", [1, 2]),
        ("transformer/config.json", "num_layers", 2.5),
        ("vae/config.json", "z_dim", True),
        ("vae/config.json", "temperal_downsample", "yes"),
        ("vae/config.json", "_class_name", "AutoencoderKL"),
        ("text_encoder/config.json", "d_model", [32]),
        ("text_encoder/config.json", "model_type", "t5"),
        ("scheduler/scheduler_config.json", "num_train_timesteps", "1000"),
        ("model_index.json", "boundary_ratio", "0.875"),
        ("model_index.json", "expand_timesteps", "false"),
        ("model_index.json", "vae", "AutoencoderKLWan"),
        ("model_index.json", "transformer", ["diffusers", "WanVACETransformer3DModel"]),
        ("model_index.json", "text_encoder", ["transformers", "T5EncoderModel"]),
        ("model_index.json", "image_encoder", ["transformers", "CLIPVisionModel"]),
    ],
)
def test_wrong_types_and_classes_are_refused_naming_file_and_field(
    tiny_teacher: Path, tmp_path: Path, rel: str, key: str, value: Any
) -> None:
    t = _copy(tiny_teacher, tmp_path, _set(rel, key, value))
    refused(t, f"'{{t}}/{rel}'", key)


@pytest.mark.parametrize(
    ("rel", "key", "raw", "field"),
    [
        ("transformer/config.json", "eps", "NaN", "eps"),
        ("model_index.json", "boundary_ratio", "Infinity", "boundary_ratio"),
        ("vae/config.json", "latents_std", "[1e400]", "latents_std[0]"),
        ("text_encoder/config.json", "layer_norm_epsilon", "-Infinity", "layer_norm_epsilon"),
        ("model_index.json", "boundary_ratio", "1.5", "boundary_ratio"),
        ("scheduler/scheduler_config.json", "flow_shift", "-3.0", "flow_shift"),
        ("transformer/config.json", "num_layers", "1000000000", "num_layers"),
        ("text_encoder/config.json", "vocab_size", "0", "vocab_size"),
        ("vae/config.json", "latents_std", json.dumps([0.0] * 16), "latents_std[0]"),
        ("vae/config.json", "latents_mean", "[0.0]", "z_dim"),
        ("transformer/config.json", "ffn_dim", "9" * 5000, "not valid JSON"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused(
    tiny_teacher: Path, tmp_path: Path, rel: str, key: str, raw: str, field: str
) -> None:
    t = _copy(tiny_teacher, tmp_path, _set(rel, key, raw=raw))
    refused(t, f"'{{t}}/{rel}'", field)


def test_a_field_fix_is_given_where_the_model_has_one(
    tiny_teacher_wan22: Path, tmp_path: Path
) -> None:
    t = _copy(tiny_teacher_wan22, tmp_path, _set("model_index.json", "boundary_ratio", raw="1.5"))
    assert "0.875" in (refused(t, "boundary_ratio").fix or "")


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("rel", "edit", "needle"),
    [
        ("transformer/config.json", "deep40", "nests deeper than 32 levels"),
        ("tokenizer/tokenizer_config.json", "deep100k", "nests deeper than 32 levels"),
        ("scheduler/scheduler_config.json", "deep40", "nests deeper than 32 levels"),
        ("vae/config.json", "huge", "larger than"),
        ("model_index.json", "huge", "larger than"),
    ],
)
def test_absurd_nesting_and_size_are_refused(
    tiny_teacher: Path, tmp_path: Path, rel: str, edit: str, needle: str
) -> None:
    if edit == "huge":
        text = (tiny_teacher / rel).read_text()
        change = _write(rel, text[:-1] + " " * (5 << 20) + "}")
    else:
        change = _set(rel, "extra", raw=_nested(40 if edit == "deep40" else 100_000))
    t = _copy(tiny_teacher, tmp_path, change)
    refused(t, f"'{{t}}/{rel}'", needle)


# --------------------------------------------------------------------------- missing parts


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            _drop("transformer/config.json"),
            "teacher folder is missing '{t}/transformer/config.json'",
        ),
        (_drop("vae"), "teacher folder is missing '{t}/vae/config.json'"),
        (_drop("scheduler/scheduler_config.json"), "missing '{t}/scheduler/scheduler_config.json'"),
        (_drop("tokenizer"), "teacher folder is missing '{t}/tokenizer'"),
        (_drop("tokenizer/tokenizer.json"), "has neither tokenizer.json nor spiece.model"),
        (_drop("model_index.json", "text_encoder"), "text_encoder is missing"),
        (_drop("model_index.json", "scheduler"), "scheduler is missing"),
        (_drop("vae/diffusion_pytorch_model.safetensors"), "'{t}/vae' has no diffusion_pytorch"),
        (_drop("model_index.json"), "teacher '{t}' is not a diffusers folder"),
    ],
)
def test_missing_components_and_files_are_refused_naming_them(
    tiny_teacher: Path, tmp_path: Path, edit: Edit, needle: str
) -> None:
    refused(_copy(tiny_teacher, tmp_path, edit), needle)


def test_a_missing_folder_and_a_non_wan_pipeline_are_refused(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    refused(tmp_path / "nope", "teacher folder '{t}' does not exist")
    t = _copy(tiny_teacher, tmp_path, _set("model_index.json", "_class_name", "FluxPipeline"))
    refused(t, "is a FluxPipeline, not a WanPipeline folder")


# --------------------------------------------------------------------------- weights


class _Boom:
    """Unpickling this creates a directory: proof that a pickle was (or was not) loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.path),)


@pytest.mark.parametrize(
    ("component", "name"),
    [
        ("transformer", "diffusion_pytorch_model.bin"),
        ("text_encoder", "pytorch_model.bin"),
        ("vae", "diffusion_pytorch_model.ckpt"),
        ("transformer", "weights.pt"),
        ("text_encoder", "model.pth"),
    ],
)
def test_pickle_only_weights_are_refused_with_the_conversion_and_never_loaded(
    tiny_teacher: Path, tmp_path: Path, component: str, name: str
) -> None:
    sentinel = tmp_path / "unpickled"

    def edit(t: Path) -> None:
        for p in (t / component).glob("*.safetensors"):
            p.unlink()
        (t / component / name).write_bytes(pickle.dumps(_Boom(sentinel)))

    t = _copy(tiny_teacher, tmp_path, edit)
    e = refused(t, f"'{{t}}/{component}' has only pickle-format weights ({name})")
    assert "save_pretrained" in (e.fix or "") and "safe_serialization=True" in (e.fix or "")
    assert not sentinel.exists()


def _header_edit(kind: str) -> Edit:
    def edit(t: Path) -> None:
        p = t / "transformer/diffusion_pytorch_model.safetensors"
        data = bytearray(p.read_bytes())
        n = int.from_bytes(data[:8], "little")
        if kind == "truncated":
            del data[-100:]
        elif kind == "header-length":
            data[:8] = (1 << 62).to_bytes(8, "little")
        elif kind == "header-json":
            data[8 : 8 + n] = b"x" * n
        elif kind == "dtype":
            data[8 : 8 + n] = bytes(data[8 : 8 + n]).replace(b'"F32"', b'"F33"')
        elif kind == "empty":
            data.clear()
        p.write_bytes(bytes(data))

    return edit


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("truncated", "truncated or damaged"),
        ("header-length", "is not a safetensors file"),
        ("header-json", "(header): not valid JSON"),
        ("dtype", "dtype"),
        ("empty", "is not a safetensors file"),
    ],
)
def test_damaged_safetensors_headers_are_refused_before_any_library_reads_them(
    tiny_teacher: Path, tmp_path: Path, kind: str, needle: str
) -> None:
    t = _copy(tiny_teacher, tmp_path, _header_edit(kind))
    refused(t, "'{t}/transformer/diffusion_pytorch_model.safetensors'", needle)


@pytest.mark.parametrize("shard", ["../escape.safetensors", "missing.safetensors", "x.bin"])
def test_a_sharded_index_naming_a_bad_shard_is_refused(
    tiny_teacher: Path, tmp_path: Path, shard: str
) -> None:
    index = json.dumps({"metadata": {}, "weight_map": {"blocks.0.ffn.net.0.proj.weight": shard}})
    t = _copy(
        tiny_teacher,
        tmp_path,
        _write("transformer/diffusion_pytorch_model.safetensors.index.json", index),
    )
    refused(t, "diffusion_pytorch_model.safetensors.index.json", repr(shard))


def test_a_sharded_index_is_read_with_its_shards(tiny_teacher: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    single = tiny_teacher / "transformer/diffusion_pytorch_model.safetensors"
    with safe_open(str(single), "pt") as sf:
        names = list(sf.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "shard-1.safetensors")}

    def edit(t: Path) -> None:
        sub = t / "transformer"
        (sub / "diffusion_pytorch_model.safetensors").rename(sub / "shard-1.safetensors")
        (sub / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))

    weights = (
        TeacherFolder.open(_copy(tiny_teacher, tmp_path, edit)).component("transformer").weights
    )
    assert weights is not None and weights.index is not None
    assert set(weights.tensor_files()) == set(names)


# --------------------------------------------------------------------------- code


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_write("hook.py", "raise SystemExit"), "hook.py"),
        (_write("transformer/modeling_wan.py", "raise SystemExit"), "modeling_wan.py"),
        (_write("tokenizer/sub/x.pyc", b"\x00"), "x.pyc"),
        (_set("model_index.json", "scheduler", ["my_sched", "MyScheduler"]), "from 'my_sched'"),
        (_set("model_index.json", "_class_name", ["pipe", "MyPipe"]), "custom pipeline class"),
        (_set("text_encoder/config.json", "auto_map", {"AutoModel": "m.M"}), "auto_map"),
        (_set("tokenizer/tokenizer_config.json", "auto_map", {"AutoTokenizer": ["t.T", None]}),
         "tokenizer/tokenizer_config.json: auto_map"),
    ],
)  # fmt: skip
def test_custom_code_in_any_form_is_refused(
    tiny_teacher: Path, tmp_path: Path, edit: Edit, needle: str
) -> None:
    e = refused(_copy(tiny_teacher, tmp_path, edit), "contains custom code", needle)
    assert "never runs code from model folders" in e.message


def test_code_is_named_even_when_the_index_is_broken_too(
    tiny_teacher: Path, tmp_path: Path
) -> None:
    def edit(t: Path) -> None:
        (t / "model_index.json").write_text("{oops")
        (t / "evil.py").write_text("raise SystemExit")

    refused(_copy(tiny_teacher, tmp_path, edit), "contains custom code (evil.py)")


# --------------------------------------------------------------------------- scheduler


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_set("scheduler/scheduler_config.json", "_class_name", "UniPCMultistepSchedular"),
         "did you mean UniPCMultistepScheduler"),
        (_set("scheduler/scheduler_config.json", "_class_name", "WanPipeline"),
         "not a diffusers scheduler class"),
        (_set("scheduler/scheduler_config.json", "_class_name", "FlowMatchEulerDiscreteScheduler"),
         "holds a FlowMatchEulerDiscreteScheduler"),
        (_set("model_index.json", "scheduler", ["diffusers", "DDIMScheduler"]),
         "scheduler = 'DDIMScheduler'"),
    ],
)  # fmt: skip
def test_unknown_or_mismatched_scheduler_classes_are_refused(
    tiny_teacher: Path, tmp_path: Path, edit: Edit, needle: str
) -> None:
    refused(_copy(tiny_teacher, tmp_path, edit), needle)


# --------------------------------------------------------------------------- every command


@pytest.mark.parametrize("command", ["precompute", "plan", "sample", "eval"])
@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_set("vae/config.json", "z_dim", raw="NaN"), "z_dim is nan, not a finite number"),
        (_damage("truncated", "text_encoder/config.json"), "text_encoder/config.json"),
        (_set("scheduler/scheduler_config.json", "_class_name", "NopeScheduler"), "NopeScheduler"),
    ],
)
def test_every_command_refuses_a_bad_teacher_in_one_line_and_writes_nothing(
    tiny_teacher: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    edit: Edit,
    needle: str,
) -> None:
    t = str(_copy(tiny_teacher, tmp_path, edit))
    (tmp_path / "p.txt").write_text("a cat\n")
    (tmp_path / "student").mkdir()
    args = {
        "precompute": ["precompute", "--teacher", t, "--prompts", str(tmp_path / "p.txt"),
                       "--out", str(tmp_path / "out")],
        "plan": ["plan", "--teacher", t],
        "sample": ["sample", "--teacher", t, "--prompts", str(tmp_path / "p.txt"),
                   "--out", str(tmp_path / "out")],
        "eval": ["eval", "--cache", str(tmp_path / "c"), "--student", str(tmp_path / "student"),
                 "--out", str(tmp_path / "out"), "--teacher", t],
    }[command]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] and "fix:" in err
    assert needle in " ".join(err.split())
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- source rules


def test_every_weight_load_in_the_package_is_safetensors_only() -> None:
    """from_pretrained is called in one place (modelfolder.load_pretrained, with
    use_safetensors=True), plus the tokenizer, which has no weights."""
    calls: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "from_pretrained":
                    safe = any(
                        k.arg == "use_safetensors"
                        and isinstance(k.value, ast.Constant)
                        and k.value.value is True
                        for k in node.keywords
                    )
                    receiver = ast.unparse(node.func.value)
                    if not safe and receiver != "AutoTokenizer":
                        calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {receiver}")
    assert calls == []


@pytest.mark.parametrize(
    ("rel", "key"),
    [("transformer/config.json", "ffn_dim"), ("text_encoder/config.json", "d_ff")],
)
def test_a_config_whose_dims_do_not_match_its_weights_is_one_line_before_any_load(
    tiny_teacher: Path, tmp_path: Path, rel: str, key: str
) -> None:
    value = json.loads((tiny_teacher / rel).read_text())[key]
    teacher = _copy(tiny_teacher, tmp_path, _set(rel, key, value * 2))
    with pytest.raises(UsageError, match="does not match its weights") as e:
        TeacherFolder.open(teacher)
    assert str(teacher / rel) in e.value.message and "the config makes it" in e.value.message
