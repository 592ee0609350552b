"""The trained tiny teacher: a stock Wan folder, reproducible, conditioned on its grammar.

Builds here train for a few hundred steps at most (the recipe's 800 take about 70 s);
the full build's sample quality and few-step degradation are measured by
tests/bench/trained_teacher.py and recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

import wandistill.demo
from wandistill.errors import UsageError
from wandistill.teacher import trained
from wandistill.teacher.trained import ensure_trained_teacher, make_trained_teacher
from wandistill.teacher.world import (
    COLOURS,
    TRAINED_SAMPLER,
    grammar_prompts,
    parse_prompt,
    synthetic_pattern,
    synthetic_prompts,
)

QUICK_STEPS = 4
"""Enough to exercise the whole build (components, embeddings, loop, EMA, save)."""
CONDITIONED_STEPS = 300
"""Where prompt conditioning shows clearly at the denoiser (about 30 s of one CPU core)."""


@pytest.fixture(scope="session")
def quick_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    return make_trained_teacher(root / "quick", steps=QUICK_STEPS, progress=False)


@pytest.fixture(scope="session")
def conditioned_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    return make_trained_teacher(root / "conditioned", steps=CONDITIONED_STEPS, progress=False)


def _sampler_kwargs(**overrides: object) -> dict[str, object]:
    """TRAINED_SAMPLER as WanPipeline call arguments (flow_shift lives in the scheduler)."""
    kwargs = {k: v for k, v in TRAINED_SAMPLER.items() if k != "flow_shift"}
    return {**kwargs, **overrides}


def _safetensors_digests(root: Path) -> dict[str, str]:
    return {
        str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*.safetensors"))
    }


def test_folder_loads_with_stock_wan_pipeline_and_samples(quick_teacher: Path) -> None:
    from diffusers import WanPipeline

    index = json.loads((quick_teacher / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer_2"] == [None, None]
    meta = json.loads((quick_teacher / "wandistill_teacher.json").read_text())
    assert meta["settings"]["steps"] == QUICK_STEPS and meta["sampler"] == dict(TRAINED_SAMPLER)
    assert not list(quick_teacher.parent.glob(".*")), "temp folders left behind"

    pipe = WanPipeline.from_pretrained(quick_teacher)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.scheduler.config.flow_shift == TRAINED_SAMPLER["flow_shift"]
    assert pipe.transformer.config.num_layers == trained.TRAINED_TRANSFORMER_CONFIG["num_layers"]
    latents = pipe(
        ["a red circle", "an orange bar at the top"],
        **_sampler_kwargs(num_inference_steps=2),
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert latents.shape == (2, 16, 1, 8, 8) and torch.isfinite(latents).all()


def test_grammar_words_are_single_tokens_and_no_prompt_is_truncated(quick_teacher: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quick_teacher / "tokenizer")
    for prompt in grammar_prompts():
        ids = tok(prompt).input_ids
        assert tok.unk_token_id not in ids
        assert len(ids) == len(prompt.split()) + 1  # one piece per word, then </s>
        assert len(ids) <= TRAINED_SAMPLER["max_sequence_length"]


def test_same_seed_gives_identical_bytes_whatever_the_threads_and_global_rng(
    quick_teacher: Path, tmp_path: Path
) -> None:
    threads = torch.get_num_threads()
    other_threads = 1 if threads > 1 else 2
    torch.manual_seed(99)
    expected_next = torch.rand(3)
    torch.manual_seed(99)  # the build must neither read nor advance the global RNG
    torch.set_num_threads(other_threads)  # nor depend on the caller's thread count
    try:
        same = make_trained_teacher(tmp_path / "same", steps=QUICK_STEPS, progress=False)
        assert torch.get_num_threads() == other_threads, "thread count not restored"
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.rand(3), expected_next)
    ref = _safetensors_digests(quick_teacher)
    assert _safetensors_digests(same) == ref
    meta = "wandistill_teacher.json"
    assert (same / meta).read_bytes() == (quick_teacher / meta).read_bytes()

    other = make_trained_teacher(tmp_path / "other", seed=1, steps=QUICK_STEPS, progress=False)
    differing = {k for k, v in _safetensors_digests(other).items() if ref[k] != v}
    assert differing == set(ref)


def test_synthetic_prompts_are_reproducible_grammar_prompts() -> None:
    grammar = grammar_prompts()
    assert len(grammar) == len(set(grammar)) == 240 == wandistill.demo.PROMPTS
    first = synthetic_prompts(100, seed=3)
    assert first == synthetic_prompts(100, seed=3) != synthetic_prompts(100, seed=4)
    assert len(set(first)) == 100 and set(first) <= set(grammar)
    assert sorted(synthetic_prompts(240, seed=3)) == sorted(grammar)  # no repeats before all
    assert len(synthetic_prompts(1000, seed=3)) == 1000 and synthetic_prompts(0) == []
    for prompt in grammar:
        assert parse_prompt(prompt).text == prompt
    for bad in ["a red cat", "a blue circle in the sky", "red circle", "a big red circle"]:
        with pytest.raises(UsageError, match="not in the trained teacher's grammar"):
            parse_prompt(bad)


def test_patterns_show_the_colour_in_channels_0_to_2_at_the_named_place() -> None:
    top, bottom = synthetic_pattern("a red circle at the top"), synthetic_pattern("a red circle")
    assert top.shape == (16, 1, 8, 8)
    rgb_top = top[:3, 0]
    assert rgb_top[:, :4].mean() > rgb_top[:, 4:].mean()  # upper half brighter
    centre = bottom[:3, 0, 3:5, 3:5].mean(dim=(1, 2))
    assert centre[0] > 0.5 and (centre[1:] < -0.5).all()  # red reads red, on black (-1)
    assert torch.allclose(bottom[:3, 0, 0, 0], torch.full((3,), -1.0), atol=0.05)
    for colour, rgb in COLOURS.items():
        c = synthetic_pattern(f"a {colour} circle")[:3, 0, 3:5, 3:5].mean(dim=(1, 2))
        assert int(c.argmax()) == max(range(3), key=lambda i: rgb[i]), colour
    assert synthetic_pattern("a red column", hw=(16, 16)).shape == (16, 1, 16, 16)


@pytest.mark.slow
def test_the_denoiser_needs_the_right_prompt(conditioned_teacher: Path) -> None:
    """With a prompt's own embedding the teacher's x0 estimate is closer to that prompt's
    pattern than with another prompt's embedding, at every noise level the sampler visits."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(conditioned_teacher)
    prompts = synthetic_prompts(32, seed=7)
    embeds, _ = pipe.encode_prompt(
        prompts,
        do_classifier_free_guidance=False,
        max_sequence_length=TRAINED_SAMPLER["max_sequence_length"],
    )
    x0 = torch.stack([synthetic_pattern(p) for p in prompts])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    for sigma in (0.5, 0.8, 1.0):
        x_t = (1 - sigma) * x0 + sigma * noise
        t = torch.full((len(prompts),), 1000.0 * sigma)

        def error(text: torch.Tensor, x_t: torch.Tensor = x_t, t: torch.Tensor = t) -> float:
            with torch.no_grad():
                v = pipe.transformer(x_t, t, text, return_dict=False)[0]
            return float((x_t - t.view(-1, 1, 1, 1, 1) / 1000.0 * v - x0).square().mean())

        own, swapped = error(embeds), error(embeds.roll(1, dims=0))
        assert own < 0.95 * swapped, (sigma, own, swapped)


