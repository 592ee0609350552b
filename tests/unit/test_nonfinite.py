"""NaN / inf never reach a cache, a checkpoint or the final student; the run says where it began.

Precompute: a teacher whose weights hold a NaN is refused at the step it first shows, naming the
prompt, its key and the step, with nothing of the batch written; the cache writer refuses any
non-finite record whoever produced it. Train: a non-finite loss (injected at an exact step with
the test hook `WANDISTILL_FAULT=train:loss:<n>:<rank>:nan`) stops the run before that
step's update, the newest checkpoint stays the newest, no student is exported, and a resume
without the fault finishes normally.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from wandistill.cache.manifest import load_committed
from wandistill.checks.finite import NonFiniteError, check_weights, is_finite
from wandistill.config import load_recipe
from wandistill.runtime.dist import DistInfo
from wandistill.train import run as train_run
from wandistill.train.checkpoint import list_checkpoints

from cachefixtures import make_record, write_cache

REPO = Path(__file__).parents[2]


# --------------------------------------------------------------------------- the check itself


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]),
    n=st.integers(1, 5000),
    where=st.floats(0, 1, exclude_max=True),
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    strided=st.booleans(),
)
def test_one_non_finite_value_anywhere_in_any_float_tensor_is_found(
    dtype: torch.dtype, n: int, where: float, bad: float, strided: bool
) -> None:
    base = torch.randn(2 * n, generator=torch.Generator().manual_seed(n)).to(dtype)
    view = base[::2] if strided else base[:n]  # strided: a non-contiguous view
    assert is_finite(view)
    view[int(where * n)] = bad
    assert not is_finite(view)


def test_empty_and_integer_tensors_are_finite() -> None:
    assert is_finite(torch.empty(0)) and is_finite(torch.empty(0, 3, dtype=torch.bfloat16))
    assert is_finite(torch.arange(5))


# --------------------------------------------------------------------------- cache writer


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("teacher_out", float("nan"), "teacher_out at recorded step 1 is not finite (nan)"),
        ("xt", float("inf"), "xt at recorded step 1 is not finite (inf)"),
        ("final_latent", float("-inf"), "final_latent is not finite (inf)"),
        ("prompt_embeds", float("nan"), "prompt_embeds is not finite (nan)"),
    ],
)
def test_the_cache_writer_never_commits_a_non_finite_record(
    tmp_path: Path, field: str, value: float, where: str
) -> None:
    writer = write_cache(tmp_path, range(2), shard_records=4, finalize=False, complete=False)
    bad = make_record(7)
    tensor = getattr(bad, field)
    if tensor.dim() > 1 and field != "prompt_embeds":
        tensor[1 if field in ("teacher_out", "xt") else 0].view(-1)[3] = value
    else:
        tensor.view(-1)[0] = value
    with pytest.raises(NonFiniteError, match=rf"record {bad.key}: {re.escape(where)}"):
        writer.write(bad)
    writer.close()
    keys = [k for s in load_committed(tmp_path).shards for k in s.keys]
    assert bad.key not in keys and len(keys) == 2  # the good records before it are committed


# --------------------------------------------------------------------------- precompute


POISON = {"transformer": "proj_out.bias", "text_encoder": "encoder.final_layer_norm.weight"}


def _poison(folder: Path, component: str) -> None:
    """Put a NaN into one weight of a component (the tiny teacher, on disk)."""
    path = next((folder / component).glob("*.safetensors"))
    tensors = load_file(path)
    name = POISON[component]
    tensors[name] = tensors[name].clone()
    tensors[name][0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("component", "message"),
    [
        (
            "transformer",
            r"the teacher output is not finite \(nan\) at step 0 \(t=999\) for prompt "
            r"'a calm lake' \(line 1, key \w{32}\) and 1 other prompt\(s\) of the batch: the "
            r"batch is refused, nothing of it was written",
        ),
        pytest.param(
            "text_encoder",
            r"the text embedding is not finite \(nan\) for prompt '' \(line recipe "
            r"sampler.negative_prompt, key negative\)",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_precompute_refuses_a_teacher_that_makes_nan_naming_prompt_key_and_step(
    tmp_path: Path, component: str, message: str
) -> None:
    from wandistill.precompute.run import run
    from wandistill.teacher.tiny import make_tiny_teacher

    teacher = make_tiny_teacher(tmp_path / "teacher")
    _poison(teacher, component)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a calm lake\na red kite\n")
    cfg = load_recipe(
        REPO / "pipelines" / "tiny.toml",
        [
            f'teacher.path="{teacher}"',
            f'prompts="{prompts}"',
            f'cache.path="{tmp_path / "cache"}"',
            "previews=0",
            "sampler.batch_size=2",
            "sampler.height=32",
            "sampler.width=32",
            "sampler.num_inference_steps=3",
        ],
        stage="precompute",
    ).precompute
    with pytest.raises(NonFiniteError, match=message) as info:
        run(cfg, quiet=True)
    assert "fix" not in info.value.message and info.value.fix
    shards = tmp_path / "cache" / "shards"
    assert not shards.exists() or not any(shards.iterdir())  # nothing, not even a temp file


# --------------------------------------------------------------------------- train


def _train_cfg(cache: Path, out: Path, *sets: str):  # noqa: ANN202 - a TrainConfig
    base = [
        f'cache="{cache}"',
        f'out="{out}"',
        "steps=8",
        "batch_size=2",
        "checkpoint_every=2",
        "log_every=1",
        "data_threads=1",
        'device="cpu"',
        "tensorboard=false",
        "student.num_layers=1",
        "student.num_attention_heads=2",
        "student.attention_head_dim=12",
        "student.ffn_dim=32",
    ]
    return load_recipe(None, [*base, *sets], stage="train").train


def test_a_nan_loss_stops_training_before_the_update_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cache(tmp_path / "cache", range(4))
    out = tmp_path / "run"
    monkeypatch.setenv("WANDISTILL_FAULT", "train:loss:5:0:nan")
    with pytest.raises(
        NonFiniteError,
        match=r"non-finite loss at step 5 \(rank 0: .*loss=nan.*grad_norm=nan\): training stopped "
        r"before applying it; the newest checkpoint \(checkpoint-4\) is kept and no student",
    ):
        train_run(_train_cfg(tmp_path / "cache", out))
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [2, 4]
    assert not (out / "student").exists() and not (out / "student_ema").exists()
    weights = load_file(out / "checkpoints" / "checkpoint-4" / "student.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())

    monkeypatch.delenv("WANDISTILL_FAULT")
    result = train_run(_train_cfg(tmp_path / "cache", out), resume=True)
    assert result.steps == 8 and (out / "student").is_dir()


def test_non_finite_weights_are_never_checkpointed() -> None:
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    good = [torch.ones(3)]
    check_weights(info, 3, {"student": good, "student_ema": good})  # fine: no error
    bad = [torch.ones(3), torch.tensor([1.0, float("inf")])]
    with pytest.raises(NonFiniteError, match="the student_ema weights are not finite after step 3"):
        check_weights(info, 3, {"student": good, "student_ema": bad})
