"""Safetensors only: a folder with only pickle-format weights is refused, naming the file and the
conversion in the folder's own library."""

from __future__ import annotations

from pathlib import Path

import pytest

from wandistill.errors import UsageError
from wandistill.io.modelfolder import UNSAFE_SUFFIXES, require_safetensors


@pytest.mark.parametrize("suffix", UNSAFE_SUFFIXES)
def test_each_pickle_format_alone_is_refused_by_name(tmp_path: Path, suffix: str) -> None:
    (tmp_path / f"weights{suffix}").write_bytes(b"\x80\x04.")
    with pytest.raises(UsageError, match=rf"only pickle-format weights \(weights\{suffix}\)"):
        require_safetensors(tmp_path, "student")


@pytest.mark.parametrize(
    ("config", "conversion"),
    [
        ('{"_class_name": "AutoencoderKLWan"}', "from diffusers import AutoencoderKLWan as M"),
        ('{"architectures": ["UMT5EncoderModel"]}', "from transformers import UMT5EncoderModel"),
        ("not json", "st.save_file(torch.load('<file>', weights_only=True)"),
    ],
)
def test_the_fix_names_the_conversion_in_the_folders_own_library(
    tmp_path: Path, config: str, conversion: str
) -> None:
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(config)
    (tmp_path / "vae" / "diffusion_pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UsageError) as info:
        require_safetensors(tmp_path, "teacher", ("vae",))
    assert str(tmp_path / "vae") in info.value.message
    assert info.value.fix and conversion in info.value.fix


def test_folders_with_safetensors_or_no_weights_pass(tmp_path: Path) -> None:
    (tmp_path / "both").mkdir()
    (tmp_path / "both" / "model.bin").write_bytes(b"x")
    (tmp_path / "both" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "spiece.model").write_bytes(b"x")
    require_safetensors(tmp_path, "teacher", ("both", "tokenizer"))
    require_safetensors(tmp_path / "missing", "student")
