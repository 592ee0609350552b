"""precompute against diffusers itself: same latents, same embeddings, any world size, resumable."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from wandistill.cache import open_cache
from wandistill.cache.contract import pad_embeds
from wandistill.cache.manifest import read_manifest
from wandistill.config import load_recipe
from wandistill.precompute.run import run
from wandistill.teacher.tiny import make_tiny_teacher

from clirun import cli_env
from zygote import Zygote, alive, kill

PROMPTS = ["a cat on a mat", "a dog in the park", "a red car at night", "the sea", "a tree"]


@pytest.fixture(scope="module")
def teachers(tiny_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teachers")
    return {
        "wan21": tiny_teacher,
        "wan22": make_tiny_teacher(root / "wan22", wan22=True, seed=1),  # not the shared seed
    }


def _cfg(teacher: Path, prompts: Path, cache: Path, *extra: str):
    sets = [
        f'teacher.path="{teacher}"',
        f'prompts="{prompts}"',
        f'cache.path="{cache}"',
        "sampler.num_inference_steps=6",
        "sampler.record_steps=[0, 2, 5]",
        "sampler.height=32",
        "sampler.width=32",
        "cache.shard_records=2",
        "cache.holdout_fraction=0.0",
        "previews=0",
        *extra,
    ]
    return load_recipe(Path("pipelines/tiny.toml"), sets, stage="precompute").precompute


def _prompt_file(tmp_path: Path, prompts: list[str] = PROMPTS) -> Path:
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    return f


@pytest.mark.parametrize("layout", ["wan21", "wan22"])
def test_records_match_wan_pipeline_latents_and_embeddings(
    tmp_path: Path, teachers: dict[str, Path], layout: str
) -> None:
    from diffusers import WanPipeline

    extra = ["sampler.batch_size=2"]
    if layout == "wan22":
        extra += ["sampler.guidance_scale_2=3.0", "sampler.expert_group_batches=2"]
    run(_cfg(teachers[layout], _prompt_file(tmp_path), tmp_path / "c", *extra), quiet=True)
    pipe = WanPipeline.from_pretrained(teachers[layout])
    if layout == "wan22":
        assert pipe.transformer_2 is not None
    with open_cache(tmp_path / "c") as store:
        records = list(store.records())
    assert sorted(r.prompt for r in records) == sorted(PROMPTS)
    for rec in records:
        captured: dict[int, torch.Tensor] = {}

        def grab(_pipe, i, _t, kw, captured=captured):  # latents after step i
            captured[i] = kw["latents"].clone()
            return kw

        kw = dict(guidance_scale_2=3.0) if layout == "wan22" else {}
        latents = pipe(
            prompt=rec.prompt,
            negative_prompt="",
            height=32,
            width=32,
            num_frames=1,
            num_inference_steps=6,
            guidance_scale=5.0,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(rec.seed),
            output_type="latent",
            callback_on_step_end=grab,
            **kw,
        ).frames[0]
        # Batched CPU matmuls may round differently from batch-of-one ones: fp32 rounding only.
        torch.testing.assert_close(rec.final_latent, latents, rtol=0, atol=1e-5)
        torch.testing.assert_close(
            rec.noise,
            torch.randn((16, 1, 4, 4), generator=torch.Generator().manual_seed(rec.seed)),
            rtol=0,
            atol=0,
        )
        # x_t at step i is the latent after step i-1 (the noise itself at step 0).
        for slot, i in enumerate([0, 2, 5]):
            want = rec.noise if i == 0 else captured[i - 1][0]
            torch.testing.assert_close(rec.xt[slot], want, rtol=0, atol=1e-5)
        with torch.no_grad():  # WanPipeline.__call__ encodes under no_grad too
            ref, _ = pipe.encode_prompt(
                rec.prompt, do_classifier_free_guidance=False, max_sequence_length=32
            )
        assert torch.equal(pad_embeds(rec.prompt_embeds, 32), ref[0])


def test_single_prompt_batches_match_the_pipeline_bit_for_bit(
    tmp_path: Path, teachers: dict[str, Path]
) -> None:
    from diffusers import WanPipeline

    run(
        _cfg(
            teachers["wan21"],
            _prompt_file(tmp_path, PROMPTS[:2]),
            tmp_path / "c",
            "sampler.batch_size=1",
        ),
        quiet=True,
    )
    pipe = WanPipeline.from_pretrained(teachers["wan21"])
    with open_cache(tmp_path / "c") as store:
        for rec in store.records():
            latents = pipe(
                prompt=rec.prompt,
                negative_prompt="",
                height=32,
                width=32,
                num_frames=1,
                num_inference_steps=6,
                guidance_scale=5.0,
                max_sequence_length=32,
                generator=torch.Generator().manual_seed(rec.seed),
                output_type="latent",
            ).frames[0]
            assert torch.equal(rec.final_latent, latents)


def test_manifest_records_sampler_settings_and_shared_schedule(
    tmp_path: Path, teachers: dict[str, Path]
) -> None:
    run(
        _cfg(
            teachers["wan22"],
            _prompt_file(tmp_path, PROMPTS[:2]),
            tmp_path / "c",
            'sampler.features=["blocks.1"]',
        ),
        quiet=True,
    )
    m = read_manifest(tmp_path / "c")
    assert m.complete and m.num_records == 2
    s = m.settings
    assert s.cfg_formula == "uncond + g * (cond - uncond)" and s.guidance_scale == 5.0
    assert s.boundary_ratio == 0.875 and s.record_steps == [0, 2, 5]
    assert s.scheduler == "UniPCMultistepScheduler" and s.num_inference_steps == 6
    assert m.dims.text_dim == 32 and m.dims.latent_shape == [16, 1, 4, 4]
    assert "feature.blocks.1" in [f.name for f in m.fields]
    with open_cache(tmp_path / "c") as store:
        shared = store.read_shared()
        rec = next(store.records())
    assert shared["timesteps"].shape == (6,) and shared["sigmas"].shape == (7,)
    assert rec.features["blocks.1"].shape[0] == 3
    torch.testing.assert_close(rec.timesteps, shared["timesteps"][[0, 2, 5]])


def test_a_second_run_skips_every_record_and_a_changed_setting_is_refused(
    tmp_path: Path, teachers: dict[str, Path]
) -> None:
    from wandistill.errors import CacheMismatchError

    prompts = _prompt_file(tmp_path)
    first = run(_cfg(teachers["wan21"], prompts, tmp_path / "c"), quiet=True)
    again = run(_cfg(teachers["wan21"], prompts, tmp_path / "c"), quiet=True)
    assert first.records_written == 5 and again.records_written == 0
    with pytest.raises(CacheMismatchError, match="settings.guidance_scale: cache has 5.0"):
        run(_cfg(teachers["wan21"], prompts, tmp_path / "c", "sampler.guidance_scale=3.0"))
    with pytest.raises(CacheMismatchError, match="teacher.fingerprint"):
        run(_cfg(teachers["wan22"], prompts, tmp_path / "c"))


def _blobs(cache: Path) -> dict[str, bytes]:
    from wandistill.cache.wds.reader import WebDatasetSource

    m = read_manifest(cache)
    src = WebDatasetSource(cache)
    try:
        return {k: src.read_blob(e, i) for e in m.shards for i, k in enumerate(e.keys)}
    finally:
        src.close()


def _cli(python: str, *args: str) -> list[str]:
    return [python, "-m", "wandistill", *args]


def _env() -> dict[str, str]:
    return cli_env(PYTHONUNBUFFERED="1")


def _cmd(teacher: Path, prompts: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "precompute",
        "pipelines/tiny.toml",
        "--teacher",
        str(teacher),
        "--prompts",
        str(prompts),
        "--out",
        str(cache),
        "--set",
        "previews=0",
        "--set",
        "sampler.batch_size=2",
        "--set",
        "cache.shard_records=2",
        "--set",
        "sampler.height=32",
        "--set",
        "sampler.width=32",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.dist
def test_two_process_torchrun_writes_the_same_records_as_one_process(
    zygote: Zygote, tmp_path: Path, teachers: dict[str, Path]
) -> None:
    """Both runs, torchrun's agent and its ranks are forks of the session's zygote."""
    # Batches of 2, rank r takes batches r, r+2, ...: line 2 is rank 0's, line 4 rank 1's.
    long = "a prompt far longer than the tiny recipe's 32 tokens " * 2
    texts = [f"prompt number {i}" if i not in (1, 3) else f"{long}{i}" for i in range(9)]
    prompts = _prompt_file(tmp_path, texts)
    one = subprocess.run(
        _cli(zygote.python, *_cmd(teachers["wan21"], prompts, tmp_path / "one")),
        env=zygote.env(_env()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [
            zygote.python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "wandistill",
            *_cmd(teachers["wan21"], prompts, tmp_path / "two"),
        ],
        env=zygote.env(_env()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    m = read_manifest(tmp_path / "two")
    assert m.complete and {s.rank for s in m.shards} == {0, 1}
    assert _blobs(tmp_path / "one") == _blobs(tmp_path / "two")
    # One summary for the whole job (rank 0's), every rank's counts and truncations in it.
    assert two.stdout.count("records written") == 1, two.stdout
    assert two.stdout.count("truncated to max_sequence_length tokens: lines 2, 4") == 1  # rank 0
    said = " ".join(two.stdout.split())
    assert "cache: 9 records written this run, 0 already there" in said, two.stdout
    assert "9 of 9 prompts in the cache, 2 truncated" in said and "on 2 ranks" in said
    assert all(len(line) <= 80 for line in two.stdout.splitlines() if "cache folder" not in line)
    report = json.loads((tmp_path / "two" / "prompts_report.json").read_text())
    assert report["truncated"] == [2, 4] and len(report["truncated_keys"]) == 2


def test_a_rerun_reports_what_earlier_runs_wrote_and_truncated(
    tmp_path: Path, teachers: dict[str, Path]
) -> None:
    prompts = _prompt_file(tmp_path, ["a cat", "a prompt far longer than 32 tokens " * 4])
    cfg = _cfg(teachers["wan21"], prompts, tmp_path / "c")
    first = run(cfg, quiet=True)
    again = run(cfg, quiet=True)  # the embedding store is gone: truncations come from the report
    assert (first.records_written, first.records_present, first.prompts_truncated) == (2, 0, 1)
    assert (again.records_written, again.records_present, again.prompts_truncated) == (0, 2, 1)
    report = json.loads((tmp_path / "c" / "prompts_report.json").read_text())
    assert report["truncated"] == [2]
    text = " ".join(again.lines())
    assert "0 records written this run, 2 already there" in text and "1 truncated" in text
    assert all(len(line) <= 80 for line in again.lines() if "cache folder" not in line)


@pytest.mark.slow
def test_kill_9_then_rerun_completes_every_record_exactly_once(
    zygote: Zygote, tmp_path: Path, teachers: dict[str, Path]
) -> None:
    prompts = _prompt_file(tmp_path, [f"prompt number {i}" for i in range(16)])
    ref = zygote.cli(_cmd(teachers["wan21"], prompts, tmp_path / "ref"), tmp_path / "ref.log")
    assert ref.returncode == 0, ref.stderr
    cache = tmp_path / "killed"
    pids = zygote.start(_cmd(teachers["wan21"], prompts, cache), tmp_path / "killed.log")
    journal = cache / "journal" / "rank-00000.json"
    deadline = time.monotonic() + 240
    while not journal.exists() and alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    kill(pids[0], signal.SIGKILL)
    zygote.wait(pids)
    assert not read_manifest(cache).complete
    again = zygote.cli(_cmd(teachers["wan21"], prompts, cache), tmp_path / "again.log")
    assert again.returncode == 0, again.stderr
    m = read_manifest(cache)
    keys = [k for s in m.shards for k in s.keys]
    assert m.complete and len(keys) == len(set(keys)) == 16
    assert _blobs(cache) == _blobs(tmp_path / "ref")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["--teacher", "/nonexistent/teacher"],
            2,
            "teacher folder '/nonexistent/teacher' does not",
        ),
        (["--prompts", "/nonexistent/p.txt"], 2, "prompt file '/nonexistent/p.txt' does not exist"),
        (["--set", "sampler.height=30"], 2, "multiple of 16"),
        (["--set", "sampler.num_inference_step=3"], 2, "did you mean"),
        (["--backend", "lmdb"], 2, "backend"),
        (["--dtype", "fp8"], 2, "dtype"),
    ],
)
def test_bad_input_is_one_line_and_a_usage_exit_code(
    zygote: Zygote,
    tmp_path: Path,
    teachers: dict[str, Path],
    args: list[str],
    code: int,
    message: str,
) -> None:
    base = {
        "--teacher": str(teachers["wan21"]),
        "--prompts": str(_prompt_file(tmp_path)),
        "--out": str(tmp_path / "c"),
    }
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag in base:
            base[flag] = value
    extra = [
        a for pair in zip(args[::2], args[1::2], strict=True) if pair[0] not in base for a in pair
    ]
    cmd = ["precompute", "pipelines/tiny.toml", *[x for kv in base.items() for x in kv], *extra]
    proc = zygote.cli(cmd, tmp_path / "run.log")  # a real process: its exit code, its stderr
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr.replace("\n", " ")
    assert "Traceback" not in proc.stderr
