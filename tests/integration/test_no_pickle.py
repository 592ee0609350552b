"""No pickle is ever loaded: the whole job runs with every way to unpickle made to raise, and
pickle-format weights are refused, named, before any library could load them."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from nopickle.sitecustomize import PickleForbidden, targets

from wandistill.cli import main

FAST = ["--set", "sampler.height=32", "--set", "sampler.width=32", "--set",
        "sampler.num_inference_steps=2", "--set", "sampler.max_sequence_length=16", "--set",
        "sampler.batch_size=2", "--set", "cache.shard_records=2"]  # fmt: skip
STUDENT = ["--set", "student.num_layers=1", "--set", "student.ffn_dim=32", "--set",
           "batch_size=2", "--set", 'device="cpu"', "--set", "tensorboard=false"]  # fmt: skip


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, " ".join((out + err).split())


def test_precompute_train_eval_and_sample_run_with_unpickling_forbidden(
    tiny_teacher: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for module, name, replacement in targets():
        monkeypatch.setattr(module, name, replacement)
    with pytest.raises(PickleForbidden):  # the guard is live
        pickle.loads(pickle.dumps(1))
    with pytest.raises(PickleForbidden):
        torch.load(str(tmp_path / "x.pt"), weights_only=True)
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(6)))
    cache, run = tmp_path / "cache", tmp_path / "run"
    steps = [
        ["precompute", "--teacher", str(tiny_teacher), "--prompts", str(prompts), "--out",
         str(cache), *FAST],
        ["train", "--cache", str(cache), "--out", str(run), "--steps", "2", *STUDENT],
        ["train", "--cache", str(cache), "--out", str(run), "--steps", "3", "--resume", *STUDENT],
        ["eval", "--cache", str(cache), "--student", str(run / "student"), "--out",
         str(tmp_path / "eval"), "--teacher", str(tiny_teacher), "--split", "all", "--max-records",
         "2"],
        ["sample", "--teacher", str(tiny_teacher), "--student", str(run / "student"), "--prompts",
         str(prompts), "--out", str(tmp_path / "sample"), "--steps", "2", "--limit", "2",
         "--max-sequence-length", "16"],
        ["cache", "verify", str(cache)],
    ]  # fmt: skip
    said = []
    for args in steps:
        code, text = _cli(capsys, *args)
        assert code == 0, f"{args[0]}: {text}"
        said.append(text)
    assert "resumed from" in said[2] and (run / "checkpoints" / "checkpoint-3").is_dir()
    assert (tmp_path / "eval" / "eval.json").is_file()
    assert (tmp_path / "sample" / "0001.png").is_file()


class _Payload:
    """A pickle that creates a folder when unpickled: proof by absence that nothing loads it."""

    def __init__(self, where: Path) -> None:
        self.where = str(where)

    def __reduce__(self):  # noqa: ANN204
        return (os.mkdir, (self.where,))


def _pickle_only(folder: Path, config: str, weights: str, pwned: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(config)
    (folder / weights).write_bytes(pickle.dumps(_Payload(pwned)))
    return folder


def test_pickle_only_weights_are_refused_naming_the_file_and_the_conversion(
    tiny_teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pwned = tmp_path / "pwned"
    student = _pickle_only(
        tmp_path / "student",
        '{"_class_name": "WanTransformer3DModel"}',
        "diffusion_pytorch_model.bin",
        pwned,
    )
    bad_teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, bad_teacher)
    for f in (bad_teacher / "vae").glob("*.safetensors"):
        f.unlink()
    (bad_teacher / "vae" / "diffusion_pytorch_model.pt").write_bytes(pickle.dumps(_Payload(pwned)))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    cases = [
        (["eval", "--cache", str(tmp_path / "nocache"), "--student", str(student), "--out",
          str(tmp_path / "o1")], "diffusion_pytorch_model.bin"),
        (["sample", "--teacher", str(tiny_teacher), "--student", str(student), "--prompts",
          str(prompts), "--out", str(tmp_path / "o2")], "diffusion_pytorch_model.bin"),
        (["sample", "--teacher", str(bad_teacher), "--prompts", str(prompts), "--out",
          str(tmp_path / "o3")], "diffusion_pytorch_model.pt"),
    ]  # fmt: skip
    for args, name in cases:
        code, text = _cli(capsys, *args)
        assert code == 2 and "Traceback" not in text, text
        assert f"has only pickle-format weights ({name})" in text and "safetensors only" in text
        assert "fix: convert it once" in text and ".save_pretrained(" in text
        assert "safe_serialization=True" in text and "from diffusers import" in text
        assert not Path(args[-1]).exists()
    assert not pwned.exists()


def test_block_init_from_a_pickle_only_teacher_is_refused(tmp_path: Path) -> None:
    from wandistill.errors import UsageError
    from wandistill.student.init import _teacher_tensors

    pwned = tmp_path / "pwned"
    where = tmp_path / "t" / "transformer"
    folder = _pickle_only(where, '{"_class_name": "X"}', "diffusion_pytorch_model.ckpt", pwned)
    with pytest.raises(UsageError, match=r"only pickle-format weights \(diffusion_pytorch_model"):
        _teacher_tensors(folder.parent, "transformer")
    assert not pwned.exists()
