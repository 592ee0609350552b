"""The tiny offline teacher is a real diffusers Wan folder: it loads, samples, is reproducible."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from wandistill.teacher.tiny import BOUNDARY_RATIO, TINY_DEFAULTS, make_tiny_teacher


def _sample(pipe: object, **kwargs: object) -> object:
    args: dict[str, object] = {
        "prompt": "a cat",
        **TINY_DEFAULTS,
        "num_inference_steps": 2,
        "guidance_scale": 5.0,
        "generator": torch.Generator().manual_seed(0),
    }
    args.update(kwargs)
    return pipe(**args).frames  # type: ignore[operator]


def _safetensors_digests(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*.safetensors"))
    }


def test_tiny_defaults_fit_wan_constraints() -> None:
    assert TINY_DEFAULTS["height"] % 16 == 0 and TINY_DEFAULTS["width"] % 16 == 0
    assert (TINY_DEFAULTS["num_frames"] - 1) % 4 == 0
    with pytest.raises(TypeError):
        TINY_DEFAULTS["height"] = 64  # type: ignore[index]


def test_wan21_folder_loads_and_samples(tiny_teacher: Path) -> None:
    from diffusers import UniPCMultistepScheduler, WanPipeline

    index = json.loads((tiny_teacher / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["tokenizer"] == ["transformers", "T5TokenizerFast"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["transformer_2"] == [None, None]
    assert index["boundary_ratio"] is None
    assert not list(tiny_teacher.parent.glob(".*")), "temp folders left behind"

    pipe = WanPipeline.from_pretrained(tiny_teacher)
    assert pipe.transformer_2 is None
    assert isinstance(pipe.scheduler, UniPCMultistepScheduler)
    cfg = pipe.scheduler.config
    assert cfg.prediction_type == "flow_prediction" and cfg.use_flow_sigmas
    assert cfg.flow_shift == 3.0 and cfg.num_train_timesteps == 1000
    assert pipe.transformer.dtype == torch.float32

    latents = _sample(pipe, output_type="latent")
    assert isinstance(latents, torch.Tensor)
    assert latents.shape == (1, 16, 1, 4, 4)  # 32 px / 8 (VAE) = 4; 1 frame -> 1 latent frame
    assert torch.isfinite(latents).all()
    assert latents.std() > 0.1

    again = _sample(pipe, output_type="latent")
    assert torch.equal(latents, again), "same generator seed must give the same latents"
    other_prompt = _sample(pipe, output_type="latent", prompt="a dog in the snow")
    assert not torch.allclose(latents, other_prompt), "the prompt must condition the output"

    video = _sample(pipe, output_type="np")
    assert isinstance(video, np.ndarray)
    assert video.shape == (1, 1, 32, 32, 3)
    assert np.isfinite(video).all()
    assert video.min() >= 0.0 and video.max() <= 1.0 and video.std() > 0


def test_wan22_folder_has_two_experts(tiny_teacher_wan22: Path) -> None:
    from diffusers import WanPipeline

    index = json.loads((tiny_teacher_wan22 / "model_index.json").read_text())
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert index["boundary_ratio"] == BOUNDARY_RATIO == 0.875
    assert (tiny_teacher_wan22 / "transformer_2" / "config.json").is_file()

    pipe = WanPipeline.from_pretrained(tiny_teacher_wan22)
    assert pipe.transformer_2 is not None
    assert pipe.config.boundary_ratio == 0.875
    cfg1, cfg2 = (dict(m.config) for m in (pipe.transformer, pipe.transformer_2))
    for cfg in (cfg1, cfg2):
        cfg.pop("_name_or_path", None)
    assert cfg1 == cfg2
    w1 = pipe.transformer.state_dict()["proj_out.weight"]
    w2 = pipe.transformer_2.state_dict()["proj_out.weight"]
    assert not torch.equal(w1, w2), "the two experts must have different weights"

    calls = {"transformer": 0, "transformer_2": 0}

    def counter(name: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            calls[name] += 1

        return hook

    h1 = pipe.transformer.register_forward_pre_hook(counter("transformer"))
    h2 = pipe.transformer_2.register_forward_pre_hook(counter("transformer_2"))
    try:
        # 2 UniPC steps with shift 3 land at t=999 (>= 875: high-noise expert) and t=750 (low).
        latents = _sample(pipe, output_type="latent", guidance_scale_2=3.0)
    finally:
        h1.remove()
        h2.remove()
    assert calls == {"transformer": 2, "transformer_2": 2}  # cond + uncond each
    assert latents.shape == (1, 16, 1, 4, 4)
    assert torch.isfinite(latents).all()


@pytest.mark.slow  # a fresh interpreter
def test_same_seed_is_byte_identical(tiny_teacher: Path, tmp_path: Path) -> None:
    # Built in a fresh process (other RNG history, one thread) to prove it is not luck of state.
    same = tmp_path / "same"
    code = (
        "import sys, torch; torch.set_num_threads(1); torch.rand(7)\n"
        "from wandistill.teacher.tiny import make_tiny_teacher\n"
        "make_tiny_teacher(sys.argv[1], seed=0)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(same)], check=True, capture_output=True)
    other = make_tiny_teacher(tmp_path / "other", seed=1)
    ref = _safetensors_digests(tiny_teacher)
    assert set(ref) == {
        "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    }
    assert _safetensors_digests(same) == ref
    differing = {k for k, v in _safetensors_digests(other).items() if ref[k] != v}
    assert differing == set(ref)


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    make_tiny_teacher(tmp_path / "t")
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_loads_offline_and_handles_any_text(tiny_teacher: Path) -> None:
    from transformers import AutoTokenizer, UMT5Config

    tok = AutoTokenizer.from_pretrained(tiny_teacher / "tokenizer")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    vocab_size = UMT5Config.from_pretrained(tiny_teacher / "text_encoder").vocab_size
    assert len(tok) <= vocab_size

    for text in ["a cat", "Zebra-crossing at 5pm!", "Ünïcödé 猫 🐈 naïve café", ""]:
        ids = tok(text).input_ids
        assert ids[-1] == tok.eos_token_id
        assert all(0 <= i < vocab_size for i in ids)
    assert tok("a cat").input_ids == [*tok.convert_tokens_to_ids(["▁a", "▁cat"]), 1]
    assert tok.unk_token_id in tok("猫").input_ids

    # Exactly the call WanPipeline.encode_prompt makes.
    enc = tok(
        ["a cat", "dog " * 100],
        padding="max_length",
        max_length=16,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    assert enc.input_ids.shape == (2, 16)
    assert enc.input_ids[0, 2] == 1 and enc.input_ids[0, 3:].eq(0).all()
    assert enc.attention_mask[0].sum() == 3
    assert enc.input_ids[1, -1] == 1, "truncated prompts still end in </s>"


def test_refuses_to_overwrite_an_existing_teacher(tmp_path: Path) -> None:
    target = make_tiny_teacher(tmp_path / "teacher", seed=0)
    before = _safetensors_digests(target)

    with pytest.raises(FileExistsError, match=str(target)):
        make_tiny_teacher(target, seed=1)
    assert _safetensors_digests(target) == before

    make_tiny_teacher(target, seed=1, overwrite=True)
    after = _safetensors_digests(target)
    assert after.keys() == before.keys() and after != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"], "temp folders left behind"

    stranger = tmp_path / "not-a-teacher"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a diffusers teacher"):
        make_tiny_teacher(stranger, overwrite=True)
    assert (stranger / "notes.txt").read_text() == "keep me"

    empty = tmp_path / "empty"
    empty.mkdir()
    assert (make_tiny_teacher(empty) / "model_index.json").is_file()