def test_ensure_builds_once_and_reuses_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ensure_trained_teacher(tmp_path, steps=1, progress=False)
    assert first.parent == tmp_path / "teachers" and (first / "model_index.json").is_file()

    monkeypatch.setattr(trained, "make_trained_teacher", _no_rebuild)
    assert ensure_trained_teacher(tmp_path, steps=1, progress=False) == first
    monkeypatch.undo()
    other = ensure_trained_teacher(tmp_path, steps=2, progress=False)
    assert other != first and (other / "model_index.json").is_file()


def test_a_second_caller_waits_for_the_running_build_and_reuses_it(
    quick_teacher: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from filelock import FileLock

    folder = tmp_path / "teachers" / _folder_name(1)
    folder.parent.mkdir()
    waiting = threading.Event()
    monkeypatch.setattr(trained._console, "print", lambda *_, **__: waiting.set())
    monkeypatch.setattr(trained, "make_trained_teacher", _no_rebuild)
    got: list[Path] = []

    def second_caller() -> None:
        got.append(ensure_trained_teacher(tmp_path, steps=1, progress=False))

    with FileLock(folder.parent / f".{folder.name}.lock"):  # the first builder, mid-build
        caller = threading.Thread(target=second_caller)
        caller.start()
        assert waiting.wait(timeout=120), "the second caller never reported waiting"
        assert not folder.exists() and caller.is_alive()
        shutil.copytree(quick_teacher, folder)  # what the first builder's rename leaves
    caller.join(timeout=120)
    assert got == [folder]


def _no_rebuild(*_: object, **__: object) -> Path:
    raise AssertionError("a cached teacher was trained again")


def test_an_interrupted_build_leaves_nothing_and_the_next_one_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wandistill.teacher import tiny

    def interrupted(_: Path) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(tiny, "fsync_tree", interrupted)  # after save_pretrained, before the rename
        with pytest.raises(KeyboardInterrupt):
            ensure_trained_teacher(tmp_path, steps=1, progress=False)
    teachers = tmp_path / "teachers"
    assert [p.name for p in teachers.iterdir() if not p.name.endswith(".lock")] == []
    stale = teachers / f".{_folder_name(1)}.tmp-99999"  # a killed build's leftovers
    stale.mkdir()
    built = ensure_trained_teacher(tmp_path, steps=1, progress=False)
    assert (built / "model_index.json").is_file() and not stale.exists()


def _folder_name(steps: int) -> str:
    return f"trained-{trained.BuildSettings(steps=steps).digest()}"


def test_make_trained_cli_writes_a_teacher(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wandistill.cli import main

    main(["teacher", "make-trained", str(tmp_path / "t"), "--steps", "1", "--seed", "2"])
    assert "wrote trained tiny Wan 2.1 teacher" in capsys.readouterr().out
    meta = json.loads((tmp_path / "t" / "wandistill_teacher.json").read_text())
    assert meta["settings"]["seed"] == 2 and meta["settings"]["steps"] == 1


def test_the_demo_recipe_samples_the_teacher_as_it_was_trained_to_be_sampled() -> None:
    """Sizes, steps and guidance of tiny-fewstep are TRAINED_SAMPLER's: at CFG 5 the teacher
    over-brightens and 82% of its samples show their prompt, against 93% at its own CFG 3
    (docs/benchmarks.md, "Trained tiny teacher")."""
    from wandistill.config import load_recipe

    sampler = load_recipe("tiny-fewstep", stage="precompute").precompute.sampler
    for key in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale"):
        assert getattr(sampler, key) == TRAINED_SAMPLER[key], key
    assert sampler.max_sequence_length == TRAINED_SAMPLER["max_sequence_length"]


def test_a_deeper_build_has_its_blocks_and_its_own_folder() -> None:
    default, deeper = trained.BuildSettings(), trained.BuildSettings(blocks=4)
    assert default.transformer_config() == dict(trained.TRAINED_TRANSFORMER_CONFIG)
    assert deeper.transformer_config()["num_layers"] == 4
    assert deeper.digest() != default.digest()
    model, _ = trained.build_trained_pipeline(trained.BuildSettings(steps=1, blocks=3), False)
    assert model.transformer.config.num_layers == 3
    with pytest.raises(UsageError, match="blocks=0"):
        trained.BuildSettings(blocks=0)
