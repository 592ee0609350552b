"""The model-free viewer reads the trained teacher's world back off latents: exactly on
rendered patterns, nearly always on jittered and noisy ones; a blurred or collapsed sampler
scores low."""

from __future__ import annotations

import torch

from wandistill.eval import viewer
from wandistill.teacher import world


def _blurred(latents_BCFHW: torch.Tensor, sigma: float) -> torch.Tensor:
    """The same samples with their colour image blurred (Gaussian, `sigma` latent px): what a
    one-step sampler returns, roughly, and what a student collapsing to the mean draws."""
    b, _, _, h, w = latents_BCFHW.shape
    image = viewer.unmix(latents_BCFHW).transpose(1, 2).reshape(b, 3, h, w)
    k = torch.arange(-3, 4.0).div(sigma).square().mul(-0.5).exp()
    k = (k[:, None] * k[None]) / k.sum() ** 2
    blurred = torch.nn.functional.conv2d(
        torch.nn.functional.pad(image, (3, 3, 3, 3)), k.expand(3, 1, 7, 7), groups=3
    )
    features = torch.cat([2 * blurred - 1, world.backdrop((h, w)).expand(b, 2, h, w)], dim=1)
    return torch.einsum("ck,bkhw->bchw", world.mixing_matrix(), features).unsqueeze(2)


def _patterns(prompts: list[str]) -> torch.Tensor:
    return torch.stack([world.synthetic_pattern(p) for p in prompts])


def test_every_rendered_pattern_of_the_grammar_is_read_back_exactly() -> None:
    prompts = world.grammar_prompts()
    readings = viewer.read(_patterns(prompts))
    for prompt, reading in zip(prompts, readings, strict=True):
        assert viewer.judge(reading, prompt) == dict.fromkeys(viewer.ATTRIBUTES, True), prompt
        assert reading.fit > 0.99
        spec = world.parse_prompt(prompt)
        want = torch.tensor(world.COLOURS[spec.colour]) * sum(world.BRIGHTNESS) / 2
        assert torch.allclose(torch.tensor(reading.rgb), want, atol=0.05)
        assert abs(reading.radius / world.SIZES[spec.size] - 1) < 0.05


def test_a_pattern_rendered_at_another_resolution_is_read_in_the_teachers_units() -> None:
    prompt = "a green column on the left"
    (reading,) = viewer.read(world.synthetic_pattern(prompt, hw=(16, 16))[None])
    assert viewer.judge(reading, prompt) == dict.fromkeys(viewer.ATTRIBUTES, True)
    assert abs(reading.centre[0] - world.POSITIONS["on the left"][0]) < 0.2


def test_noise_on_all_channels_and_brightness_leave_the_reading_unchanged() -> None:
    """Unmixing solves for RGB over all 16 channels, so noise on each one averages out."""
    prompts = world.grammar_prompts()[::3]
    g = torch.Generator().manual_seed(0)
    noisy = _patterns(prompts) + 0.1 * torch.randn(len(prompts), 16, 1, 8, 8, generator=g)
    for prompt, reading in zip(prompts, viewer.read(noisy), strict=True):
        assert all(viewer.judge(reading, prompt).values()), (prompt, reading)


def test_jittered_training_samples_are_read_as_their_prompt() -> None:
    """The teacher's own training data: the jitter stays inside the gaps between sizes and
    positions, so every sample reads as its prompt (the ceiling a teacher can reach)."""
    specs = world._grammar()
    idx, latents = world._training_batch(specs, 240, torch.Generator().manual_seed(0))
    tally = viewer.Tally()
    tally.add([specs[i].text for i in idx], {"data": latents})
    score = tally.scores("data")["data"]
    assert (score.all, score.clear, score.spread_ratio) == (1.0, 1.0, 1.0)
    assert 0.2 < score.spread < 0.6  # +-0.4 px of position jitter (RMS 0.33 over two axes)


def test_a_blurred_sampler_scores_low_and_a_collapsed_one_has_no_spread() -> None:
    specs = world._grammar()
    idx, data = world._training_batch(specs, 96, torch.Generator().manual_seed(1))
    prompts = [specs[i].text for i in idx]
    means = _patterns(prompts)  # each prompt's own centre: crisp, but the same for every seed
    tally = viewer.Tally()
    tally.add(prompts, {"data": data, "mean": means, "blurred": _blurred(means, 1.0)})
    scores = tally.scores("data")
    assert scores["data"].all == 1.0
    assert scores["mean"].all == 1.0 and scores["mean"].spread_ratio < 0.2
    assert scores["blurred"].all < 0.5


def test_prompts_outside_the_grammar_turn_the_viewer_off() -> None:
    tally = viewer.Tally()
    rows = tally.add(["a red circle", "a cat"], {"x": _patterns(["a red circle"] * 2)})
    assert rows == [{}, {}] and not tally.active and tally.scores("x") == {}
    assert not viewer.in_world(["a red circle"], torch.zeros(1, 4, 1, 8, 8))


def test_per_record_marks_say_which_attributes_each_sample_shows() -> None:
    prompts = ["a red circle", "a small blue bar at the top"]
    latents = _patterns(["a red circle", "a small blue column at the top"])
    rows = viewer.Tally().add(prompts, {"student@4": latents})
    assert rows == [{"student@4": [1, 1, 1, 1]}, {"student@4": [1, 0, 1, 1]}]


def test_a_non_finite_sample_shows_nothing_and_stays_out_of_the_spread() -> None:
    latents = _patterns(["a red circle", "a red circle"])
    latents[1, 0, 0, 0, 0] = float("nan")
    tally = viewer.Tally()
    rows = tally.add(["a red circle"] * 2, {"x": latents})
    assert rows == [{"x": [1, 1, 1, 1]}, {"x": [0, 0, 0, 0]}]
    score = tally.scores("x")["x"]
    assert score.all == 0.5 and score.position == 0.5 and score.spread < 0.1
